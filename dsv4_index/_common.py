"""Shared plumbing of the library: argument checks, backend dispatch, ``out=`` buffers, DCP math, and
the torch helpers of the op references (``ops/<op>/naive.py`` import only these).

Every public op (:mod:`dsv4_index.ops`) validates its arguments with these and
:mod:`dsv4_index.ops._args` first (shape / dtype / device / geometry always; values that need device
data only on CPU inputs or with ``validate=True``), then runs either its Triton kernel or its
pure-PyTorch reference (:mod:`dsv4_index.reference`).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

from ._triton import HAVE_TRITON, MISSING_MESSAGE, TritonUnavailable

INDEX_SENTINEL = -1
LENGTH_SENTINEL = 0
INT32_MAX = 2 ** 31 - 1
INT32_MIN = -(2 ** 31)
BACKENDS = ("triton", "reference")


# backend dispatch
def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device, backend: Optional[str] = None) -> bool:
    """Pick the implementation of an op.

    ``backend`` (keyword) beats the ``DSV4_INDEX_BACKEND`` environment variable, which beats the
    default: Triton for CUDA tensors or under ``TRITON_INTERPRET=1``, the reference otherwise.
    Without the ``triton`` package the default is the reference everywhere except under
    ``TRITON_INTERPRET=1``; asking for Triton (``backend="triton"`` or the interpreter) then raises
    :class:`dsv4_index._triton.TritonUnavailable` (an ``ImportError``) saying what to install.
    """
    choice = backend if backend is not None else os.environ.get("DSV4_INDEX_BACKEND") or None
    if choice is not None:
        if choice not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {choice!r}")
        if choice == "triton":
            _require_triton()
        if choice == "triton" and device.type != "cuda" and not interpreting():
            raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        return choice == "triton"
    if interpreting():
        _require_triton()
        return True
    return device.type == "cuda" and HAVE_TRITON


def _require_triton() -> None:
    if not HAVE_TRITON:
        raise TritonUnavailable(MISSING_MESSAGE)


def check_device(device, *, available: bool = True) -> torch.device:
    """``device`` as a ``torch.device``: a str or ``torch.device`` of type ``cpu`` or ``cuda``; with ``available``
    a CUDA device must exist in this process. ``TypeError`` / ``ValueError`` naming ``device`` (torch's own
    ``RuntimeError`` / ``AssertionError`` never reach the caller)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device ('cpu', 'cuda', 'cuda:1'), got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device ('cuda', 'cuda:<index>'), got {device!r}")
    if available and dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: this process has no CUDA device (torch "
                             f"{torch.__version__}, torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: CUDA device {dev.index} does not exist "
                             f"({torch.cuda.device_count()} visible)")
    return dev


def needs_value_checks(device: torch.device, validate: bool) -> bool:
    """Value checks read device data: always on CPU inputs, on CUDA only when asked."""
    return validate or device.type != "cuda"


# argument checks (ValueError naming the argument)
def check_tensor(name: str, x, *, dtypes: Sequence[torch.dtype], ndim: int,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device; the ops need real (CPU or CUDA) tensors")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (same device as query_start_loc)")
    if x.numel() > 0 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {x.stride()}")
    return x


def is_int(v, *, numpy_ok: bool = False) -> bool:
    """``v`` is a Python int (a numpy integer too with ``numpy_ok``), never a bool."""
    return not isinstance(v, bool) and isinstance(v, (int, np.integer) if numpy_ok else int)


def check_int(name: str, v, *, lo: Optional[int] = None, hi: Optional[int] = None, numpy_ok: bool = False) -> int:
    """``v`` as an int, or ``ValueError`` naming ``name``: an int (not a bool; numpy integers with
    ``numpy_ok``) with ``lo <= v <= hi`` (either bound optional). The one integer-argument check of the
    package: the message always reads ``"<name> must be an int[ >= lo| <= hi| in [lo, hi]], got <v>"``.

    >>> check_int("block_size", 64, lo=1)
    64
    >>> check_int("cp_rank", 2, lo=0, hi=1)
    Traceback (most recent call last):
        ...
    ValueError: cp_rank must be an int in [0, 1], got 2
    >>> check_int("window", True, lo=1)
    Traceback (most recent call last):
        ...
    ValueError: window must be an int >= 1, got True
    """
    if is_int(v, numpy_ok=numpy_ok) and (lo is None or v >= lo) and (hi is None or v <= hi):
        return int(v)
    bound = ("" if lo is None and hi is None else f" >= {lo}" if hi is None else f" <= {hi}" if lo is None
             else f" in [{lo}, {hi}]")
    raise ValueError(f"{name} must be an int{bound}, got {v!r}")


def check_batch(query_start_loc, seq_lens, block_table=None):
    """Shape / dtype / device checks of the batch description; returns (B, device)."""
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1)
    device = query_start_loc.device
    if query_start_loc.numel() < 1:
        raise ValueError("query_start_loc must have B + 1 >= 1 entries")
    B = query_start_loc.numel() - 1
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=device)
        if seq_lens.numel() != B:
            raise ValueError(f"seq_lens has {seq_lens.numel()} entries, query_start_loc implies B = {B}")
    if block_table is not None:
        check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=device)
        if block_table.shape[0] < B:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, needs at least B = {B}")
    return B, device


def check_cp(cp_world_size: int, cp_rank: int, cp_interleave: int, alloc_block: Optional[int] = None):
    check_int("cp_world_size", cp_world_size, lo=1)
    check_int("cp_interleave", cp_interleave, lo=1)
    check_int("cp_rank", cp_rank, lo=0, hi=cp_world_size - 1)
    if alloc_block is not None and cp_world_size > 1 and alloc_block % cp_interleave != 0:
        raise ValueError(
            f"cp_interleave={cp_interleave} must divide the allocation block size {alloc_block}")


def check_batch_values(query_start_loc, seq_lens, *, num_tokens: Optional[int] = None):
    """Value checks that read the batch tensors (host copies)."""
    qsl = query_start_loc.detach().cpu().long()
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    q_len = qsl[1:] - qsl[:-1]
    if bool((q_len < 0).any()):
        b = int(torch.nonzero(q_len < 0)[0])
        raise ValueError(f"query_start_loc must be non-decreasing; it drops at request {b}")
    if num_tokens is not None and int(qsl[-1]) > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {int(qsl[-1])} exceeds num_tokens = {num_tokens}")
    if seq_lens is not None:
        sl = seq_lens.detach().cpu().long()
        bad = torch.nonzero(sl < q_len)
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"seq_lens[{b}] = {int(sl[b])} is below the query length {int(q_len[b])} of request {b}")


def resolve_num_tokens(query_start_loc: torch.Tensor, num_tokens: Optional[int], out=None) -> int:
    """Live token count: ``num_tokens`` if given, else read ``query_start_loc[-1]`` (a host sync on CUDA)."""
    if num_tokens is not None:
        check_int("num_tokens", num_tokens, lo=0)
        return num_tokens
    return int(query_start_loc[-1].item())


def prepare_out(name: str, out, *, shape: Sequence[int], min_rows: int, dtype: torch.dtype,
                device: torch.device, exact_cols: bool = False) -> torch.Tensor:
    """Check a caller's ``out=`` buffer, or allocate one of ``shape``.

    ``out`` may have more rows than ``min_rows`` (the rest is set to the sentinel by the op); for a
    2-D output its columns must be at least ``shape[1]`` (exactly, with ``exact_cols``).
    """
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    check_tensor(name, out, dtypes=(dtype,), ndim=len(shape), device=device)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if out.shape[0] < min_rows:
        raise ValueError(f"{name} has {out.shape[0]} rows, needs at least {min_rows}")
    if len(shape) == 2:
        if (exact_cols and out.shape[1] != shape[1]) or out.shape[1] < shape[1]:
            raise ValueError(f"{name} has {out.shape[1]} columns, needs {shape[1]}")
    return out


# DCP ownership (docs/DESIGN.md §4) — torch versions shared by the reference and the host-side checks
def cp_owner(p: torch.Tensor, world: int, interleave: int) -> torch.Tensor:
    return (p // interleave) % world


def cp_local(p: torch.Tensor, world: int, interleave: int) -> torch.Tensor:
    return (p // (interleave * world)) * interleave + p % interleave


def cp_global(lp: torch.Tensor, world: int, rank: int, interleave: int) -> torch.Tensor:
    """Inverse of :func:`cp_local` on rank ``rank``: the global position (or row) stored at local ``lp``."""
    return (lp // interleave) * (interleave * world) + rank * interleave + lp % interleave


def cp_owned_count(n, world: int, rank: int, interleave: int):
    """How many of ``0 .. n-1`` rank ``rank`` owns (torch tensor or numpy array ``n >= 0``)."""
    cycle = interleave * world
    part = n % cycle - rank * interleave
    part = part.clamp(0, interleave) if isinstance(part, torch.Tensor) else np.clip(part, 0, interleave)
    return (n // cycle) * interleave + part


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


# reference helpers: token map and masked table gathers (torch, any device)
def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_rows: int):
    """Token map of ``num_rows`` token slots: (req int64, pos int64, valid bool), each ``[num_rows]``.

    Token ``t`` belongs to the largest ``b < B`` with ``qsl[b] <= t``; it is valid iff
    ``t < qsl[B]``; ``pos = seq_lens[b] - qsl[b+1] + t``. Invalid tokens get ``req 0``, ``pos -1``.
    """
    device = query_start_loc.device
    qsl = query_start_loc.long()
    B = qsl.numel() - 1
    t = torch.arange(num_rows, device=device, dtype=torch.long)
    if B == 0:
        zero = torch.zeros_like(t)
        return zero, zero - 1, torch.zeros(num_rows, dtype=torch.bool, device=device)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True).clamp(0, B - 1)
    valid = t < qsl[B]
    pos = seq_lens.long()[req] - qsl[req + 1] + t
    return torch.where(valid, req, 0), torch.where(valid, pos, -1), valid


def token_table_rows(rows: torch.Tensor, req: torch.Tensor, valid: torch.Tensor, table_rows: int):
    """Per-token table row ``rows[req]`` and ``valid`` narrowed to rows inside ``[0, table_rows)``
    (a token whose ``idx_mapping`` row is outside the table reads nothing: memory safety on
    unchecked inputs). Returns (row int64, valid bool), rows 0 where not valid."""
    if rows.numel() == 0:
        return torch.zeros_like(req), torch.zeros_like(valid)
    r = rows.long()[req]
    ok = valid & (r >= 0) & (r < table_rows)
    return torch.where(ok, r, 0), ok


def no_block(slot: torch.Tensor) -> torch.Tensor:
    """``-1`` for the slots of a negative block id (vLLM's ``-1`` placeholder: no block), the slot
    otherwise (int64 in, int64 out). NOTE: ``slot = bid * S + off`` with ``0 <= off < S`` is negative iff
    ``bid`` is, so one clamp masks it (the device twin is :func:`dsv4_index.ops._device.no_block`)."""
    return slot.clamp(min=-1)


def table_slots(block_table: torch.Tensor, req: torch.Tensor, local: torch.Tensor, unit: int,
                mask: torch.Tensor) -> torch.Tensor:
    """``bt[req, local // unit] * unit + local % unit`` (int64) where ``mask`` and the block lies
    inside the table (``0 <= local // unit < width``), else ``-1`` (also for a negative block id,
    :func:`no_block`). Shapes broadcast."""
    blk = torch.div(local, unit, rounding_mode="floor")
    ok = mask & (local >= 0) & (blk < block_table.shape[1])
    if block_table.numel() == 0 or not bool(ok.any()):
        return torch.full(ok.shape, INDEX_SENTINEL, dtype=torch.long, device=ok.device)
    r = torch.where(ok, req, 0).expand(ok.shape)
    k = torch.where(ok, blk, 0).expand(ok.shape)
    slot = no_block(block_table[r, k].long() * unit + local % unit)
    return torch.where(ok, slot, INDEX_SENTINEL)
