"""One step's metadata as a picture, readable from the tiny model up to V4-Flash with hundreds of
requests (``python -m dsv4_index inspect``, or :func:`draw_step`).

The figure has three parts:

* **token order** — tokens per batch row (decode rows first, then prefill chunks), with each
  request's context length; padding and the decode / prefill split marked;
* **table occupancy** — one heatmap per kv-cache group, a row per request (batch order, reading
  table row ``idx_mapping[b]``), a column per stored table column: blocks held before the step,
  blocks this step writes, blocks inside a sliding window, stale ring columns; ring tables mark
  the column of each request's newest block;
* **zoomed requests** — for a few requests, the last scheduled token's index lists against the
  request's positions: the causal compressed rows (``c128a``), the converted top-k picks
  (``c4a``; random picks) over the whole context, and the window lists (``swa`` and the
  compressor-state channels) over the last positions, each entry coloured by the block holding it.

matplotlib (the ``plot`` extra) is imported lazily; the Agg backend is used (no display needed).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .sample import indexed_channels, ratio_label
from .sample import sample_step, sample_step_batch  # noqa: F401  (re-exported: where they were)

__all__ = ["draw_step", "sample_step_batch"]

# categories of the occupancy heatmaps
EMPTY, HELD, WINDOW, WRITTEN, STALE = 0, 1, 2, 3, 4
_CAT_COLORS = ["#ffffff", "#9ecae1", "#74c476", "#f16913", "#d9d9d9"]
_CAT_NAMES = ["empty", "held (before this step)", "in a token's window (read)", "written this step",
              "stale ring column (not read)"]


# font sizes (points): legible at 100 % zoom of the saved PNG
FS_CELL, FS_SMALL, FS_LABEL, FS_TITLE, FS_SUPTITLE = 8, 10, 11, 12, 14


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a step needs matplotlib: pip install 'dsv4-index[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# a sample step
def _occupancy(meta, g, qsl, seq, max_rows: int):
    """(categories int8 [rows, cols], ring head column per row or None, table ids [rows, cols])."""
    B = min(meta.num_reqs, max_rows)
    bt = meta.block_tables[g.gid].detach().cpu().numpy()[meta.req_slots[:B]]
    ring = int(meta.ring_cols[g.gid])
    q = np.diff(qsl)[:B]
    seq = seq[:B]
    first = seq - q
    bs = g.block_size
    last = np.where(seq > 0, (seq - 1) // bs, -1)
    if g.kind == "circular":
        cat = np.repeat(np.where(seq > 0, WRITTEN, EMPTY)[:, None], bt.shape[1], axis=1).astype(np.int8)
        return cat, None, bt
    cols = bt.shape[1]
    c = np.arange(cols)[None, :]
    if ring:
        logical = last[:, None] - ((last[:, None] - c) % ring)      # newest logical block in each column
    else:
        logical = np.broadcast_to(c, (B, cols))
    cat = np.full((B, cols), EMPTY, dtype=np.int8)
    valid = (logical >= 0) & (logical <= last[:, None])
    cat[valid] = HELD
    if g.window:
        lo = np.maximum(first - g.window + 1, 0) // bs
        cat[valid & (logical < lo[:, None])] = STALE if ring else HELD
        cat[valid & (logical >= lo[:, None])] = WINDOW
    wr = valid & (logical >= (first // bs)[:, None]) & (q[:, None] > 0)
    cat[wr] = WRITTEN
    return cat, (last % ring if ring else None), bt


def _pick_rows(meta, requests) -> list:
    B, nd = meta.num_reqs, meta.num_decodes
    qsl = meta.host_query_start_loc
    q = np.diff(qsl)
    if requests is not None:
        out = []
        for r in requests:
            if isinstance(r, str):
                if meta.req_ids is None or r not in meta.req_ids:
                    raise ValueError(f"requests: no request {r!r} in this step")
                out.append(meta.req_ids.index(r))
            elif isinstance(r, (int, np.integer)) and 0 <= r < B:
                out.append(int(r))
            else:
                raise ValueError(f"requests: {r!r} is neither a request id nor a batch row in [0, {B})")
        return out
    seq = meta.host_seq_lens
    picks = []
    dec = [b for b in range(nd) if q[b] == 1]
    spec = [b for b in range(nd) if q[b] > 1]
    for group in (dec, spec, list(range(nd, B))):
        if group:
            picks.append(max(group, key=lambda b: seq[b]))   # NOTE: the longest context of each kind
    return picks[:3]


def draw_step(meta, path, *, requests: Optional[Sequence] = None, max_rows: int = 512, topk=None,
              seed: int = 0, title: Optional[str] = None, dpi: int = 110) -> str:
    """Draw one step's metadata into a PNG (or any format matplotlib infers from ``path``).

    Parameters
    ----------
    meta : DSV4Metadata — a built step (``pipe.build()``).
    path : str or Path — output file; its folder is created.
    requests : sequence of request ids (str) or batch rows (int), optional — the zoomed requests
        (default: the longest-context decode, speculative decode and prefill chunk).
    max_rows : int — occupancy heatmaps show the first ``max_rows`` batch rows.
    topk : int32 ``[>= T_pad, K]``, optional — picks converted for the ``c4a`` lane (default: random
        picks below each token's ``n_c`` and a few out-of-range ones, from ``seed``).
    title : str, optional — figure title.
    dpi : int

    Returns
    -------
    str — ``path``.
    """
    plt = _plt()

    import os
    layout = meta.layout
    B, T = meta.num_reqs, meta.num_tokens
    qsl = np.asarray(meta.host_query_start_loc, dtype=np.int64)
    seq = np.asarray(meta.host_seq_lens, dtype=np.int64)
    rows = _pick_rows(meta, requests)
    groups = layout.groups
    fig = plt.figure(figsize=(18, 10 + 3.3 * len(rows)))
    gs = fig.add_gridspec(2 + len(rows), max(len(groups), 2), height_ratios=[1.9, 4.4] + [1.5] * len(rows),
                          hspace=0.62, wspace=0.25, top=1 - 0.6 / fig.get_figheight(), bottom=0.03)

    _token_order(fig, gs, meta, qsl, seq)
    _occupancy_panels(fig, gs, meta, qsl, seq, max_rows)

    # 3. zoomed requests ----------------------------------------------------------------------
    picks = _topk_picks(meta, topk, seed)
    for k, b in enumerate(rows):
        _zoom(fig, gs[2 + k, :], meta, b, qsl, seq, picks)

    fig.suptitle(title or f"dsv4-index step: {B} requests, {T} tokens (layout: {len(groups)} groups, "
                 f"window {layout.sliding_window}, ratios {ratio_label(layout)}, "
                 f"max_model_len {layout.max_model_len})", fontsize=FS_SUPTITLE, y=0.995)
    path = str(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)   # NOTE: also when the file cannot be written
    return path


def _token_order(fig, gs, meta, qsl, seq) -> None:
    """Part 1, token order: decode rows | prefill rows (each panel as wide as it needs), the token axis below."""
    plt = _plt()
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    B, T, Tp, nd = meta.num_reqs, meta.num_tokens, meta.num_tokens_padded, meta.num_decodes
    q = np.diff(qsl)
    kind_colors = ["#3182bd", "#9e9ac8", "#e6550d"]
    kind_names = ["decode (1 token)", "speculative decode", "prefill chunk"]
    top = gs[0, :].subgridspec(2, 2, height_ratios=[3, 1], width_ratios=[4.2, 1.0], hspace=1.0, wspace=0.12)
    _token_strip(fig.add_subplot(top[1, 0]), meta, qsl)
    key = fig.add_subplot(top[1, 1])
    key.axis("off")
    key.legend(handles=[Patch(color=c, label=n) for c, n in zip(kind_colors, kind_names, strict=True)]
               + [plt.Line2D([], [], ls="", marker=".", ms=9, color="0.25", label="context after the step")],
               loc="center", fontsize=FS_SMALL, frameon=False)
    kind = np.where(np.arange(B) >= nd, 2, np.where(q > 1, 1, 0))
    for k, (lo, hi, what) in enumerate(((0, nd, "decode rows"), (nd, B, "prefill rows"))):
        ax = fig.add_subplot(top[0, k])
        x = np.arange(lo, hi)
        ax.bar(x, q[lo:hi], width=0.9 if hi - lo < 50 else 1.0, color=np.asarray(kind_colors)[kind[lo:hi]],
               linewidth=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        ax.set_xlim(lo - 0.5, max(hi, lo + 1) - 0.5)
        if hi - lo <= 12:
            ax.set_xticks(x)
        ax.set_xlabel(f"batch row ({what})", fontsize=FS_LABEL)
        ax2 = ax.twinx()
        ax2.plot(x, np.maximum(seq[lo:hi], 1), ".", ms=3 if hi - lo > 50 else 9, color="0.25")
        ax2.set_yscale("log")
        if k == 0:
            ax.set_ylabel("tokens scheduled (bars)", fontsize=FS_LABEL)
            ax.set_title(f"token order: {nd} decode rows ({meta.num_decode_tokens} tokens) first, then {B - nd} "
                         f"prefill rows ({meta.num_prefill_tokens} tokens); {T} tokens + {Tp - T} padding = {Tp}",
                         fontsize=FS_TITLE, loc="left")
        else:
            ax2.set_ylabel("context (dots)", fontsize=FS_LABEL)
        if hi == lo:
            ax.text(0.5, 0.5, f"no {what}", transform=ax.transAxes, ha="center", va="center", fontsize=FS_LABEL)
        for a in (ax, ax2):
            a.tick_params(labelsize=FS_SMALL)


def _occupancy_panels(fig, gs, meta, qsl, seq, max_rows: int) -> None:
    """Part 2, occupancy: per group, the decode rows and (in their own panel, so they stay visible) the prefill rows."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    B, nd, groups = meta.num_reqs, meta.num_decodes, meta.layout.groups
    cmap = ListedColormap(_CAT_COLORS)
    cat_all = {g.gid: _occupancy(meta, g, qsl, seq, B) for g in groups}
    spans = [(0, min(nd, max_rows))] + ([(nd, min(B, nd + max_rows))] if B > nd else [])
    for g in groups:
        cat, head, ids = cat_all[g.gid]
        used = np.flatnonzero((cat != EMPTY).any(0))
        ncol = cat.shape[1] if meta.ring_cols[g.gid] or not used.size else min(cat.shape[1], int(used[-1]) + 2)
        cell = gs[1, g.gid].subgridspec(len(spans), 1, hspace=0.08,
                                       height_ratios=[4.0, 1.0][:len(spans)] if len(spans) > 1 else [1.0])
        for k, (r0, r1) in enumerate(spans):
            ax = fig.add_subplot(cell[k, 0])
            _heat(ax, cmap, cat, head, ids, r0, r1, ncol)
            if g.gid == 0:
                ax.set_ylabel("decode rows" if k == 0 else "prefill\nrows", fontsize=FS_LABEL)
            if k == 0:
                ring = int(meta.ring_cols[g.gid])
                kind_s = (f"circular: a ring of {g.ring_capacity} rows in {g.ring_blocks} block(s) per request"
                          if g.kind == "circular" else
                          f"ring of {ring} columns, \u25bc newest block" if ring else
                          f"{g.kind}: columns {ncol} of {cat.shape[1]} shown")
                win = f", window {g.window}" if g.window else ""
                ax.set_title(f"gid {g.gid} {g.name}: block {g.block_size} tokens{win}\n{kind_s}", fontsize=FS_LABEL)
            if k == len(spans) - 1:
                ax.set_xlabel("table column", fontsize=FS_LABEL)
            else:
                ax.tick_params(labelbottom=False)
    cats = zip(_CAT_COLORS, _CAT_NAMES, strict=True)
    fig.legend(handles=[Patch(facecolor=c, edgecolor="0.6", label=n) for c, n in cats],
               loc="upper center", ncol=5, fontsize=FS_LABEL, frameon=False,
               bbox_to_anchor=(0.5, _legend_y(fig, gs)))


def _legend_y(fig, gs) -> float:
    """Just under the occupancy row's x labels, above the zoomed requests (in the gap between them)."""
    pos = gs[1, 0].get_position(fig)
    return pos.y0 - 0.5 / fig.get_figheight()


def _heat(ax, cmap, cat, head, ids, r0: int, r1: int, ncol: int) -> None:
    """Occupancy rows ``[r0, r1)`` (batch rows on the y axis), ring heads, block ids of small tables."""
    n = max(r1 - r0, 0)
    part = cat[r0:r1, :ncol] if n else np.zeros((1, ncol), dtype=cat.dtype)
    ax.imshow(part, cmap=cmap, vmin=-0.5, vmax=len(_CAT_COLORS) - 0.5, aspect="auto", interpolation="nearest",
              extent=(-0.5, ncol - 0.5, r0 + max(n, 1) - 0.5, r0 - 0.5))
    if head is not None and n:
        big = n <= 50
        ax.plot(head[r0:r1], np.arange(r0, r1) - (0.38 if big else 0), "kv" if big else "k|", ms=7 if big else 3,
                mew=0.6)
    if n * ncol <= 400 and ncol <= 20:   # NOTE: small tables: the ids of the blocks in use
        for (r, c), v in np.ndenumerate(ids[r0:r1, :ncol]):
            if cat[r0 + r, c] in (HELD, WINDOW, WRITTEN):
                ax.text(c, r0 + r, str(int(v)), ha="center", va="center", fontsize=FS_CELL,
                        rotation=0 if ncol <= 12 else 90)
    if n <= 12:
        ax.set_yticks(range(r0, r1))
    ax.tick_params(labelsize=FS_SMALL)


def _topk_picks(meta, topk, seed: int):
    """(channel, picks int64 [T_pad, K], slots int64 [T_pad, K]) for the first indexed channel (``c4a``; V4.1
    ``c1a``), or None."""
    names = [n for n in indexed_channels(meta.layout) if n in meta.channels]
    if not names:
        return None
    name = names[0]
    K = int(meta.layout.index_topk or 1)
    Tp = meta.num_tokens_padded
    if topk is None:
        g = torch.Generator().manual_seed(seed)
        R = meta[name].compress_ratio
        nc = (meta.positions.detach().cpu()[:Tp] + 1) // R
        u = torch.rand((Tp, K), generator=g)
        topk = (u * nc[:, None].clamp(min=1)).long()
        topk[:, -max(1, K // 16):] = nc[:, None] + torch.arange(max(1, K // 16))   # NOTE: invalid picks, -> -1
        topk = topk.to(torch.int32)
    slots, _ = meta.topk_to_slots(name, topk.to(meta.query_start_loc.device))
    return name, topk.detach().cpu().long().numpy(), slots.detach().cpu().long().numpy()


def _block_colors(blocks: np.ndarray):
    import matplotlib.pyplot as plt
    pal = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # a ListedColormap
    return [pal[int(v) % 20] for v in blocks]


def _zoom(fig, spec, meta, b: int, qsl, seq, picks) -> None:
    """Two panels for batch row ``b``'s last token: whole context (compressed lanes), last positions
    (window lanes)."""
    sub = spec.subgridspec(1, 2, width_ratios=[1.6, 1.0], wspace=0.08)
    t = int(qsl[b + 1]) - 1
    pos = int(meta.positions[t])
    q = int(qsl[b + 1] - qsl[b])
    rid = repr(meta.req_ids[b]) if meta.req_ids is not None else f"in slot {int(meta.req_slots[b])}"
    what = "decode" if b < meta.num_decodes and q == 1 else "speculative decode" if b < meta.num_decodes else "prefill"
    lanes = []                                    # (axis index, label, positions, blocks, valid, marker)
    for name, ch in meta.channels.items():
        if ch.indices is None or ch.lens is None:
            continue
        n = int(ch.lens[t])
        idx = ch.indices[t, :n].detach().cpu().long().numpy()
        if ch.compress_ratio > 1:     # causal compressed rows 0..n-1
            p = np.arange(n) * ch.compress_ratio
            lanes.append((0, f"{name}: {n} causal rows (R={ch.compress_ratio})", p, idx // ch.rows_per_block,
                          np.ones(n, bool)))
        else:                         # window: positions pos-n+1 .. pos
            p = np.arange(pos - n + 1, pos + 1)
            lanes.append((1, f"{name}: window of {n} (W={ch.window})", p, idx // ch.block_size, np.ones(n, bool)))
    if picks is not None:
        name, tk, sl = picks
        R, S = meta[name].compress_ratio, meta[name].rows_per_block
        ok = sl[t] >= 0
        lanes.append((0, f"{name}: top-k picks ({int(ok.sum())} of {tk.shape[1]} valid; x = invalid -> -1)",
                      tk[t] * R, np.where(ok, sl[t] // S, -1), ok))
    lanes.append((0, f"this step: positions {pos - q + 1}..{pos}", np.arange(pos - q + 1, pos + 1),
                  np.full(q, -1), np.ones(q, bool)))
    zoom_lo = max(0, pos - 2 * max((len(lane[2]) for lane in lanes if lane[0] == 1), default=8) - 4)
    for k in (0, 1):
        ax = fig.add_subplot(sub[0, k])
        mine = [lane for lane in lanes if lane[0] == k or (k == 1 and lane[1].startswith("this step"))]
        for y, (_, label, p, blk, ok) in enumerate(mine):
            if k == 1:
                keep = p >= zoom_lo
                p, blk, ok = p[keep], blk[keep], ok[keep]
            col = _block_colors(np.where(blk >= 0, blk, 0))
            col = [c if v >= 0 and o else (0.6, 0.6, 0.6) for c, v, o in zip(col, blk, ok, strict=True)]
            if k == 0 and len(p) > 0:
                ax.scatter(np.where(ok, p, np.minimum(p, seq[b] + 1)), np.full(len(p), y), c=col,
                           marker="|", s=90, linewidths=1.0)
                if not ok.all():
                    bad = ~ok
                    ax.scatter(np.minimum(p[bad], seq[b] * 1.02 + 1), np.full(int(bad.sum()), y), c="0.4",
                               marker="x", s=12, linewidths=0.8)
            elif len(p) > 0:
                ax.barh(np.full(len(p), y), np.ones(len(p)), left=p - 0.5, height=0.6, color=col,
                        edgecolor="white", linewidth=0.3)
                _label_blocks(ax, y, p, blk, pos + 2 - zoom_lo)
                if label.split(":")[0] in meta.channels:
                    sl = meta[label.split(":")[0]].indices[t, :len(p)]
                    ax.text(p[0] - 1, y, _slots_text(sl.detach().cpu()[-len(p):].tolist()), ha="right",
                            va="center", fontsize=FS_SMALL)
        ax.set_yticks(range(len(mine)), [lane[1] for lane in mine], fontsize=FS_SMALL)
        ax.set_ylim(-0.7, len(mine) - 0.3)
        ax.tick_params(axis="x", labelsize=FS_SMALL)
        if k == 0:
            ax.set_xlim(-0.01 * seq[b], seq[b] * 1.04 + 1)
            ax.set_xlabel("position in the request (compressed row r drawn at r * R; colour = block id)",
                          fontsize=FS_SMALL)
            ax.set_title(f"request {rid} (batch row {b}, {what}, {q} token(s)): token {t} at position {pos}, "
                         f"context {int(seq[b])}", fontsize=FS_LABEL, loc="left")
        else:
            ax.set_xlim(zoom_lo - 0.5, pos + 1.5)
            ax.yaxis.tick_right()
            ax.set_xlabel("last positions (colour and label: block id of each window entry)", fontsize=FS_SMALL)


def _slots_text(sl: list) -> str:
    return "slots " + (", ".join(map(str, sl)) if len(sl) <= 4 else f"{sl[0]}, {sl[1]}, ..., {sl[-1]}")


def _token_strip(ax, meta, qsl) -> None:
    """The token axis ``[0, T_pad)``: one segment per request (decode / speculative / prefill), padding."""
    nd, T, Tp = meta.num_decodes, meta.num_tokens, meta.num_tokens_padded
    q = np.diff(qsl)
    cols = {0: ("#3182bd", "#6baed6"), 1: ("#9e9ac8", "#bcbddc"), 2: ("#e6550d", "#fd8d3c")}
    for b in range(meta.num_reqs):
        k = 2 if b >= nd else (1 if q[b] > 1 else 0)
        ax.broken_barh([(qsl[b], q[b])], (0, 1), color=cols[k][b % 2], linewidth=0)
    if Tp > T:
        ax.broken_barh([(T, Tp - T)], (0, 1), facecolor="0.85", hatch="////", edgecolor="0.5", linewidth=0)
    ax.set_xlim(0, max(Tp, 1))
    ax.set_yticks([])
    ax.tick_params(labelsize=FS_SMALL)
    ax.set_xlabel(f"token index (request segments alternate shades; hatched: {Tp - T} padding tokens)",
                  fontsize=FS_LABEL)


def _label_blocks(ax, y, p, blk, xrange: float) -> None:
    """Label each run of one block id along a lane (if the run is wide enough to hold the label)."""
    if len(p) == 0:
        return
    cuts = np.flatnonzero(np.diff(blk)) + 1
    for s, e in zip(np.r_[0, cuts], np.r_[cuts, len(p)], strict=True):
        if blk[s] >= 0 and (e - s) / max(xrange, 1) > 0.07:
            ax.text((p[s] + p[e - 1]) / 2, y, f"blk {int(blk[s])}", ha="center", va="center", fontsize=FS_SMALL)
