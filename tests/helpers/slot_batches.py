"""Batch strategies and plain-Python models of DESIGN §4 shared by the slot / window op tests.

The ``py_*`` functions are written straight from DESIGN §4 (loops over requests and positions)
and never call the library: they are the independent check of the references.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import strategies as st

from helpers.pipelines import HAS_TRITON

POISON = 12345
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # for @given tests
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
KINDS = ("decode", "spec", "prefill", "chunk", "empty")


def cdiv(a, b):
    return -(-a // b)


@st.composite
def batches(draw, *, max_reqs=4, max_ctx=300, max_q=24, unit=64, kinds=KINDS):
    """(q_lens, seq_lens) lists: decode / spec (2-4) / prefill / chunked prefill / empty rows;
    contexts often sit next to a multiple of ``unit`` (block size or ratio)."""
    B = draw(st.integers(0, max_reqs))
    near = st.builds(lambda k, d: max(k * unit + d, 0), st.integers(0, max_ctx // unit),
                     st.integers(-2, 1))
    ctx_st = st.one_of(st.integers(0, max_ctx), near)
    q_lens, seq_lens = [], []
    for _ in range(B):
        kind = draw(st.sampled_from(kinds))
        if kind == "decode":
            q, ctx = 1, draw(ctx_st)
        elif kind == "spec":
            q, ctx = draw(st.integers(2, 4)), draw(ctx_st)
        elif kind == "prefill":
            q, ctx = draw(st.integers(1, max_q)), 0
        elif kind == "chunk":
            q, ctx = draw(st.integers(1, max_q)), draw(ctx_st)
        else:
            q, ctx = 0, draw(ctx_st)
        q_lens.append(q)
        seq_lens.append(ctx + q)
    return q_lens, seq_lens


def batch_tensors(q_lens, seq_lens, device="cpu"):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return (torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def make_table(needed, *, seed, extra_cols=2, extra_rows=1, base=1, device="cpu"):
    """int32 table: row b holds ``needed[b]`` distinct ids from ``base``, then int32 garbage;
    ``extra_rows`` garbage rows below."""
    g = torch.Generator().manual_seed(seed)
    B = len(needed)
    width = max(needed + [0]) + extra_cols
    bt = torch.randint(-2 ** 31, 2 ** 31 - 1, (B + extra_rows, width), generator=g,
                       dtype=torch.int64)
    ids = torch.randperm(max(sum(needed), 1), generator=g) + base
    k = 0
    for b, n in enumerate(needed):
        bt[b, :n] = ids[k:k + n]
        k += n
    return bt.to(torch.int32).to(device)


def poisoned(shape, dtype, device):
    return torch.full(shape, POISON, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------
# plain-Python models (DESIGN §4)
# ----------------------------------------------------------------------------------------------
def py_tokens(q_lens, seq_lens):
    """(b, pos) of every live token in batch order."""
    return [(b, s - q + i) for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for i in range(q)]


def py_owned_local(p, world, rank, interleave):
    """Local position of ``p`` on ``rank``, or None when another rank owns it."""
    if (p // interleave) % world != rank:
        return None
    return (p // (interleave * world)) * interleave + p % interleave


def py_slot(row, p, unit, world=1, rank=0, interleave=1, ring=False):
    """Slot of position (or compressed row) ``p`` in table row ``row``; ``ring``: logical block
    ``i`` lives in column ``i % len(row)``."""
    lp = py_owned_local(p, world, rank, interleave)
    if lp is None:
        return -1
    blk = lp // unit
    return int(row[blk % len(row) if ring else blk]) * unit + lp % unit


def py_slot_mapping(q_lens, seq_lens, bt, block_size, T_out, world=1, rank=0, interleave=1,
                    circular=None, ring=False, replay_end=None):
    out = [-1] * T_out
    for t, (b, p) in enumerate(py_tokens(q_lens, seq_lens)):
        if replay_end is not None and p < replay_end[b]:
            continue  # bounded replay: the prefix-shared blocks are never written
        if circular is not None:
            out[t] = int(bt[b][0]) * circular + p % circular
        else:
            out[t] = py_slot(bt[b], p, block_size, world, rank, interleave, ring)
    return out


def py_compressed(q_lens, seq_lens, bt, S, R, T_out, world=1, rank=0, interleave=1, replay_end=None):
    out = [-1] * T_out
    for t, (b, p) in enumerate(py_tokens(q_lens, seq_lens)):
        if (p + 1) % R == 0 and (replay_end is None or p >= replay_end[b]):
            out[t] = py_slot(bt[b], p // R, S, world, rank, interleave)
    return out


def py_compact(q_lens, seq_lens, bt, S, R, n_out, world=1, rank=0, interleave=1, replay_end=None):
    """Every completed row listed (``-1`` when owned elsewhere or replayed), ``cu`` per request."""
    rows, cu = [], [0]
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - q, s):
            if (p + 1) % R == 0:
                replayed = replay_end is not None and p < replay_end[b]
                rows.append(-1 if replayed else py_slot(bt[b], p // R, S, world, rank, interleave))
        cu.append(len(rows))
    return rows + [-1] * (n_out - len(rows)), cu


def py_window(q_lens, seq_lens, bt, block_size, W, width, T_out, replay=None, world=1, rank=0,
              interleave=1, ring=False, circular=None):
    idx = [[-1] * width for _ in range(T_out)]
    lens = [0] * T_out
    for t, (b, p) in enumerate(py_tokens(q_lens, seq_lens)):
        floor = replay[b] if replay is not None else 0
        owned = [x for x in range(max(p - W + 1, floor), p + 1)
                 if py_owned_local(x, world, rank, interleave) is not None]
        for j, x in enumerate(owned):
            if circular is not None:
                idx[t][j] = int(bt[b][0]) * circular + x % circular
            else:
                idx[t][j] = py_slot(bt[b], x, block_size, world, rank, interleave, ring)
        lens[t] = len(owned)
    return idx, lens


# Named batches shared by the compressed-row op tests: (q_lens, ctx_lens) for decode-only, prefill-only,
# mixed (decodes first) and spec runs of 2-4 tokens; contexts cross ratio (R = 4) and block (S * R = 16)
# boundaries.
COMPRESSED_SCENARIOS = {
    "decode": ([1, 1, 1, 1], [0, 3, 15, 63]),
    "prefill": ([17, 5, 33], [0, 11, 31]),
    "mixed": ([1, 1, 20, 6], [47, 2, 0, 13]),
    "spec": ([2, 3, 4, 2], [14, 30, 60, 1]),
}
