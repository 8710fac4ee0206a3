"""Consumer views that need more than a slice: FlashMLA's sparse prefill over a per-chunk workspace
(the form vLLM's ``combine_topk_swa_indices`` builds).

``flash_mla_sparse_fwd`` has no batch dimension and no paged cache: the engine gathers each
request's keys into a flat workspace and hands the kernel one index matrix into it. For the prefill
requests of a step, taken ``chunk_reqs`` at a time (batch rows ``num_decodes ..``, in order):

* **Workspace** ``[n_reqs, M, D]`` (flattened to ``[n_reqs * M, 1, D]`` for the kernel). Request
  ``b`` (chunk-local) holds its compressed rows ``0 .. L_b // R - 1`` at rows ``[0, N)`` (slots
  through the compressed channel's table, group 0) and its raw positions ``[L_b - g_b, L_b)`` at rows
  ``[N, N + g_b)`` (slots through the SWA table), ``g_b = q_b + min(L_b - q_b, W - 1)`` (``q_b`` tokens
  this step), ``N = max_b L_b // R`` (0 for SWA-only layers), ``M = N + max_b g_b``. ``N`` and ``M``
  come from the host copies ``meta.host_seq_lens`` / ``meta.host_query_start_loc``: no device sync.
* **Row of a token** at ``pos`` of request ``b``: ``n_c`` compressed entries ``b * M + local[j]``, then
  ``n_w`` window entries ``b * M + N + (pos - n_w + 1 - (L_b - g_b)) + j``, ascending (oldest first,
  the token itself last); ``topk_length = n_c + n_w``; ``-1`` after, up to ``width``.
    - c4 (C4A): ``local`` = the layer's request-local top-k picks ``[T, K]``; ``n_c = min((pos + 1) //
      R, K)`` columns are read; a pick outside ``[0, (pos + 1) // R)`` becomes ``-1`` (NaN logits
      once produced garbage ids in an engine); ``width = round_up(K + W, 128)``.
    - c128 (C128A): ``local[j] = j``, ``n_c = min((pos + 1) // R, Wc)`` with ``Wc`` the fixed width of
      ``meta["c128a"].indices`` (``round_up(cdiv(max_model_len, R), 128)``), ``width = round_up(Wc +
      W, 128)``.
    - swa (SWA-only): ``n_c = 0``, ``width = round_up(W, 128)`` (128).
  ``n_w`` is the token's SWA list length ``meta["swa"].lens`` (``min(pos + 1, W)``, or fewer under
  bounded replay: the window starts at ``replay_start``); raw positions below a request's first window
  start are never listed, and their gather slots are ``-1``.

Channels are found by role, never by name (:func:`swa_channel`, :func:`compressed_channel`): with
several channels of a role (vLLM's two SWA groups, ``from_config(groups="vllm")``; V4.1's ``c1a`` and ``c2a``,
both of role ``c4a``) pass ``layer=``: the layer's own (``meta.layout.layer_channels(layer)``).

Widths depend only on the layout and ``K``, never on the batch. Device work is torch ops on the
metadata's device tensors (any device), with no ``.item()`` and no host sync; the results are fresh
tensors (not CUDA-graph buffers: prefill runs eagerly). Decode context parallelism is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from ._common import check_int, no_block, round_up

__all__ = ["PrefillChunk", "prefill_chunk", "prefill_chunks", "prefill_workspace_size", "gather_workspace",
           "PREFILL_INDEX_ALIGN", "swa_channel", "compressed_channel"]

PREFILL_INDEX_ALIGN = 128  # NOTE: FlashMLA's B_TOPK alignment
_KINDS = ("swa", "c4", "c128")
_COMPRESSED_ROLE = {"c4": "c4a", "c128": "c128a"}  # NOTE: a c4 layer reads through the top-k (V4.1: R 1, 2 too)


@dataclass
class PrefillChunk:
    """FlashMLA sparse-prefill inputs for one chunk of a step's prefill requests.

    Attributes
    ----------
    req_start, req_end : int — batch rows ``[req_start, req_end)`` of the chunk (host).
    tok_start, tok_end : int — token rows ``[tok_start, tok_end)`` of the step: the kernel's ``q`` is
        ``q[tok_start:tok_end]`` (host).
    N, M : int — compressed rows and total rows per request in the workspace (host).
    comp_slots : int32 [n_reqs, N] — physical slot of compressed row ``j`` of each request in the
        layer's compressed cache (workspace row ``j``), ``-1`` for ``j >= L // R`` (and for SWA-only).
    raw_slots : int32 [n_reqs, M - N] — physical SWA slot of raw position ``L - g + i`` (workspace row
        ``N + i``), ``-1`` for ``i >= g`` and below the window floor.
    indices : int32 [T_chunk, 1, width] — ids into the flattened workspace ``[n_reqs * M, 1, D]``.
    topk_length : int32 [T_chunk] — valid prefix of each row of ``indices``.
    """

    req_start: int
    req_end: int
    tok_start: int
    tok_end: int
    N: int
    M: int
    comp_slots: torch.Tensor
    raw_slots: torch.Tensor
    indices: torch.Tensor
    topk_length: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.req_end - self.req_start


def swa_channel(layout, layer_kind: str, layer: Optional[int] = None) -> str:
    """The SWA channel a layer reads: ``layout.layer_channels(layer)["swa"]``, or ``"swa"`` when the
    layout has a single SWA group and ``layer`` is None. ``layer_kind`` must be the layer's kind."""
    if layer is None:
        if "swa" not in layout.channels:
            names = [c.name for c in layout.channels.values() if c.role == "swa"]
            raise ValueError(f"layer: this layout has several SWA channels {names}; pass the layer index")
        return "swa"
    chans = layout.layer_channels(layer)
    if layout.layer_kind(layer) != layer_kind:
        raise ValueError(f"layer_kind {layer_kind!r} differs from layer {layer}'s kind "
                         f"{layout.layer_kind(layer)!r}")
    return chans["swa"]


def compressed_channel(layout, layer_kind: str, layer: Optional[int] = None) -> str:
    """The compressed channel a layer reads, by role (``"c4a"`` for a ``"c4"`` layer, whatever its ratio:
    ``c2a`` / ``c1a`` in V4.1; ``"c128a"`` for a ``"c128"`` layer): ``layout.layer_channels(layer)[role]``,
    or, when ``layer`` is None, the layout's one channel of that role. ``layer_kind`` must be the layer's.

    Raises ValueError for an SWA or unknown kind, a layout with no or several channels of the role and no
    ``layer`` (naming them), or a ``layer`` of another kind.
    """
    role = _COMPRESSED_ROLE.get(layer_kind)
    if role is None:
        raise ValueError(f"layer_kind must be 'c4' or 'c128' (a compressed layer), got {layer_kind!r}")
    if layer is None:
        names = [c.name for c in layout.channels.values() if c.role == role]
        if not names:
            raise ValueError(f"layer_kind {layer_kind!r}: this layout has no channel of role {role!r}")
        if len(names) > 1:
            raise ValueError(f"layer: this layout has several {role!r} channels {names}; pass the layer index")
        return names[0]
    chans = layout.layer_channels(layer)
    if layout.layer_kind(layer) != layer_kind:
        raise ValueError(f"layer_kind {layer_kind!r} differs from layer {layer}'s kind "
                         f"{layout.layer_kind(layer)!r}")
    return chans[role]


def _kind_params(meta, layer_kind: str, topk: Optional[torch.Tensor], layer: Optional[int] = None):
    """(R, K) of a layer kind: compress ratio (0 for swa) and compressed columns of a row; ``topk`` the raw
    picks of a ``"c4"`` layer (``topk_picks``: checked here, the one place)."""
    if layer_kind not in _KINDS:
        raise ValueError(f"layer_kind must be one of {_KINDS}, got {layer_kind!r}")
    if meta.cp[0] > 1:
        raise ValueError(f"meta: the prefill workspace view does not support decode context parallelism "
                         f"(cp_world_size = {meta.cp[0]})")
    if layer_kind == "swa":
        return 0, 0
    if layer_kind == "c128":
        c = meta[compressed_channel(meta.layout, layer_kind, layer)]
        return c.compress_ratio, c.indices.shape[1]
    if isinstance(topk, (tuple, list)):
        raise ValueError("topk_picks: the prefill helpers take the raw request-local picks, int32/int64 [>= T, K] "
                         "(the indexer's output; they convert them themselves), got a pair: the (slots, lens) of "
                         "meta.topk_to_slots are meta.sparse_decode_args' form")
    if not isinstance(topk, torch.Tensor) or topk.dim() != 2 or topk.dtype not in (torch.int32, torch.int64):
        raise ValueError("topk_picks: a c4 layer needs its request-local top-k picks, int32/int64 [>= T, K]")
    if topk.shape[0] < meta.num_tokens:
        raise ValueError(f"topk_picks has {topk.shape[0]} rows, needs at least num_tokens = {meta.num_tokens}")
    if topk.device != meta.positions.device:
        raise ValueError(f"topk_picks is on {topk.device}, expected {meta.positions.device} (the metadata's)")
    return meta[compressed_channel(meta.layout, layer_kind, layer)].compress_ratio, topk.shape[1]


def _host_rows(meta, req_start: int, req_end: int):
    """Host (L, q, g) int64 [n] of batch rows [req_start, req_end)."""
    qsl = np.asarray(meta.host_query_start_loc, dtype=np.int64)
    L = np.asarray(meta.host_seq_lens, dtype=np.int64)[req_start:req_end]
    q = np.diff(qsl[req_start:req_end + 1])
    return L, q, q + np.minimum(L - q, meta.layout.sliding_window - 1)


def prefill_workspace_size(meta, layer_kind: str, req_start: Optional[int] = None,
                           req_end: Optional[int] = None, *, layer: Optional[int] = None):
    """Host ``(N, M)`` of the workspace for batch rows ``[req_start, req_end)`` (default: every
    prefill request of the step): ``N = max L // R`` (0 for ``"swa"``; ``R`` of the layer's compressed
    channel, :func:`compressed_channel`), ``M = N + max g``. Reads only the metadata's host copies (no
    device sync)."""
    req_start = meta.num_decodes if req_start is None else req_start
    req_end = meta.num_reqs if req_end is None else req_end
    if layer_kind not in _KINDS:
        raise ValueError(f"layer_kind must be one of {_KINDS}, got {layer_kind!r}")
    if req_end <= req_start:
        return 0, 0
    L, _, g = _host_rows(meta, req_start, req_end)
    R = 0 if layer_kind == "swa" else meta[compressed_channel(meta.layout, layer_kind, layer)].compress_ratio
    N = int((L // R).max()) if R else 0
    return N, N + int(g.max())


def prefill_chunk(meta, layer_kind: str, req_start: int, req_end: int, topk_picks: Optional[torch.Tensor] = None,
                  *, N: Optional[int] = None, M: Optional[int] = None, layer: Optional[int] = None) -> PrefillChunk:
    """The workspace gather plan and the combined index matrix of prefill rows ``[req_start, req_end)``.

    Parameters
    ----------
    meta : DSV4Metadata — one step's metadata (``cp_world_size == 1``).
    layer_kind : {"swa", "c4", "c128"}
    req_start, req_end : int — batch rows, all prefill rows (``num_decodes <= req_start < req_end <=
        num_reqs``).
    topk_picks : int32 / int64 [>= T, K] — ``"c4"`` only: the layer's **raw** request-local indexer picks
        (compressed row numbers of the request, not slots: the helper converts them itself), rows = the step's
        token rows (decodes first; vLLM's shared top-k buffer), ``-1`` = none. Not the ``(slots, lens)`` of
        ``meta.topk_to_slots`` (that is :meth:`DSV4Metadata.sparse_decode_args`' form; a pair raises).
    N, M : int, optional — workspace geometry; default :func:`prefill_workspace_size` of these rows.
        Larger values (e.g. one shape for every chunk of a step) are allowed; smaller raise.
    layer : int, optional — the layer index: its own SWA and compressed channels (:func:`swa_channel`,
        :func:`compressed_channel`); needed when the layout has several channels of the role.

    Returns
    -------
    PrefillChunk — see its attributes; ``indices int32 [T_chunk, 1, width]`` with ``width =
    round_up(K + W, 128)`` (``K`` = top-k for c4, the fixed C128A list width for c128, 0 for swa).
    """
    R, K = _kind_params(meta, layer_kind, topk_picks, layer)
    swa_name = swa_channel(meta.layout, layer_kind, layer)
    check_int("req_start", req_start)
    check_int("req_end", req_end)
    if not meta.num_decodes <= req_start < req_end <= meta.num_reqs:
        raise ValueError(f"req_start, req_end = {req_start}, {req_end}: need prefill rows, num_decodes = "
                         f"{meta.num_decodes} <= req_start < req_end <= num_reqs = {meta.num_reqs}")
    need_n, need_m = prefill_workspace_size(meta, layer_kind, req_start, req_end, layer=layer)
    N = need_n if N is None else N
    M = max(need_m, N + need_m - need_n) if M is None else M
    if isinstance(N, bool) or not isinstance(N, int) or N < need_n:
        raise ValueError(f"N must be an int >= {need_n} (max L // R of the chunk), got {N!r}")
    if isinstance(M, bool) or not isinstance(M, int) or M - N < need_m - need_n:
        raise ValueError(f"M must be an int >= N + {need_m - need_n} (max g of the chunk), got {M!r}")
    W = meta.layout.sliding_window
    width = round_up(K + W, PREFILL_INDEX_ALIGN)
    qsl_h = np.asarray(meta.host_query_start_loc, dtype=np.int64)
    t0, t1 = int(qsl_h[req_start]), int(qsl_h[req_end])
    dev = meta.positions.device
    n_reqs, G = req_end - req_start, M - N

    # -- per request (device) ------------------------------------------------------------------
    qsl = meta.query_start_loc[req_start:req_end + 1].long()
    L = meta.seq_lens[req_start:req_end].long()
    q = qsl[1:] - qsl[:-1]
    g = q + (L - q).clamp(max=W - 1)
    gstart = L - g                                        # first raw position in the workspace
    swa = meta[swa_name]
    # NOTE: the first token's window start is the request's floor (replay_start or pos - W + 1)
    floor = (L - q) - swa.lens[qsl[:-1]].long() + 1
    rows = meta.idx_mapping[req_start:req_end].long()

    def slots(ch, local, ok):  # physical slots of per-request unit `local` through ch's table row
        bt, unit = ch.block_table, ch.rows_per_block
        blk = torch.div(local, unit, rounding_mode="floor")
        col = blk % ch.ring_cols if ch.ring_cols else blk
        ok = ok & (local >= 0) & (col < bt.shape[1])
        bid = bt[rows[:, None].expand(ok.shape), torch.where(ok, col, 0)].long()
        return torch.where(ok, no_block(bid * unit + local % unit), -1).to(torch.int32)

    j = torch.arange(N, device=dev)[None, :]
    if R:
        ch = meta[compressed_channel(meta.layout, layer_kind, layer)]
        comp_slots = slots(ch, j.expand(n_reqs, N), j < (L // R)[:, None])
    else:
        comp_slots = torch.full((n_reqs, N), -1, dtype=torch.int32, device=dev)
    i = torch.arange(G, device=dev)[None, :]
    p = gstart[:, None] + i
    raw_slots = slots(swa, p, (i < g[:, None]) & (p >= floor[:, None]))

    # -- per token (device) --------------------------------------------------------------------
    pos = meta.positions[t0:t1].long()
    b = meta.token_to_req[t0:t1].long() - req_start      # chunk-local request
    base = b * M
    n_w = swa.lens[t0:t1].long()
    vis = torch.div(pos + 1, R, rounding_mode="floor") if R else torch.zeros_like(pos)
    n_c = torch.clamp(vis, max=K)
    c = torch.arange(width, device=dev)[None, :]
    if layer_kind == "c4":
        assert topk_picks is not None  # NOTE: _kind_params rejected a c4 call without them
        picks = topk_picks[t0:t1].long()
        picks = torch.where((picks >= 0) & (picks < vis[:, None]), base[:, None] + picks, -1)
        comp = torch.nn.functional.pad(picks, (0, width - K), value=-1)
    else:
        comp = base[:, None] + c                         # c128: local row j = j; unused for swa
    win = base[:, None] + N + (pos - n_w + 1 - gstart[b])[:, None] + (c - n_c[:, None])
    idx = torch.where(c < n_c[:, None], comp, torch.where(c < (n_c + n_w)[:, None], win, -1))
    return PrefillChunk(req_start, req_end, t0, t1, N, M, comp_slots, raw_slots,
                        idx.to(torch.int32).unsqueeze(1), (n_c + n_w).to(torch.int32))


def prefill_chunks(meta, layer_kind: str, topk_picks: Optional[torch.Tensor] = None, *, chunk_reqs: int = 4,
                   same_shape: bool = True, layer: Optional[int] = None) -> List[PrefillChunk]:
    """Every prefill request of the step, ``chunk_reqs`` requests per :class:`PrefillChunk`.

    Parameters
    ----------
    meta, layer_kind, topk_picks, layer : see :func:`prefill_chunk` (``topk_picks``: the raw picks).
    chunk_reqs : int — requests per chunk (vLLM: 4).
    same_shape : bool — one ``(N, M)`` for every chunk (the step's maximum, like vLLM: one workspace
        allocation per step) instead of each chunk's own.

    Returns
    -------
    list of PrefillChunk — in batch order; empty when the step has no prefill.
    """
    check_int("chunk_reqs", chunk_reqs, lo=1)
    _kind_params(meta, layer_kind, topk_picks, layer)
    N = M = None
    if same_shape:
        N, M = prefill_workspace_size(meta, layer_kind, layer=layer)
    return [prefill_chunk(meta, layer_kind, s, min(s + chunk_reqs, meta.num_reqs), topk_picks, N=N, M=M,
                          layer=layer)
            for s in range(meta.num_decodes, meta.num_reqs, chunk_reqs)]


def gather_workspace(chunk: PrefillChunk, swa_cache: torch.Tensor, comp_cache: Optional[torch.Tensor] = None,
                     *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fill the chunk's workspace from flat caches (plain PyTorch; a real engine dequantises here).

    Parameters
    ----------
    chunk : PrefillChunk
    swa_cache : float [swa slots, D] — the SWA cache as one row per slot (``paged.view(-1, D)``).
    comp_cache : float [compressed slots, D] or None — the layer's compressed cache (None: swa layer).
    out : float [>= n_reqs, M, D] or None — written rows ``[:n_reqs]``; rows of ``-1`` slots get 0.

    Returns
    -------
    float [n_reqs, M, D] — flatten with ``.view(-1, 1, D)`` for the kernel's ``kv``.
    """
    D = swa_cache.shape[-1]
    if out is None:
        out = torch.empty((chunk.num_reqs, chunk.M, D), dtype=swa_cache.dtype, device=swa_cache.device)
    ws = out[:chunk.num_reqs]
    if ws.shape[1:] != (chunk.M, D):
        raise ValueError(f"out must be [>= {chunk.num_reqs}, {chunk.M}, {D}], got {tuple(out.shape)}")
    for cache, sl, rows in ((comp_cache, chunk.comp_slots, ws[:, :chunk.N]), (swa_cache, chunk.raw_slots,
                                                                              ws[:, chunk.N:])):
        if sl.numel() == 0:
            continue
        if cache is None:
            raise ValueError("comp_cache: this chunk gathers compressed rows; pass the layer's cache")
        ok = (sl >= 0)[..., None]
        rows.copy_(torch.where(ok, cache[sl.clamp(min=0).long()], torch.zeros((), dtype=cache.dtype,
                                                                                 device=cache.device)))
    return ws
