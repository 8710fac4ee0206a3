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

from typing import Callable, Mapping, Optional

import torch
from einops import rearrange
from torch import nn

from .caches import LayerCache, PagedCaches, layer_channels
from .config import DSV4Config
from .layers import (NEG_INF, Compressor, Indexer, apply_rope, candidate_blocks, candidate_columns,  # noqa: F401
                     gather_rows, merge_partials, rms_norm, select_topk, sink_attention, sink_attention_lse,
                     write_rows)

__all__ = ["DSV4Attention", "Compressor", "Indexer", "PagedCaches", "LayerCache", "layer_channels",
           "rms_norm", "apply_rope", "sink_attention", "sink_attention_lse", "merge_partials", "select_topk"]


class DSV4Attention(nn.Module):
    """One DSV4 attention layer; its kind comes from ``config.compress_ratios[layer_id]``.

    KV sharing (DeepSeek-V4.1, ``config.kv_source(layer_id) != layer_id``): the layer has no compressor;
    it reads the compressed rows and indexer keys of its kv source, which writes them (the source runs
    first in a step); its indexer queries are its own. Dense: pass ``source_rows`` (the source's
    :meth:`compressed_rows`); paged: :class:`PagedCaches` gives it the source's caches.

    Top-k reuse (DeepSeek-V4.1, ``config.topk_source(layer_id) != layer_id``: an indexed layer that is no index
    source): the layer runs no indexer; it attends with its index source's top-k (pass ``topk``: the source's
    :meth:`dense_topk` / :meth:`paged_topk` of the same tokens) through its own ``topk_to_slots``.

    Two-level indexer (DeepSeek-V4.1, ``config.candidate_role(layer_id)``): the candidate source also picks
    ``nb`` blocks of ``C`` rows per token (:meth:`dense_candidates` / :meth:`paged_candidates`, the block score
    being the max of its rows' indexer scores); a consumer (pass ``candidates``: the source's blocks of the same
    tokens) scores only those blocks' columns and converts its picked columns with
    ``meta.candidate_topk_to_slots``, its indexer keys gathered through ``meta.candidate_blocks_to_physical``.
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
        self.topk_source = config.topk_source(layer_id)  # NOTE: None unless indexed
        self.runs_indexer = self.topk_source == layer_id
        self.candidate_role = config.candidate_role(layer_id)  # NOTE: "source" | "consumer" | None
        self.indexer = None  # NOTE: a kv source keeps the indexer keys' compressor even when it reuses a top-k
        if self.kind == "c4" and (self.runs_indexer or self.owns_kv):
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

    def dense_kwargs(self, layers: Mapping[int, "DSV4Attention"], x: torch.Tensor) -> dict:
        """:meth:`forward_dense` keyword arguments of a V4.1 layer that reads other layers' work, for the whole
        sequence ``x``: ``source_rows`` (its kv source's rows) and ``topk`` (its index source's top-k); ``{}`` for
        every other layer. ``layers``: the model's layers by id, the sources included."""
        kw = {}
        if self.kind != "swa" and not self.owns_kv:
            kw["source_rows"] = layers[self.kv_source].compressed_rows(x)
        if self.kind == "c4" and not self.runs_indexer:
            src = layers[self.topk_source]
            kw["topk"] = src.dense_topk(x, **src.dense_kwargs(layers, x))
        if self.candidate_role == "consumer":
            src = layers[self.config.candidate[0]]
            kw["candidates"] = src.dense_candidates(x, **src.dense_kwargs(layers, x))
        return kw

    def paged_kwargs(self, layers: Mapping[int, "DSV4Attention"], x: torch.Tensor, meta, caches: "PagedCaches"):
        """:meth:`forward_paged` keyword arguments of a V4.1 layer that runs no indexer: ``topk``, its index
        source's :meth:`paged_topk` of this step (the source's kv source ran its forward first); ``{}`` for every
        other layer. ``layers``: as in :meth:`dense_kwargs`; ``caches``: the model's :class:`PagedCaches`."""
        kw = {}
        if self.kind == "c4" and not self.runs_indexer:
            src = layers[self.topk_source]
            kw["topk"] = src.paged_topk(x, meta, caches[self.topk_source], **src.paged_kwargs(layers, x, meta, caches))
        if self.candidate_role == "consumer":
            src_id = self.config.candidate[0]
            kw["candidates"] = layers[src_id].paged_candidates(x, meta, caches[src_id])
        return kw

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

    def dense_topk(self, x: torch.Tensor, source_rows: Optional[dict] = None,
                   candidates: Optional[torch.Tensor] = None) -> torch.Tensor:
        """c4 layers: indexer top-k rows of each token of a whole sequence ``x [L, hidden]``;
        int32 [L, index_topk], ``-1`` padded (``source_rows``, ``candidates``: as in :meth:`forward_dense`)."""
        return self._topk_or(None, lambda: self._topk(x, self._rows_of(x, source_rows)["idx"], candidates))

    def dense_candidates(self, x: torch.Tensor, source_rows: Optional[dict] = None, **_) -> torch.Tensor:
        """The candidate source's blocks of each token of ``x [L, hidden]``: int32 [L, nb], ``-1`` padded."""
        self._check_role("source")
        _, C, nb = self.config.candidate
        return candidate_blocks(self._scores(x, self._rows_of(x, source_rows)["idx"]), C, nb)

    def _check_role(self, role: str) -> None:
        if self.candidate_role != role:
            raise ValueError(f"layer {self.layer_id} is no candidate {role} (its role: {self.candidate_role})")

    def _topk_or(self, topk: Optional[torch.Tensor], compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()`` on a layer that runs its indexer; else its index source's ``topk`` (required)."""
        if self.runs_indexer:
            if topk is not None:
                raise ValueError(f"topk: layer {self.layer_id} runs its own indexer; pass no top-k")
            return compute()
        if topk is None:
            raise ValueError(f"topk: layer {self.layer_id} runs no indexer (index_source_layer_ids): it attends with "
                             f"layer {self.topk_source}'s top-k of the same tokens; pass it")
        return topk

    def _scores(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Indexer scores float [L, n] of every token over the indexer keys float [n, d] (``-inf``: not visible)."""
        L = x.shape[0]
        n_c = (torch.arange(L, device=x.device) + 1) // self.ratio
        visible = torch.arange(keys.shape[0], device=x.device)[None, :] < n_c[:, None]
        return self.indexer.scores(x, keys.expand(L, -1, -1), visible)

    def _topk(self, x: torch.Tensor, keys: torch.Tensor, candidates: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The indexer's top-k over the indexer keys float [n, d] of the sequence; a candidate consumer scores
        only the columns of ``candidates`` (int32 [L, nb]) and maps its picks back to rows."""
        L, K = x.shape[0], self.config.index_topk
        if self.candidate_role != "consumer":
            return select_topk(self._scores(x, keys), K)
        if candidates is None:
            raise ValueError(f"candidates: layer {self.layer_id} is a candidate consumer: pass its candidate "
                             f"source's (layer {self.config.candidate[0]}) blocks of the same tokens")
        rows = candidate_columns(candidates, self.config.candidate[1])       # [L, nb * C]
        n_c = (torch.arange(L, device=x.device) + 1) // self.ratio
        valid = (rows >= 0) & (rows < n_c[:, None])
        cols = select_topk(self.indexer.scores(x, keys[rows.clamp(0, max(keys.shape[0] - 1, 0))], valid), K)
        return torch.where(cols >= 0, rows.gather(1, cols.clamp(min=0).long()), -1).to(torch.int32)

    def forward_dense(self, x: torch.Tensor, *, window_floor: int = 0, source_rows: Optional[dict] = None,
                      topk: Optional[torch.Tensor] = None, candidates: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One whole sequence at positions ``0..L-1``: float [L, hidden] -> float [L, hidden].

        ``source_rows``: a layer sharing its kv source's caches (V4.1) reads the source's rows, the source's
        :meth:`compressed_rows` of the source's input; None for every other layer. ``topk``: a layer that runs no
        indexer (V4.1) attends with its index source's :meth:`dense_topk` of ``x``; None for every other layer.
        ``candidates``: a candidate consumer (V4.1) scores only its candidate source's :meth:`dense_candidates`.

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
                rows = self._topk_or(topk, lambda: self._topk(x, own["idx"], candidates)).long()
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

    def _paged_scores(self, x: torch.Tensor, meta, caches: "LayerCache") -> torch.Tensor:
        """Indexer scores float [T_pad, N] over the entries of ``meta["c4i"].indices`` (causal: entry j is row j)."""
        c4i = meta[layer_channels(meta.layout, self.layer_id, self.config)["c4i"]]
        idx_keys, idx_valid = gather_rows(caches.idx_comp, c4i.indices, c4i.lens)
        return self.indexer.scores(x, idx_keys, idx_valid)

    def paged_topk(self, x: torch.Tensor, meta, caches: "LayerCache", topk_fn: Optional[Callable] = None,
                   candidates: Optional[torch.Tensor] = None):
        """Indexed layers that run their indexer: this step's top-k, int32 [T_pad, index_topk] request-local
        compressed row ids (``-1`` padded), over the indexer keys cached through ``meta["c4i"]`` (written by this
        step's :meth:`forward_paged` of the layer's kv source; ``topk_fn`` as there). A candidate consumer
        (``candidates``: its source's :meth:`paged_candidates`) picks columns (:meth:`paged_columns`), returned
        here as the rows they name, for the layers that reuse its top-k."""
        if self.candidate_role == "consumer":
            cols = self.paged_columns(x, meta, caches, candidates, topk_fn)
            rows = candidate_columns(candidates, self.config.candidate[1])
            return torch.where(cols >= 0, rows.gather(1, cols.clamp(min=0).long()), -1).to(torch.int32)
        return (topk_fn or select_topk)(self._paged_scores(x, meta, caches), self.config.index_topk)

    def paged_candidates(self, x: torch.Tensor, meta, caches: "LayerCache") -> torch.Tensor:
        """The candidate source's blocks of this step: int32 [T_pad, nb] request-local block ids, ``-1`` padded
        (from the same scores as its top-k; the kv source wrote this step's indexer keys first)."""
        self._check_role("source")
        _, C, nb = self.config.candidate
        return candidate_blocks(self._paged_scores(x, meta, caches), C, nb)

    def paged_columns(self, x: torch.Tensor, meta, caches: "LayerCache", candidates: Optional[torch.Tensor],
                      topk_fn: Optional[Callable] = None) -> torch.Tensor:
        """A candidate consumer's picks: int32 [T_pad, index_topk] sparse columns (``-1`` padded) over the
        ``nb * C`` columns of ``candidates`` (int32 [T_pad, nb]), its indexer keys read at the slots
        ``phys[t, j // C] * C + j % C`` of ``meta.candidate_blocks_to_physical`` (a column is visible iff its
        row is below the token's ``n_c``, ``meta["c4i"].lens``)."""
        self._check_role("consumer")
        if candidates is None:
            raise ValueError(f"candidates: layer {self.layer_id} is a candidate consumer: pass its candidate "
                             f"source's (layer {self.config.candidate[0]}) paged_candidates() of this step")
        ch, C = layer_channels(meta.layout, self.layer_id, self.config), self.config.candidate[1]
        a, i = meta.layout.channels[ch["c4a"]], meta.layout.channels[ch["c4i"]]
        assert (a.gid, a.rows_per_block) == (i.gid, i.rows_per_block)  # NOTE: one slot space for both caches
        phys, _ = meta.candidate_blocks_to_physical(ch["c4a"], candidates)
        j = torch.arange(phys.shape[1] * C, device=phys.device)
        p = phys[:, j // C].long()
        slots = torch.where(p >= 0, p * C + j % C, -1)
        valid = (slots >= 0) & (candidate_columns(candidates, C) < meta[ch["c4i"]].lens[:, None])
        scores = self.indexer.scores(x, caches.idx_comp[slots.clamp(min=0)], valid)
        return (topk_fn or select_topk)(scores, self.config.index_topk)

    def forward_paged(self, x: torch.Tensor, meta, caches: "LayerCache", *, return_lse: bool = False,
                      with_sink: bool = True, topk_fn: Optional[Callable] = None,
                      topk: Optional[torch.Tensor] = None, candidates: Optional[torch.Tensor] = None):
        """One step's tokens (batch order of ``meta``): float [T_pad, hidden] -> float [T_pad, hidden].

        Writes this step's kv / compressor state / completed compressed rows into ``caches`` and reads
        them back through ``meta`` only. Padded tokens give zeros and write nothing.

        Decode context parallelism (``meta`` built by a DCP rank, see docs/CP.md): ``return_lse=True``
        returns this rank's partial ``(o float [T_pad, H, D], lse float [T_pad, H])`` before the output
        projection (merge with :func:`merge_partials`, then :meth:`project`); ``with_sink`` counts the
        sink logit in this partial (True on exactly one rank). ``topk_fn(scores, k)`` picks the
        indexer's rows: ``scores float [T_pad, N]`` over the entries of ``meta["c4i"].indices``
        (``-inf`` = not listed) -> int32 [T_pad, k] request-local row ids (default
        :func:`select_topk`; a DCP rank passes one that selects over every rank's scores). ``topk``: a layer
        that runs no indexer (V4.1) attends with its index source's :meth:`paged_topk` of this step;
        ``candidates``: a candidate consumer's source's :meth:`paged_candidates` of this step.
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
            if self.candidate_role == "consumer":  # NOTE: its columns, converted by the candidate channel
                cols = self.paged_columns(x, meta, caches, candidates, topk_fn)
                slots, lens = meta.candidate_topk_to_slots(ch["c4a"], candidates, cols)
            else:
                topk = self._topk_or(topk, lambda: self.paged_topk(x, meta, caches, topk_fn))
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
