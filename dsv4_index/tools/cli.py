"""Command line of dsv4-index: ``python -m dsv4_index COMMAND`` (or the ``dsv4-index`` script).

``layout``, ``demo``, ``inspect`` and ``audit`` take ``--config`` (a shipped name ``flash`` | ``pro`` | ``tiny`` |
``v41_flash`` | ``tiny_v41`` or a config.json path) and ``--max-model-len`` (default: the config's
``max_position_embeddings``, at most 32768); ``replay`` takes the trace file (the recorded layout; ``--config``
replays it with another config). "Padding" means the rows a step adds after its live tokens to reach the padded
size ``T_pad`` (a CUDA-graph batch size); ``T_pad`` = live tokens + padding.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..config import SHIPPED
from .argtypes import int_in
from .audit import add_arguments as audit_arguments, audit_cmd

CONFIGS = Path(__file__).resolve().parent.parent / "configs"  # package data (dsv4_index.config.CONFIG_DIR)


def _config_path(name: str) -> str:
    p = Path(name)
    if p.suffix == ".json" or p.exists():
        return str(p)
    return str(CONFIGS / f"{name}.json")


DEFAULT_MAX_MODEL_LEN = 32768
MAX_MODEL_LEN = 1 << 24          # NOTE: the trace reader's bound (trace_schema.LIMITS)
SAMPLE_MAX_MODEL_LEN = 1 << 20   # NOTE: demo / inspect allocate a pipeline: DeepSeek-V4's longest context
MAX_SAMPLE_REQUESTS = 4096       # NOTE: inspect's sample step: a picture of at most 4096 rows

LAYOUT_COLUMNS = """\
columns: gid = kv-cache group id; kind = full | sliding | circular; block = tokens per (kernel) block;
  f = kernel blocks per allocation block (hybrid blocks; 1 = plain); window = sliding window in tokens;
  width = logical blocks per request, ceil(max_model_len / block) (per DCP rank where sharded; sliding
  groups store only a ring of their newest blocks; circular groups: the blocks of their ring);
  channels: R = compress ratio, S = rows per cache block, idx = index-list width (entries per token)"""


def max_model_len_of(args) -> int:
    """``--max-model-len`` or the default: the config's ``max_position_embeddings``, at most 32768."""
    if args.max_model_len is not None:
        return args.max_model_len
    from ..config import normalize_config

    try:  # NOTE: the config reader bounds size and depth; from_config reports an unreadable config itself
        longest = int(normalize_config(_config_path(args.config)).get("max_position_embeddings")
                      or DEFAULT_MAX_MODEL_LEN)
    except (OSError, ValueError, TypeError):
        longest = DEFAULT_MAX_MODEL_LEN
    return min(longest, DEFAULT_MAX_MODEL_LEN)


class OptionError(ValueError):
    """A bad command-line option: ``option`` (e.g. ``"--out"``) and the message, printed as one line."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"{option}: {message}")


def _layout(args):
    """The layout of ``--config`` / ``--max-model-len``; a config that cannot be used names ``--config``."""
    from .. import DSV4Layout
    from ..config import ConfigError

    try:
        return DSV4Layout.from_config(_config_path(args.config), max_model_len=max_model_len_of(args))
    except ConfigError as e:
        raise OptionError("--config", str(e)) from None


def layout_cmd(args) -> int:
    print(_layout(args))
    print(LAYOUT_COLUMNS)
    return 0


def sample_step(layout, *, seed: int = 0):
    """One mixed step: 2 decodes (contexts 300 and 1000), 1 spec decode (2 tokens), one 40-token prefill chunk."""
    from ..frontend import NewRequest, StepInput

    g = torch.Generator().manual_seed(seed)
    next_id = [1]

    def blocks(n_tokens):
        out = []
        for grp in layout.groups:
            n = grp.blocks_for(n_tokens)   # NOTE: a circular group: its ring, whatever the length
            ids = (torch.randperm(4000, generator=g)[:n] + next_id[0]).tolist()
            next_id[0] += 4000
            out.append(ids)
        return tuple(out)

    reqs = [("decode-a", 299, 1), ("decode-b", 999, 1), ("spec-c", 510, 2), ("prefill-d", 256, 40)]
    new = [NewRequest(rid, blocks(c + n), c) for rid, c, n in reqs]
    return StepInput(new_requests=new, running_requests=[], num_scheduled_tokens={r: n for r, _, n in reqs},
                     finished_req_ids=[], preempted_req_ids=[])


def demo(args) -> int:
    from .. import MetadataPipeline

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        print("(CPU: functional ops run their PyTorch reference; set TRITON_INTERPRET=1 to run the Triton "
              "kernels in the interpreter)")
    layout = _layout(args)
    print(layout)
    try:
        pipe = MetadataPipeline(layout, max_num_reqs=8, max_num_batched_tokens=64, device=device,
                                num_speculative_tokens=1)
    except ValueError as e:   # NOTE: the pipeline's capacities follow the layout's max_model_len
        raise OptionError("--max-model-len", f"no sample pipeline of this size: {e}") from None
    pipe.warmup()
    pipe.update(sample_step(layout), pad_to=48)
    meta = pipe.build()
    torch.set_printoptions(linewidth=140, threshold=200, edgeitems=4)
    print(f"\nstep: {meta.num_reqs} requests {meta.req_ids} (decode-first), {meta.num_tokens} tokens + "
          f"{meta.num_tokens_padded - meta.num_tokens} padding = {meta.num_tokens_padded}; decodes {meta.num_decodes} "
          f"({meta.num_decode_tokens} tokens), "
          f"prefills {meta.num_prefills} ({meta.num_prefill_tokens} tokens)")
    print("query_start_loc", meta.query_start_loc.tolist(), " seq_lens", meta.seq_lens.tolist())
    print("positions      ", meta.positions.tolist())
    print("token_to_req   ", meta.token_to_req.tolist())
    show = [0, 1, 2, 3, meta.num_tokens - 1, meta.num_tokens]
    for name, ch in meta.channels.items():
        print(f"\n[{name}] gid {ch.gid}  R={ch.compress_ratio}  S={ch.rows_per_block}  block_size={ch.block_size}"
              f"  window={ch.window}")
        for field in ("slot_mapping", "compressed_slot_mapping", "lens", "ks", "ke", "cu", "decode_lens"):
            v = getattr(ch, field)
            if v is not None:
                print(f"  {field:24s}{list(v.shape)}  {v.flatten()[:48].tolist()}")
        if ch.indices is not None:
            print(f"  indices {list(ch.indices.shape)}: rows of tokens {show} (first 8 / last 2 columns of the row "
                  "prefix that holds entries)")
            for t in show:
                n = int(ch.lens[t]) if ch.lens is not None else 0
                row = ch.indices[t, :max(n, 1)].tolist()
                cut = row if len(row) <= 10 else row[:8] + ["..."] + row[-2:]
                print(f"    t={t:3d} len={n:5d}  {cut}")
    from .sample import indexed_channels

    for name in indexed_channels(layout):
        K = int(layout.index_topk or 1)
        topk = torch.full((meta.num_tokens_padded, K), -1, dtype=torch.int32, device=device)
        topk[:, :4] = torch.tensor([0, 3, 70, 10_000], dtype=torch.int32)[:K]
        slots, lens = meta.topk_to_slots(name, topk)
        print(f"\n[{name}] topk_to_slots of picks [0, 3, 70, 10000] (10000 is beyond every context): "
              f"token 0 -> {slots[0, :4].tolist()} len {int(lens[0])}")
    return 0



def inspect_step(args) -> int:
    from .plot import draw_step
    from .sample import sample_step

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("inspect draws with matplotlib, which is not installed: pip install 'dsv4-index[plot]' "
              "(or pip install matplotlib)", file=sys.stderr)
        return 2
    out = _out_path(args.out)
    _layout(args)   # NOTE: a bad --config is named before the sample step is built
    try:
        pipe, meta = sample_step(_config_path(args.config), args.requests, max_model_len=max_model_len_of(args),
                                 device=args.device or "cpu", seed=args.seed)
    except ValueError as e:   # NOTE: the sample pipeline's capacities follow these two options
        raise OptionError("--requests / --max-model-len", f"no sample step of this size: {e}") from None
    try:
        draw_step(meta, str(out), seed=args.seed)
    except OSError as e:
        raise OptionError("--out", f"cannot write {str(out)!r}: {e.strerror or e}") from None
    print(f"{args.config}: {meta.num_reqs} requests ({meta.num_decodes} decodes first), {meta.num_tokens} tokens "
          f"+ {meta.num_tokens_padded - meta.num_tokens} padding -> {out} ({os.path.getsize(out) // 1024} KiB)")
    return 0


PICTURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")


def _out_path(given: str) -> Path:
    """The file ``inspect`` will write for ``--out given``: a name without an extension gets ``.png``;
    a folder, an unknown extension or a place that cannot be written is an :class:`OptionError`
    before anything is computed."""
    p = Path(given)
    if not given or p.is_dir() or given.endswith(os.sep):
        raise OptionError("--out", f"{given!r} is a folder; give a file name such as "
                          f"{str(p / 'step.png')!r}")
    if not p.suffix:
        p = p.with_name(p.name + ".png")
    elif p.suffix[1:].lower() not in PICTURE_FORMATS:
        raise OptionError("--out", f"unknown picture format {p.suffix!r} (one of {', '.join(PICTURE_FORMATS)})")
    if p.is_dir():
        raise OptionError("--out", f"{str(p)!r} is a folder")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OptionError("--out", f"cannot create {str(p)!r}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise OptionError("--out", f"cannot write {str(p)!r}: permission denied")
    return p


def replay(args) -> int:
    """Exit status: 0 when every step replays clean (and matches its recorded outputs), 1 at the first
    problem (printed), 2 for a trace or config that cannot be used (one line on stderr, see main)."""
    from ..config import ConfigError
    from .replay import replay_trace

    try:
        res = replay_trace(args.trace, config=_config_path(args.config) if args.config else None,
                           device=args.device, backend=args.backend, topk_seed=args.seed,
                           progress=not args.no_progress)
    except ConfigError as e:
        raise OptionError("--config", str(e)) from None
    print(res.report())
    return 0 if res.ok else 1


def _one_line_errors(fn):
    """Every error -> one line on stderr and exit status 2, never a traceback: bad input (a
    ``ValueError``: OptionError, TraceError, ConfigError, ...; an unreadable or unwritable file), an
    interrupt (Ctrl-C), and anything else (named as an internal error). ``DSV4_INDEX_TRACEBACK=1``
    re-raises."""
    import functools

    @functools.wraps(fn)
    def run(argv=None) -> int:
        try:
            return fn(argv)
        except KeyboardInterrupt:
            if os.environ.get("DSV4_INDEX_TRACEBACK"):
                raise
            print("\npython -m dsv4_index: error: interrupted", file=sys.stderr)
            return 2
        except Exception as e:   # NOTE: SystemExit (argparse, --help) passes through
            if os.environ.get("DSV4_INDEX_TRACEBACK"):
                raise
            msg = " ".join(str(e).split()) or type(e).__name__
            if not isinstance(e, (ValueError, OSError)):
                msg = f"internal error ({type(e).__name__}: {msg}); DSV4_INDEX_TRACEBACK=1 shows where"
            print(f"python -m dsv4_index: error: {msg}", file=sys.stderr)
            return 2
    return run


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``PROG: error: argument --seed: ...``), exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (--help for usage)\n")


def _device(s: str) -> str:
    """A ``--device`` that exists on this machine: ``cpu``, ``cuda`` or ``cuda:N``."""
    try:
        d = torch.device(s)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{s[:40]!r} is not a device (cpu, cuda or cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{s[:40]!r}: only cpu and cuda devices are supported")
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise argparse.ArgumentTypeError(f"{s!r}: no CUDA device is available on this machine")
        if d.index is not None and d.index >= n:
            raise argparse.ArgumentTypeError(f"{s!r}: this machine has {n} CUDA device(s) (cuda:0 to cuda:{n - 1})")
    return s


SEED_MAX = (1 << 63) - 1


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    ap = _Parser(prog="python -m dsv4_index", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"dsv4-index {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str = "", longest: int = MAX_MODEL_LEN) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description or help)
        p.add_argument("--config", default="flash", help=f"{' | '.join(SHIPPED)} | path to a config.json "
                       "(default: flash)")
        p.add_argument("--max-model-len", type=int_in(1, longest), default=None, metavar="N",
                       help="longest request in tokens; sizes every table (default: the config's "
                       f"max_position_embeddings, at most {DEFAULT_MAX_MODEL_LEN}; largest: 2**20 for demo and "
                       "inspect, 2**24 for layout and audit)")
        return p

    command("layout", "print the kv-cache groups and channels a config gives, with a key to the columns")
    p = command("demo", "build one sample step (2 decodes, 1 speculative decode, 1 prefill chunk) and "
                "print its metadata", longest=SAMPLE_MAX_MODEL_LEN)
    p.add_argument("--device", type=_device, default=None,
                   help="pipeline device (default: cuda if available, else cpu)")
    p = command("inspect", "draw one sample step (table occupancy, token order, zoomed requests) as a PNG",
                "draw one sample step of a layout as a PNG (needs matplotlib: pip install 'dsv4-index[plot]')",
                longest=SAMPLE_MAX_MODEL_LEN)
    p.add_argument("--requests", type=int_in(1, MAX_SAMPLE_REQUESTS), default=None, metavar="N",
                   help="requests in the step (default: 300; tiny: 6)")
    p.add_argument("--out", default="step.png", help="output picture (default: step.png; no extension: .png "
                   "added; the line printed names the file written)")
    p.add_argument("--seed", type=int_in(0, SEED_MAX), default=0,
                   help="seed of the sample step and its top-k picks (default: 0)")
    p.add_argument("--device", type=_device, default=None, help="pipeline device (default: cpu, the PyTorch reference)")
    audit_arguments(command("audit", "audit a layout's geometry: prefix-hit lengths, write/read overlap, chunk demand"))
    p = sub.add_parser("replay", help="replay a recorded step trace through the checker and the reference",
                       description="replay a recorded step trace through a checked pipeline and the reference; "
                       "prints the first divergence, or a summary")
    p.add_argument("trace", help="JSONL trace written by dsv4_index.tools.trace.record_steps")
    p.add_argument("--config", default=None, help="replay with this config instead of the recorded layout "
                   f"({' | '.join(SHIPPED)} | path); the recorded block sizes, rings and DCP are kept")
    p.add_argument("--device", type=_device, default=None,
                   help="device of the checked pipeline (default: cuda if available)")
    p.add_argument("--backend", default=None, choices=("triton", "reference"),
                   help="backend of the checked pipeline (default: triton on CUDA or under TRITON_INTERPRET=1)")
    p.add_argument("--seed", type=int_in(0, SEED_MAX), default=0,
                   help="seed of the random top-k picks compared every step")
    p.add_argument("--no-progress", action="store_true", default=not sys.stderr.isatty(),
                   help="no progress output (default: a bar on a terminal, nothing when stderr is not one)")
    return ap


@_one_line_errors
def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "layout":
        return layout_cmd(args)
    elif args.cmd == "demo":
        return demo(args)
    elif args.cmd == "inspect":
        return inspect_step(args)
    elif args.cmd == "audit":
        args.max_model_len = max_model_len_of(args)   # NOTE: the default every command documents
        return audit_cmd(args)
    else:
        return replay(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
