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

Trace format (one JSON object per line, UTF-8), version 2:

* line 1, ``{"type": "header", "version": 2, "dsv4_index": "0.2.0", "outputs": "rowmix64" or null,
  "layout": {...}, "pipeline": {...}}``
  — the layout itself (groups, channels and scalars of :class:`~dsv4_index.geometry.DSV4Layout`, so
  the replay needs no config file) and the pipeline's arguments (``max_num_reqs``,
  ``max_num_batched_tokens``, ``num_speculative_tokens``, ``cp_world_size``, ``cp_rank``,
  ``cp_interleave``, ``checks``, ``max_staged_blocks``, ``backend``, ``device``, ``fused``);
* then one line per ``update()``: ``{"type": "step", "index": i, "pad_to": int or null, "step":
  StepBatch.to_json(), "req_ids": [...] or null}`` for an accepted step, or ``"type": "rejected"`` with
  ``"error"`` (the ``ValueError`` text) for a rejected one (``"step"`` is null when the id-keyed step
  could not even be converted). A :class:`~dsv4_index.step.StepInput` is recorded as the array-form
  step the pipeline's own converter made of it (``req_ids``: the request id of each row);
* after an accepted step, once its ``build()`` returned: ``{"type": "outputs", "index": i, "digests":
  {...}}``, the digest of every output the step built (:mod:`dsv4_index.tools.digest`: per channel
  and field over the valid rows, and the block-table rows the step read). A replay recomputes them
  and names the first step, channel, field and row that differ from the recording.

Version 1 traces (no ``outputs`` lines) still replay, compared with the reference only. Every file a
replay cannot use raises :class:`~dsv4_index.tools.trace_schema.TraceError` (a ``ValueError``) naming
the file, the line and the field; sizes, nesting depth and capacities are bounded before parsing or
allocating (:data:`~dsv4_index.tools.trace_schema.LIMITS`).
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

from .._json import BadJSON, decode_utf8, loads_bounded
from ..batch import StepBatch, batch_from_step
from ..geometry import ChannelSpec, DSV4Layout, GroupSpec
from ..step import StepInput
from .digest import DIGEST, first_difference, output_digests
from .trace_schema import TraceError, check_header, check_line, rebuild_layout as _rebuild_layout

__all__ = ["TRACE_VERSION", "READS_VERSIONS", "Recorder", "record_steps", "read_trace", "layout_to_json",
           "layout_from_json", "replay_trace", "ReplayResult", "Problem", "TraceError"]

TRACE_VERSION = 2
READS_VERSIONS = (1, 2)
MAX_LINE_BYTES = 1 << 28
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
    :meth:`record_rejected` call and, with ``outputs``, one ``outputs`` line after the first
    ``build()`` of each accepted step, each flushed at once (a crash leaves every line before it
    readable: a step whose build crashed is there, without outputs).

    Parameters
    ----------
    path : str or Path — the JSONL file (created or truncated).
    pipe : MetadataPipeline — whose layout and arguments go into the header.
    outputs : bool — record the digests of every step's outputs (wraps ``pipe.build`` on the instance
        until :meth:`close`); each costs one host copy per output field (see RELIABILITY.md).
    values_limit : int — fields with at most this many valid entries are recorded as values (the
        replay then prints the recorded values), larger ones as row hashes only.
    """

    def __init__(self, path: Union[str, Path], pipe, *, outputs: bool = True, values_limit: int = 4096):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self.num_steps = self.num_rejected = 0
        self.values_limit = int(values_limit)
        self._pipe, self._pending, self._hook = pipe, None, None
        from .. import __version__
        self._write(dict(type="header", version=TRACE_VERSION, dsv4_index=__version__,
                         outputs=DIGEST if outputs else None, layout=layout_to_json(pipe.layout),
                         pipeline=pipeline_args(pipe)))
        if outputs:
            prior, inner = pipe.__dict__.get("build"), pipe.build

            def build():
                meta = inner()
                self.record_outputs(meta)
                return meta

            pipe.build = build
            self._hook = (prior, build)

    def _write(self, d: dict) -> None:
        self._f.write(json.dumps(d, separators=(",", ":")) + "\n")
        self._f.flush()

    def record(self, batch: StepBatch, pad_to: Optional[int], req_ids: Optional[List[str]] = None) -> None:
        """One accepted step (after ``update()`` returned)."""
        self._pending = self.num_steps + self.num_rejected
        self._write(dict(type="step", index=self._pending, pad_to=pad_to, step=batch.to_json(), req_ids=req_ids))
        self.num_steps += 1

    def record_rejected(self, batch: Optional[StepBatch], pad_to: Optional[int], error: BaseException,
                        req_ids: Optional[List[str]] = None) -> None:
        """One rejected step (``update()`` raised ``error``; ``batch`` None if it could not be converted)."""
        self._write(dict(type="rejected", index=self.num_steps + self.num_rejected, pad_to=pad_to,
                         step=None if batch is None else batch.to_json(), req_ids=req_ids,
                         error=f"{type(error).__name__}: {error}"))
        self.num_rejected += 1

    def record_outputs(self, meta) -> None:
        """The digests of ``meta``, the first build of the last recorded step (later builds of the
        same step, and builds of unrecorded steps such as warm-up, write nothing)."""
        if self._pending is None or self._f.closed:
            return
        index, self._pending = self._pending, None
        self._write(dict(type="outputs", index=index,
                         digests=output_digests(meta, self._pipe, values_limit=self.values_limit)))

    def close(self) -> None:
        if self._hook is not None:
            prior, build = self._hook
            if self._pipe.__dict__.get("build") is build:
                if prior is None:
                    del self._pipe.build
                else:
                    self._pipe.build = prior
            self._hook = None
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def record_steps(pipe, path: Union[str, Path], *, outputs: bool = True, values_limit: int = 4096) -> Iterator[Recorder]:
    """Record every ``pipe.update(step, pad_to=...)`` inside the block into ``path`` and, with
    ``outputs``, the digests of what the following ``build()`` made (see the module docstring and
    :class:`Recorder`). A :class:`StepInput` is converted with the pipeline's own converter (on its
    current slot map, exactly as ``update()`` converts it) and recorded once ``update()`` accepted
    it; a rejected step is recorded with its error, and the ``ValueError`` still propagates.
    """
    rec = Recorder(path, pipe, outputs=outputs, values_limit=values_limit)
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


def _raw_lines(path):
    """``(line number, bytes)`` of a file, each line bounded by :data:`MAX_LINE_BYTES`."""
    p = Path(path)
    if not p.exists():
        raise TraceError(path, 0, None, "no such file")
    if p.is_dir():
        raise TraceError(path, 0, None, "is a directory, not a trace file")
    try:
        f = open(p, "rb")
    except OSError as e:
        raise TraceError(path, 0, None, f"cannot read: {e.strerror or e}") from None
    with f:
        n = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise TraceError(path, n + 1, None, f"cannot read: {e.strerror or e}") from None
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(path, n, None, f"line longer than {MAX_LINE_BYTES} bytes")
            yield n, raw


def _read(path):
    """(version, layout, pipeline args, header dict, step dicts) of a checked trace."""
    version = layout = p = header = None
    steps: List[dict] = []
    for n, raw in _raw_lines(path):
        if not raw.strip():
            continue
        try:
            d = loads_bounded(decode_utf8(raw, str(path), n), str(path), first_line=n, raw=raw)
        except BadJSON as e:
            raise TraceError(path, e.line, None, e.msg) from None
        if header is None:
            if n != 1:
                raise TraceError(path, 1, None, "the first line must be the trace header, got an empty line")
            version, layout, p = check_header(path, d, READS_VERSIONS)
            header, prev = d, n
            continue
        expected = len(steps)
        d = check_line(path, n, d, expected, version)
        if d["type"] == "outputs":
            last = steps[-1] if steps else None
            if last is None or last["type"] != "step" or last.get("outputs") is not None or last["line"] != prev:
                raise TraceError(path, n, "type", "an 'outputs' line must follow the accepted step it belongs to")
            last["outputs"], last["outputs_line"] = d["digests"], n
        else:
            steps.append(dict(d, line=n, outputs=None))
        prev = n
    if header is None:
        raise TraceError(path, 0, None, "empty trace (no header line)")
    return version, layout, p, header, steps


def read_trace(path: Union[str, Path]):
    """(header dict, list of step dicts) of a trace, every line checked; each step dict gains ``line``
    and ``outputs`` (its recorded digests, or None). Raises :class:`TraceError` (a ``ValueError``)
    naming the file, the line and the field on anything a replay cannot use."""
    _, _, _, header, steps = _read(path)
    return header, steps


# ----------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """The first thing that went wrong in a replay."""

    step: int                      # index of the step in the trace (0-based)
    line: int                      # its line in the file
    kind: str                      # "rejected" | "accepted" | "invariant" | "divergence" | "recording"
    message: str
    channel: Optional[str] = None
    field: Optional[str] = None
    token: Optional[int] = None
    req_id: Optional[object] = None
    expected: object = None        # the reference's value; for "recording": the recorded one
    found: object = None           # the checked pipeline's value (this replay)
    row: Optional[int] = None      # batch row, for per-request fields and block tables

    def __str__(self) -> str:
        head = {"rejected": "REJECTED (the recording accepted it)",
                "accepted": "ACCEPTED (the recording rejected it)",
                "invariant": "INVARIANT BROKEN", "divergence": "DIVERGES FROM THE REFERENCE",
                "recording": "DIFFERS FROM THE RECORDING"}[self.kind]
        lines = [f"step {self.step} (line {self.line}): {head}", f"  {self.message}"]
        where = [f"{k} {v!r}" for k, v in (("channel", self.channel), ("field", self.field), ("token", self.token),
                                            ("row", self.row), ("request", self.req_id)) if v is not None]
        if where:
            lines.append("  at " + ", ".join(where))
        if self.expected is not None or self.found is not None:
            a, b = ("recorded", "replayed") if self.kind == "recording" else ("expected", "found   ")
            lines += [f"  {a} {_short(self.expected)}", f"  {b} {_short(self.found)}"]
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
    recorded_on: str = "?"                                   # device (backend) of the recording
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def report(self) -> str:
        if self.problem is not None:
            return "\n".join([str(self.problem)] + [f"note: {n}" for n in self.notes])
        rows = [("steps", self.num_steps), *self.stats.items()]
        rows += [(f"values compared: {ch}", n) for ch, n in self.values.items()]
        w = max(len(k) for k, _ in rows)
        lines = [f"replay of {self.path}: OK (checked pipeline on {self.device}, backend {self.backend}, "
                 f"vs the PyTorch reference and the outputs recorded on {self.recorded_on})", "-" * (w + 14)]
        lines += [f"{k:<{w}}  {v:>10}" for k, v in rows]
        return "\n".join(lines + ["-" * (w + 14)] + [f"note: {n}" for n in self.notes])


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
    version, layout, p, header, steps = _read(path)
    if config is not None:
        new = _rebuild_layout(layout, config)
        if new != layout:
            log(f"note: the layout of config {config!r} differs from the recorded one; replaying with it "
                "(the recorded outputs are compared all the same)")
        layout = new
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    common = dict(num_speculative_tokens=p["num_speculative_tokens"], cp_world_size=p["cp_world_size"],
                  cp_rank=p["cp_rank"], cp_interleave=p["cp_interleave"], max_staged_blocks=p["max_staged_blocks"])
    args = (layout, p["max_num_reqs"], p["max_num_batched_tokens"])
    try:
        checked = MetadataPipeline(*args, device, validate=True, backend=backend, **common)
        ref = MetadataPipeline(*args, "cpu", checks="full", backend="reference", **common)
    except (ValueError, TypeError, OverflowError) as e:
        raise TraceError(path, 1, "pipeline", f"the recorded pipeline cannot be built: {e}") from None
    name = "triton" if use_triton(device, backend) else "reference"
    res = ReplayResult(str(path), len(steps), str(device), name)
    res.recorded_on = f"{p['device']} ({p['backend'] or 'default backend'})"
    st = res.stats = dict.fromkeys(("accepted steps", "rejected steps (as recorded)", "steps matching the recording",
                                    "live tokens", "padded tokens", "max batch rows", "top-k conversions"), 0)
    n_out = sum(d["outputs"] is not None for d in steps)
    n_acc = sum(d["type"] == "step" for d in steps)
    if n_out == 0:
        why = ("a version-1 trace" if version == 1 else "recorded with outputs=False" if header.get("outputs") is None
               else "no step was built")
        res.notes.append(f"no digests recorded ({why}): outputs compared with the reference only")
    elif n_out < n_acc:
        res.notes.append(f"{n_acc - n_out} accepted step(s) have no recorded outputs (never built, or the recording "
                         "stopped first): those are compared with the reference only")
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
        except ValueError as e:   # NOTE: the header's checks should leave none; name the line if one is left
            raise TraceError(path, line, None, f"build() of this step failed: {e}") from e
        mref = ref.build()
        prob = _compare(meta, mref, slot_id, res.values)
        if prob is None and meta.channels:
            prob = _compare_topk(meta, mref, gen, slot_id, check_topk, st)
        if prob is None and d["outputs"] is not None:
            prob = _compare_recording(path, d, meta, checked, slot_id)
            st["steps matching the recording"] += prob is None
        if prob is not None:
            prob.step, prob.line = i, line
            res.problem = prob
            return res
        st["accepted steps"] += 1
        st["live tokens"] += meta.num_tokens
        st["padded tokens"] += meta.num_tokens_padded
        st["max batch rows"] = max(st["max batch rows"], meta.num_reqs)
    return res


def _compare_recording(path, d, meta, pipe, slot_id) -> Optional[Problem]:
    """The first output of ``meta`` whose digest differs from the step's recorded one."""
    from .digest import PER_TOKEN
    mine: dict = {}
    replayed = output_digests(meta, pipe, values_limit=0, keep=mine)
    try:
        diff = first_difference(d["outputs"], replayed, mine)
    except ValueError as e:
        raise TraceError(path, d["outputs_line"], "digests", str(e)) from None
    if diff is None:
        return None
    ch, f, row = diff["channel"], diff["field"], diff["row"]
    per_token = f in PER_TOKEN and row is not None
    others = [x for x in diff["fields"][1:]]
    where = (f"{f}" if ch is None else f"{ch}.{f}") + ("" if row is None else f"[{row}]")
    if f.startswith("block_table["):
        where += " (values: [blocks the step reads, their ids...])"
    msg = (f"{where} differs from the outputs recorded at line {d['outputs_line']}"
           + (f"; {len(others)} more field(s) differ: {', '.join(others[:8])}{', ...' if len(others) > 8 else ''}"
              if others else ""))
    req = None
    if per_token:
        req = _where(meta, row, slot_id)
    elif row is not None and row < meta.num_reqs and f != "query_start_loc":
        slot = int(meta.req_slots[row])
        req = slot_id.get(slot, f"slot {slot}")
    return Problem(-1, -1, "recording", msg, channel=ch, field=f, token=row if per_token else None,
                   row=None if per_token else row, req_id=req, expected=diff["expected"], found=diff["found"])


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
