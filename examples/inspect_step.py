"""Render one step's metadata as a PNG: block tables, slot mappings and index rows, request by request.

A scripted trace of the reference scheduler on the tiny DSV4 layout (window 8, compress ratios 4 and
16, mla block 32, swa block 4) runs up to a mixed step (decodes with a speculative token and a prefill
chunk, windows crossing blocks) and draws it:

* the block-table rows of the batch, one panel per kv-cache group;
* per-token strips: raw slot mapping (``swa``) and compressed slot mappings (``c4a``, ``c128a``);
* heatmaps of the ``swa`` window indices and the ``c128a`` causal compressed indices per token.

Cells are coloured by block id (the same id has the same colour everywhere) and labelled with the
slot / id; ``-1`` is blank; dashed lines separate requests; padded tokens are marked.

    python examples/inspect_step.py                 # writes out/inspect_step.png
    python examples/inspect_step.py --step 9 --out step.png
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse

import numpy as np
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.scheduler import ReferenceScheduler, scripted_trace
from models.deepseek_v4 import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = [
    {"add": [dict(req_id="a", prompt_len=30, max_new_tokens=12), dict(req_id="b", prompt_len=13, max_new_tokens=10)]},
    {},
    {"add": [dict(req_id="c", prompt_len=50, max_new_tokens=6)], "accept": {}},
    {"accept": {"b": 1}},
    {"accept": {"b": 0}},
    {"accept": {"a": 1, "b": 1}},
    {"accept": {"a": 0, "b": 1}},
    {"accept": {"a": 1, "b": 0}},
]


def build_step(step_index: int, device):
    """Run the scripted trace up to step ``step_index``; return (layout, meta, step_index)."""
    layout = DSV4Layout.from_config(load_config("tiny").to_dict(), 128, mla_block_size=32, swa_block_size=4)
    sched = ReferenceScheduler(layout, 96, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=1,
                               long_prefill_threshold=16)
    pipe = MetadataPipeline(layout, 4, 32, device, num_speculative_tokens=1)
    script = SCRIPT + [{}] * max(0, step_index + 1 - len(SCRIPT))
    for i, (step, views) in enumerate(scripted_trace(sched, script)):
        T = step.total_tokens
        pipe.update(step, pad_to=-(-T // 8) * 8 if T else 8)
        meta = pipe.build()
        if i == step_index:
            return layout, meta, i
    raise SystemExit(f"--step {step_index}: the script has no such step")


def draw(layout, meta, index, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    cmap = ListedColormap(plt.get_cmap("tab20").colors)
    cmap.set_bad("white")
    B, T, Tp = meta.num_reqs, meta.num_tokens, meta.num_tokens_padded
    qsl = meta.query_start_loc.tolist()
    pos = meta.positions.tolist()
    tok_labels = [f"{meta.req_ids[int(meta.token_to_req[t])]}@{pos[t]}" if t < T else "pad" for t in range(Tp)]

    def cells(ax, arr, unit, *, label=True, fs=6, dim=None):
        """int array, -1 blank; colour = block id (value // unit; unit may be per row), text = value;
        ``dim`` (bool array): hatched, grey text."""
        arr = np.asarray(arr)
        col = np.ma.masked_where(arr < 0, (arr // np.asarray(unit)) % 20)
        ax.imshow(col, cmap=cmap, vmin=-0.5, vmax=19.5, aspect="auto", interpolation="nearest")
        for (r, c), v in np.ndenumerate(arr):
            faded = dim is not None and dim[r, c]
            if faded:
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor="white", alpha=0.6, hatch="///",
                                       edgecolor="0.5", lw=0))
            if label and v >= 0:
                ax.text(c, r, str(v), ha="center", va="center", fontsize=fs, color="0.45" if faded else "k")
        ax.set_xticks(range(arr.shape[1]))
        ax.tick_params(labelsize=6, length=0)

    def req_lines(ax, axis):
        for b in range(1, B + 1):
            (ax.axhline if axis == "y" else ax.axvline)(qsl[b] - 0.5, color="k", lw=1.2, ls="--")

    groups = layout.groups
    fig = plt.figure(figsize=(17, 5 + 0.28 * Tp))
    gs = fig.add_gridspec(3, len(groups), height_ratios=[1.1, 1.2, 0.32 * Tp], hspace=0.45, wspace=0.25)

    # 1. block tables: rows of the batch, columns up to the widest used entry; in sliding groups the
    #    entries wholly below the oldest window position of the step are stale (nothing reads them)
    seq_lens = meta.seq_lens.tolist()
    first = [seq_lens[b] - (qsl[b + 1] - qsl[b]) for b in range(B)]
    for g in groups:
        ax = fig.add_subplot(gs[0, g.gid])
        n = max(1, -(-max(seq_lens, default=1) // g.block_size))
        bt = meta.block_tables[g.gid].cpu().numpy()[:, :n]
        stale = np.zeros(bt.shape, dtype=bool)
        if g.window:
            for b in range(B):
                stale[b, :max(0, first[b] - g.window + 1) // g.block_size] = True
        cells(ax, np.where(bt > 0, bt, -1), 1, dim=stale)
        ax.set_yticks(range(B), [f"{r} ({s} tok)" for r, s in zip(meta.req_ids, seq_lens)])
        win = f", window {g.window}" if g.window else ""
        ax.set_title(f"gid {g.gid} {g.name}: block table (block {g.block_size}{win})", fontsize=8)
        ax.set_xlabel("logical block" + (" (hatched: left the window, stale)" if g.window else ""), fontsize=7)

    # 2. per-token strips
    ax = fig.add_subplot(gs[1, :])
    strips = [("swa slot", meta["swa"].slot_mapping, meta["swa"].block_size),
              ("c4a comp slot", meta["c4a"].compressed_slot_mapping, meta["c4a"].rows_per_block),
              ("c128a comp slot", meta["c128a"].compressed_slot_mapping, meta["c128a"].rows_per_block)]
    cells(ax, np.stack([s.cpu().numpy() for _, s, _ in strips]), np.array([u for _, _, u in strips])[:, None])
    ax.set_yticks(range(len(strips)), [n for n, _, _ in strips])
    ax.set_xticks(range(Tp), tok_labels, rotation=90)
    req_lines(ax, "x")
    if Tp > T:
        ax.axvspan(T - 0.5, Tp - 0.5, color="0.85", zorder=0)
    ax.set_title(f"step {index}: slot mappings per token (request@position; {B} requests, {meta.num_decodes} "
                 f"decodes first; {T} tokens padded to {Tp}); blank = -1 (no write)", fontsize=8)

    # 3. heatmaps: window indices (swa) and causal compressed indices (c128a)
    half = max(1, len(groups) // 2)
    for k, (name, unit) in enumerate([("swa", meta["swa"].block_size), ("c128a", meta["c128a"].rows_per_block)]):
        ax = fig.add_subplot(gs[2, k * half:(k + 1) * half])
        ch = meta[name]
        idx, lens = ch.indices.cpu().numpy(), ch.lens.cpu().numpy()
        w = idx.shape[1] if name == "swa" else max(1, int(lens.max()) + 1)
        cells(ax, idx[:, :w], unit)
        ax.set_yticks(range(Tp), [f"{lab}  len {int(n)}" for lab, n in zip(tok_labels, lens)])
        req_lines(ax, "y")
        what = (f"window indices (swa slots of positions pos-{layout.sliding_window - 1}..pos, oldest first)"
                if name == "swa" else
                f"causal compressed indices (c128a rows 0..n_c-1, R={ch.compress_ratio}; "
                f"first {w} of {idx.shape[1]} columns)")
        ax.set_title(f"{name}: {what}", fontsize=8)
        ax.set_xlabel("entry", fontsize=7)

    fig.suptitle("dsv4-index: one step of the tiny DSV4 layout (colour = block id, text = slot / id)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "inspect_step.png"), help="PNG path")
    ap.add_argument("--step", type=int, default=3, help="step of the script to draw (default 3: two spec decodes "
                    "and a 16-token prefill chunk)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    layout, meta, index = build_step(args.step, torch.device(args.device))
    draw(layout, meta, index, args.out)
    print(f"step {index}: {meta.num_reqs} requests {meta.req_ids}, {meta.num_tokens} tokens "
          f"(padded to {meta.num_tokens_padded}) -> {args.out} ({os.path.getsize(args.out) // 1024} KiB)")


if __name__ == "__main__":
    main()
