"""Replay a step trace (:mod:`dsv4_index.tools.trace`) through a fresh checked pipeline and the PyTorch
reference, and compare every step's outputs with the digests the trace recorded; the first step that
goes wrong is reported (:class:`Problem`) with its channel, field, token or row and both values."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

from ..batch import StepBatch
from .digest import CHANNEL_FIELDS, COMMON_FIELDS, first_difference, output_digests
from .trace import _read
from .trace_schema import TraceError, rebuild_layout as _rebuild_layout

__all__ = ["replay_trace", "ReplayResult", "Problem"]


@dataclass
class Problem:
    """The first thing that went wrong in a replay."""

    step: int                      # index of the step in the trace (0-based)
    line: int                      # its line in the file
    kind: str                      # "rejected" | "accepted" | "invariant" | "divergence" | "recording" | "incomplete"
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
                "recording": "DIFFERS FROM THE RECORDING",
                "incomplete": "THE TRACE IS INCOMPLETE"}[self.kind]
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

    log = log or (lambda s: print(s, file=sys.stderr))
    version, layout, p, header, steps, end = _read(path)
    if config is not None:
        layout = _with_config(layout, config, log)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    checked, ref = _pipelines(path, layout, p, device, backend)
    name = "triton" if use_triton(device, backend) else "reference"
    res = ReplayResult(str(path), len(steps), str(device), name)
    res.recorded_on = f"{p['device']} ({p['backend'] or 'default backend'})"
    res.stats = dict.fromkeys(("accepted steps", "rejected steps (as recorded)", "steps matching the recording",
                               "live tokens", "padded tokens", "max batch rows", "top-k conversions"), 0)
    res.notes += _digest_notes(version, header, steps)
    gen = torch.Generator().manual_seed(topk_seed)
    for i, d in _progress(enumerate(steps), len(steps), progress):
        prob = _replay_step(path, i, d, checked, ref, gen, res)
        if prob is not None:
            res.problem = prob
            return res
    return _complete(res, version, end, steps)


def _with_config(layout, config, log):
    """The recorded layout rebuilt from ``config`` (a note when it differs)."""
    new = _rebuild_layout(layout, config)
    if new != layout:
        log(f"note: the layout of config {config!r} differs from the recorded one; replaying with it "
            "(the recorded outputs are compared all the same)")
    return new


def _pipelines(path, layout, p: dict, device: torch.device, backend: Optional[str]):
    """The checked pipeline (``validate=True``) and the CPU reference one, from the header's arguments."""
    from ..pipeline import MetadataPipeline

    common = dict(num_speculative_tokens=p["num_speculative_tokens"], cp_world_size=p["cp_world_size"],
                  cp_rank=p["cp_rank"], cp_interleave=p["cp_interleave"], max_staged_blocks=p["max_staged_blocks"],
                  query_batches=p["query_batches"])
    args = (layout, p["max_num_reqs"], p["max_num_batched_tokens"])
    try:
        # NOTE: the fused launch refuses circular rings of several blocks (channels/window.py)
        fused = all(g.ring_blocks == 1 for g in layout.groups)
        checked = MetadataPipeline(*args, device, validate=True, backend=backend, fused=fused, **common)
        ref = MetadataPipeline(*args, "cpu", checks="full", backend="reference", **common)
    except (ValueError, TypeError, OverflowError) as e:
        raise TraceError(path, 1, "pipeline", f"the recorded pipeline cannot be built: {e}") from None
    return checked, ref


def _replay_step(path, i: int, d: dict, checked, ref, gen, res: ReplayResult) -> Optional[Problem]:
    """Feed step ``i`` (trace line ``d``) to both pipelines, build and compare; the step's problem or None
    (``res.stats`` and ``res.values`` counted)."""
    from ..validate import MetadataError

    line, st = d["line"], res.stats
    if d["step"] is None:   # rejected before conversion: nothing to feed
        st["rejected steps (as recorded)"] += 1
        return None
    batch, pad = StepBatch.from_json(d["step"]), d.get("pad_to")
    ids = d.get("req_ids")
    slot_id = {} if ids is None else dict(zip(batch.req_slots.tolist(), ids, strict=True))
    errors = [_update(pipe, batch, pad) for pipe in (checked, ref)]
    if d["type"] == "rejected":
        if errors[0] is None or errors[1] is None:
            return Problem(i, line, "accepted", f"the recording rejected it with {d['error']}; "
                           f"the replay {'checked' if errors[0] is None else 'reference'} pipeline accepted it")
        st["rejected steps (as recorded)"] += 1
        return None
    err = errors[0] if errors[0] is not None else errors[1]
    if err is not None:
        return Problem(i, line, "rejected", f"{type(err).__name__}: {err}")
    try:
        meta = checked.build()
    except MetadataError as e:
        return Problem(i, line, "invariant", str(e), channel=e.channel, token=e.token,
                       req_id=_req(slot_id, e.req_id), expected=e.expected, found=e.found)
    except ValueError as e:   # NOTE: the header's checks should leave none; name the line if one is left
        raise TraceError(path, line, None, f"build() of this step failed: {e}") from e
    prob = _compare_step(path, d, meta, checked, ref, gen, slot_id, res)
    if prob is not None:
        prob.step, prob.line = i, line
        return prob
    st["accepted steps"] += 1
    st["live tokens"] += meta.num_tokens
    st["padded tokens"] += meta.num_tokens_padded
    st["max batch rows"] = max(st["max batch rows"], meta.num_reqs)
    return None


def _compare_step(path, d, meta, checked, ref, gen, slot_id, res: ReplayResult) -> Optional[Problem]:
    """The built step against the reference pipeline's, its top-k conversions, then the recorded digests."""
    from ..validate import check_topk

    mref = ref.build()
    prob = _compare(meta, mref, slot_id, res.values)
    if prob is None and meta.channels:
        prob = _compare_topk(meta, mref, gen, slot_id, check_topk, res.stats)
    if prob is None and d["outputs"] is not None:
        prob = _compare_recording(path, d, meta, checked, slot_id)
        res.stats["steps matching the recording"] += prob is None
    return prob


def _digest_notes(version: int, header: dict, steps) -> List[str]:
    """What the replay cannot compare with recorded outputs."""
    n_out = sum(d["outputs"] is not None for d in steps)
    n_acc = sum(d["type"] == "step" for d in steps)
    if n_out == 0:
        why = ("a version-1 trace" if version == 1 else "recorded with outputs=False" if header.get("outputs") is None
               else "no step was built")
        return [f"no digests recorded ({why}): outputs compared with the reference only"]
    if n_out < n_acc:
        return [f"{n_acc - n_out} accepted step(s) have no recorded outputs (never built, or the recording "
                "stopped first): those are compared with the reference only"]
    return []


def _complete(res: ReplayResult, version: int, end, steps) -> ReplayResult:
    """A clean replay of a trace without its end line is still a problem: the trace was cut."""
    if version < 3:
        res.notes.append(f"a version-{version} trace has no end line: a trace cut at a line boundary cannot be told "
                         "from a complete one")
    elif end is not None and end.get("error"):
        res.notes.append(f"the recording ended with an error (line {end['line']}): {end['error']}")
    elif end is None:
        last = steps[-1]["line"] if steps else 1
        res.problem = Problem(len(steps), last, "incomplete", f"the trace ends after line {last} without its end line "
                              f"(cut, or its recording never closed): the {len(steps)} step(s) it holds replayed clean")
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
    for name in COMMON_FIELDS:
        prob = _diff(meta, slot_id, None, name, getattr(meta, name), getattr(mref, name))
        if prob:
            return prob
    for g, (a, b) in enumerate(zip(meta.block_tables, mref.block_tables, strict=True)):
        prob = _diff(meta, slot_id, None, f"block_tables[{g}]", a, b)
        if prob:
            return prob
    for ch, c in meta.channels.items():
        r = mref.channels[ch]
        for f in CHANNEL_FIELDS:
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
