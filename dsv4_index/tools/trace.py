"""Record the steps a pipeline accepts (and rejects) as a JSONL trace; the replay is
:mod:`dsv4_index.tools.replay`.

Recording::

    with record_steps(pipe, "steps.jsonl"):        # wraps pipe.update for the block
        for step in scheduler:
            pipe.update(step, pad_to=bucket(step))
            meta = pipe.build()

Replaying (``python -m dsv4_index replay steps.jsonl``, or :func:`dsv4_index.tools.replay.replay_trace`)::

    result = replay_trace("steps.jsonl", device="cuda")
    print(result.report())

Trace format (one JSON object per line, UTF-8), version 3:

* line 1, ``{"type": "header", "version": 3, "dsv4_index": "0.2.0", "outputs": "rowmix64" or null,
  "layout": {...}, "pipeline": {...}}``
  — the layout itself (groups, channels and scalars of :class:`~dsv4_index.geometry.DSV4Layout`, so
  the replay needs no config file) and the pipeline's arguments (``max_num_reqs``,
  ``max_num_batched_tokens``, ``num_speculative_tokens``, ``cp_world_size``, ``cp_rank``,
  ``cp_interleave``, ``checks``, ``max_staged_blocks``, ``backend``, ``device``, ``fused``,
  ``query_batches``: absent from traces written before that argument, whose pipelines all accepted declared steps,
  so a replay reads absent as true);
* then one line per ``update()``: ``{"type": "step", "index": i, "pad_to": int or null, "step":
  StepBatch.to_json(), "req_ids": [...] or null}`` for an accepted step, or ``"type": "rejected"`` with
  ``"error"`` (the ``ValueError`` text) for a rejected one (``"step"`` is null unless the refused step
  was a StepBatch). An accepted step is what the pipeline accepted (``pipe.last_batch``): a StepInput
  or SchedulerOutput as the array-form step the pipeline converted it to (``req_ids``: the request id
  of each row);
* after an accepted step, once its ``build()`` returned: ``{"type": "outputs", "index": i, "digests":
  {...}}``, the digest of every output the step built (:mod:`dsv4_index.tools.digest`: per channel
  and field over the valid rows, and the block-table rows the step read). A replay recomputes them
  and names the first step, channel, field and row that differ from the recording;
* last, written when the recording closes: ``{"type": "end", "steps": n, "rejected": r, "outputs": o}``,
  the counts of the lines before it (and ``"error"``, the exception that ended the ``record_steps`` block,
  if one did). A version-3 trace without it was cut (or its recording never
  closed): the replay says so and exits non-zero.

Version 1 traces (no ``outputs`` lines) and version 2 (no ``end`` line) still replay. Every file a
replay cannot use raises :class:`~dsv4_index.tools.trace_schema.TraceError` (a ``ValueError``) naming
the file, the line and the field; sizes, nesting depth and capacities are bounded before parsing or
allocating (:data:`~dsv4_index.tools.trace_schema.LIMITS`), and every ``outputs`` entry by what the
header's pipeline can produce before it is decompressed (:func:`~dsv4_index.tools.trace_schema.entry_bounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Iterator, List, Optional, Union

from .._common import check_int
from .._json import BadJSON, decode_utf8, loads_bounded
from ..batch import StepBatch
from ..geometry import ChannelSpec, DSV4Layout, GroupSpec
from .digest import DIGEST, output_digests
from .trace_outputs import check_end, check_outputs, entry_bounds
from .trace_schema import TraceError, check_header, check_line

__all__ = ["TRACE_VERSION", "READS_VERSIONS", "Recorder", "record_steps", "read_trace", "layout_to_json",
           "layout_from_json", "TraceError"]

TRACE_VERSION = 3
READS_VERSIONS = (1, 2, 3)
MAX_LINE_BYTES = 1 << 28


# ----------------------------------------------------------------------------------------------
# layout and pipeline <-> JSON
# ----------------------------------------------------------------------------------------------
def layout_to_json(layout: DSV4Layout) -> dict:
    """Plain-JSON form of a layout (every group and channel field); inverse of :func:`layout_from_json`."""
    d = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    # NOTE: `capacity` only for circular rings of several blocks: other layouts keep their JSON
    d["groups"] = [{k: v for k, v in dataclasses.asdict(g).items() if k != "capacity" or v is not None}
                   for g in layout.groups]
    d["channels"] = [dict(dataclasses.asdict(c), outputs=sorted(c.outputs)) for c in layout.channels.values()]
    d["compress_ratios"] = list(layout.compress_ratios)
    d["kv_sources"] = list(layout.kv_sources)
    return d


def layout_from_json(d: dict) -> DSV4Layout:
    d = dict(d)
    groups = tuple(GroupSpec(**g) for g in d.pop("groups"))
    channels = {c["name"]: ChannelSpec(**dict(c, outputs=frozenset(c["outputs"]))) for c in d.pop("channels")}
    return DSV4Layout(groups=groups, channels=channels, **dict(d, compress_ratios=tuple(d["compress_ratios"]),
                                                               kv_sources=tuple(d.get("kv_sources", ()))))


def pipeline_args(pipe) -> dict:
    """The constructor arguments of ``pipe`` that a replay needs (JSON types)."""
    world, rank, inter = pipe.cp
    return dict(max_num_reqs=pipe.max_num_reqs, max_num_batched_tokens=pipe.max_num_tokens,
                num_speculative_tokens=pipe.num_speculative_tokens, cp_world_size=world, cp_rank=rank,
                cp_interleave=inter, checks=pipe.checks, max_staged_blocks=pipe.max_staged_blocks,
                backend=pipe.ctx.backend, device=str(pipe.device), fused=getattr(pipe, "_fused", None) is not None,
                query_batches=bool(getattr(pipe, "query_batches", False)))


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
        _check_recording_args(pipe, path, outputs, values_limit)   # NOTE: before the file is created
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self.num_steps = self.num_rejected = self.num_outputs = 0
        self.values_limit = values_limit
        self._pipe, self._hook = pipe, None
        self._pending: Optional[int] = None
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
        self.num_outputs += 1

    def close(self, error: Optional[BaseException] = None) -> None:
        """Unhook ``build`` and write the end line (with ``error``: what ended the recording early)."""
        if self._hook is not None:
            prior, build = self._hook
            if self._pipe.__dict__.get("build") is build:
                if prior is None:
                    del self._pipe.build
                else:
                    self._pipe.build = prior
            self._hook = None
        if not self._f.closed:   # NOTE: the end line: a trace without it was cut or never closed
            end = dict(type="end", steps=self.num_steps, rejected=self.num_rejected, outputs=self.num_outputs)
            if error is not None:
                end["error"] = f"{type(error).__name__}: {error}"
            self._write(end)
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_recording_args(pipe, path, outputs, values_limit) -> None:
    """``Recorder`` / ``record_steps`` arguments: TypeError / ValueError naming the argument."""
    from ..pipeline import MetadataPipeline

    if not isinstance(pipe, MetadataPipeline):
        raise TypeError(f"pipe must be a MetadataPipeline, got {type(pipe).__name__}")
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or pathlib.Path, got {type(path).__name__}")
    if not isinstance(outputs, bool):
        raise TypeError(f"outputs must be a bool, got {outputs!r}")
    if not isinstance(values_limit, int) or isinstance(values_limit, bool):
        raise TypeError(f"values_limit must be an int >= 0, got {values_limit!r}")
    check_int("values_limit", values_limit, lo=0)


@contextlib.contextmanager
def record_steps(pipe, path: Union[str, Path], *, outputs: bool = True, values_limit: int = 4096) -> Iterator[Recorder]:
    """Record every ``pipe.update(step, pad_to=...)`` inside the block into ``path`` and, with
    ``outputs``, the digests of what the following ``build()`` made (see the module docstring and
    :class:`Recorder`). What is recorded is what the pipeline accepted (``pipe.last_batch``: the
    array-form step, its pad size and, for id-keyed inputs, the request id of each row), so a
    StepBatch, a StepInput and a SchedulerOutput of the same step record the same line. A rejected
    step is recorded with its error (its ``step`` only when it was a StepBatch: an id-keyed step the
    pipeline refused was never converted on the pipeline's behalf), and the ``ValueError`` still
    propagates. Closing the block writes the trace's ``end`` line (its counts).

    Blocks may nest (two traces of the same pipeline): a step inside both is recorded in both, and leaving
    the inner block hands ``pipe.update`` / ``pipe.build`` back to the outer block's recorder.
    """
    rec = Recorder(path, pipe, outputs=outputs, values_limit=values_limit)
    prior, inner = pipe.__dict__.get("update"), pipe.update   # NOTE: prior: an outer block's wrapper, or None

    def update(step, *, pad_to=None):
        try:
            inner(step, pad_to=pad_to)
        except ValueError as e:
            rec.record_rejected(step if isinstance(step, StepBatch) else None, pad_to, e)
            raise
        accepted = pipe.last_batch
        if accepted is not None:
            batch, pad, ids = accepted
            rec.record(batch, pad, None if ids is None else list(ids))

    pipe.update = update
    error = None
    try:
        yield rec
    except BaseException as e:   # NOTE: recorded in the end line, then re-raised
        error = e
        raise
    finally:
        if pipe.__dict__.get("update") is update:
            if prior is None:
                del pipe.update
            else:
                pipe.update = prior
        rec.close(error)


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
    """(version, layout, pipeline args, header dict, step dicts, end dict or None) of a checked trace.
    From version 3 on a trace ends with its ``end`` line; None when it is missing (a cut trace)."""
    version = layout = p = header = bounds = end = None
    steps: List[dict] = []
    num_outputs = 0
    for n, raw in _raw_lines(path):
        if not raw.strip():
            continue
        try:
            d = loads_bounded(decode_utf8(raw, str(path), n), str(path), first_line=n, raw=raw)
        except BadJSON as e:
            raise TraceError(path, e.line, e.key, e.msg) from None
        if header is None:
            if n != 1:
                raise TraceError(path, 1, None, "the first line must be the trace header, got an empty line")
            version, layout, p = check_header(path, d, READS_VERSIONS)
            bounds = entry_bounds(layout, p)
            header, prev = d, n
            continue
        if end is not None:
            raise TraceError(path, n, None, f"a line after the trace's end line (line {end['line']})")
        expected = len(steps)
        kind = d.get("type") if isinstance(d, dict) else None
        if kind == "outputs" and version >= 2:
            d = check_outputs(path, n, d, expected, bounds)
        elif kind == "end" and version >= 3:
            d = check_end(path, n, d)
        else:
            d = check_line(path, n, d, expected, version)
        if d["type"] == "end":
            end = _check_end(path, n, d, steps, num_outputs)
        elif d["type"] == "outputs":
            last = steps[-1] if steps else None
            if last is None or last["type"] != "step" or last.get("outputs") is not None or last["line"] != prev:
                raise TraceError(path, n, "type", "an 'outputs' line must follow the accepted step it belongs to")
            last["outputs"], last["outputs_line"] = d["digests"], n
            num_outputs += 1
        else:
            steps.append(dict(d, line=n, outputs=None))
        prev = n
    if header is None:
        raise TraceError(path, 0, None, "empty trace (no header line)")
    return version, layout, p, header, steps, end


def _check_end(path, n: int, d: dict, steps: List[dict], num_outputs: int) -> dict:
    """The ``end`` line's counts must be what the lines before it hold."""
    have = dict(steps=sum(s["type"] == "step" for s in steps), rejected=sum(s["type"] == "rejected" for s in steps),
                outputs=num_outputs)
    for k, v in have.items():
        if d[k] != v:
            raise TraceError(path, n, k, f"the end line counts {d[k]} {k} lines, the trace holds {v} (lines lost "
                             "or added after recording?)")
    return dict(d, line=n)


def read_trace(path: Union[str, Path]):
    """(header dict, list of step dicts) of a trace, every line checked; each step dict gains ``line``
    and ``outputs`` (its recorded digests, or None). Raises :class:`TraceError` (a ``ValueError``)
    naming the file, the line and the field on anything a replay cannot use."""
    _, _, _, header, steps, _ = _read(path)
    return header, steps

