"""Block-table memory of a pipeline (issue 13): device tables, their host mirror and the pinned
staging buffers, for V4-Flash at 128K and 1M context with 256 and 1024 requests, ring vs full-width
sliding tables. Pure arithmetic over the layout (``GroupSpec.columns``), so it runs anywhere.

    python benchmarks/table_memory.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_index import DSV4Layout  # noqa: E402
from dsv4_index.state.staging import StageLayout  # noqa: E402

MiB = 1 << 20


def sizes(layout, max_num_reqs: int, max_num_batched_tokens: int = 8192):
    """(device table bytes, host mirror bytes, pinned staging bytes, per-group device bytes)."""
    per_group = {}
    for g in layout.groups:
        cols, _ = g.columns(max_num_batched_tokens)
        per_group[g.name] = 4 * cols * max_num_reqs
    tables = sum(per_group.values())
    entries = tables // 4
    writes = min(entries, 1 << 20)  # NOTE: MetadataPipeline's default max_staged_blocks
    stage = StageLayout.for_tokens(max_num_batched_tokens, len(layout.groups), 2, max_num_reqs).writes + 2 * writes
    return tables, tables, 2 * 4 * stage, per_group


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n")[0] + " (no options)").parse_args(argv)
    print("| context | requests | sliding tables | device tables MiB | host mirror MiB | pinned staging MiB | "
          "of which c4_state / c128_state MiB |")
    print("|---|---|---|---|---|---|---|")
    for ctx in (131072, 1 << 20):
        for reqs in (256, 1024):
            for kind in ("full", "ring"):
                layout = DSV4Layout.from_config("flash", max_model_len=ctx, sliding_tables=kind)
                dev, host, pinned, per = sizes(layout, reqs)
                print(f"| {ctx // 1024}K | {reqs} | {kind} | {dev / MiB:.1f} | {host / MiB:.1f} | {pinned / MiB:.1f} | "
                      f"{per['c4_state'] / MiB:.1f} / {per['c128_state'] / MiB:.1f} |")


if __name__ == "__main__":
    main()
