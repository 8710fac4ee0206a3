"""Checker of one step's metadata (debug runs and tests).

It copies the step to the host and checks two things (slow on purpose; never in serving):

* **values** — every output equals what its builder states it must be
  (:meth:`ChannelBuilder.expected`: the builder's own launch on the PyTorch references, run on host
  copies of the step), and the common tensors equal the token map of ``query_start_loc``;
* **invariants** that hold whatever a channel means — padded tokens inert, the batch decode-first,
  no two tokens writing one slot, every listed slot inside the cache and outside the null block,
  ``lens`` equal to the listed entries (a prefix), a window ending at the token's own slot.

::

    meta = pipe.build()
    check_metadata(meta, num_blocks=pool_size)                 # MetadataError on the first violation
    slots, lens = meta.topk_to_slots("c4a", topk)
    check_topk(meta, "c4a", topk, slots, lens)
    check_candidates(meta, "c1a", blocks, cols, phys, counts, slots, lens)   # V4.1's two-level indexer
    check_cp_partition([meta_rank0, meta_rank1])               # DCP: ranks partition the tokens
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._common import cp_owner
from .channels.base import BuildContext
from .query_batch import query_batch

__all__ = ["MetadataError", "check_metadata", "check_topk", "check_candidates", "check_cp_partition", "host_context"]

_SLOT_FIELDS = ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "indices")
_LEN_FIELDS = ("lens", "ks", "ke")
_PER_REQUEST = ("cu", "compact_cu", "compact_slot_mapping", "decode_lens", "decode_lens_clamped")


class MetadataError(ValueError):
    """A metadata invariant does not hold.

    Attributes
    ----------
    channel : str — channel name, or the common field (``"positions"``, ``"batch"``, ...).
    token : int or None — token index in the step; ``req_id`` / ``row``: its request and batch row.
    expected, found : the values compared.
    """

    def __init__(self, channel, what, *, token=None, req_id=None, row=None, pos=None, expected=None,
                 found=None):
        self.channel, self.what, self.token, self.req_id, self.row = channel, what, token, req_id, row
        self.expected, self.found = expected, found
        where = ""
        if token is not None:
            where = f" at token {token}"
        if row is not None:
            where += f" (request {req_id!r}, batch row {row}" + ("" if pos is None else f", position {pos}") + ")"
        super().__init__(f"{channel}: {what}{where}: expected {expected}, found {found}")


def _cpu(x):
    return None if x is None else x.detach().cpu()


def host_context(meta) -> BuildContext:
    """A CPU :class:`BuildContext` holding host copies of ``meta``'s step (references backend), with
    the token map filled: what :meth:`ChannelBuilder.expected` runs on."""
    B, T, Tp = meta.num_reqs, meta.num_tokens, meta.num_tokens_padded
    cap = max(Tp, 1)
    i32 = torch.int32

    def per_req(x, n):
        out = torch.zeros(cap + 1, dtype=i32)
        if x is not None:
            out[:n] = torch.as_tensor(x)[:n].to(i32)
        return out

    world, rank, inter = meta.cp
    ctx = BuildContext(
        layout=meta.layout, device=torch.device("cpu"), max_num_reqs=meta.block_tables[0].shape[0] if meta.block_tables
        else 1, max_num_tokens=cap, next_n=meta.next_n, cp_world_size=world, cp_rank=rank, cp_interleave=inter,
        tables=tuple(_cpu(t) for t in meta.block_tables), ring_cols=tuple(meta.ring_cols),
        query_start_loc=per_req(_cpu(meta.query_start_loc), B + 1), seq_lens=per_req(_cpu(meta.seq_lens), B),
        idx_mapping=per_req(_cpu(meta.idx_mapping), B), replay_start=per_req(meta.replay_start, B),
        replay_end=per_req(meta.replay_end, B), token_to_req=torch.zeros(cap, dtype=i32),
        positions=torch.zeros(cap, dtype=torch.int64), is_valid_token=torch.zeros(cap, dtype=torch.bool),
        backend="reference", num_reqs=B, num_tokens=T, num_tokens_padded=Tp, num_decodes=meta.num_decodes,
        has_replay_start=meta.replay_start is not None, has_replay_end=meta.replay_end is not None)
    ctx.fill_token_map()
    if meta.query_lens is not None:  # NOTE: a declared step: its query batch (docs/DESIGN.md §5)
        qsl_q = torch.as_tensor(meta.host_query_start_loc_q, dtype=i32)
        ctx.query = query_batch(torch.as_tensor(meta.query_lens).numpy(), meta.num_decodes, True,
                                meta.num_query_tokens_padded)
        ctx.fill_query(qsl_q)
    return ctx


class _Step:
    def __init__(self, meta, ctx: BuildContext):
        self.meta, self.ctx = meta, ctx
        Tp = meta.num_tokens_padded
        self.valid = ctx.is_valid_token[:Tp]
        self.req = ctx.token_to_req[:Tp].long()
        self.pos = ctx.positions[:Tp]
        # NOTE: a declared step's query rows (docs/DESIGN.md §5): their mask and source rows (-1: padded)
        self.q_to_src = None if meta.q_to_src is None else _cpu(meta.q_to_src).long()
        self.valid_q = self.valid if self.q_to_src is None else self.q_to_src >= 0

    def fail(self, channel, what, t=None, expected=None, found=None, query=False):
        if t is None:
            raise MetadataError(channel, what, expected=expected, found=found)
        t = int(t)
        if query and self.q_to_src is not None:  # NOTE: a query row: name its source token
            what, t = f"{what} (query row {t})", int(self.q_to_src[t])
            if t < 0:
                raise MetadataError(channel, what, expected=expected, found=found)
        ok = bool(self.valid[t])
        b = int(self.req[t]) if ok else None
        ids = self.meta.req_ids
        rid = ids[b] if ok and ids is not None else (int(self.meta.req_slots[b]) if ok else None)
        raise MetadataError(channel, what, token=t, req_id=rid, row=b, pos=int(self.pos[t]) if ok else None,
                            expected=expected, found=found)


def _first(mask: torch.Tensor) -> Optional[int]:
    m = mask.flatten(1).any(1) if mask.dim() > 1 else mask
    nz = torch.nonzero(m)
    return int(nz[0]) if nz.numel() else None


def _compare(s: _Step, channel: str, field: str, found: torch.Tensor, exp: torch.Tensor, what: str,
             query: bool = False):
    if found.shape != exp.shape:
        s.fail(channel, f"{field} shape", expected=tuple(exp.shape), found=tuple(found.shape))
    bad = found != exp
    t = _first(bad)
    if t is not None:
        tok = None if field in _PER_REQUEST else t  # NOTE: rows of per-request fields are no tokens
        if found.dim() > 1:
            k = int(torch.nonzero(bad[t])[0])
            s.fail(channel, f"{field}[{t}, {k}] {what}", tok, expected=int(exp[t, k]), found=int(found[t, k]),
                   query=query)
        if tok is None:
            s.fail(channel, f"{field}[{t}] {what}", expected=int(exp[t]), found=int(found[t]))
        s.fail(channel, f"{field} {what}", t, expected=int(exp[t]), found=int(found[t]), query=query)


def _check_common(s: _Step, meta) -> None:
    B, T, Tp, nd = meta.num_reqs, meta.num_tokens, meta.num_tokens_padded, meta.num_decodes
    qsl = _cpu(meta.query_start_loc).long()
    q = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or int(qsl[-1]) != T or bool((q < 0).any()):
        s.fail("query_start_loc", "query_start_loc must rise from 0 to num_tokens", expected=T, found=qsl.tolist())
    if not T <= Tp or nd + meta.num_prefills != B:
        s.fail("batch", "counts (num_tokens <= num_tokens_padded, decodes + prefills = rows)",
               expected=(T, B), found=(Tp, nd + meta.num_prefills))
    dec = (q >= 1) & (q <= meta.next_n)
    b = _first(~dec[:nd])
    if b is not None:
        s.fail("batch", f"decode row {b} has a query length outside [1, next_n = {meta.next_n}]",
               expected=f"1..{meta.next_n}", found=int(q[b]))
    b = _first(dec[nd:])
    if b is not None:
        s.fail("batch", f"decode-first order: batch row {b + nd} is a decode after the first prefill row",
               expected=f"q_len > {meta.next_n}", found=int(q[b + nd]))
    if (meta.num_decode_tokens, meta.num_prefill_tokens) != (int(q[:nd].sum()), int(q[nd:].sum())):
        s.fail("batch", "(num_decode_tokens, num_prefill_tokens)", expected=(int(q[:nd].sum()), int(q[nd:].sum())),
               found=(meta.num_decode_tokens, meta.num_prefill_tokens))
    for name in ("token_to_req", "positions", "is_valid_token"):
        _compare(s, name, name, _cpu(getattr(meta, name)), getattr(s.ctx, name)[:Tp], "(token map of query_start_loc)")


def _check_channel(s: _Step, name: str, c, exp, num_blocks, null_block) -> None:
    spec = s.meta.layout.channels[name]
    g = s.meta.layout.groups[spec.gid]
    qf = s.meta.builders[name].query_fields() if s.q_to_src is not None else frozenset()
    circular = g.kind == "circular"  # NOTE: address map may repeat slots; in-step window entries are <= -2
    for field in ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "compact_slot_mapping",
                  "compact_cu", "indices", "lens", "ks", "ke", "cu", "decode_lens", "lens_clamped",
                  "decode_lens_clamped"):
        found, want = getattr(c, field), getattr(exp, field)
        q = field in qf  # NOTE: rows of the query batch (docs/DESIGN.md §5)
        valid = s.valid_q if q else s.valid
        if (found is None) != (want is None):
            s.fail(name, f"{field} present / absent", expected=want is not None, found=found is not None)
        if found is None:
            continue
        found, want = _cpu(found), _cpu(want)
        if found.shape != want.shape:  # NOTE: before any per-token check indexes it
            s.fail(name, f"{field} shape", expected=tuple(want.shape), found=tuple(found.shape))
        per_token = field not in ("cu", "compact_cu", "decode_lens", "compact_slot_mapping", "lens_clamped",
                                  "decode_lens_clamped")
        if per_token:
            pad = ~valid if found.dim() == 1 else ~valid[:, None]
            sentinel = 0 if field in _LEN_FIELDS else -1
            t = _first(pad & (found != sentinel))
            if t is not None:
                s.fail(name, f"padded token has {field} != {sentinel}", t, expected=sentinel,
                       found=found[t].tolist(), query=q)
        if field in _SLOT_FIELDS:
            unit = spec.rows_per_block if spec.compress_ratio > 1 and field != "slot_mapping" else g.block_size
            listed = found >= 0 if circular and field == "indices" else found != -1
            cap = None if num_blocks is None else num_blocks * g.blocks_per_kv_block * unit
            bad = listed & ((found < 0) | ((found >= cap) if cap is not None else torch.zeros_like(listed)))
            if null_block is not None:
                bad |= listed & (torch.div(found, unit * g.blocks_per_kv_block, rounding_mode="floor") == null_block)
            t = _first(bad)
            if t is not None:  # NOTE: the first offending entry and a count of the others (no row dump)
                k = int(torch.nonzero(bad[t])[0]) if found.dim() > 1 else None
                more = int(bad.sum()) - 1
                s.fail(name, f"{field}{'' if k is None else f'[{t}, {k}]'} outside the cache or in the null "
                       f"block {null_block}" + (f" ({more} more entries)" if more else ""), t if per_token else None,
                       expected=f"-1 or a slot in [0, {'inf' if cap is None else cap}) outside block {null_block}",
                       found=int(found[t] if k is None else found[t, k]), query=q)
            if field in ("slot_mapping", "compressed_slot_mapping", "tail_slot_mapping") and not (
                    circular and field == "slot_mapping"):
                x = found[valid & listed]
                u, cnt = torch.unique(x, return_counts=True)
                if bool((cnt > 1).any()):
                    v = int(u[cnt > 1][0])
                    t = int(torch.nonzero(found == v)[1])
                    s.fail(name, f"{field}: two tokens write slot {v}", t, expected="one writer per slot", found=v)
        if field == "indices" and c.lens is not None:
            lens = _cpu(c.lens)
            j = torch.arange(found.shape[1])
            shape = (j[None, :] < lens[:, None]) == (found != -1)
            t = _first(valid[:, None] & ~shape)
            if t is not None:
                s.fail(name, "indices: lens entries listed, then -1", t, expected=f"{int(lens[t])} entries",
                       found=found[t].tolist(), query=q)
            if c.slot_mapping is not None:
                sm, L = _cpu(c.slot_mapping), lens
                if q and s.q_to_src is not None:  # NOTE: the slot of each query row's source token
                    sm = torch.where(valid, sm[s.q_to_src.clamp(min=0)], -1)
                if circular:  # NOTE: the token itself is read from its own row t, encoded -2 - t
                    sm = torch.where(sm != -1, -2 - torch.arange(sm.shape[0], dtype=sm.dtype), sm)
                last = found.gather(1, (L - 1).clamp(0, found.shape[1] - 1)[:, None].long())[:, 0]
                mine = valid & (sm != -1)
                t = _first(mine & ((L == 0) | (last != sm)))
                if t is not None:
                    s.fail(name, "window does not end at the token's own slot", t, expected=int(sm[t]),
                           found=int(last[t]) if int(L[t]) else "empty row", query=q)
        _compare(s, name, field, found, want, "(docs/DESIGN.md §4, from the reference)", query=q)


def check_metadata(meta, *, num_blocks: Optional[int] = None, null_block: Optional[int] = 0) -> None:
    """Check one step's metadata; raise :class:`MetadataError` on the first violation.

    Parameters
    ----------
    meta : DSV4Metadata — as returned by ``build()`` (check it before the next build overwrites it).
    num_blocks : int, optional — pool size (allocation blocks); listed slots must lie below
        ``num_blocks * blocks_per_kv_block * rows``. Default: only non-negative.
    null_block : int or None — no listed slot may lie in this block (None: skip).
    """
    try:
        ctx = host_context(meta)
    except ValueError as e:  # NOTE: the step's own tensors contradict each other (counts, qsl)
        raise MetadataError("batch", f"inconsistent step ({e})", expected="a consistent step",
                            found=(meta.num_tokens, meta.num_tokens_padded)) from e
    s = _Step(meta, ctx)
    _check_common(s, meta)
    for name, c in meta.channels.items():
        exp = meta.builders[name].expected(ctx)
        _check_channel(s, name, c, exp, num_blocks, null_block)


def check_topk(meta, channel: str, topk: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, *,
               compact: bool = False, num_blocks: Optional[int] = None, null_block: Optional[int] = 0) -> None:
    """Check one top-k conversion (``meta.topk_to_slots(channel, topk)``) against the reference
    :func:`dsv4_index.reference.topk_to_slots` on host copies; entries inside the cache."""
    from . import reference
    ctx = host_context(meta)
    s = _Step(meta, ctx)
    c = meta[channel]
    B, T, Tp = meta.num_reqs, meta.num_query_tokens, meta.num_query_tokens_padded  # NOTE: query rows
    w, r, i = ctx.group_cp(c.gid)
    K = slots.shape[1]
    pad = torch.full((Tp, K), -1, dtype=torch.int64)
    m = min(Tp, topk.shape[0])
    pad[:m] = _cpu(topk)[:m, :K].long()
    exp, exp_lens = reference.topk_to_slots(
        pad, ctx.query_qsl(), ctx.seq_lens[:B], ctx.tables[c.gid], c.rows_per_block, c.compress_ratio,
        idx_mapping=ctx.idx_mapping[:B], cp_world_size=w, cp_rank=r, cp_interleave=i, compact=compact,
        num_tokens=T, out=torch.empty((Tp, K), dtype=torch.int32), out_lens=torch.empty(Tp, dtype=torch.int32))
    g = meta.layout.groups[c.gid]
    out = _cpu(slots)
    if num_blocks is not None:
        t = _first((out != -1) & ((out < 0) | (out >= num_blocks * g.blocks_per_kv_block * c.rows_per_block)))
        if t is not None:
            s.fail(channel, "top-k slot outside the cache", t, expected=f"< {num_blocks * c.rows_per_block}",
                   found=out[t].tolist(), query=True)
    _compare(s, channel, "top-k slots", out, exp, "(reference topk_to_slots)", query=True)
    _compare(s, channel, "top-k lens", _cpu(lens), exp_lens, "(reference topk_to_slots)", query=True)


def check_candidates(meta, channel: str, blocks: torch.Tensor, cols: Optional[torch.Tensor],
                     phys: Optional[torch.Tensor], counts: Optional[torch.Tensor], slots: Optional[torch.Tensor],
                     lens: Optional[torch.Tensor], *, compact: bool = False) -> None:
    """Check V4.1's candidate conversions (``meta.candidate_blocks_to_physical(channel, blocks)`` -> ``phys``,
    ``counts``; ``meta.candidate_topk_to_slots(channel, blocks, cols)`` -> ``slots``, ``lens``; pass None for a
    pair not made) against the references on host copies (docs/DESIGN.md §4 "Candidate blocks")."""
    from . import reference
    ctx = host_context(meta)
    s = _Step(meta, ctx)
    c = meta[channel]
    B, T, Tp = meta.num_reqs, meta.num_query_tokens, meta.num_query_tokens_padded  # NOTE: query rows
    C = meta.layout.candidate_block_size
    if C is None:
        raise ValueError("this layout has no two-level indexer (layout.candidate_block_size is None)")
    args = (ctx.query_qsl(), ctx.seq_lens[:B], ctx.tables[c.gid], c.rows_per_block, c.compress_ratio, C)
    blk = _cpu(blocks)[:Tp]
    if phys is not None and counts is not None:
        exp, exp_n = reference.candidate_blocks_to_physical(blk, *args, idx_mapping=ctx.idx_mapping[:B],
                                                            num_tokens=T, out=torch.empty((Tp, blk.shape[1]),
                                                                                          dtype=torch.int32),
                                                            out_counts=torch.empty(Tp, dtype=torch.int32))
        _compare(s, channel, "candidate physical blocks", _cpu(phys), exp, "(reference candidate_blocks_to_physical)",
                 query=True)
        _compare(s, channel, "candidate counts", _cpu(counts), exp_n, "(reference candidate_blocks_to_physical)",
                 query=True)
    if cols is not None and slots is not None and lens is not None:
        w, r, i = ctx.group_cp(c.gid)
        K = slots.shape[1]
        exp, exp_n = reference.candidate_topk_to_slots(
            blk, _cpu(cols)[:Tp, :K], *args, idx_mapping=ctx.idx_mapping[:B], cp_world_size=w, cp_rank=r,
            cp_interleave=i, compact=compact, num_tokens=T, out=torch.empty((Tp, K), dtype=torch.int32),
            out_lens=torch.empty(Tp, dtype=torch.int32))
        _compare(s, channel, "candidate slots", _cpu(slots), exp, "(reference candidate_topk_to_slots)", query=True)
        _compare(s, channel, "candidate lens", _cpu(lens), exp_n, "(reference candidate_topk_to_slots)", query=True)


def check_cp_partition(metas_per_rank: Sequence) -> None:
    """Check that the per-rank metadata of one DCP step partition the tokens (docs/DESIGN.md §4): every rank
    sees the same batch; each live token's raw slot in a sharded group, and each completed compressed
    row, is written by exactly one rank, its owner; per-rank list lengths add up to the global ones."""
    metas = list(metas_per_rank)
    if not metas:
        raise ValueError("metas_per_rank must not be empty")
    Wc, _, inter = metas[0].cp
    if len(metas) != Wc:
        raise ValueError(f"metas_per_rank has {len(metas)} entries, the metadata says cp_world_size = {Wc}")
    ctx0 = host_context(metas[0])
    s0 = _Step(metas[0], ctx0)
    for r, m in enumerate(metas[1:], 1):
        if m.num_tokens != metas[0].num_tokens \
                or not torch.equal(_cpu(m.query_start_loc), _cpu(metas[0].query_start_loc)) \
                or not torch.equal(_cpu(m.seq_lens), _cpu(metas[0].seq_lens)):
            s0.fail("batch", f"rank {r} sees another batch than rank 0", expected=metas[0].num_tokens,
                    found=m.num_tokens)
    p = s0.pos
    for name, c0 in metas[0].channels.items():
        g = metas[0].layout.groups[c0.gid]
        if not g.sharded:
            continue
        R = c0.compress_ratio
        for field in ("slot_mapping", "compressed_slot_mapping"):
            if getattr(c0, field) is None:
                continue
            x = torch.stack([_cpu(getattr(m[name], field)) for m in metas])
            done = s0.valid & ((p + 1) % R == 0) if field == "compressed_slot_mapping" else s0.valid
            if metas[0].replay_end is not None and g.prefix_cacheable:
                done &= p >= torch.as_tensor(metas[0].replay_end)[s0.req] if metas[0].num_reqs else done
            unit = p // R if field == "compressed_slot_mapping" else p
            owner = cp_owner(unit, Wc, inter)
            listed = x != -1
            t = _first(done & ((listed.sum(0) != 1) | ~listed.gather(0, owner[None])[0]))
            if t is None:
                t = _first(~done & listed.any(0))
            if t is not None:
                s0.fail(name, f"{field}: ranks writing the token's slot (owner rank {int(owner[t])})", t,
                        expected=[int(owner[t])] if bool(done[t]) else [],
                        found=torch.nonzero(listed[:, t]).flatten().tolist())
        if c0.lens is not None and c0.ks is not None:
            total = torch.stack([_cpu(m[name].lens) for m in metas]).sum(0)
            exp = torch.where(s0.valid, (p + 1) // R, 0).to(total.dtype)
            t = _first(total != exp)
            if t is not None:
                s0.fail(name, "indexer lens summed over ranks", t, expected=int(exp[t]), found=int(total[t]))
