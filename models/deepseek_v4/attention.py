"""A small DeepSeek-V4 attention layer, in two forms that must agree.

* :meth:`DSV4Attention.forward_dense` -- one whole sequence, no caches: the math, written plainly.
* :meth:`DSV4Attention.forward_paged` -- one scheduler step of many requests; reads and writes the
  paged caches of :class:`PagedCaches` ONLY through :class:`dsv4_index.DSV4Metadata` (slot mappings,
  index lists, ``topk_to_slots``); no position-to-slot math here.

One token ``t`` at position ``pos`` (fp32 throughout):

1. ``q = RoPE(Wq x) [H, D]``; ``kv = RoPE(RMSNorm(Wkv x)) [D]`` -- one KV head; the same vector is key
   and value; RoPE rotates the last ``qk_rope_head_dim`` dims by the absolute position.
2. Window: the ``kv`` of positions ``[pos - W + 1, pos]``.
3. Compressed rows (layers with ratio ``R > 0``): row ``g`` pools the compressor state (per-token
   ``kv_c``, gate logits ``z``) of its span -- ``[gR - R, gR + R)`` for c4 layers (overlapping, tokens
   ``< 0`` masked), ``[gR, gR + R)`` for c128 layers, the token ``g`` itself for V4.1's ratio-1 layers
   (no state cache) -- as ``RMSNorm(sum_s softmax_s(z_s + bias_s) * kv_c_s)``
   (softmax over the span's tokens, per dim). Row ``g`` exists once its last token ``gR + R - 1`` is
   seen, so ``t`` sees ``n_c = (pos + 1) // R`` rows.
4. c4 layers (V4's smaller ratio, V4.1's ratios 1 and 2) pick ``index_topk`` of those rows with the
   Lightning indexer
   (``score_j = sum_h w_h relu(q_idx_h . k_idx_j)``, keys from the indexer's own compressor; ties go
   to the lower row); c128 layers take them all.
5. One softmax over window and compressed keys plus a per-head sink logit; output ``Wo [H*D -> hidden]``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from einops import rearrange
from torch import nn

from .caches import LayerCache, PagedCaches, layer_channels
from .config import DSV4Config

__all__ = ["DSV4Attention", "Compressor", "Indexer", "PagedCaches", "LayerCache", "layer_channels",
           "rms_norm", "apply_rope", "sink_attention", "sink_attention_lse", "merge_partials", "select_topk"]

NEG_INF = float("-inf")


# math shared by both forms
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Rotate the last ``rope_dim`` dims of ``x [T, ..., D]`` by ``positions [T]`` (rotate-half pairs)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim)
    ang = positions.to(torch.float32)[:, None] * inv_freq  # [T, rope_dim / 2]
    ang = ang.reshape(ang.shape[:1] + (1,) * (x.dim() - 2) + ang.shape[1:])
    cos, sin = ang.cos(), ang.sin()
    keep, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    a, b = rot.chunk(2, dim=-1)
    return torch.cat([keep, a * cos - b * sin, b * cos + a * sin], dim=-1)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                   sink: torch.Tensor) -> torch.Tensor:
    """Per-token attention over its own key list, one softmax including a per-head sink logit.

    Parameters
    ----------
    q : float [T, H, D]
    keys : float [T, N, D] -- key = value; entries with ``valid`` False may hold anything (NaN too).
    valid : bool [T, N]
    sink : float [H]

    Returns
    -------
    float [T, H, D]
    """
    keys = torch.where(valid[..., None], keys, 0.0)
    s = torch.einsum("thd,tnd->thn", q, keys) * q.shape[-1] ** -0.5
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    s = torch.cat([s, sink.expand(q.shape[0], -1)[..., None]], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]  # the sink takes its share and gives nothing back
    return torch.einsum("thn,tnd->thd", p, keys)


def sink_attention_lse(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                       sink: Optional[torch.Tensor]):
    """Partial attention over one rank's share of the keys, with its log-sum-exp (for a DCP merge).

    Parameters
    ----------
    q : float [T, H, D]
    keys : float [T, N, D] -- key = value; entries with ``valid`` False may hold anything.
    valid : bool [T, N]
    sink : float [H] or None -- the per-head sink logit; give it on exactly one rank of a merge.

    Returns
    -------
    (float [T, H, D], float [T, H]) -- output normalised over this rank's keys (+ sink), and
    ``logsumexp`` of those logits (``-inf`` and a zero output where nothing is visible).
    """
    keys = torch.where(valid[..., None], keys, 0.0)
    s = torch.einsum("thd,tnd->thn", q, keys) * q.shape[-1] ** -0.5
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    if sink is not None:
        s = torch.cat([s, sink.expand(q.shape[0], -1)[..., None]], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # [T, H]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])[..., :keys.shape[1]]
    return torch.einsum("thn,tnd->thd", p, keys), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp merge of per-rank partial attention.

    Parameters
    ----------
    outs : float [Wc, T, H, D] -- each rank's normalised partial output.
    lses : float [Wc, T, H] -- each rank's log-sum-exp (``-inf``: the rank saw nothing).

    Returns
    -------
    float [T, H, D] -- the attention over the union of the ranks' keys (zero where no rank saw any).
    """
    total = torch.logsumexp(lses, dim=0)  # [T, H]
    w = torch.exp(lses - torch.where(torch.isfinite(total), total, 0.0))  # [Wc, T, H]; 0 for -inf ranks
    return (w[..., None] * outs).sum(0)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` columns of ``scores [T, N]`` (``-inf`` = not visible), best first, ties to the lower
    column; ``-1`` where fewer than ``k`` are visible. Returns int32 [T, k]."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    taken = scores.gather(1, order) > NEG_INF
    out = torch.where(taken, order, -1).to(torch.int32)
    return torch.nn.functional.pad(out, (0, k - out.shape[1]), value=-1)


def gather_rows(cache: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor):
    """Rows of ``cache`` named by an index list (``indices [T, N]``, first ``lens [T]`` entries, ``-1``
    masked). Returns (float [T, N, D], bool valid [T, N])."""
    n = torch.arange(indices.shape[1], device=indices.device)
    valid = (n[None, :] < lens[:, None]) & (indices >= 0)
    return cache[indices.clamp(min=0).long()], valid


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, ok: torch.Tensor):
    """``cache[slots[t]] = values[t]`` for tokens with ``ok[t]`` and ``slots[t] >= 0``."""
    sel = ok & (slots >= 0)
    cache[slots[sel].long()] = values[sel]


# modules
class Compressor(nn.Module):
    """Gated pooling of a span of ``span`` tokens into one compressed row of ``dim``.

    Per-token state ``[kv_c | z]`` (``[2 * dim]``) is what the paged form caches in a state channel.
    """

    def __init__(self, hidden: int, dim: int, span: int, eps: float):
        super().__init__()
        self.dim, self.span, self.eps = dim, span, eps
        self.wkv = nn.Linear(hidden, dim, bias=False)
        self.wgate = nn.Linear(hidden, dim, bias=False)
        self.pos_bias = nn.Parameter(torch.zeros(span, dim))
        self.norm = nn.Parameter(torch.ones(dim))

    def state(self, x: torch.Tensor) -> torch.Tensor:
        """float [T, hidden] -> per-token state float [T, 2 * dim]."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def pool(self, state: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """float [G, span, 2 * dim] states of each row's span (oldest first), bool valid [G, span]
        -> float [G, dim] compressed rows."""
        state = torch.where(valid[..., None], state, 0.0)
        kv, z = state.split(self.dim, dim=-1)
        logits = (z + self.pos_bias).masked_fill(~valid[..., None], NEG_INF)
        w = torch.softmax(logits, dim=1)  # over the span's tokens, per dim
        return rms_norm((w * kv).sum(1), self.norm, self.eps)


class Indexer(nn.Module):
    """Lightning indexer: ``score(t, j) = sum_h w_h(t) relu(q_h(t) . k_j)``."""

    def __init__(self, config: DSV4Config, ratio: int, span: int = 0, own_keys: bool = True):
        super().__init__()
        h, d = config.index_n_heads, config.index_head_dim
        self.n_heads = h
        self.wq = nn.Linear(config.hidden_size, h * d, bias=False)
        self.wweights = nn.Linear(config.hidden_size, h, bias=False)
        # NOTE: the keys' compressor lives on the layer that owns the compressed caches (V4.1: its kv source)
        self.compressor = Compressor(config.hidden_size, d, span or 2 * ratio, config.rms_norm_eps) if own_keys \
            else None

    def scores(self, x: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x float [T, hidden], keys float [T, N, d], valid bool [T, N] -> float [T, N] (-inf if not valid)."""
        q = rearrange(self.wq(x), "t (h d) -> t h d", h=self.n_heads)
        keys = torch.where(valid[..., None], keys, 0.0)
        s = torch.relu(torch.einsum("thd,tnd->thn", q, keys))
        s = torch.einsum("th,thn->tn", self.wweights(x), s)
        return s.masked_fill(~valid, NEG_INF)


class DSV4Attention(nn.Module):
    """One DSV4 attention layer; its kind comes from ``config.compress_ratios[layer_id]``.

    KV sharing (DeepSeek-V4.1, ``config.kv_source(layer_id) != layer_id``): the layer has no compressor;
    it reads the compressed rows and indexer keys of its kv source, which writes them (the source runs
    first in a step); its indexer queries are its own. Dense: pass ``source_rows`` (the source's
    :meth:`compressed_rows`); paged: :class:`PagedCaches` gives it the source's caches.
    """

    def __init__(self, config: DSV4Config, layer_id: int):
        super().__init__()
        self.config, self.layer_id = config, layer_id
        self.kind = config.layer_kind(layer_id)  # "swa" | "c4" | "c128"
        self.ratio = config.compress_ratios[layer_id]
        self.kv_source = config.kv_source(layer_id)  # NOTE: None for SWA-only layers
        self.owns_kv = self.kv_source == layer_id
        H, D, hid, eps = config.num_attention_heads, config.head_dim, config.hidden_size, config.rms_norm_eps
        self.wq = nn.Linear(hid, H * D, bias=False)
        self.wkv = nn.Linear(hid, D, bias=False)
        self.kv_norm = nn.Parameter(torch.ones(D))
        self.sink = nn.Parameter(torch.zeros(H))
        self.wo = nn.Linear(H * D, hid, bias=False)
        if self.kind != "swa":
            span = config.compressor_span(layer_id)
            if self.owns_kv:
                self.compressor = Compressor(hid, D, span, eps)
        if self.kind == "c4":
            self.indexer = Indexer(config, self.ratio, span, own_keys=self.owns_kv)

    # -- shared ------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        q = rearrange(self.wq(x), "t (h d) -> t h d", h=c.num_attention_heads)
        q = apply_rope(q, positions, c.qk_rope_head_dim, c.rope_theta)
        kv = rms_norm(self.wkv(x), self.kv_norm, c.rms_norm_eps)
        return q, apply_rope(kv, positions, c.qk_rope_head_dim, c.rope_theta)

    def _out(self, q, keys, valid):
        o = sink_attention(q, torch.cat(keys, dim=1), torch.cat(valid, dim=1), self.sink)
        return self.project(o)

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """Output projection: attention output float [T, H, D] -> float [T, hidden]."""
        return self.wo(rearrange(o, "t h d -> t (h d)"))

    # -- dense ---------------------------------------------------------------------------------
    def _dense_rows(self, comp: Compressor, state: torch.Tensor) -> torch.Tensor:
        """Every complete compressed row of a sequence: state float [L, 2d] -> float [L // R, d]."""
        n_rows = state.shape[0] // self.ratio
        last = (torch.arange(n_rows, device=state.device) + 1) * self.ratio  # one past each row's span
        span_pos = last[:, None] - comp.span + torch.arange(comp.span, device=state.device)
        return comp.pool(state[span_pos.clamp(min=0)], span_pos >= 0)

    def compressed_rows(self, x: torch.Tensor) -> dict:
        """A kv source's compressed rows of a whole sequence ``x [L, hidden]``: ``{"comp": float [L // R, D]}``,
        and on c4 layers ``"idx"``: the indexer's keys float [L // R, d]. What layers sharing its caches read."""
        if not self.owns_kv:
            raise ValueError(f"layer {self.layer_id} owns no compressed cache (its kv source: layer {self.kv_source})")
        rows = {"comp": self._dense_rows(self.compressor, self.compressor.state(x))}
        if self.kind == "c4":
            rows["idx"] = self._dense_rows(self.indexer.compressor, self.indexer.compressor.state(x))
        return rows

    def _rows_of(self, x: torch.Tensor, source_rows: Optional[dict]) -> dict:
        """This layer's compressed rows: its own, or its kv source's (``source_rows``, required then)."""
        if self.owns_kv:
            if source_rows is not None:
                raise ValueError(f"source_rows: layer {self.layer_id} is its own kv source")
            return self.compressed_rows(x)
        if source_rows is None:
            raise ValueError(f"source_rows: layer {self.layer_id} reads the compressed rows of its kv source, layer "
                             f"{self.kv_source}: pass that layer's compressed_rows() of its own input")
        return source_rows

    def dense_topk(self, x: torch.Tensor, source_rows: Optional[dict] = None) -> torch.Tensor:
        """c4 layers: indexer top-k rows of each token of a whole sequence ``x [L, hidden]``;
        int32 [L, index_topk], ``-1`` padded (``source_rows``: as in :meth:`forward_dense`)."""
        return self._topk(x, self._rows_of(x, source_rows)["idx"])

    def _topk(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The indexer's top-k over the indexer keys float [n, d] of the sequence."""
        L, K = x.shape[0], self.config.index_topk
        n_c = (torch.arange(L, device=x.device) + 1) // self.ratio
        visible = torch.arange(keys.shape[0], device=x.device)[None, :] < n_c[:, None]
        return select_topk(self.indexer.scores(x, keys.expand(L, -1, -1), visible), K)

    def forward_dense(self, x: torch.Tensor, *, window_floor: int = 0,
                      source_rows: Optional[dict] = None) -> torch.Tensor:
        """One whole sequence at positions ``0..L-1``: float [L, hidden] -> float [L, hidden].

        ``source_rows``: a layer sharing its kv source's caches (V4.1) reads the source's rows, the source's
        :meth:`compressed_rows` of the source's input; None for every other layer.

        ``window_floor``: the sliding window of every token starts at this position at the earliest
        (bounded replay after a prefix-cache hit, docs/DESIGN.md §4: what a replayed token's window list holds;
        tokens whose window stays above it are unaffected). Compressed rows are never floored.
        """
        L, W = x.shape[0], self.config.sliding_window
        pos = torch.arange(L, device=x.device)
        q, kv = self._qkv(x, pos)
        win = pos[:, None] - W + 1 + torch.arange(W, device=x.device)  # [L, W], the token itself last
        keys, valid = [kv[win.clamp(min=0)]], [win >= max(0, window_floor)]
        if self.kind != "swa" and L >= self.ratio:
            own = self._rows_of(x, source_rows)
            comp = own["comp"]  # [L // R, D]
            if self.kind == "c4":
                rows = self._topk(x, own["idx"]).long()
            else:
                rows = torch.arange(comp.shape[0], device=x.device).expand(L, -1)
                rows = torch.where(rows < ((pos + 1) // self.ratio)[:, None], rows, -1)
            keys.append(comp[rows.clamp(min=0)])
            valid.append(rows >= 0)
        return self._out(q, keys, valid)

    # -- paged ---------------------------------------------------------------------------------
    def _paged_compress(self, comp: Compressor, x, meta, state_ch: Optional[str], out_ch: str,
                        state_cache: Optional[torch.Tensor], out_cache: torch.Tensor):
        """Cache this step's compressor state, then pool and cache every row a token completes
        (``state_ch`` None: a span of one token, V4.1's ratio 1: the row is pooled from the token)."""
        ok = meta.is_valid_token
        cur = comp.state(x)
        if state_ch is None:
            done = meta[out_ch].compressed_slot_mapping
            sel = ok & (done >= 0)
            out_cache[done[sel].long()] = comp.pool(cur[sel][:, None], torch.ones_like(sel[sel])[:, None])
            return
        st = meta[state_ch]
        # NOTE: a circular state group (vLLM's ring) lists in-step entries as -2 - token_row and is written
        # with its write plan after the reads; other groups are written first and read from the cache
        circular = st.tail_slot_mapping is not None
        if not circular:
            write_rows(state_cache, st.slot_mapping, cur, ok)
        # [T_pad], -1 unless the token ends a row. NOTE: under bounded replay (prefix hit) the state
        # windows of replayed tokens are floored at replay_start, so a row they complete may miss part
        # of its span; the metadata gives them no compressed write (pos < replay_end: the row is
        # cached in the blocks shared with the prefix owner already). Trusted as is: a partial-span
        # row written here would show up against the dense model.
        done = meta[out_ch].compressed_slot_mapping
        sel = ok & (done >= 0)
        # NOTE: the state window ends at the token: its last `span` live entries are the row's span.
        idx, lens = st.indices[sel], st.lens[sel]
        k = lens[:, None] - comp.span + torch.arange(comp.span, device=idx.device)  # [G, span]
        pick = torch.where(k >= 0, idx.gather(1, k.clamp(min=0)), -1)  # -1: span starts before pos 0
        rows = state_cache[pick.clamp(min=0).long()]
        if circular:
            rows = torch.where((pick <= -2)[..., None], cur[(-2 - pick).clamp(min=0).long()], rows)
        out_cache[done[sel].long()] = comp.pool(rows, pick != -1)
        if circular:
            write_rows(state_cache, st.tail_slot_mapping, cur, ok)

    def forward_paged(self, x: torch.Tensor, meta, caches: "LayerCache", *, return_lse: bool = False,
                      with_sink: bool = True, topk_fn: Optional[Callable] = None):
        """One step's tokens (batch order of ``meta``): float [T_pad, hidden] -> float [T_pad, hidden].

        Writes this step's kv / compressor state / completed compressed rows into ``caches`` and reads
        them back through ``meta`` only. Padded tokens give zeros and write nothing.

        Decode context parallelism (``meta`` built by a DCP rank, see docs/CP.md): ``return_lse=True``
        returns this rank's partial ``(o float [T_pad, H, D], lse float [T_pad, H])`` before the output
        projection (merge with :func:`merge_partials`, then :meth:`project`); ``with_sink`` counts the
        sink logit in this partial (True on exactly one rank). ``topk_fn(scores, k)`` picks the
        indexer's rows: ``scores float [T_pad, N]`` over the entries of ``meta["c4i"].indices``
        (``-inf`` = not listed) -> int32 [T_pad, k] request-local row ids (default
        :func:`select_topk`; a DCP rank passes one that selects over every rank's scores).
        """
        ok = meta.is_valid_token
        ch = layer_channels(meta.layout, self.layer_id, self.config)  # NOTE: channel names of this layer
        q, kv = self._qkv(x, meta.positions)
        swa = meta[ch["swa"]]
        write_rows(caches.swa, swa.slot_mapping, kv, ok)
        if not self.owns_kv:
            pass  # NOTE: V4.1 KV sharing: the source wrote this step's compressed rows and state
        elif self.kind == "c4":
            st = ch.get("c4_state")
            self._paged_compress(self.compressor, x, meta, st, ch["c4a"], caches.state, caches.comp)
            self._paged_compress(self.indexer.compressor, x, meta, st, ch["c4i"], caches.idx_state, caches.idx_comp)
        elif self.kind == "c128":
            self._paged_compress(self.compressor, x, meta, ch["c128_state"], ch["c128a"], caches.state, caches.comp)
        # every write of the step is done: now read
        win, win_valid = gather_rows(caches.swa, swa.indices, swa.lens)
        keys, valid = [win], [win_valid]
        if self.kind == "c4":
            c4i = meta[ch["c4i"]]  # causal list: entry j is compressed row j
            idx_keys, idx_valid = gather_rows(caches.idx_comp, c4i.indices, c4i.lens)
            scores = self.indexer.scores(x, idx_keys, idx_valid)
            topk = (topk_fn or select_topk)(scores, self.config.index_topk)
            slots, lens = meta.topk_to_slots(ch["c4a"], topk)
            # NOTE: converted in place (not compacted): under DCP rows owned elsewhere are -1 between
            # owned ones, so an entry is valid iff its slot is (lens only counts them).
            rows, rows_valid = gather_rows(caches.comp, slots, torch.full_like(lens, slots.shape[1]))
            keys.append(rows), valid.append(rows_valid)
        elif self.kind == "c128":
            c128a = meta[ch["c128a"]]
            rows, rows_valid = gather_rows(caches.comp, c128a.indices, c128a.lens)
            keys.append(rows), valid.append(rows_valid)
        if return_lse:
            o, lse = sink_attention_lse(q, torch.cat(keys, dim=1), torch.cat(valid, dim=1),
                                        self.sink if with_sink else None)
            return torch.where(ok[:, None, None], o, 0.0), lse.masked_fill(~ok[:, None], NEG_INF)
        return torch.where(ok[:, None], self._out(q, keys, valid), 0.0)
