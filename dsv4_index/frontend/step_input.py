"""Scheduler contract: what a serving engine's scheduler hands the metadata pipeline each step.

The shapes mirror a vLLM-like scheduler output (docs/DESIGN.md §5, the README's "Steps" section):

* a request's *computed* tokens are those whose KV is already in the cache before this step
  (``num_computed_tokens``); the step schedules positions
  ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[req_id])``;
* block ids come from one shared pool (id 0 is the null block, never given to a request) and are
  listed per kv-cache group ``gid`` (order of :attr:`DSV4Layout.groups`);
* the library never allocates block ids, it only mirrors them into block tables.

The rules of a step live in one place, :mod:`dsv4_index.frontend.rules` (run by the conversions of
:mod:`dsv4_index.frontend`, which the pipeline calls); :func:`check_step` (what
:meth:`StepInput.validate_static` runs) is the part that needs no pipeline state. The requests fix the
shape of their block lists at construction (a tuple of lists per gid); counts and ids are checked per
step: Python ints (not bools, floats or numpy scalars) in ``[0, 2**31 - 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple, Union

from .rules import LISTS, STEP, StepTypeError, check_rows

__all__ = ["NewRequest", "RunningRequest", "StepInput", "StepTypeError", "check_step", "new_of", "running_of"]

IdSet = Union[AbstractSet[str], Sequence[str]]


def _as_block_lists(name: str, block_ids, allow_none: bool = False) -> Optional[Tuple[List[int], ...]]:
    """The per-gid block lists as a tuple; every entry a list or tuple (its ids are checked per step).

    NOTE: the tuple and the type of each entry are fixed here (the dataclasses are frozen), so the
    converters need not re-check them; the ids inside may still change and are checked every step.
    """
    if block_ids is None and allow_none:
        return None
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, (tuple, list)):
        raise StepTypeError(f"{name} must be a tuple with one list of block ids per gid, "
                            f"got {type(block_ids).__name__}")
    block_ids = tuple(block_ids)
    if not set(map(type, block_ids)) <= LISTS:
        g, bad = next((g, x) for g, x in enumerate(block_ids) if type(x) not in LISTS)
        raise StepTypeError(f"{name} gid {g} must be a list of block ids, got {type(bad).__name__}")
    return block_ids


@dataclass(frozen=True)
class NewRequest:
    """A request that enters the batch in this step (first scheduled, or re-added after preemption
    when the scheduler chooses to send it as new).

    Attributes
    ----------
    req_id : str
        Engine-wide request id.
    block_ids : tuple[list[int], ...]
        One list per gid: every block id the request holds in that group, in logical block order
        (entry ``i`` covers the group's tokens ``[i * block_size, (i + 1) * block_size)``). Sliding
        groups may hold the null block (0) for blocks that left the window.
    num_computed_tokens : int
        Tokens whose KV is already cached before this step (prefix-cache hits included). The step
        schedules positions ``[num_computed_tokens, num_computed_tokens + n)``.
    """

    req_id: str
    block_ids: Tuple[List[int], ...]
    num_computed_tokens: int

    def __post_init__(self):
        object.__setattr__(self, "block_ids", _as_block_lists(f"block_ids of {self.req_id!r}",
                                                              self.block_ids))


@dataclass(frozen=True)
class RunningRequest:
    """A request already in the batch (scheduled in an earlier step) that is scheduled again.

    Attributes
    ----------
    req_id : str
        Engine-wide request id.
    new_block_ids : tuple[list[int], ...] or None
        One list per gid: block ids appended to the request's row in that group since the last step
        (empty lists, or None as vLLM sends it, when none). With ``resumed=True`` (the request comes
        back after preemption) these are the request's *whole* block lists, replacing the old rows.
    num_computed_tokens : int
        Tokens whose KV is cached before this step; may go backwards after rejected speculative
        tokens (the scheduler rewinds it).
    resumed : bool
        True when the request was preempted earlier and resumes in this step.
    """

    req_id: str
    new_block_ids: Optional[Tuple[List[int], ...]]
    num_computed_tokens: int
    resumed: bool = False

    def __post_init__(self):
        object.__setattr__(self, "new_block_ids",
                           _as_block_lists(f"new_block_ids of {self.req_id!r}", self.new_block_ids, True))


@dataclass(frozen=True)
class StepInput:
    """One scheduler step.

    Attributes
    ----------
    new_requests : sequence of NewRequest
        Requests entering the batch.
    running_requests : sequence of RunningRequest
        Requests already in the batch and scheduled again (or resumed after preemption).
    num_scheduled_tokens : dict[str, int]
        Tokens scheduled per request in this step (speculative draft tokens included); the keys are
        exactly the ids of ``new_requests`` and ``running_requests``. A request in the batch that is
        not listed is not scheduled this step (its row is kept).
    finished_req_ids : set or list of str
        Requests that finished since the last step; their rows are dropped before this step.
    preempted_req_ids : set or list of str
        Requests preempted since the last step (blocks returned to the pool); their rows are
        dropped; they come back in a later step as ``RunningRequest(resumed=True)`` or as a
        ``NewRequest``. An id in both ``finished_req_ids`` and ``preempted_req_ids``, or in either
        and also scheduled in this step, is refused.
    replay_start : dict[str, int]
        Optional per-request floor of the sliding window (bounded replay): window lists start at
        ``max(pos - W + 1, replay_start)``. Requests not listed use 0.
    replay_end : dict[str, int]
        Optional per-request end of bounded replay: tokens at ``pos < replay_end`` are recomputed only
        to rebuild the sliding and state caches, and write nothing into prefix-cacheable groups
        (their KV is cached in blocks shared with other requests). Requests not listed use 0.
    drafts : dict[str, int]
        Optional per-request draft (speculative) tokens among its scheduled tokens (``StepBatch.drafts``;
        ``len(scheduled_spec_decode_tokens[req])`` in vLLM). Requests not listed use the default rule:
        ``min(n - 1, num_speculative_tokens)`` for a row of at most ``1 + num_speculative_tokens`` tokens, 0 for
        a prefill chunk.
    query_lens : dict[str, int]
        Optional per-request decoder queries (``StepBatch.query_lens``, V4.1 decoder-suffix replay): the request's
        last ``q`` scheduled tokens query (``1 <= q <= num_scheduled_tokens``), its compressor / indexer source
        covers every scheduled token. Requests not listed: every scheduled token queries.
    """

    new_requests: Sequence[NewRequest]
    running_requests: Sequence[RunningRequest]
    num_scheduled_tokens: Dict[str, int]
    finished_req_ids: IdSet = field(default_factory=set)
    preempted_req_ids: IdSet = field(default_factory=set)
    replay_start: Dict[str, int] = field(default_factory=dict)
    replay_end: Dict[str, int] = field(default_factory=dict)
    drafts: Dict[str, int] = field(default_factory=dict)
    query_lens: Dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        """Tokens scheduled in this step (sum of ``num_scheduled_tokens``), before padding."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_reqs(self) -> int:
        """Requests scheduled in this step."""
        return len(self.num_scheduled_tokens)

    def validate_static(self, num_groups: Optional[int] = None) -> None:
        """The checks of the id-keyed converter that need no pipeline state (the same code:
        :func:`check_step`); raise ``ValueError`` naming the request and field.

        Parameters
        ----------
        num_groups : int, optional
            Expected number of per-gid block lists (``len(layout.groups)``). When None, every request
            must simply carry the same number of lists.

        NOTE: duplicate block ids are a ``checks="full"`` contract check of the pipeline (docs/DESIGN.md §5),
        not a rule of the step.
        """
        check_step(self, num_groups)


def check_step(step: StepInput, num_groups: Optional[int] = None) -> None:
    """The stateless rules of ``step`` (what ``StepInput.validate_static`` runs)."""
    if not isinstance(step, StepInput):
        raise StepTypeError(f"step must be a StepInput, got {type(step).__name__}")
    check_rows(STEP, num_groups, new_of(step), running_of(step), step.num_scheduled_tokens, step.finished_req_ids,
               step.preempted_req_ids, step.replay_start, step.replay_end)


def new_of(step: StepInput) -> list:
    """``[(req_id, block_ids, num_computed_tokens)]`` of the new requests."""
    return [(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests]


def running_of(step: StepInput) -> list:
    """``[(req_id, new_block_ids, num_computed_tokens, resumed)]`` of the running requests."""
    return [(r.req_id, r.new_block_ids, r.num_computed_tokens, bool(r.resumed)) for r in step.running_requests]
