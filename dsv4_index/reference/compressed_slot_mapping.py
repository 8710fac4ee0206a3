"""Reference of ``compressed_slot_mapping`` (DESIGN §4 "Compressed slot mapping", DCP, compact form)."""

from __future__ import annotations

from typing import Optional

import torch

from .._common import (check_batch, check_cp, check_positive_int, cp_local,
                       cp_owner, needs_value_checks, prepare_out, resolve_num_tokens, table_slots,
                       token_positions)
from .slot_mapping import check_table_width
from .token_to_req import check_values, prepare_rows


def rows_this_step(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int):
    """(first row, count) of the compressed rows completed this step, per request, int64 ``[B]``.

    Rows ``c`` with ``ctx <= c*R + R - 1 < seq_len`` (``ctx = seq_len - q_len``): from ``ctx // R``,
    ``seq_len // R - ctx // R`` of them. NOTE: negatives (garbage inputs) are clamped to 0.
    """
    qsl = query_start_loc.long()
    sl = seq_lens.long()
    ctx = (sl - (qsl[1:] - qsl[:-1])).clamp(min=0)
    first = ctx // compress_ratio
    return first, (sl.clamp(min=0) // compress_ratio - first).clamp(min=0)


def _completed_rows(query_start_loc, seq_lens, num_rows, rows_per_block, compress_ratio,
                    cp_world_size, cp_rank, cp_interleave):
    """(req, row c, done mask, local row, needs-a-slot mask), each ``[num_rows]`` tokens."""
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_rows)
    done = valid & (pos >= 0) & ((pos + 1) % compress_ratio == 0)
    c = torch.where(done, pos // compress_ratio, -1)
    need = done & (cp_owner(c, cp_world_size, cp_interleave) == cp_rank)
    lc = torch.where(need, cp_local(c, cp_world_size, cp_interleave), -1)
    return req, c, done, lc, need


def _check_args(query_start_loc, seq_lens, block_table, rows_per_block, compress_ratio,
                cp_world_size, cp_rank, cp_interleave, compact, num_tokens, out, out_cu, validate):
    """Shared by the reference and the Triton wrapper; returns ``(out, out_cu | None, T)``.

    ``T`` is the number of token slots to scan (``T_out`` for the token-aligned form).
    """
    B, device = check_batch(query_start_loc, seq_lens, block_table)
    check_positive_int("rows_per_block", rows_per_block)
    check_positive_int("compress_ratio", compress_ratio)
    check_cp(cp_world_size, cp_rank, cp_interleave)
    if not compact:
        if out_cu is not None:
            raise ValueError("out_cu is only used with compact=True")
        out = prepare_rows("out", out, query_start_loc, num_tokens, torch.int64)
        T = out.shape[0]
    else:
        T = resolve_num_tokens(query_start_loc, num_tokens)
        cap = T // compress_ratio + B
        out = prepare_out("out", out, shape=(cap,), min_rows=cap if num_tokens is not None else 0,
                          dtype=torch.int64, device=device)
        out_cu = prepare_out("out_cu", out_cu, shape=(B + 1,), min_rows=B + 1, dtype=torch.int32,
                             device=device)
    if needs_value_checks(device, validate):
        check_values(query_start_loc, seq_lens, num_tokens, T)
        if compact:
            _, n = rows_this_step(query_start_loc, seq_lens, compress_ratio)
            if int(n.sum()) > out.shape[0]:
                raise ValueError(f"out has {out.shape[0]} rows, the step completes {int(n.sum())}")
        req, _, _, lc, need = _completed_rows(query_start_loc, seq_lens, int(query_start_loc[-1]),
                                              rows_per_block, compress_ratio, cp_world_size,
                                              cp_rank, cp_interleave)
        check_table_width("block_table", block_table, req, lc // rows_per_block, need)
    return out, out_cu, T


def _compressed_slot_mapping(query_start_loc, seq_lens, block_table, rows_per_block,
                             compress_ratio, cp_world_size, cp_rank, cp_interleave, num_rows):
    """Token-aligned form, int64 ``[num_rows]``, plus (req, c, done) for the compact form."""
    req, c, done, lc, need = _completed_rows(query_start_loc, seq_lens, num_rows, rows_per_block,
                                             compress_ratio, cp_world_size, cp_rank, cp_interleave)
    return table_slots(block_table, req, lc, rows_per_block, need), req, c, done


def _compact(query_start_loc, seq_lens, slots, req, c, done, compress_ratio, n_out, n_cu):
    """Compact form: (int64 ``[n_out]``, int32 cu ``[n_cu]``)."""
    device = slots.device
    first, n = rows_this_step(query_start_loc, seq_lens, compress_ratio)
    cu = torch.zeros(n_cu, dtype=torch.long, device=device)
    B = n.numel()
    cu[1:B + 1] = torch.cumsum(n, 0)
    cu[B + 1:] = cu[B]
    out = torch.full((n_out,), -1, dtype=torch.long, device=device)
    if B:
        row = cu[req] + c - first[req]
        keep = done & (row >= 0) & (row < n_out)
        out[row[keep]] = slots[keep]
    return out, cu.to(torch.int32)


def compressed_slot_mapping(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, rows_per_block: int, compress_ratio: int, *,
                            cp_world_size: int = 1, cp_rank: int = 0, cp_interleave: int = 1,
                            compact: bool = False, num_tokens: Optional[int] = None, out=None,
                            out_cu=None, validate: bool = False, backend=None):
    """Reference of :func:`dsv4_index.compressed_slot_mapping`: same signature, arguments and result (the kernel must equal it).

    Plain PyTorch on any device; ``backend`` is accepted and ignored.
    """
    out, out_cu, T = _check_args(query_start_loc, seq_lens, block_table, rows_per_block,
                                 compress_ratio, cp_world_size, cp_rank, cp_interleave, compact,
                                 num_tokens, out, out_cu, validate)
    slots, req, c, done = _compressed_slot_mapping(query_start_loc, seq_lens, block_table,
                                                   rows_per_block, compress_ratio, cp_world_size,
                                                   cp_rank, cp_interleave, T)
    if not compact:
        out.copy_(slots)
        return out
    rows, cu = _compact(query_start_loc, seq_lens, slots, req, c, done, compress_ratio,
                        out.shape[0], out_cu.shape[0])
    out.copy_(rows)
    out_cu.copy_(cu)
    return out, out_cu

