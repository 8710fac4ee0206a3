"""The rules of an id-keyed step, in one place (imports nothing of the front door): the conversions
of :mod:`dsv4_index.frontend.convert` and :mod:`dsv4_index.frontend.fast` run them, and
``StepInput.validate_static`` runs their stateless part (:func:`dsv4_index.frontend.check_step`).

* request ids are ``str``, each listed once (new or running); the keys of ``num_scheduled_tokens``
  are exactly the scheduled ids;
* contradictions are refused, naming the request and both fields: an id both finished and
  preempted, or finished (or preempted) and scheduled in the same step. vLLM never schedules a
  request in the step that preempts it (its waiting queue is skipped in a step that preempted), so
  a resumed request may not be in the same step's ``preempted_req_ids`` either;
* every count (``num_computed_tokens``, ``num_scheduled_tokens``, ``replay_start``, ``replay_end``)
  and every block id is a Python ``int`` (not a ``bool``, ``float`` or numpy scalar) in
  ``[0, LIMIT = 2**31 - 1]``, checked before any sum or array conversion, so no wrap can pass; the
  pipeline then bounds them by ``max_model_len`` and its capacities;
* a request's block lists are a tuple (or list) with one list (or tuple) per gid; a running request's
  ``new_block_ids`` may be None (no new block; vLLM's form);
* (slot map, :func:`dsv4_index.frontend.convert.convert`) a running request holds a slot, or is
  resumed after a preemption the map saw; a new request takes the lowest free slot; a finished or
  preempted id the map never saw is a no-op (vLLM reports requests aborted while waiting).

Errors are ``ValueError`` (:class:`StepTypeError`, also a ``TypeError``, for a wrong type) naming
the scheduler's field and the request id.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import countOf
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .._common import INT32_MAX

__all__ = ["LIMIT", "StepTypeError", "Src", "STEP", "SCHED", "NEW", "RESUMED", "APPENDS", "LISTS", "ints",
           "ints_of_lists", "pack", "id_set", "gone_ids", "Row", "Checked", "check_rows"]


class StepTypeError(ValueError, TypeError):
    """A field of an id-keyed step has the wrong type (both a ``TypeError`` and a ``ValueError``: a
    pipeline rejects it like any other bad step)."""


LIMIT = INT32_MAX  # NOTE: every count and block id of an id-keyed step is in [0, LIMIT]
LISTS = {list, tuple}
_ID_SETS = {set, frozenset, list, tuple}
NEW, RESUMED, APPENDS = 0, 1, 2  # row kinds


class Src(NamedTuple):
    new: str   # where new requests are listed
    run: str   # where running requests are listed


STEP = Src("new_requests", "running_requests")
SCHED = Src("scheduled_new_reqs", "scheduled_cached_reqs")


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


def ints(vals: list, tail: Sequence[int] = ()) -> Optional[np.ndarray]:
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


def ints_of_lists(lists: list) -> Optional[np.ndarray]:
    """:func:`ints` of the concatenation of ``lists`` (lists of block ids), converted one list at a time
    (one type pass and one ``struct.pack`` each, no Python-level concatenation of the ids) and checked
    once, over these ids only. A read-only int64 array; None when any id is not an int in ``[0, LIMIT]``.

    NOTE: measured on 52 K ids in 16 lists, warm: 0.8-0.9x one ``np.asarray(list, np.int32)`` per list
    (the issue's floor), where ``np.asarray(list, np.int64)`` or ``np.fromiter`` per list took 1.4-1.6x
    and one ``struct.pack`` of the concatenation 1.4-1.5x (``benchmarks/FRONTEND.md``).
    """
    parts = []
    for x in lists:
        n = len(x)
        if countOf(map(type, x), int) != n:
            return None
        try:
            parts.append(struct.pack(f"{n}q", *x))
        except struct.error:
            return None
    a = np.frombuffer(b"".join(parts), dtype=np.int64)
    if a.shape[0] and a.view(np.uint64).max() > LIMIT:
        return None
    return a


def pack(a, b, c, d, t1: Sequence[int] = (), t2: Sequence[int] = (), t3: Sequence[int] = ()
         ) -> Optional[np.ndarray]:
    """The concatenation of ``a`` .. ``d`` (sized iterables of Python ints, type-checked) and ``t1`` .. ``t3``
    (ints in ``[0, LIMIT]`` the caller made, unchecked) as one read-only int64 array, without building the
    concatenation; None when an entry of ``a`` .. ``d`` is not an ``int`` or is past int64.

    NOTE: not range-checked: the caller checks ``a`` .. ``d`` against ``[0, LIMIT]`` before any use (the runs
    pass of :mod:`dsv4_index.frontend.runs`, in the same loop that reads the runs).
    """
    if countOf(map(type, a), int) != len(a) or countOf(map(type, b), int) != len(b) \
            or countOf(map(type, c), int) != len(c) or countOf(map(type, d), int) != len(d):
        return None
    n = len(a) + len(b) + len(c) + len(d) + len(t1) + len(t2) + len(t3)
    try:
        return np.frombuffer(struct.pack(f"{n}q", *a, *b, *c, *d, *t1, *t2, *t3), dtype=np.int64)
    except struct.error:
        return None


def id_set(name: str, ids) -> Sequence[str]:
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


class Row(NamedTuple):
    where: str
    field: str
    rid: str
    lists: Optional[tuple]
    nc: int
    kind: int


class Checked(NamedTuple):
    rows: List[Row]
    finished: Sequence[str]
    preempted: Sequence[str]
    num_groups: Optional[int]


def gone_ids(finished, preempted) -> Tuple[Sequence[str], Sequence[str]]:
    """``finished_req_ids`` and ``preempted_req_ids`` as sequences of ids; raise when one id is in both."""
    finished = id_set("finished_req_ids", finished)
    preempted = id_set("preempted_req_ids", preempted)
    if finished and preempted and not set(finished).isdisjoint(preempted):
        rid = next(r for r in preempted if r in set(finished))
        raise ValueError(f"preempted_req_ids: request {rid!r} is also in finished_req_ids (a request either "
                         f"finished or was preempted)")
    return finished, preempted


def check_rows(src: Src, num_groups: Optional[int], new, running, nst, finished, preempted, replay_start,
               replay_end) -> Checked:
    """Every rule that needs no slot map; raise naming the field and request.

    ``new``: [(rid, block_ids, nc)]; ``running``: [(rid, new_block_ids or None, nc, resumed)].
    Returns the rows in the order listed (new requests first).
    """
    finished, preempted = gone_ids(finished, preempted)
    if not isinstance(nst, Mapping):
        raise StepTypeError(f"num_scheduled_tokens must be a dict of request id -> int, got {type(nst).__name__}")
    rows, width, seen = _entries(src, num_groups, new, running, nst, set(finished), set(preempted))
    _counts(src, nst, seen, replay_start, replay_end)
    return Checked(rows, finished, preempted, width)


def _entries(src: Src, num_groups: Optional[int], new, running, nst, finished: set, preempted: set):
    """The rows of the new and running requests (ids, kinds, block lists, computed counts)."""
    width = num_groups
    seen: Dict[str, int] = {}
    rows: List[Row] = []
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
        for name, ids in (("finished_req_ids", finished), ("preempted_req_ids", preempted)):
            if rid in ids:
                raise ValueError(f"{where}: request {rid!r} is also in {name} (scheduled in {where} and "
                                 f"listed in {name} in the same step)")
        if not _ok(nc):
            _bad_int(f"{where}: num_computed_tokens of {rid!r}", nc)
        if rid not in nst:
            raise ValueError(f"{where}: request {rid!r} has no entry in num_scheduled_tokens")
        if lists is not None or kind == NEW:
            width = _lists(where, fld, rid, lists, width, num_groups)
            for ids in lists:
                all_ids.extend(ids)
        rows.append(Row(where, fld, rid, None if lists is None else tuple(lists), nc, kind))
    if all_ids and ints(all_ids) is None:
        for r in rows:
            for g, ids in enumerate(r.lists or ()):
                for k, b in enumerate(ids):
                    if not _ok(b):
                        msg = (f"{r.where}: {r.field} of {r.rid!r} gid {g} has a bad block id {b!r} at "
                               f"{r.field}[{g}][{k}] (block ids are Python ints in [0, {LIMIT}])")
                        raise (StepTypeError if type(b) is not int else ValueError)(msg)
    return rows, width, seen


def _lists(where: str, fld: str, rid: str, lists, width: Optional[int], num_groups: Optional[int]) -> int:
    """Check the shape of one request's block lists; the number of lists every request must have."""
    if isinstance(lists, (str, bytes)) or not isinstance(lists, (tuple, list)):
        raise StepTypeError(f"{where}: {fld} of {rid!r} must be a tuple with one list per gid, "
                            f"got {type(lists).__name__}")
    if width is None:
        width = len(lists)
    if len(lists) != width:
        raise ValueError(f"{where}: {fld} of {rid!r} has {len(lists)} per-gid block lists, expected "
                         f"{width if num_groups is not None else f'{width} (as other requests)'}")
    for g, ids in enumerate(lists):
        if type(ids) not in LISTS:
            raise StepTypeError(f"{where}: {fld} of {rid!r} gid {g} must be a list of block ids, "
                                f"got {type(ids).__name__}")
    return width


def _counts(src: Src, nst, seen: Dict[str, int], replay_start, replay_end) -> None:
    """``num_scheduled_tokens`` and the replay bounds: keys scheduled, values counts."""
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
