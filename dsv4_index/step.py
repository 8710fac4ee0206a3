"""Scheduler contract: what a serving engine's scheduler hands the metadata pipeline each step.

The shapes mirror a vLLM-like scheduler output (INTERFACES.md "Scheduler contract"):

* a request's *computed* tokens are those whose KV is already in the cache before this step
  (``num_computed_tokens``); the step schedules positions
  ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[req_id])``;
* block ids come from one shared pool (id 0 is the null block, never given to a request) and are
  listed per kv-cache group ``gid`` (order of :attr:`DSV4Layout.groups`);
* the library never allocates block ids, it only mirrors them into block tables.

Only checks that need no pipeline state live here (:meth:`StepInput.validate_static`); the pipeline
checks the rest (e.g. that a running request is known, that a table row is wide enough).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["NewRequest", "RunningRequest", "StepInput"]

IdSet = Union[AbstractSet[str], Sequence[str]]


def _as_block_lists(name: str, block_ids) -> Tuple[List[int], ...]:
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, (tuple, list)):
        raise ValueError(f"{name} must be a tuple with one list of block ids per gid, "
                         f"got {type(block_ids).__name__}")
    return tuple(block_ids)


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
    new_block_ids : tuple[list[int], ...]
        One list per gid: block ids appended to the request's row in that group since the last step
        (empty lists when none). With ``resumed=True`` (the request comes back after preemption)
        these are the request's *whole* block lists, replacing the old rows.
    num_computed_tokens : int
        Tokens whose KV is cached before this step; may go backwards after rejected speculative
        tokens (the scheduler rewinds it).
    resumed : bool
        True when the request was preempted earlier and resumes in this step.
    """

    req_id: str
    new_block_ids: Tuple[List[int], ...]
    num_computed_tokens: int
    resumed: bool = False

    def __post_init__(self):
        object.__setattr__(self, "new_block_ids",
                           _as_block_lists(f"new_block_ids of {self.req_id!r}", self.new_block_ids))




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
        dropped; they come back later as ``RunningRequest(resumed=True)`` or as a ``NewRequest``.
    replay_start : dict[str, int]
        Optional per-request floor of the sliding window (bounded replay): window lists start at
        ``max(pos - W + 1, replay_start)``. Requests not listed use 0.
    replay_end : dict[str, int]
        Optional per-request end of bounded replay: tokens at ``pos < replay_end`` are recomputed only
        to rebuild the sliding and state caches, and write nothing into prefix-cacheable groups
        (their KV is cached in blocks shared with other requests). Requests not listed use 0.
    """

    new_requests: Sequence[NewRequest]
    running_requests: Sequence[RunningRequest]
    num_scheduled_tokens: Dict[str, int]
    finished_req_ids: IdSet = field(default_factory=set)
    preempted_req_ids: IdSet = field(default_factory=set)
    replay_start: Dict[str, int] = field(default_factory=dict)
    replay_end: Dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        """Tokens scheduled in this step (sum of ``num_scheduled_tokens``), before padding."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_reqs(self) -> int:
        """Requests scheduled in this step."""
        return len(self.num_scheduled_tokens)

    def validate_static(self, num_groups: Optional[int] = None) -> None:
        """Checks that need no pipeline state; raise ValueError naming the field.

        Parameters
        ----------
        num_groups : int, optional
            Expected number of per-gid block lists (``len(layout.groups)``). When None, every request
            must simply carry the same number of lists.
        """
        self._validate_static_slow(num_groups)

    def _validate_static_slow(self, num_groups: Optional[int] = None) -> None:
        nst = self.num_scheduled_tokens
        if not isinstance(nst, Mapping):
            raise ValueError(f"num_scheduled_tokens must be a dict, got {type(nst).__name__}")
        for rid, n in nst.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"num_scheduled_tokens[{rid!r}] must be an int >= 0, got {n!r}")

        computed: Dict[str, int] = {}
        widths = set() if num_groups is None else {num_groups}
        entries = [("new_requests", r, r.block_ids) for r in self.new_requests]
        entries += [("running_requests", r, r.new_block_ids) for r in self.running_requests]
        for what, req, lists in entries:
            rid = req.req_id
            if rid in computed:
                raise ValueError(f"{what}: request {rid!r} is listed more than once "
                                 f"(in new_requests and/or running_requests)")
            n_c = req.num_computed_tokens
            if isinstance(n_c, bool) or not isinstance(n_c, int) or n_c < 0:
                raise ValueError(f"{what}: num_computed_tokens of {rid!r} must be an int >= 0, got {n_c!r}")
            computed[rid] = n_c
            if rid not in nst:
                raise ValueError(f"{what}: request {rid!r} has no entry in num_scheduled_tokens")
            widths.add(len(lists))
            if len(widths) > 1:
                expect = f"{num_groups}" if num_groups is not None else "the same number as other requests"
                raise ValueError(f"{what}: request {rid!r} has {len(lists)} per-gid block lists, "
                                 f"expected {expect}")
            for gid, ids in enumerate(lists):
                seen = set()
                for b in ids:
                    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                        raise ValueError(f"{what}: request {rid!r} gid {gid} has a bad block id {b!r}")
                    if b in seen and b != 0:
                        raise ValueError(f"{what}: request {rid!r} lists block id {b} twice in gid {gid}")
                    seen.add(b)

        extra = [rid for rid in nst if rid not in computed]
        if extra:
            raise ValueError(f"num_scheduled_tokens lists {extra[0]!r}, which is in neither "
                             f"new_requests nor running_requests")
        for name in ("finished_req_ids", "preempted_req_ids"):
            if isinstance(getattr(self, name), (str, bytes)):
                raise ValueError(f"{name} must be a set or list of request ids, got the bare string "
                                 f"{getattr(self, name)!r}")
            clash = [rid for rid in getattr(self, name) if rid in computed]
            if clash:
                raise ValueError(f"{name} contains {clash[0]!r}, which is also scheduled in this step")
        for rid, start in self.replay_start.items():
            if rid not in computed:
                raise ValueError(f"replay_start lists {rid!r}, which is not scheduled in this step")
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"replay_start[{rid!r}] must be an int >= 0, got {start!r}")
            if nst[rid] > 0 and start > computed[rid]:
                raise ValueError(f"replay_start[{rid!r}] = {start} exceeds the first scheduled position "
                                 f"{computed[rid]} (num_computed_tokens)")
        for rid, end in self.replay_end.items():
            if rid not in computed:
                raise ValueError(f"replay_end lists {rid!r}, which is not scheduled in this step")
            if isinstance(end, bool) or not isinstance(end, int) or end < 0:
                raise ValueError(f"replay_end[{rid!r}] must be an int >= 0, got {end!r}")
