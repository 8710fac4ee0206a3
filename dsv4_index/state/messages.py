"""Every rejection of a step (``update()``) in one table: code -> (level, template, fields).

A check raises :class:`Rejection` (a ``ValueError``) by code with its fields; the text is the
template filled with them (``str.format``), so every message is written once, here. The fields stay
on the exception (``error.code``, ``error.fields``): the id-keyed front door
(:func:`dsv4_index.frontend.convert.explain`) names the request and the scheduler field of a position
from them, never by reading the text. A compiled pass returns ``(code, i, j, k, v)`` and its Python
wrapper words it with :func:`reject`.

Position fields (their names say what they index, :data:`POSITIONS`): ``j`` a ``write_ids`` index,
``r`` a write run, ``slot`` a request slot; any other field is plain text. ``level`` is the check level
(``"safe"``: always; ``"full"``: ``checks="full"`` / ``validate=True``, docs/DESIGN.md §5).
"""

from __future__ import annotations

from string import Formatter
from typing import Dict, NamedTuple, Tuple

__all__ = ["Message", "MESSAGES", "POSITIONS", "Rejection", "reject"]


class Message(NamedTuple):
    level: str
    template: str
    fields: Tuple[str, ...]


POSITIONS = {"j": "write_ids[{}]", "r": "write run {}", "slot": "slot {}"}  # NOTE: field -> its text


def _m(level: str, template: str) -> Message:
    names = tuple(dict.fromkeys(f for _, f, _, _ in Formatter().parse(template) if f))
    return Message(level, template, tuple(n.split("!")[0] for n in names))


MESSAGES: Dict[str, Message] = {
    # ---- the step's rows (state/plan.py) ------------------------------------------------------
    "step_type": _m("safe", "step must be a StepInput or a StepBatch, got {type}"),
    "not_array": _m("safe", "{name} must be a 1-D integer array, got {type}"),
    "bad_dtype": _m("safe", "{name} must be a 1-D {kind} array, got dtype {dtype} and shape {shape}"),
    "bad_length": _m("safe", "{name} has {n} entries, expected {expected}"),
    "out_of_range": _m("safe", "{name}[{i}] = {value} is not {what} in [0, {hi})"),
    "negative": _m("safe", "{name}[{i}] = {value} is negative"),
    "beyond_model_len": _m("safe", "num_computed_tokens[{i}] = {value} is beyond max_model_len = {limit}"),
    "too_many_tokens": _m("safe", "num_scheduled_tokens: the step schedules {total} tokens, more than "
                                  "max_num_batched_tokens = {limit}"),
    "pad_to": _m("safe", "pad_to must be an int in [{lo}, {hi}], got {pad_to}"),
    "slot_twice": _m("safe", "req_slots: slot {slot} appears in {count} batch rows"),
    "free_twice": _m("safe", "free_slots lists a slot twice"),
    "free_not_held": _m("safe", "free_slots[{i}] = {value} does not hold a request"),
    "new_held": _m("safe", "req_slots[{i}] = {value} is new but still holds a request (free it first)"),
    "not_held": _m("safe", "req_slots[{i}] = {value} holds no request (mark it is_new)"),
    "replay_start": _m("safe", "replay_start of slot {slot} = {value} is outside "
                               "[0, num_computed_tokens = {nc}]"),
    "replay_end_negative": _m("safe", "replay_end of slot {slot} = {value} is negative"),
    "replay_end_int32": _m("safe", "replay_end of slot {slot} = {value} does not fit int32"),
    # ---- write runs (state/plan_runs.py) ------------------------------------------------------
    "write_slot_free": _m("safe", "write_slots[{i}] = {value} holds no request after this step"),
    "write_cu": _m("safe", "write_cu must rise from 0 to len(write_ids) = {n}"),
    "two_runs": _m("safe", "two write runs for gid {g}, slot {slot} (one run per (group, slot))"),
    "hole": _m("safe", "write_starts[{i}] = {value} leaves a hole: gid {g} of slot {slot} holds {have} blocks"),
    "run_too_long": _m("safe", "write run {r}: slot {slot} would hold {end} blocks in gid {g} ({name}), the "
                               "table holds {limit} ({why})"),
    "id_negative": _m("safe", "write_ids[{j}] = {value} is negative"),
    "id_int32": _m("safe", "write_ids[{j}] = {value} in gid {g} ({name}) gives slots beyond int32 "
                           "(largest id {limit})"),
    # ---- coverage, rings, capacity (state/plan.py) --------------------------------------------
    "ring_short": _m("safe", "gid {g} ({name}) is a ring of {ring} blocks, but slot {slot} holds blocks up to "
                             "{have} and reads from block {lo} this step"),
    "blocks_missing": _m("safe", "block ids missing for gid {g} ({name}) of slot {slot}: {seq} tokens need "
                                 "{need} blocks, the row has {have}"),
    "too_many_staged": _m("safe", "write_ids: the step stages {staged} block ids, more than "
                                  "max_staged_blocks = {limit}"),
    # ---- checks="full" (state/contract.py) ----------------------------------------------------
    "null_block": _m("full", "the null block 0 in {kind} group gid {g} ({name}) of slot {slot}{row}: {what}, "
                             "{src}; {why}{tail}"),
    "id_twice": _m("full", "write run {r}: block id {value} twice in gid {g} of slot {slot}"),
    "ring_shared": _m("full", "block id {value} is in the rings of slots {a} and {b} of circular group gid {g} "
                              "({name}): two requests would write the same ring rows"),
    # ---- block ownership (state/owners*): appended below by the ownership checks ----------------
}


class Rejection(ValueError):
    """A rejected step: ``code`` (a key of :data:`MESSAGES`) and ``fields`` (the values the message
    names; position fields are ints). ``str()`` is the worded message."""

    def __init__(self, code: str, fields: Dict[str, object], text: str):
        super().__init__(text)
        self.code, self.fields = code, fields

    def positions(self):
        """``[(text, kind, value)]`` of the position fields, in the order the message names them
        (``kind``: ``"j"``, ``"r"`` or ``"slot"``); ``j`` may also be given by a field ``src_j``."""
        out = []
        for name in MESSAGES[self.code].fields + ("src_j",):
            kind = "j" if name == "src_j" else name
            v = self.fields.get(name)
            if kind in POSITIONS and isinstance(v, int):
                out.append((POSITIONS[kind].format(v), kind, v))
        return out


def reject(code: str, **fields) -> Rejection:
    """The :class:`Rejection` of ``code`` worded with ``fields`` (raise it)."""
    return Rejection(code, fields, MESSAGES[code].template.format(**fields))
