"""Every rejection of the ownership rule (:mod:`dsv4_index.state.owners`): code, level, template, fields.

A block of the one table of rejections (``state/messages.py``): the lead merges these rows into it. A pass
returns a code and named fields; :func:`reject` words them, and the raised ``ValueError`` carries both
(``.code``, ``.fields``) so that a front door reads fields instead of parsing the text.

Codes (``level``: the check level that raises it):

========================  =====  ==================================================================
code                      level  when
========================  =====  ==================================================================
``own.jump``              safe   ``num_computed_tokens`` past what the row's steps wrote
``own.ring``              safe   a row reads a ring column that now holds a later block
``own.again``             safe   a window moved back onto a block another live row holds now
``own.fill_held``         safe   an acquired block the row writes is certainly read by another row
``own.rewind_held``       safe   a row rewrites (below its frontier) a block another row reads
``own.write_held``        safe   a row writes into a block another row filled and certainly reads
``own.stale_read``        safe   a row would read a block another request filled since this row did
``own.hit_position``      safe   a prefix hit of a block filled at another block position
``own.twice``             full   one id twice in a row (acquired where it writes)
``own.twice_sliding``     full   one id twice in a sliding row from its window start on
``own.held_null``         full   the null block among the held blocks a step reads
``own.id_limit``          safe   a block id beyond the ownership tables (``2**28`` keys)
``own.ring_capacity``     safe   a circular group's ring is too small for the draft tokens
========================  =====  ==================================================================
"""

from __future__ import annotations

from typing import Dict, NoReturn, Optional, Tuple

__all__ = ["MESSAGES", "MAX_KEYS", "OwnershipError", "reject", "word", "check_id_limit"]

MAX_KEYS = 1 << 28  # NOTE: id keys kid * G + gid of the ownership tables

MESSAGES: Dict[str, Tuple[str, str]] = {
    "own.jump": ("safe", "num_computed_tokens[{i}] = {nc} of slot {slot} jumps past what its steps wrote: positions "
                         "{front}..{last} were never written (a running request may rewind, never skip ahead)"),
    "own.ring": ("safe", "slot {slot} reads gid {gid} ({name}) from block {lo} (position {lo_pos}, "
                         "num_computed_tokens {nc}), but its ring columns hold blocks {ring_lo} and up only ({why}; "
                         "write_starts): the window lists would read columns that now hold later blocks"),
    "own.again": ("safe", "slot {slot} reads gid {gid} ({name}) at block position {pos} again (its window moved back "
                          "to blocks it had left; num_computed_tokens), but slot {other} holds that block ({kid}) "
                          "now: it would read another live request's KV"),
    "own.fill_held": ("safe", "write_ids[{raw}] = {kid} gives slot {slot} block position {pos} of gid {gid} ({name}), "
                              "where it writes, but slot {other} holds block {kid} too (block position {opos}{since}): "
                              "a token would write into a block another live request holds"),
    "own.rewind_held": ("safe", "slot {slot} writes gid {gid} ({name}) from position {ws}, below the position {mark} "
                                "its steps already wrote or hold as a prefix (num_computed_tokens {nc}), into block "
                                "{kid} (block position {pos}), but slot {other} holds that block too (block position "
                                "{opos}): a token would write into a block another live request holds"),
    "own.write_held": ("safe", "slot {slot} writes gid {gid} ({name}) from position {ws} into block {kid} (block "
                               "position {pos}), but slot {other} holds that block too (block position {opos}) and "
                               "filled it last: a token would write into a block another live request holds"),
    "own.stale_read": ("safe", "slot {slot} would read gid {gid} ({name}) block {kid} at block position {pos} "
                               "(num_computed_tokens {nc}), but slot {writer} filled that block at block position "
                               "{fpos} in step {step}, after slot {slot} last wrote or took it: it would read "
                               "another request's KV"),
    "own.hit_position": ("safe", "write_ids[{raw}] = {kid} gives slot {slot} block position {pos} of gid {gid} "
                                 "({name}) as a prefix hit (below its write start), but that block was filled at "
                                 "block position {fpos} (slot {writer}, step {step}): the row would read KV of other "
                                 "positions as its own prefix"),
    "own.twice": ("full", "write_ids[{raw}] = {kid} gives slot {slot} block position {pos} of gid {gid} ({name}), "
                          "where it writes, but the row holds block {kid} at block position {opos} too: one block id "
                          "twice in gid {gid} of slot {slot}"),
    "own.twice_sliding": ("full", "block id {kid} twice in sliding gid {gid} ({name}) of slot {slot} from its window "
                                  "start on (one block would hold two positions)"),
    "own.held_null": ("full", "the null block 0 in {kind} group gid {gid} ({name}) of slot {slot} (batch row {row}): "
                              "block {col} (positions {p0}..{p1}{local}), held since an earlier step; the step reads "
                              "positions {lo_pos}..{last} of this group (only blocks wholly before position {lo_pos} "
                              "may be null){tail}"),
    "own.id_limit": ("safe", "write_ids: block id {kid} is beyond the ownership table's limit of {limit} ids per "
                             "group"),
    "own.ring_capacity": ("safe", "circular group gid {gid} ({name!r}): capacity {cap} is below window - 1 + "
                                  "num_speculative_tokens = {window} - 1 + {spec} = {need}"),
}


class OwnershipError(ValueError):
    """A rejected step: ``code`` (a key of :data:`MESSAGES`) and the ``fields`` its template words."""

    def __init__(self, message: str, code: str = "", fields: Optional[dict] = None):
        super().__init__(message)  # NOTE: one argument, like ValueError (the front door re-raises type(e)(text))
        self.code, self.fields = code, dict(fields or {})


def word(code: str, fields: dict) -> str:
    """The message of ``code`` with ``fields``."""
    return MESSAGES[code][1].format(**fields)


def reject(code: str, **fields) -> NoReturn:
    """Raise the :class:`OwnershipError` of ``code``."""
    raise OwnershipError(word(code, fields), code, fields)


def check_id_limit(max_id: int, G: int) -> None:
    """Refuse a block id whose key ``max_id * G + G`` is beyond :data:`MAX_KEYS`."""
    if max_id * G + G >= MAX_KEYS:
        reject("own.id_limit", kid=(max_id * G + G) // max(G, 1), limit=MAX_KEYS // max(G, 1))
