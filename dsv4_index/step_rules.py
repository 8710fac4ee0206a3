"""The rules of an id-keyed step, in one place: the converters of :mod:`dsv4_index.frontend` run
them, and ``StepInput.validate_static`` runs their stateless part (:func:`check_step`).

* request ids are ``str``, each listed once (new or running) and not also finished / preempted;
  the keys of ``num_scheduled_tokens`` are exactly the scheduled ids;
* every count (``num_computed_tokens``, ``num_scheduled_tokens``, ``replay_start``, ``replay_end``)
  and every block id is a Python ``int`` (not a ``bool``, ``float`` or numpy scalar) in
  ``[0, LIMIT = 2**31 - 1]``, checked before any sum or array conversion, so no wrap can pass; the
  pipeline then bounds them by ``max_model_len`` and its capacities;
* a request's block lists are a tuple (or list) with one list (or tuple) per gid; a running request's
  ``new_block_ids`` may be None (no new block; vLLM's form);
* (slot map, :func:`dsv4_index.frontend._convert`) a running request holds a slot, or is resumed
  after a preemption the map saw; a new request takes the lowest free slot; a finished or preempted
  id the map never saw is a no-op (vLLM reports requests aborted while waiting).

Errors are ``ValueError`` (:class:`~dsv4_index.step.StepTypeError`, also a ``TypeError``, for a wrong
type) naming the scheduler's field and the request id. :func:`explain` names the pipeline's
array-level errors (``write_ids[j]``, ``slot s``) the same way.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import countOf
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional

import numpy as np

from ._common import INT32_MAX
from .step import StepInput, StepTypeError

if TYPE_CHECKING:
    from .batch import StepBatch
    from .frontend import SlotMapDelta

__all__ = ["LIMIT", "check_step", "explain"]

LIMIT = INT32_MAX  # NOTE: every count and block id of an id-keyed step is in [0, LIMIT]
_INT = {int}
_LISTS = {list, tuple}
_ID_SETS = {set, frozenset, list, tuple}
NEW, RESUMED, APPENDS = 0, 1, 2  # row kinds


class _Src(NamedTuple):
    new: str   # where new requests are listed
    run: str   # where running requests are listed


STEP = _Src("new_requests", "running_requests")
SCHED = _Src("scheduled_new_reqs", "scheduled_cached_reqs")


def _bad_int(name: str, v) -> None:
    """Raise for a count or id ``v`` outside the rules (called only when one is bad)."""
    if type(v) is not int:
        raise StepTypeError(f"{name} must be an int >= 0, got {v!r} (a {type(v).__name__}; counts are Python ints)")
    if v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if v > LIMIT:
        raise ValueError(f"{name} must be an int >= 0 and <= {LIMIT} (int32), got {v!r}")


def _ok(v) -> bool:
    return type(v) is int and 0 <= v <= LIMIT


def _ints(vals: list, tail: Sequence[int] = ()) -> Optional[np.ndarray]:
    """Python ints in ``[0, LIMIT]`` -> a read-only int64 array; None when any is not (the caller
    names it). ``tail``: ints in ``[0, LIMIT]`` the caller made, appended unchecked (one conversion).

    NOTE: the types first (``np.array`` would truncate floats and take bools; ``struct`` takes bools
    and numpy integers), then an overflow-safe conversion (``struct.pack`` raises past int64; it is
    2x faster than ``np.array`` on a list of ints), then one unsigned max (negatives are huge as
    uint64).
    """
    if countOf(map(type, vals), int) != len(vals):
        return None
    try:
        a = np.frombuffer(struct.pack(f"{len(vals) + len(tail)}q", *vals, *tail), dtype=np.int64)
    except struct.error:
        return None
    if a.shape[0] and a.view(np.uint64).max() > LIMIT:
        return None
    return a


def _pack(a, b, c, d, t1: Sequence[int] = (), t2: Sequence[int] = (), t3: Sequence[int] = ()
          ) -> Optional[np.ndarray]:
    """:func:`_ints` of the concatenation of ``a`` .. ``d`` (sized iterables, checked) and ``t1`` ..
    ``t3`` (ints in ``[0, LIMIT]`` the caller made, unchecked), without building the concatenation."""
    if countOf(map(type, a), int) != len(a) or countOf(map(type, b), int) != len(b) \
            or countOf(map(type, c), int) != len(c) or countOf(map(type, d), int) != len(d):
        return None
    n = len(a) + len(b) + len(c) + len(d) + len(t1) + len(t2) + len(t3)
    try:
        out = np.frombuffer(struct.pack(f"{n}q", *a, *b, *c, *d, *t1, *t2, *t3), dtype=np.int64)
    except struct.error:
        return None
    if n and out.view(np.uint64).max() > LIMIT:
        return None
    return out


def _id_set(name: str, ids) -> Sequence[str]:
    if ids is None or (not ids and type(ids) in _ID_SETS):
        return ()
    if isinstance(ids, (str, bytes)):
        raise StepTypeError(f"{name} must be a set or list of request ids, got the bare string {ids!r}")
    if isinstance(ids, Mapping):
        raise StepTypeError(f"{name} must be a set or list of request ids, got {type(ids).__name__}")
    try:
        ids = list(ids)
    except TypeError:
        raise StepTypeError(f"{name} must be a set or list of request ids, got {type(ids).__name__}") from None
    for rid in ids:
        if not isinstance(rid, str):
            raise StepTypeError(f"{name} must hold str request ids, got {rid!r}")
    return ids


class _Row(NamedTuple):
    where: str
    field: str
    rid: str
    lists: Optional[tuple]
    nc: int
    kind: int


class _Checked(NamedTuple):
    rows: List[_Row]
    finished: Sequence[str]
    preempted: Sequence[str]
    num_groups: Optional[int]


def _rows(src: _Src, num_groups: Optional[int], new, running, nst, finished, preempted, replay_start,
          replay_end) -> _Checked:
    """Every rule that needs no slot map; raise naming the field and request.

    ``new``: [(rid, block_ids, nc)]; ``running``: [(rid, new_block_ids or None, nc, resumed)].
    """
    finished = _id_set("finished_req_ids", finished)
    preempted = _id_set("preempted_req_ids", preempted)
    if not isinstance(nst, Mapping):
        raise StepTypeError(f"num_scheduled_tokens must be a dict of request id -> int, got {type(nst).__name__}")
    gone = set(finished) | set(preempted)
    width = num_groups
    seen: Dict[str, int] = {}
    rows: List[_Row] = []
    all_ids: List[int] = []
    entries = chain(((src.new, "block_ids", rid, lists, nc, NEW) for rid, lists, nc in new),
                    ((src.run, "new_block_ids", rid, lists, nc, RESUMED if rs else APPENDS)
                     for rid, lists, nc, rs in running))
    for where, fld, rid, lists, nc, kind in entries:
        if not isinstance(rid, str):
            raise StepTypeError(f"{where}: request ids must be str, got {rid!r}")
        if rid in seen:
            raise ValueError(f"{where}: request {rid!r} is listed more than once "
                             f"(in {src.new} and/or {src.run})")
        seen[rid] = nc
        if rid in gone:
            raise ValueError(f"{where}: request {rid!r} is also in finished_req_ids / preempted_req_ids")
        if not _ok(nc):
            _bad_int(f"{where}: num_computed_tokens of {rid!r}", nc)
        if rid not in nst:
            raise ValueError(f"{where}: request {rid!r} has no entry in num_scheduled_tokens")
        if lists is not None or kind == NEW:
            if isinstance(lists, (str, bytes)) or not isinstance(lists, (tuple, list)):
                raise StepTypeError(f"{where}: {fld} of {rid!r} must be a tuple with one list per gid, "
                                    f"got {type(lists).__name__}")
            if width is None:
                width = len(lists)
            if len(lists) != width:
                raise ValueError(f"{where}: {fld} of {rid!r} has {len(lists)} per-gid block lists, expected "
                                 f"{width if num_groups is not None else f'{width} (as other requests)'}")
            for g, ids in enumerate(lists):
                if type(ids) not in _LISTS:
                    raise StepTypeError(f"{where}: {fld} of {rid!r} gid {g} must be a list of block ids, "
                                        f"got {type(ids).__name__}")
                all_ids.extend(ids)
        rows.append(_Row(where, fld, rid, None if lists is None else tuple(lists), nc, kind))
    if all_ids and _ints(all_ids) is None:
        for r in rows:
            for g, ids in enumerate(r.lists or ()):
                for k, b in enumerate(ids):
                    if not _ok(b):
                        msg = (f"{r.where}: {r.field} of {r.rid!r} gid {g} has a bad block id {b!r} at "
                               f"{r.field}[{g}][{k}] (block ids are Python ints in [0, {LIMIT}])")
                        raise (StepTypeError if type(b) is not int else ValueError)(msg)
    for rid, n in nst.items():
        if rid not in seen:
            raise ValueError(f"num_scheduled_tokens lists {rid!r}, which is in neither {src.new} nor {src.run}")
        if not _ok(n):
            _bad_int(f"num_scheduled_tokens[{rid!r}]", n)
    for name, mapping in (("replay_start", replay_start), ("replay_end", replay_end)):
        if not mapping:
            continue
        if not isinstance(mapping, Mapping):
            raise StepTypeError(f"{name} must be a dict of request id -> int, got {type(mapping).__name__}")
        for rid, v in mapping.items():
            if rid not in seen:
                raise ValueError(f"{name} lists {rid!r}, which is not scheduled in this step")
            if not _ok(v):
                _bad_int(f"{name}[{rid!r}]", v)
            if name == "replay_start" and nst[rid] > 0 and v > seen[rid]:
                raise ValueError(f"replay_start[{rid!r}] = {v} is outside [0, num_computed_tokens = {seen[rid]}]")
    return _Checked(rows, finished, preempted, width)


def check_step(step: StepInput, num_groups: Optional[int] = None) -> None:
    """The stateless rules of ``step`` (what ``StepInput.validate_static`` runs)."""
    if not isinstance(step, StepInput):
        raise StepTypeError(f"step must be a StepInput, got {type(step).__name__}")
    _rows(STEP, num_groups, _new_of(step), _running_of(step), step.num_scheduled_tokens, step.finished_req_ids,
          step.preempted_req_ids, step.replay_start, step.replay_end)


def _new_of(step: StepInput):
    return [(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests]


def _running_of(step: StepInput):
    return [(r.req_id, r.new_block_ids, r.num_computed_tokens, bool(r.resumed)) for r in step.running_requests]


# ----------------------------------------------------------------------------------------------
# the pipeline's array-level errors, in the scheduler's terms
# ----------------------------------------------------------------------------------------------
_POS = re.compile(r"write_ids\[(\d+)\]|write run (\d+)|\bslot (\d+)")


def explain(error: ValueError, batch: StepBatch, delta: SlotMapDelta, src: str = "step") -> ValueError:
    """``error`` (raised by the pipeline for a converted ``batch``) with its array positions named as
    the scheduler's requests and fields, appended so the message keeps its words:
    ``... write_ids[5] = 2147483647 in gid 0 ... [write_ids[5] = running_requests['a'].new_block_ids[0][0]]``,
    ``write run r = new_requests['a'].block_ids[g]``, ``slot s = request 'a'``.

    ``src``: ``"step"`` (a StepInput) or ``"scheduler_output"``. Returns a new exception of the same
    type (raise it ``from error``), or ``error`` itself when it names no position it can map.
    """
    order, slots = delta.order, np.asarray(batch.req_slots).tolist()
    if len(order) != len(slots):
        return error
    rid_of = dict(zip(slots, order))
    new_where, run_where = (STEP if src == "step" else SCHED)
    fresh = set(delta.new)

    def run_field(r: int) -> Optional[str]:
        if batch.write_gids is None or not 0 <= r < len(batch.write_gids):
            return None
        rid = rid_of.get(int(batch.write_slots[r]))
        if rid is None:
            return None
        g = int(batch.write_gids[r])
        return (f"{new_where}[{rid!r}].block_ids[{g}]" if rid in fresh else
                f"{run_where}[{rid!r}].new_block_ids[{g}]")

    def name(m: re.Match) -> Optional[str]:
        if m.group(1) is not None and batch.write_cu is not None:
            j = int(m.group(1))
            cu = np.asarray(batch.write_cu)
            r = int(np.searchsorted(cu, j, side="right")) - 1
            f = run_field(r)
            return None if f is None else f"{f}[{j - int(cu[r])}]"
        if m.group(2) is not None:
            return run_field(int(m.group(2)))
        s = int(m.group(3))
        return f"request {rid_of[s]!r}" if s in rid_of else None

    names = {}
    for m in _POS.finditer(str(error)):
        n = name(m)
        if n is not None:
            names.setdefault(m.group(0), n)
    if not names:
        return error
    return type(error)(f"{error} [{'; '.join(f'{k} = {v}' for k, v in names.items())}]")
