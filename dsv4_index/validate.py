"""Invariant checker of one step's metadata (debug runs and tests).

Everything here copies device tensors to the host (``.cpu()``) and recomputes the expected values
from the host copies of the block tables (DESIGN §4); it is slow on purpose and must never run in
the serving path (``MetadataPipeline(..., validate=True)`` is for debugging).

::

    meta = pipe.build()
    check_metadata(meta, num_blocks=pool_size)                 # MetadataError on the first violation
    slots, lens = meta.topk_to_slots("c4a", topk)
    check_topk(meta, "c4a", topk, slots, lens)
    check_cp_partition([meta_rank0, meta_rank1])               # DCP: ranks partition the tokens
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple, Union

import torch

from ._common import cp_local, cp_owned_count, cp_owner, table_slots

__all__ = ["MetadataError", "check_metadata", "check_topk", "check_cp_partition"]

CpArg = Union[None, Mapping[str, int], Tuple[int, int, int]]


class MetadataError(ValueError):
    """A metadata invariant does not hold.

    Attributes
    ----------
    channel : str — channel name, or the common field (``"positions"``, ``"batch"``, ...).
    token : int or None — token index in the step; ``req_id`` / ``row``: its request and batch row.
    expected, found : the values compared.
    """

    def __init__(self, channel, what, *, token=None, req_id=None, row=None, pos=None,
                 expected=None, found=None):
        self.channel, self.what, self.token, self.req_id, self.row = channel, what, token, req_id, row
        self.expected, self.found = expected, found
        where = ""
        if token is not None:
            where = f" at token {token}"
        if row is not None:
            where += f" (request {req_id!r}, batch row {row}" + ("" if pos is None else f", position {pos}") + ")"
        super().__init__(f"{channel}: {what}{where}: expected {expected}, found {found}")


# ----------------------------------------------------------------------------------------------
# step view on the host
# ----------------------------------------------------------------------------------------------
class _Step:
    """Host copies of one step + the token map recomputed from query_start_loc / seq_lens."""

    def __init__(self, meta, layout, cp, replay_start, next_n):
        pipe = getattr(meta, "_pipeline", None)
        self.layout = layout if layout is not None else getattr(pipe, "layout", None)
        if self.layout is None:
            raise ValueError("layout: needed when the metadata has no pipeline")
        if cp is None:
            cp = getattr(pipe, "cp", None) or (1, 0, 1)
        if isinstance(cp, Mapping):
            cp = (cp["cp_world_size"], cp["cp_rank"], cp["cp_interleave"])
        self.world, self.rank, self.inter = (int(x) for x in cp)
        self.B, self.T, self.Tp = meta.num_reqs, meta.num_tokens, meta.num_tokens_padded
        self.req_ids = list(meta.req_ids)
        self.qsl = meta.query_start_loc.detach().cpu().long()
        self.seq_lens = meta.seq_lens.detach().cpu().long()
        self.tables = [bt.detach().cpu().long() for bt in meta.block_tables]
        if next_n is None:
            next_n = 1 + pipe.num_speculative_tokens if pipe is not None else None
        self.next_n = next_n
        B = self.B
        if replay_start is None:
            ctx = getattr(pipe, "_ctx", None)
            replay_start = ctx.replay_start[:B] if ctx is not None else torch.zeros(B, dtype=torch.long)
        elif isinstance(replay_start, Mapping):
            replay_start = torch.tensor([int(replay_start.get(r, 0)) for r in self.req_ids], dtype=torch.long)
        self.replay = torch.as_tensor(replay_start).detach().cpu().long().reshape(-1)[:B]
        self.q_len = self.qsl[1:] - self.qsl[:-1] if B else torch.zeros(0, dtype=torch.long)
        t = torch.arange(self.Tp)
        self.valid = t < self.T
        if B:
            req = torch.searchsorted(self.qsl[1:].contiguous(), t, right=True).clamp(0, B - 1)
            self.req = torch.where(self.valid, req, 0)
            self.pos = torch.where(self.valid, self.seq_lens[self.req] - self.qsl[self.req + 1] + t, -1)
        else:
            self.req = torch.zeros(self.Tp, dtype=torch.long)
            self.pos = torch.full((self.Tp,), -1, dtype=torch.long)

    # -- DCP helpers
    def owner_ok(self, p):
        return cp_owner(p, self.world, self.inter) == self.rank

    def local(self, p):
        return cp_local(p, self.world, self.inter)

    def owned(self, n):
        return cp_owned_count(n, self.world, self.rank, self.inter)

    def fail(self, channel, what, t=None, expected=None, found=None):
        if t is None:
            raise MetadataError(channel, what, expected=expected, found=found)
        t = int(t)
        b = int(self.req[t]) if self.B else None
        valid = bool(self.valid[t])
        rid = self.req_ids[b] if valid and b is not None and b < len(self.req_ids) else None
        raise MetadataError(channel, what, token=t, req_id=rid, row=b if valid else None,
                            pos=int(self.pos[t]) if valid else None, expected=expected, found=found)


def _first(mask: torch.Tensor) -> Optional[int]:
    """Index (along dim 0) of the first True row of ``mask`` (any trailing dims), else None."""
    m = mask.flatten(1).any(1) if mask.dim() > 1 else mask
    nz = torch.nonzero(m)
    return int(nz[0]) if nz.numel() else None


def _host(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().cpu().long()


# ----------------------------------------------------------------------------------------------
# common tensors
# ----------------------------------------------------------------------------------------------
def _check_common(s: _Step, meta) -> None:
    B, T, Tp = s.B, s.T, s.Tp
    if len(s.req_ids) != B:
        s.fail("batch", "len(req_ids) != num_reqs", expected=B, found=len(s.req_ids))
    if s.qsl.numel() != B + 1 or s.seq_lens.numel() != B:
        s.fail("query_start_loc", "shape of query_start_loc / seq_lens", expected=(B + 1, B),
               found=(s.qsl.numel(), s.seq_lens.numel()))
    if int(s.qsl[0]) != 0:
        s.fail("query_start_loc", "query_start_loc[0]", expected=0, found=int(s.qsl[0]))
    b = _first(s.q_len < 0)
    if b is not None:
        s.fail("query_start_loc", f"query length of batch row {b} (request {s.req_ids[b]!r}) is negative",
               expected=">= 0", found=int(s.q_len[b]))
    if int(s.qsl[-1]) != T:
        s.fail("query_start_loc", "query_start_loc[num_reqs] != num_tokens", expected=T, found=int(s.qsl[-1]))
    if not T <= Tp:
        s.fail("batch", "num_tokens > num_tokens_padded", expected=f"<= {Tp}", found=T)
    b = _first(s.seq_lens < s.q_len)
    if b is not None:
        s.fail("seq_lens", f"seq_lens of batch row {b} (request {s.req_ids[b]!r}) below its query length",
               expected=f">= {int(s.q_len[b])}", found=int(s.seq_lens[b]))
    b = _first(s.replay > s.seq_lens - s.q_len) if B else None
    if b is not None and int(s.q_len[b]) > 0:
        s.fail("replay_start", f"replay_start of batch row {b} (request {s.req_ids[b]!r}) beyond its first "
               "scheduled position", expected=f"<= {int(s.seq_lens[b] - s.q_len[b])}", found=int(s.replay[b]))

    # decode-first order (one threshold for every channel)
    nd = meta.num_decodes
    if nd + meta.num_prefills != B:
        s.fail("batch", "num_decodes + num_prefills != num_reqs", expected=B, found=nd + meta.num_prefills)
    if s.next_n is not None and B:
        is_dec = (s.q_len >= 1) & (s.q_len <= s.next_n)
        b = _first(~is_dec[:nd])
        if b is not None:
            s.fail("batch", f"decode row {b} (request {s.req_ids[b]!r}) has a query length outside "
                   f"[1, next_n = {s.next_n}]", expected=f"1..{s.next_n}", found=int(s.q_len[b]))
        b = _first(is_dec[nd:])
        if b is not None:
            b += nd
            s.fail("batch", f"decode-first order: batch row {b} (request {s.req_ids[b]!r}) is a decode after "
                   f"the first prefill row {nd}", expected=f"q_len > {s.next_n}", found=int(s.q_len[b]))
    ndt, npt = int(s.q_len[:nd].sum()), int(s.q_len[nd:].sum())
    if (meta.num_decode_tokens, meta.num_prefill_tokens) != (ndt, npt):
        s.fail("batch", "(num_decode_tokens, num_prefill_tokens)", expected=(ndt, npt),
               found=(meta.num_decode_tokens, meta.num_prefill_tokens))

    # token map
    for name in ("positions", "token_to_req", "is_valid_token"):
        x = getattr(meta, name)
        if x.shape[0] != Tp:
            s.fail(name, f"{name} length != num_tokens_padded", expected=Tp, found=x.shape[0])
    valid = meta.is_valid_token.detach().cpu()
    t = _first(valid != s.valid)
    if t is not None:
        s.fail("is_valid_token", "is_valid_token", t, expected=bool(s.valid[t]), found=bool(valid[t]))
    ttr = _host(meta.token_to_req)
    exp = torch.where(s.valid, s.req, 0)
    t = _first(ttr != exp)
    if t is not None:
        s.fail("token_to_req", "token_to_req", t, expected=int(exp[t]), found=int(ttr[t]))
    pos = _host(meta.positions)
    t = _first(s.valid & (pos != s.pos))
    if t is not None:
        s.fail("positions", "positions", t, expected=int(s.pos[t]), found=int(pos[t]))
    for gid, bt in enumerate(s.tables):
        if bt.shape[0] != B:
            s.fail("block_tables", f"block_tables[{gid}] rows != num_reqs", expected=B, found=bt.shape[0])


# ----------------------------------------------------------------------------------------------
# per-channel checks
# ----------------------------------------------------------------------------------------------
class _Chan:
    def __init__(self, s: _Step, c, num_blocks, null_block):
        self.s, self.c, self.name = s, c, c.name
        g = s.layout.groups[c.gid]
        self.bt = s.tables[c.gid]
        self.f = getattr(g, "blocks_per_kv_block", 1)
        self.R, self.S, self.bs = c.compress_ratio, c.rows_per_block, c.block_size
        self.num_blocks, self.null_block = num_blocks, null_block

    def slots(self, req, local, unit, mask):
        if self.bt.shape[0] == 0:
            return torch.full(torch.broadcast_shapes(local.shape, mask.shape), -1, dtype=torch.long)
        return table_slots(self.bt, req, local, unit, mask)

    def check_range(self, field, x, unit):
        """Every listed slot / index (``!= -1``) lies inside the cache and outside the null block."""
        s = self.s
        listed = x != -1
        cap = None if self.num_blocks is None else self.num_blocks * self.f * unit
        bad = listed & ((x < 0) | (x >= cap if cap is not None else torch.zeros_like(listed)))
        t = _first(bad)
        if t is not None:
            v = int(x[t][bad[t]][0]) if x.dim() > 1 else int(x[t])
            s.fail(self.name, f"{field} outside the cache capacity", t,
                   expected=f"-1 or 0 <= slot < {cap if cap is not None else 'inf'}", found=v)
        if self.null_block is not None:
            nb = listed & (torch.div(x, unit * self.f, rounding_mode="floor") == self.null_block)
            t = _first(nb)
            if t is not None:
                v = int(x[t][nb[t]][0]) if x.dim() > 1 else int(x[t])
                s.fail(self.name, f"{field} points into the null block {self.null_block}", t,
                       expected="a slot of an allocated block", found=v)

    def check_padded_1d(self, field, x, sentinel):
        t = _first(~self.s.valid & (x != sentinel))
        if t is not None:
            self.s.fail(self.name, f"padded token has {field} != {sentinel}", t, expected=sentinel, found=int(x[t]))

    def check_unique(self, field, x, key):
        """No two valid tokens write the same slot. NOTE: two requests sharing a prefix block may
        rewrite the same slot from the same position / row ``key`` (identical content): allowed."""
        s = self.s
        idx = torch.nonzero(s.valid & (x != -1)).flatten()
        seen = {}
        for t in idx.tolist():
            v = int(x[t])
            u = seen.setdefault(v, t)
            if u != t and not (int(key[u]) == int(key[t]) and int(s.req[u]) != int(s.req[t])):
                s.fail(self.name, f"{field}: two tokens write slot {v} (the other is token {u}, "
                       f"batch row {int(s.req[u])})", t, expected="a slot no other token writes", found=v)

    def check_equal(self, field, x, exp, what):
        t = _first(self.s.valid & (x != exp))
        if t is not None:
            self.s.fail(self.name, f"{field}: {what}", t, expected=int(exp[t]), found=int(x[t]))

    # -- raw slots ------------------------------------------------------------------------------
    def slot_mapping(self, sm):
        s = self.s
        own = s.valid & s.owner_ok(s.pos.clamp(min=0))
        exp = self.slots(s.req, s.local(s.pos.clamp(min=0)), self.bs, own)
        self.check_padded_1d("slot_mapping", sm, -1)
        self.check_range("slot_mapping", sm, self.bs)
        self.check_unique("slot_mapping", sm, s.pos)
        self.check_equal("slot_mapping", sm, exp, "slot of the token's position (DESIGN §4)")
        return exp

    def compressed(self, cs):
        s, R = self.s, self.R
        p = s.pos.clamp(min=0)
        c = p // R
        done = s.valid & ((p + 1) % R == 0)
        exp = self.slots(s.req, s.local(c), self.S, done & s.owner_ok(c))
        self.check_padded_1d("compressed_slot_mapping", cs, -1)
        t = _first(s.valid & ~done & (cs != -1))
        if t is not None:
            s.fail(self.name, f"compressed_slot_mapping: the token completes no compressed row "
                   f"((pos + 1) % {R} != 0)", t, expected=-1, found=int(cs[t]))
        self.check_range("compressed_slot_mapping", cs, self.S)
        self.check_unique("compressed_slot_mapping", cs, torch.where(done, c, -1))
        self.check_equal("compressed_slot_mapping", cs, exp, "slot of the completed row c = pos // R")

    # -- index lists ----------------------------------------------------------------------------
    def check_rows(self, field, idx, lens, exp, exp_len, unit, label):
        """Shared by window and causal lists: padding, lens, -1 tail, range, exact entries."""
        s = self.s
        W = idx.shape[1]
        j = torch.arange(W)
        pad = ~s.valid
        t = _first(pad[:, None] & (idx != -1))
        if t is not None:
            s.fail(self.name, f"padded token has a listed {field} entry", t, expected="all -1",
                   found=idx[t].tolist())
        count = (idx != -1).sum(1)
        if lens is not None:
            t = _first(pad & (lens != 0))
            if t is not None:
                s.fail(self.name, "padded token has lens != 0", t, expected=0, found=int(lens[t]))
            t = _first(s.valid & (lens != count))
            if t is not None:
                s.fail(self.name, f"lens != count of listed {field} entries", t, expected=int(count[t]),
                       found=int(lens[t]))
        L = count if lens is None else lens
        shape = (j[None, :] < L[:, None]) == (idx != -1)
        t = _first(~shape)
        if t is not None:
            s.fail(self.name, f"{field}: entries before len must be listed and entries after len -1", t,
                   expected=f"{int(L[t])} entries then -1", found=idx[t].tolist())
        self.check_range(field, idx, unit)
        t = _first(s.valid & (L != exp_len))
        if t is not None:
            s.fail(self.name, f"{field} len {label}", t, expected=int(exp_len[t]), found=int(L[t]))
        bad = s.valid[:, None] & (idx != exp)
        t = _first(bad)
        if t is not None:
            k = int(torch.nonzero(bad[t])[0])
            row, er = idx[t, :int(L[t])].tolist(), exp[t, :int(exp_len[t])].tolist()
            if sorted(row) == sorted(er):
                s.fail(self.name, f"{field} row not in strictly ascending position order", t,
                       expected=er, found=row)
            s.fail(self.name, f"{field} entry {k} (row {k} of the list)", t, expected=int(exp[t, k]),
                   found=int(idx[t, k]))

    def window(self, idx, lens, own_slots):
        s, W = self.s, self.c.window
        if idx.shape[1] < W:
            s.fail(self.name, "indices width below the window", expected=f">= {W}", found=idx.shape[1])
        p = s.pos.clamp(min=0)
        floor = s.replay[s.req] if s.B else torch.zeros_like(p)
        start = torch.maximum(p - W + 1, floor).clamp(min=0)
        first, cnt = s.owned(start), s.owned(p + 1) - s.owned(start)
        cnt = torch.where(s.valid, cnt.clamp(min=0), 0)
        j = torch.arange(idx.shape[1])
        listed = s.valid[:, None] & (j[None, :] < cnt[:, None])
        exp = self.slots(s.req[:, None], first[:, None] + j, self.bs, listed)
        exp_len = (exp != -1).sum(1)
        if own_slots is not None:
            # NOTE: the token itself is the newest entry of its own window (when this rank owns it)
            L = (idx != -1).sum(1)
            last = idx.gather(1, (L - 1).clamp(min=0)[:, None])[:, 0]
            mine = s.valid & (own_slots != -1)
            t = _first(mine & ((L == 0) | (last != own_slots)))
            if t is not None:
                s.fail(self.name, "window does not end at the token's own slot (its slot_mapping entry)",
                       t, expected=int(own_slots[t]), found=int(last[t]) if int(L[t]) else "empty row")
        self.check_rows("indices", idx, lens, exp, exp_len, self.bs,
                        "!= min(W, pos + 1 - floor)" if s.world == 1 else "!= owned positions of the window")

    def causal(self, idx, lens):
        s = self.s
        p = s.pos.clamp(min=0)
        n_c = s.owned((p + 1) // self.R)
        bound = min(idx.shape[1], self.bt.shape[1] * self.S)
        exp_len = torch.where(s.valid, n_c.clamp(max=bound), 0)
        j = torch.arange(idx.shape[1])
        exp = self.slots(s.req[:, None], j[None, :].expand(s.Tp, -1), self.S, j[None, :] < exp_len[:, None])
        self.check_rows("indices", idx, lens, exp, exp_len, self.S,
                        "!= visible compressed rows n_c = (pos + 1) // R (bounded by width)")

    def indexer(self, lens, ks, ke, cu, decode_lens):
        s, R = self.s, self.R
        p = s.pos.clamp(min=0)
        exp = torch.where(s.valid, s.owned((p + 1) // R), 0)
        self.check_padded_1d("lens", lens, 0)
        self.check_equal("lens", lens, exp, "indexer length != (pos + 1) // R")
        if cu is not None:
            ecu = torch.zeros(s.B + 1, dtype=torch.long)
            ecu[1:] = torch.cumsum(s.owned(s.seq_lens // R), 0)
            if cu.numel() != s.B + 1 or not torch.equal(cu, ecu):
                b = _first(cu[:s.B + 1] != ecu[:cu.numel()]) if cu.numel() else 0
                s.fail(self.name, f"cu (prefix sum of seq_len // R) at batch row {b}",
                       expected=ecu.tolist(), found=cu.tolist())
            for field, x, e in (("ks", ks, ecu[s.req]), ("ke", ke, ecu[s.req] + exp)):
                if x is not None:
                    self.check_padded_1d(field, x, 0)
                    self.check_equal(field, x, e, f"{field} inconsistent with cu")
        if decode_lens is not None and s.next_n is not None:
            nd, nn = self.num_decodes, s.next_n
            if decode_lens.shape[0] != nd or decode_lens.shape[1] != nn:
                s.fail(self.name, "decode_lens shape", expected=(nd, nn),
                       found=tuple(decode_lens.shape))
            for b in range(nd):
                q = int(s.q_len[b])
                for j in range(nn):
                    i = j - (nn - q)
                    e = int(exp[int(s.qsl[b]) + i]) if i >= 0 else 0
                    if int(decode_lens[b, j]) != e:
                        t = int(s.qsl[b]) + max(i, 0)
                        s.fail(self.name, f"decode_lens[{b}, {j}] (right-aligned)", t, expected=e,
                               found=int(decode_lens[b, j]))


def check_metadata(meta, layout=None, *, num_blocks: Optional[int] = None, cp: CpArg = None,
                   replay_start=None, next_n: Optional[int] = None, null_block: Optional[int] = 0) -> None:
    """Check every invariant of one step's metadata; raise :class:`MetadataError` on the first violation.

    Parameters
    ----------
    meta : DSV4Metadata — as returned by ``build()`` (check it before the next build overwrites it).
    layout : DSV4Layout, optional — default: the pipeline's.
    num_blocks : int, optional — pool size (allocation blocks); slots must lie below
        ``num_blocks * blocks_per_kv_block * rows`` (``rows`` = block_size, or rows_per_block for
        compressed caches). Default: only non-negative.
    cp : dict (``cp_world_size``, ``cp_rank``, ``cp_interleave``) or tuple, optional — default: the pipeline's.
    replay_start : int32 [num_reqs] tensor or dict req_id -> int, optional — window floors;
        default: the pipeline's current step.
    next_n : int, optional — decode threshold ``1 + num_speculative_tokens``; default: the pipeline's.
    null_block : int or None — no listed slot may lie in this block (None: skip the check).

    Checks: batch (qsl, seq_lens, decode-first order and counts), token map (token_to_req, positions,
    is_valid_token), and per channel: padded tokens have ``-1`` / ``0``; slots and indices inside the
    cache and outside the null block; no slot written twice (per rank under DCP); raw and compressed
    slots, window rows, causal rows, indexer lengths / ks / ke / cu / decode_lens recomputed from the
    host copy of the block table (DESIGN §4); lens = count of listed entries, entries after len ``-1``.
    """
    s = _Step(meta, layout, cp, replay_start, next_n)
    _check_common(s, meta)
    for name, c in meta.channels.items():
        ch = _Chan(s, c, num_blocks, null_block)
        ch.num_decodes = meta.num_decodes
        if c.block_table is not None and c.block_table.shape[0] != s.B:
            s.fail(name, "block_table rows != num_reqs", expected=s.B, found=c.block_table.shape[0])
        for field in ("slot_mapping", "compressed_slot_mapping", "indices", "lens", "ks", "ke"):
            x = getattr(c, field)
            if x is not None and x.shape[0] != s.Tp:
                s.fail(name, f"{field} length != num_tokens_padded", expected=s.Tp, found=x.shape[0])
        sm, lens, idx = _host(c.slot_mapping), _host(c.lens), _host(c.indices)
        if sm is not None:
            ch.slot_mapping(sm)
        if c.compressed_slot_mapping is not None:
            ch.compressed(_host(c.compressed_slot_mapping))
        indexer = c.ks is not None or c.cu is not None or c.decode_lens is not None
        if indexer:
            ch.indexer(lens, _host(c.ks), _host(c.ke), _host(c.cu), _host(c.decode_lens))
        if idx is not None:
            own_lens = None if indexer else lens
            if c.window is not None:
                ch.window(idx, own_lens, sm)
            else:
                ch.causal(idx, own_lens)


def check_topk(meta, channel: str, topk: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, *,
               compact: bool = False, layout=None, cp: CpArg = None, num_blocks: Optional[int] = None,
               null_block: Optional[int] = 0) -> None:
    """Check one top-k conversion of ``channel`` (``meta.topk_to_slots(channel, topk)``).

    Parameters
    ----------
    topk : int32 / int64 [>= T, K] — request-local compressed row ids (``-1`` = none).
    slots : int32 [T, K]; lens : int32 [T] — the conversion (``T = num_tokens_padded``).
    compact : bool — the conversion packed valid entries to the front.

    Every converted entry is the slot of a row visible to the token (``0 <= l < n_c(pos)``, owned under
    DCP); entries of invisible / invalid picks are ``-1``; lens = count of listed entries; padded
    tokens all ``-1`` with len 0. Raises :class:`MetadataError` naming the channel.
    """
    s = _Step(meta, layout, cp, None, None)
    c = meta[channel]
    ch = _Chan(s, c, num_blocks, null_block)
    out, ln = _host(slots), _host(lens)
    K = out.shape[1]
    l = torch.full((s.Tp, K), -1, dtype=torch.long)
    m = min(s.Tp, topk.shape[0])
    l[:m] = _host(topk)[:m, :K]
    n_c = ((s.pos.clamp(min=0) + 1) // ch.R)[:, None]
    ok = s.valid[:, None] & (l >= 0) & (l < n_c)
    lc = s.local(torch.where(ok, l, 0))
    ok &= s.owner_ok(torch.where(ok, l, 0)) & (lc // ch.S < ch.bt.shape[1])
    exp = ch.slots(s.req[:, None], lc, ch.S, ok)
    if compact:
        exp = exp.gather(1, torch.argsort((~ok).to(torch.int8), dim=1, stable=True))
    t = _first(~s.valid[:, None] & (out != -1))
    if t is not None:
        s.fail(channel, "padded token has a converted top-k entry", t, expected="all -1", found=out[t].tolist())
    ch.check_padded_1d("topk lens", ln, 0)
    ch.check_range("top-k slots", out, ch.S)
    bad = s.valid[:, None] & (out != exp)
    t = _first(bad)
    if t is not None:
        k = int(torch.nonzero(bad[t])[0])
        what = f"top-k entry {k}"
        if not compact and out[t, k] != -1 and not bool(ok[t, k]):
            what += (f" points past the token's visible rows (picked row {int(l[t, k])}, "
                     f"n_c = {int(n_c[t, 0])})")
        s.fail(channel, what, t, expected=int(exp[t, k]), found=int(out[t, k]))
    cnt = (out != -1).sum(1)
    ch.check_equal("topk lens", ln, cnt, "lens != count of converted entries")


def check_cp_partition(metas_per_rank: Sequence, *, cp_interleave: Optional[int] = None,
                       replay_start=None) -> None:
    """Check that the per-rank metadata of one DCP step partition the tokens (DESIGN §4).

    Parameters
    ----------
    metas_per_rank : list of DSV4Metadata — one per rank, ``metas_per_rank[r]`` built by rank ``r``.
    cp_interleave : int, optional — default: the pipelines'.

    Every rank sees the same batch; each valid token's raw slot is listed (``!= -1``) by exactly one
    rank, its owner ``(pos // I) % Wc``; each completed compressed row likewise; per-rank window /
    causal / indexer lengths add up to the global ones (``min(W, pos + 1 - floor)``, ``n_c``).
    """
    metas = list(metas_per_rank)
    Wc = len(metas)
    if Wc == 0:
        raise ValueError("metas_per_rank must not be empty")
    if cp_interleave is None:
        cp_interleave = int((getattr(metas[0]._pipeline, "cp", None) or {}).get("cp_interleave", 1))
    steps = [_Step(m, None, (Wc, r, cp_interleave), replay_start, None) for r, m in enumerate(metas)]
    s0 = steps[0]
    for r, s in enumerate(steps[1:], 1):
        if (s.T, s.Tp, s.req_ids) != (s0.T, s0.Tp, s0.req_ids) or not torch.equal(s.qsl, s0.qsl) \
                or not torch.equal(s.seq_lens, s0.seq_lens):
            s0.fail("batch", f"rank {r} sees another batch than rank 0", expected=(s0.T, s0.req_ids),
                    found=(s.T, s.req_ids))
    p = s0.pos.clamp(min=0)
    for name, c0 in metas[0].channels.items():
        R = c0.compress_ratio
        for field in ("slot_mapping", "compressed_slot_mapping"):
            if getattr(c0, field) is None:
                continue
            x = torch.stack([_host(getattr(m[name], field)) for m in metas])   # [Wc, Tp]
            unit = p if field == "slot_mapping" else p // R
            need = s0.valid & ((p + 1) % R == 0) if field == "compressed_slot_mapping" else s0.valid
            owner = cp_owner(unit, Wc, cp_interleave)
            listed = x != -1
            t = _first(need & (listed.sum(0) != 1))
            if t is None:
                t = _first(need & ~listed.gather(0, owner[None])[0])
            if t is None:
                t = _first(~need & listed.any(0))
            if t is not None:
                s0.fail(name, f"{field}: ranks listing the token's slot (owner rank {int(owner[t])})", t,
                        expected=[int(owner[t])] if bool(need[t]) else [],
                        found=torch.nonzero(listed[:, t]).flatten().tolist())
        if c0.lens is not None and (c0.indices is not None or c0.ks is not None):
            total = torch.stack([_host(m[name].lens) for m in metas]).sum(0)
            if c0.ks is not None:
                exp = (p + 1) // R
            elif c0.window is None:   # NOTE: each rank's causal list is bounded by its width
                bound = min(c0.indices.shape[1], c0.block_table.shape[1] * c0.rows_per_block)
                exp = sum(s.owned((p + 1) // R).clamp(max=bound) for s in steps)
            else:
                floor = s0.replay[s0.req] if s0.B else torch.zeros_like(p)
                exp = p + 1 - torch.maximum(p - c0.window + 1, floor).clamp(min=0)
            exp = torch.where(s0.valid, exp, 0)
            t = _first(total != exp)
            if t is not None:
                s0.fail(name, "lens summed over ranks", t, expected=int(exp[t]), found=int(total[t]))
