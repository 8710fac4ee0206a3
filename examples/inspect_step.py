"""Render one step's metadata as a PNG: a thin wrapper over ``python -m dsv4_index inspect``
(:func:`dsv4_index.tools.plot.draw_step` on :func:`dsv4_index.tools.plot.sample_step`).

The picture shows the token order (decode rows first, tokens per request, padding), the occupancy of
every group's block table (held / written / in-window / stale ring columns, the newest block of each
ring), and zoomed rows of a few requests with their window, causal compressed and top-k entries.

    python examples/inspect_step.py                            # tiny layout -> out/inspect_step.png
    python examples/inspect_step.py --config flash --requests 300 --out flash.png

To draw a step of your own pipeline:
``from dsv4_index.tools.plot import draw_step; draw_step(pipe.build(), "step.png")``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

from dsv4_index.tools.cli import main as cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny",
                    help="tiny | flash | pro | v41_flash | tiny_v41 | path to a config.json (default: tiny)")
    ap.add_argument("--requests", type=int, default=None, help="requests in the step (tiny: 6, else 300)")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "inspect_step.png"), help="PNG path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    extra = ["--requests", str(args.requests)] if args.requests else []
    return cli(["inspect", "--config", args.config, "--out", args.out, "--seed", str(args.seed), *extra])


if __name__ == "__main__":
    raise SystemExit(main())
