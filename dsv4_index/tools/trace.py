"""Record the steps a pipeline accepts (and rejects) as a JSONL trace, and replay a trace through a
fresh checked pipeline and the PyTorch reference to find where the metadata first goes wrong.

Recording::

    with record_steps(pipe, "steps.jsonl"):        # wraps pipe.update for the block
        for step in scheduler:
            pipe.update(step, pad_to=bucket(step))
            meta = pipe.build()

Replaying (``python -m dsv4_index replay steps.jsonl``, or :func:`replay_trace`)::

    result = replay_trace("steps.jsonl", device="cuda")
    print(result.report())

Trace format (one JSON object per line, UTF-8):

* line 1, ``{"type": "header", "version": 1, "dsv4_index": "0.2.0", "layout": {...}, "pipeline": {...}}``
  — the layout itself (groups, channels and scalars of :class:`~dsv4_index.geometry.DSV4Layout`, so
  the replay needs no config file) and the pipeline's arguments (``max_num_reqs``,
  ``max_num_batched_tokens``, ``num_speculative_tokens``, ``cp_world_size``, ``cp_rank``,
  ``cp_interleave``, ``checks``, ``max_staged_blocks``, ``backend``, ``device``, ``fused``);
* then one line per ``update()``: ``{"type": "step", "index": i, "pad_to": int or null, "step":
  StepBatch.to_json(), "req_ids": [...] or null}`` for an accepted step, or ``"type": "rejected"`` with
  ``"error"`` (the ``ValueError`` text) for a rejected one (``"step"`` is null when the id-keyed step
  could not even be converted). A :class:`~dsv4_index.step.StepInput` is recorded as the array-form
  step the pipeline's own converter made of it (``req_ids``: the request id of each row).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Union

import torch

from ..batch import StepBatch, batch_from_step
from ..geometry import ChannelSpec, DSV4Layout, GroupSpec
from ..step import StepInput

__all__ = ["TRACE_VERSION", "Recorder", "record_steps", "read_trace", "layout_to_json", "layout_from_json",
           "replay_trace", "ReplayResult", "Problem"]

TRACE_VERSION = 1
_META_FIELDS = ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token")
_CHANNEL_FIELDS = ("slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices",
                   "lens", "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")


# ----------------------------------------------------------------------------------------------
# layout and pipeline <-> JSON
# ----------------------------------------------------------------------------------------------
def layout_to_json(layout: DSV4Layout) -> dict:
    """Plain-JSON form of a layout (every group and channel field); inverse of :func:`layout_from_json`."""
    d = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    d["groups"] = [dataclasses.asdict(g) for g in layout.groups]
    d["channels"] = [dict(dataclasses.asdict(c), outputs=sorted(c.outputs)) for c in layout.channels.values()]
    d["compress_ratios"] = list(layout.compress_ratios)
    return d


def layout_from_json(d: dict) -> DSV4Layout:
    d = dict(d)
    groups = tuple(GroupSpec(**g) for g in d.pop("groups"))
    channels = {c["name"]: ChannelSpec(**dict(c, outputs=frozenset(c["outputs"]))) for c in d.pop("channels")}
    return DSV4Layout(groups=groups, channels=channels, **dict(d, compress_ratios=tuple(d["compress_ratios"])))


def pipeline_args(pipe) -> dict:
    """The constructor arguments of ``pipe`` that a replay needs (JSON types)."""
    world, rank, inter = pipe.cp
    return dict(max_num_reqs=pipe.max_num_reqs, max_num_batched_tokens=pipe.max_num_tokens,
                num_speculative_tokens=pipe.num_speculative_tokens, cp_world_size=world, cp_rank=rank,
                cp_interleave=inter, checks=pipe.checks, max_staged_blocks=pipe.max_staged_blocks,
                backend=pipe.ctx.backend, device=str(pipe.device), fused=getattr(pipe, "_fused", None) is not None)


# ----------------------------------------------------------------------------------------------
# recording
# ----------------------------------------------------------------------------------------------
class Recorder:
    """Writes a trace: the header at construction, then one line per :meth:`record` /
    :meth:`record_rejected` call, flushed at once (a crash leaves every step before it readable).

    Parameters
    ----------
    path : str or Path — the JSONL file (created or truncated).
    pipe : MetadataPipeline — whose layout and arguments go into the header.
    """

    def __init__(self, path: Union[str, Path], pipe):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self.num_steps = self.num_rejected = 0
        from .. import __version__
        self._write(dict(type="header", version=TRACE_VERSION, dsv4_index=__version__,
                         layout=layout_to_json(pipe.layout), pipeline=pipeline_args(pipe)))

    def _write(self, d: dict) -> None:
        self._f.write(json.dumps(d, separators=(",", ":")) + "\n")
        self._f.flush()

    def record(self, batch: StepBatch, pad_to: Optional[int], req_ids: Optional[List[str]] = None) -> None:
        """One accepted step (after ``update()`` returned)."""
        self._write(dict(type="step", index=self.num_steps + self.num_rejected, pad_to=pad_to,
                         step=batch.to_json(), req_ids=req_ids))
        self.num_steps += 1

    def record_rejected(self, batch: Optional[StepBatch], pad_to: Optional[int], error: BaseException,
                        req_ids: Optional[List[str]] = None) -> None:
        """One rejected step (``update()`` raised ``error``; ``batch`` None if it could not be converted)."""
        self._write(dict(type="rejected", index=self.num_steps + self.num_rejected, pad_to=pad_to,
                         step=None if batch is None else batch.to_json(), req_ids=req_ids,
                         error=f"{type(error).__name__}: {error}"))
        self.num_rejected += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def record_steps(pipe, path: Union[str, Path]) -> Iterator[Recorder]:
    """Record every ``pipe.update(step, pad_to=...)`` inside the block into ``path`` (see the module
    docstring for the format). A :class:`StepInput` is converted with the pipeline's own converter
    (on its current slot map, exactly as ``update()`` converts it) and recorded once ``update()``
    accepted it; a rejected step is recorded with its error, and the ``ValueError`` still propagates.
    """
    rec = Recorder(path, pipe)
    inner = pipe.update

    def update(step, *, pad_to=None):
        batch, ids = step if isinstance(step, StepBatch) else None, None
        if isinstance(step, StepInput):
            try:
                batch, delta = batch_from_step(step, pipe.slot_map, len(pipe.layout.groups))
                ids = list(delta.order)
            except ValueError:
                pass  # NOTE: update() raises the same error below; recorded without a batch
        try:
            inner(step, pad_to=pad_to)
        except ValueError as e:
            rec.record_rejected(batch, pad_to, e, ids)
            raise
        if batch is not None:
            rec.record(batch, pad_to, ids)

    pipe.update = update
    try:
        yield rec
    finally:
        if pipe.__dict__.get("update") is update:
            del pipe.update
        rec.close()


def read_trace(path: Union[str, Path]):
    """(header dict, list of step dicts) of a trace; ValueError naming the line on a bad one."""
    header, steps = None, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            kind = d.get("type") if isinstance(d, dict) else None
            if n == 1:
                if kind != "header":
                    raise ValueError(f"{path}:1: the first line must be the header (type 'header'), got {kind!r}")
                if d.get("version") != TRACE_VERSION:
                    raise ValueError(f"{path}:1: trace version {d.get('version')!r}, this library reads {TRACE_VERSION}")
                header = d
            elif kind in ("step", "rejected"):
                steps.append(dict(d, line=n))
            else:
                raise ValueError(f"{path}:{n}: unknown line type {kind!r} (expected 'step' or 'rejected')")
    if header is None:
        raise ValueError(f"{path}: empty trace (no header line)")
    return header, steps


# ----------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """The first thing that went wrong in a replay."""

    step: int                      # index of the step in the trace (0-based)
    line: int                      # its line in the file
    kind: str                      # "rejected" | "accepted" | "invariant" | "divergence"
    message: str
    channel: Optional[str] = None
    field: Optional[str] = None
    token: Optional[int] = None
    req_id: Optional[object] = None
    expected: object = None
    found: object = None

    def __str__(self) -> str:
        head = {"rejected": "REJECTED (the recording accepted it)",
                "accepted": "ACCEPTED (the recording rejected it)",
                "invariant": "INVARIANT BROKEN", "divergence": "DIVERGES FROM THE REFERENCE"}[self.kind]
        lines = [f"step {self.step} (line {self.line}): {head}", f"  {self.message}"]
        where = [f"{k} {v!r}" for k, v in (("channel", self.channel), ("field", self.field), ("token", self.token),
                                            ("request", self.req_id)) if v is not None]
        if where:
            lines.append("  at " + ", ".join(where))
        if self.expected is not None or self.found is not None:
            lines += [f"  expected {_short(self.expected)}", f"  found    {_short(self.found)}"]
        return "\n".join(lines)


@dataclass
class ReplayResult:
    """What :func:`replay_trace` saw: ``problem`` is None when every step replayed clean."""

    path: str
    num_steps: int
    device: str
    backend: str
    problem: Optional[Problem] = None
    stats: Dict[str, int] = field(default_factory=dict)
    values: Dict[str, int] = field(default_factory=dict)   # channel -> values compared

    @property
    def ok(self) -> bool:
        return self.problem is None

    def report(self) -> str:
        if self.problem is not None:
            return str(self.problem)
        rows = [("steps", self.num_steps), *self.stats.items()]
        rows += [(f"values compared: {ch}", n) for ch, n in self.values.items()]
        w = max(len(k) for k, _ in rows)
        lines = [f"replay of {self.path}: OK (checked pipeline on {self.device}, backend {self.backend}, "
                 f"vs the PyTorch reference)", "-" * (w + 14)]
        lines += [f"{k:<{w}}  {v:>10}" for k, v in rows]
        return "\n".join(lines + ["-" * (w + 14)])


def _short(v, n: int = 24) -> str:
    if isinstance(v, list) and len(v) > n:
        return str(v[:n - 4])[:-1] + ", ..., " + str(v[-3:])[1:] + f"  ({len(v)} entries)"
    return str(v)


def _progress(items, total: int, enabled: bool):
    """tqdm when installed, else a plain bar on stderr (both only when ``enabled``)."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
        yield from tqdm(items, total=total, desc="replay", unit="step", file=sys.stderr)
        return
    except ImportError:
        pass
    for i, x in enumerate(items):
        if (100 * (i + 1)) // max(total, 1) != (100 * i) // max(total, 1):    # NOTE: redraw once per percent
            pct = (100 * (i + 1)) // max(total, 1)
            print(f"\rreplay [{'#' * (pct // 4):<25}] {i + 1}/{total}", end="", file=sys.stderr, flush=True)
        yield x
    print(file=sys.stderr)


def _rebuild_layout(recorded: DSV4Layout, config) -> DSV4Layout:
    """``config`` with the recorded geometry arguments (block sizes, rings, circular groups, DCP)."""
    g = {x.name: x for x in recorded.groups}
    circ = {n: x.block_size for n, x in g.items() if x.kind == "circular"}
    sizes = {f"{n}_block_size": x.alloc_block_size for n, x in g.items() if n not in circ}
    kbs = {n: x.block_size for n, x in g.items() if x.blocks_per_kv_block > 1}
    sliding = [x for x in recorded.groups if x.kind == "sliding"]
    return DSV4Layout.from_config(
        config, recorded.max_model_len, **sizes, kernel_block_size=kbs or None, circular=circ or None,
        sliding_tables="ring" if not sliding or any(x.ring for x in sliding) else "full",
        indexer_causal_indices=recorded.indexer_causal_indices, cp_world_size=recorded.cp_world_size,
        cp_interleave=recorded.cp_interleave, compact_compressed=any(c.compact for c in recorded.channels.values()))


def replay_trace(path: Union[str, Path], *, config=None, device=None, backend: Optional[str] = None,
                 topk_seed: int = 0, progress: bool = False, log=None) -> ReplayResult:
    """Feed a trace through a fresh ``MetadataPipeline(validate=True)`` (the checker after every
    build) and a reference-backend pipeline on the CPU; stop at the first rejection that differs
    from the recording, broken invariant or difference between the two.

    Parameters
    ----------
    path : the JSONL trace (:func:`record_steps`).
    config : optional config (name, path, dict, config object) replacing the recorded layout; the
        recorded geometry arguments (block sizes, rings, DCP) are kept.
    device : device of the checked pipeline (default: CUDA when available, else CPU).
    backend : functional-op backend of the checked pipeline (default: Triton on CUDA or under
        ``TRITON_INTERPRET=1``, the reference otherwise).
    topk_seed : seed of the random top-k picks converted and compared at every step.
    progress : show a progress bar (tqdm when installed).
    log : callable for notes (default: print to stderr).

    Returns
    -------
    ReplayResult
    """
    from .._common import use_triton
    from ..pipeline import MetadataPipeline
    from ..validate import MetadataError, check_topk

    log = log or (lambda s: print(s, file=sys.stderr))
    header, steps = read_trace(path)
    layout = layout_from_json(header["layout"])
    if config is not None:
        new = _rebuild_layout(layout, config)
        if new != layout:
            log(f"note: the layout of config {config!r} differs from the recorded one; replaying with it")
        layout = new
    p = dict(header["pipeline"])
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    common = dict(num_speculative_tokens=p["num_speculative_tokens"], cp_world_size=p["cp_world_size"],
                  cp_rank=p["cp_rank"], cp_interleave=p["cp_interleave"], max_staged_blocks=p["max_staged_blocks"])
    args = (layout, p["max_num_reqs"], p["max_num_batched_tokens"])
    checked = MetadataPipeline(*args, device, validate=True, backend=backend, **common)
    ref = MetadataPipeline(*args, "cpu", checks="full", backend="reference", **common)
    name = "triton" if use_triton(device, backend) else "reference"
    res = ReplayResult(str(path), len(steps), str(device), name)
    st = res.stats = dict.fromkeys(("accepted steps", "rejected steps (as recorded)", "live tokens", "padded tokens",
                                    "max batch rows", "top-k conversions"), 0)
    gen = torch.Generator().manual_seed(topk_seed)
    for i, d in _progress(enumerate(steps), len(steps), progress):
        line = d["line"]
        if d["step"] is None:   # rejected before conversion: nothing to feed
            st["rejected steps (as recorded)"] += 1
            continue
        batch, pad = StepBatch.from_json(d["step"]), d.get("pad_to")
        ids = d.get("req_ids")
        slot_id = {} if ids is None else dict(zip(batch.req_slots.tolist(), ids))
        errors = [_update(pipe, batch, pad) for pipe in (checked, ref)]
        if d["type"] == "rejected":
            if errors[0] is None or errors[1] is None:
                res.problem = Problem(i, line, "accepted", f"the recording rejected it with {d['error']}; "
                                      f"the replay {'checked' if errors[0] is None else 'reference'} pipeline "
                                      "accepted it")
                return res
            st["rejected steps (as recorded)"] += 1
            continue
        if errors[0] is not None or errors[1] is not None:
            e = errors[0] if errors[0] is not None else errors[1]
            res.problem = Problem(i, line, "rejected", f"{type(e).__name__}: {e}")
            return res
        try:
            meta = checked.build()
        except MetadataError as e:
            res.problem = Problem(i, line, "invariant", str(e), channel=e.channel, token=e.token,
                                  req_id=_req(slot_id, e.req_id), expected=e.expected, found=e.found)
            return res
        mref = ref.build()
        prob = _compare(meta, mref, slot_id, res.values)
        if prob is None and meta.channels:
            prob = _compare_topk(meta, mref, gen, slot_id, check_topk, st)
        if prob is not None:
            prob.step, prob.line = i, line
            res.problem = prob
            return res
        st["accepted steps"] += 1
        st["live tokens"] += meta.num_tokens
        st["padded tokens"] += meta.num_tokens_padded
        st["max batch rows"] = max(st["max batch rows"], meta.num_reqs)
    return res


def _update(pipe, batch, pad) -> Optional[ValueError]:
    try:
        pipe.update(batch, pad_to=pad)
    except ValueError as e:
        return e
    return None


def _req(slot_id: dict, rid):
    return slot_id.get(rid, rid) if isinstance(rid, int) else rid


def _where(meta, t: Optional[int], slot_id: dict):
    if t is None or t >= meta.num_tokens:
        return None
    b = int(meta.token_to_req[t])
    slot = int(meta.req_slots[b])
    return slot_id.get(slot, f"slot {slot}")


def _diff(meta, slot_id, channel, name, a: torch.Tensor, b: torch.Tensor) -> Optional[Problem]:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        return Problem(-1, -1, "divergence", f"{name} shapes differ", channel=channel, field=name,
                       expected=tuple(b.shape), found=tuple(a.shape))
    if a.numel() == 0 or torch.equal(a, b):
        return None
    bad = (a != b).reshape(a.shape[0], -1).any(1) if a.dim() else (a != b).reshape(1)
    t = int(torch.nonzero(bad)[0])
    per_token = name not in ("cu", "compact_cu", "compact_slot_mapping", "query_start_loc", "seq_lens",
                             "idx_mapping", "decode_lens", "decode_lens_clamped") and not name.startswith("block_table")
    label = "token" if per_token else "row"
    return Problem(-1, -1, "divergence", f"{name}[{t}] ({label} {t}) differs between the checked pipeline and "
                   "the reference", channel=channel, field=name, token=t if per_token else None,
                   req_id=_where(meta, t, slot_id) if per_token else None,
                   expected=b[t].tolist(), found=a[t].tolist())


def _compare(meta, mref, slot_id, values: Dict[str, int]) -> Optional[Problem]:
    for name in _META_FIELDS:
        prob = _diff(meta, slot_id, None, name, getattr(meta, name), getattr(mref, name))
        if prob:
            return prob
    for g, (a, b) in enumerate(zip(meta.block_tables, mref.block_tables)):
        prob = _diff(meta, slot_id, None, f"block_tables[{g}]", a, b)
        if prob:
            return prob
    for ch, c in meta.channels.items():
        r = mref.channels[ch]
        for f in _CHANNEL_FIELDS:
            a, b = getattr(c, f), getattr(r, f)
            if (a is None) != (b is None):
                return Problem(-1, -1, "divergence", f"{f} present in one pipeline only", channel=ch, field=f)
            if a is None:
                continue
            prob = _diff(meta, slot_id, ch, f, a, b)
            if prob:
                return prob
            values[ch] = values.get(ch, 0) + a.numel()
    return None


def _compare_topk(meta, mref, gen, slot_id, check_topk, stats) -> Optional[Problem]:
    from ..channels.base import ChannelBuilder
    from ..validate import MetadataError
    K = max(1, int(meta.layout.index_topk or 1))
    for ch in meta.channels:
        if type(meta.builders[ch]).topk_to_slots is ChannelBuilder.topk_to_slots:
            continue  # NOTE: the channel converts no top-k
        hi = max(2, int(meta.host_seq_lens.max()) // meta[ch].compress_ratio + 2) if meta.num_reqs else 2
        topk = torch.randint(-2, hi, (meta.num_tokens_padded, K), generator=gen, dtype=torch.int32)
        a = meta.topk_to_slots(ch, topk.to(meta.query_start_loc.device))
        b = mref.topk_to_slots(ch, topk)
        for f, x, y in (("topk_to_slots slots", a[0], b[0]), ("topk_to_slots lens", a[1], b[1])):
            prob = _diff(meta, slot_id, ch, f, x, y)
            if prob:
                return prob
        try:
            check_topk(meta, ch, topk, *a)
        except MetadataError as e:
            return Problem(-1, -1, "invariant", str(e), channel=ch, field="topk_to_slots", token=e.token,
                           req_id=_req(slot_id, e.req_id), expected=e.expected, found=e.found)
        stats["top-k conversions"] += 1
    return None
