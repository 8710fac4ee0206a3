# over 400 lines: one reference scheduler, read top to bottom (admission, prefix cache, chunks, preemption, MTP)
"""Reference scheduler: a small vLLM-like scheduler that emits :class:`StepInput` s (tests, examples,
benchmarks). It models block bookkeeping faithfully and token contents not at all.

What it supports
----------------
* One block pool shared by every group, ids ``0..num_blocks-1``; id 0 is the null block, never
  handed out. Free blocks form an LRU queue; a freed block that the prefix cache knows keeps its
  content key until the queue hands it out again (eviction).
* Full groups hold ``ceil(n / alloc_block_size)`` blocks for KV positions ``[0, n)``. Sliding groups
  (window ``W``) hold blocks only for positions ``>= max(c - W + 1, replay_start)`` when the step
  schedules ``[c, c + k)`` (every scheduled token is written, and the oldest reads down to
  ``c - W + 1``). Blocks wholly below that are released when the next ``schedule()`` schedules the
  request (vLLM frees them in ``allocate_slots``, so a request left out of a step keeps them; ``free_policy``
  ``"eager"`` frees them for every running request at the start of a step, ``"optimistic"`` behind the count
  the last step would reach with every draft accepted, as async scheduling does);
  in the scheduler's view their entries become the null block 0, while the pipeline's rows keep
  the stale ids (``new_block_ids`` are append-only; nothing reads those entries). Entries never
  needed (below ``replay_start``) are appended as 0. Steps always carry logical block order, so a
  pipeline storing sliding tables as rings (docs/DESIGN.md §4) needs nothing else from the scheduler.
* Circular groups (``kind == "circular"``, vLLM's ``CircularBufferSpec``: a ring of ``capacity``
  rows per request in ``k = capacity // block_size`` blocks, ``k = 1`` unless ``GroupSpec.capacity``
  says otherwise): ``k`` blocks per request, allocated at admission (a new or resumed request lists
  ``[b_0, .., b_{k-1}]`` for the group, a running one ``[]``), freed at finish or preemption, never
  trimmed. Chunks are not capped by the capacity (vLLM's ring,
  docs/DESIGN.md §4 "circular group": reads inside the chunk come from the step itself, only the chunk's
  last ``capacity`` tokens are written).
* Hybrid blocks (``blocks_per_kv_block = f``): the pool hands out allocation blocks ``b``; steps
  carry those allocation ids (as a real scheduler does), while block tables (the pipeline's, and
  the views here) hold kernel-block ids ``b*f .. b*f+f-1`` (``f`` zeros for the null block).
* Token budget ``max_num_batched_tokens``: running decodes first (``1 + num_speculative_tokens``
  tokens each, fewer near the budget or ``max_model_len``), then running
  prefills (chunked, at most ``long_prefill_threshold`` tokens each), then waiting requests
  (preempted ones first, then arrivals in order) while the budget and ``max_num_seqs`` allow and
  their blocks fit. Batch order in the step is the scheduling order, so decodes come first.
* Speculative decoding: after a step, ``update_after_step(accepted)`` keeps ``1 + accepted`` tokens
  of a decode (``num_computed_tokens`` advances by that; rejected positions are rewritten next
  step). A request is a decode once it has produced its first token and has one token left
  to compute; spec tokens are only scheduled for decodes.
* Preemption: when a running request cannot get its blocks, the newest running request not yet
  scheduled in this step (possibly itself) is preempted: all its blocks are freed and its id is in
  this step's ``preempted_req_ids``. No waiting request is admitted in a step that preempted.
  It resumes later (front of the waiting queue) recomputing from 0, or from the replay start of a
  prefix hit, as ``RunningRequest(resumed=True)`` with its *whole* block lists (like vLLM).
* Finish: a request that produced ``max_new_tokens`` tokens is finished after that step; its blocks
  are freed then and its id is in the next step's ``finished_req_ids``.
* Prefix cache (``enable_prefix_caching``), only on the one ``prefix_cacheable`` full group, and only
  when every other full group is prefix-cacheable too (i.e. there is none). Token ids are not
  modelled: each full prompt block of that group has a content key, ``(owner, block_index)``;
  ``add_request(..., prefix_of=X, prefix_len=L)`` gives the request X's keys for its first
  ``L // alloc_block_size`` blocks (X an earlier request id, whose keys are inherited, or any other
  string naming a shared prefix). A block is registered once its KV is computed (prompt blocks
  only, not generated tokens). A hit of ``N`` tokens (whole blocks, ``N < prompt_len``) shares those
  blocks, ref-counted, never freed while held. Sliding and circular groups do not have those
  tokens, so the request uses bounded replay (docs/DESIGN.md §4): ``replay_start = max(0, N - W_max)``
  (``W_max`` the largest window of a sliding or circular group) and it is scheduled from
  ``num_computed_tokens = replay_start``; every step that schedules it carries
  ``replay_start[req_id]`` (the sliding-window floor), and every step that schedules positions
  below ``N`` also carries ``replay_end[req_id] = N``. Tokens in ``[replay_start, N)`` are
  recomputed only to rebuild the sliding and state caches: they write nothing into the
  prefix-cacheable group (their compressed rows are already cached in the blocks shared with the
  prefix owner, and a recomputed row need not be bit-identical, so it must not overwrite them).

``add_request`` refuses a request that could not run alone in the pool (a conservative bound:
full blocks for the whole length, sliding blocks for ``W - 1`` + the largest chunk, the ring's
blocks per circular group), so the oldest running request can always progress.

Not modelled: DCP (tables cover global positions), priorities, aborts, caching of generated tokens,
encoder inputs.

NOTE: over the ~400-line guide on purpose: test harness, not core; one state machine (pool, prefix
cache, waiting / running queues, preemption) whose policy reads best in one class.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

from .._common import cdiv, check_int, is_int
from ..frontend import NewRequest, RunningRequest, StepInput

__all__ = ["ReferenceScheduler", "ReqState", "ScheduledView", "CacheWrite", "random_trace", "scripted_trace",
           "cache_writes"]

FREE_POLICIES = ("vllm", "eager", "optimistic")  # NOTE: ReferenceScheduler(free_policy=...)


@dataclass(frozen=True)
class ReqState:
    """Scheduler-side state of one request (copies). ``block_ids``: table ids per gid (kernel blocks,
    0 where released / never needed); ``alloc_block_ids``: pool ids per gid (0 likewise)."""

    req_id: str
    status: str  # "waiting" | "running" | "finished"
    prompt_len: int
    max_new_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    block_ids: Tuple[List[int], ...]
    alloc_block_ids: Tuple[List[int], ...]
    replay_start: int
    prefix_hit_tokens: int


@dataclass(frozen=True)
class ScheduledView:
    """One scheduled request of a step, in the scheduler's own view (what the pipeline must build).

    ``positions`` = ``range(num_computed_tokens, num_computed_tokens + num_scheduled_tokens)``;
    ``block_ids[gid]``: the table row (kernel-block ids, 0 where released; the ring's ``k`` ids for
    a circular group); ``replay_start``: window floor (0 when none); ``is_decode``: scheduled as a decode
    (``1 + spec`` tokens); ``replay_end``: the step's ``replay_end`` of the request (the prefix-hit
    length when the step schedules positions below it, else 0): positions below it write nothing
    into the prefix-cacheable group."""

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: Tuple[List[int], ...]
    replay_start: int
    is_decode: bool
    replay_end: int = 0

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens


class _Req:
    def __init__(self, req_id: str, prompt_len: int, max_new_tokens: int, keys: List[tuple]) -> None:
        self.req_id, self.prompt_len, self.max_new_tokens = req_id, prompt_len, max_new_tokens
        self.keys = keys  # content key per full prompt block of the prefix group
        self.status = "waiting"
        self.num_output = 0
        self.num_computed = 0
        self.blocks: Optional[List[List[int]]] = None  # pool ids per gid (0 = null)
        self.sent_len: List[int] = []  # entries per gid the pipeline's row has
        self.in_batch = False  # the pipeline has a row for it
        self.resumed = False  # preempted earlier: next schedule sends resumed=True
        self.replay_start = 0
        self.prefix_hit = 0
        self.optimistic = 0  # NOTE: free_policy="optimistic": the count its last step would reach, every draft accepted

    def held(self) -> List[List[int]]:
        """``blocks`` of a request that holds them (scheduled, not freed since)."""
        assert self.blocks is not None, f"request {self.req_id!r} holds no blocks"
        return self.blocks

    @property
    def num_tokens(self) -> int:  # tokens known (prompt + sampled); the last one has no KV yet
        return self.prompt_len + self.num_output

    @property
    def is_decode(self) -> bool:
        return self.num_output > 0 and self.num_tokens - self.num_computed == 1


def _ring_blocks(g) -> int:
    """Blocks of a circular group's ring per request (``GroupSpec.ring_blocks``; 1 for a group
    record without it)."""
    return int(getattr(g, "ring_blocks", 1)) if g.kind == "circular" else 1


def _int(name, v, minimum):
    return check_int(name, v, lo=minimum)


class ReferenceScheduler:
    """Reference scheduler (see the module docstring for what it models).

    Parameters
    ----------
    groups : sequence of GroupSpec, or a DSV4Layout
        kv-cache groups in gid order (fields ``kind`` (``"full"``, ``"sliding"`` or ``"circular"``),
        ``block_size``, ``window``, ``prefix_cacheable``, ``table_width``, optional
        ``blocks_per_kv_block``).
    num_blocks : int
        Pool size, ids ``0..num_blocks-1`` (0 is the null block).
    max_num_batched_tokens, max_num_seqs : int
        Token budget and running-request cap per step.
    num_speculative_tokens : int
        Draft tokens per decode.
    long_prefill_threshold : int, optional
        Cap on a prefill chunk per request per step.
    enable_prefix_caching : bool
    seed : int
        Seeds :meth:`random_acceptance` (and :meth:`random_trace` when given no seed).
    cache_when_scheduled : bool
        Register a prompt block in the prefix cache when the step that fills it is scheduled (vLLM's
        ``cache_blocks`` in ``allocate_slots``), not once it is computed: a request admitted later in the
        same step then shares the block its allocator is filling in that step.
    free_policy : str
        When sliding blocks wholly behind a request's window are freed: ``"vllm"`` (vLLM 0.33: in
        ``allocate_slots`` of a request scheduled in the step, behind the window of its committed tokens);
        ``"eager"`` (at the start of every step, for every running request, scheduled or not; the token budget
        may leave it out, its row stays); ``"optimistic"`` (async scheduling: like ``"vllm"``, but behind the
        window of the count its last step would reach with every draft accepted, before the acceptance is
        known: a request whose drafts were rejected may then read a block handed on, which the pipeline must
        refuse at the read).
    """

    def __init__(self, groups, num_blocks: int, *, max_num_batched_tokens: int, max_num_seqs: int,
                 num_speculative_tokens: int = 0, long_prefill_threshold: Optional[int] = None,
                 enable_prefix_caching: bool = True, seed: int = 0, cache_when_scheduled: bool = False,
                 free_policy: str = "vllm"):
        groups = tuple(getattr(groups, "groups", groups))
        if not groups:
            raise ValueError("groups must not be empty")
        for g in groups:
            if g.kind not in ("full", "sliding", "circular") or (g.kind == "full") != (g.window is None):
                raise ValueError(f"groups: group {g.name!r} has kind {g.kind!r}, window {g.window!r}")
            cap = _ring_blocks(g) * g.block_size
            if g.kind == "circular" and (getattr(g, "blocks_per_kv_block", 1) != 1 or cap < g.window):
                raise ValueError(f"groups: circular group {g.name!r} needs blocks_per_kv_block 1 and a "
                                 f"capacity ({cap}) >= its window {g.window}")
        self.groups = groups
        self.num_blocks = _int("num_blocks", num_blocks, 2)
        self.max_num_batched_tokens = _int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_num_seqs = _int("max_num_seqs", max_num_seqs, 1)
        self.num_speculative_tokens = _int("num_speculative_tokens", num_speculative_tokens, 0)
        if long_prefill_threshold is not None:
            _int("long_prefill_threshold", long_prefill_threshold, 1)
        self.long_prefill_threshold = long_prefill_threshold
        self.seed = seed
        if free_policy not in FREE_POLICIES:
            raise ValueError(f"free_policy must be one of {FREE_POLICIES}, got {free_policy!r}")
        self.free_policy = free_policy
        self._cache_when_scheduled = bool(cache_when_scheduled)
        self._f = [getattr(g, "blocks_per_kv_block", 1) for g in groups]
        self._abs = [g.block_size * f for g, f in zip(groups, self._f)]  # allocation block sizes
        self.max_model_len = min((g.table_width * g.block_size for g in groups if g.kind != "circular"),
                                 default=min(g.table_width * g.block_size for g in groups))
        # NOTE: bounded replay rebuilds the last W positions of every sliding and circular group
        self.max_window = max((g.window for g in groups if g.kind != "full"), default=0)
        pc = [g.gid for g in groups if g.prefix_cacheable]
        if len(pc) > 1:
            raise ValueError(f"groups: at most one prefix_cacheable group is supported, got gids {pc}")
        full_ok = all(g.prefix_cacheable for g in groups if g.kind == "full")
        use_cache = enable_prefix_caching and pc and groups[pc[0]].kind == "full" and full_ok
        self._pg = pc[0] if use_cache else None  # gid of the prefix-cached group
        self._rng = random.Random(seed)
        # pool
        self._free: Dict[int, None] = dict.fromkeys(range(1, num_blocks))  # NOTE: insertion order = LRU
        self._ref = [0] * num_blocks
        self._cache: Dict[tuple, int] = {}  # content key -> pool id
        self._block_key: Dict[int, tuple] = {}
        # requests
        self._reqs: Dict[str, _Req] = {}
        self._keys: Dict[str, list] = {}  # every request ever added (for prefix_of)
        self._waiting: List[str] = []
        self._running: List[str] = []  # admission order: newest last
        self._finished: List[str] = []  # finished since the last step
        self._last: Optional[Tuple[StepInput, List[ScheduledView]]] = None
        self._pending = False  # schedule() called, update_after_step() not yet

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_len: int, max_new_tokens: int, *,
                    prefix_of: Optional[str] = None, prefix_len: int = 0) -> None:
        """Queue a request. ``prefix_of`` (an earlier request id, or a name for a shared prefix)
        and ``prefix_len``: the first ``prefix_len`` prompt tokens equal that prefix's."""
        if not isinstance(req_id, str) or req_id in self._keys:
            raise ValueError(f"req_id must be a new str, got {req_id!r}")
        _int("prompt_len", prompt_len, 1)
        _int("max_new_tokens", max_new_tokens, 1)
        if prompt_len + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")
        if prompt_len + max_new_tokens > self.max_request_len():
            raise ValueError(f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens}: the request "
                             f"alone would not fit in num_blocks={self.num_blocks}")
        _int("prefix_len", prefix_len, 0)
        if prefix_len > prompt_len or (prefix_len and not isinstance(prefix_of, str)):
            raise ValueError(f"prefix_len {prefix_len} needs prefix_of (a str) and must be <= "
                             f"prompt_len {prompt_len}")
        keys = []
        if self._pg is not None:
            bs = self._abs[self._pg]
            shared = prefix_len // bs
            if prefix_of in self._keys:  # NOTE: request ids take precedence over prefix names
                keys = self._keys[prefix_of][:shared]
            elif prefix_of is not None:
                keys = [(prefix_of, j) for j in range(shared)]
            keys += [(req_id, j) for j in range(len(keys), prompt_len // bs)]
        self._keys[req_id] = keys
        self._reqs[req_id] = _Req(req_id, prompt_len, max_new_tokens, keys)
        self._waiting.append(req_id)

    def max_request_len(self) -> int:
        """Longest request (prompt + new tokens) that fits the pool alone."""
        lo, hi = 0, self.max_model_len
        while lo < hi:  # NOTE: worst-case need is monotone in the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._worst_need(mid) <= self.num_blocks - 1 else (lo, mid - 1)
        return lo

    def _worst_need(self, length: int) -> int:
        k = self.num_speculative_tokens  # NOTE: a decode may write k positions past the length
        top = min(length + k, self.max_model_len)
        prefill = min(length, self.long_prefill_threshold or length)
        chunk = min(self.max_num_batched_tokens, max(prefill, 1 + k))
        return sum(cdiv(top, a) if g.kind == "full" else _ring_blocks(g) if g.kind == "circular"
                   else cdiv(g.window - 1 + chunk, a) + 1
                   for g, a in zip(self.groups, self._abs))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running_req_ids(self) -> List[str]:
        return list(self._running)

    @property
    def waiting_req_ids(self) -> List[str]:
        return list(self._waiting)

    def req_state(self, req_id: str) -> ReqState:
        if req_id not in self._reqs:
            raise ValueError(f"req_id: unknown request {req_id!r}")
        r = self._reqs[req_id]
        alloc = tuple(list(b) for b in r.blocks) if r.blocks else tuple([] for _ in self.groups)
        return ReqState(req_id, r.status, r.prompt_len, r.max_new_tokens, r.num_computed, r.num_output,
                        self._table(r), alloc, r.replay_start, r.prefix_hit)

    def free_block_ids(self) -> List[int]:
        """Pool ids on the free queue (cached ones included), LRU first."""
        return list(self._free)

    def block_holders(self) -> Dict[int, Set[str]]:
        """Pool id -> ids of the running requests holding it (any group); the null block is absent.

        Between :meth:`schedule` and :meth:`update_after_step` this is the ownership the step's cache
        writes must respect (see :func:`cache_writes`)."""
        out: Dict[int, Set[str]] = {}
        for rid in self._running:
            for ids in self._reqs[rid].blocks or ():
                for b in ids:
                    if b:
                        out.setdefault(b, set()).add(rid)
        return out

    # ------------------------------------------------------------------ pool
    def _take(self) -> int:
        b = next(iter(self._free))
        del self._free[b]
        key = self._block_key.pop(b, None)
        if key is not None:  # evict
            del self._cache[key]
        self._ref[b] = 1
        return b

    def _hold(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free[b] = None

    def _table(self, r: _Req) -> Tuple[List[int], ...]:
        if not r.blocks:
            return tuple([] for _ in self.groups)
        return tuple([b * f + j if b else 0 for b in ids for j in range(f)]
                     for ids, f in zip(r.blocks, self._f))

    def _trim(self, r: _Req) -> None:
        """Release sliding blocks wholly below the oldest position the next step reads (``free_policy``
        ``"optimistic"``: were every draft of its last step accepted)."""
        c = max(r.num_computed, r.optimistic) if self.free_policy == "optimistic" else r.num_computed
        for g, a, ids in zip(self.groups, self._abs, r.held()):
            if g.kind == "sliding":
                for j in range(min(len(ids), max(0, c - g.window + 1) // a)):
                    if ids[j]:
                        self._release(ids[j])
                        ids[j] = 0

    def _plan(self, r: _Req, n: int) -> List[List[bool]]:
        """Entries to append per gid for scheduling ``[c, c + n)``: True = allocate, False = null."""
        c, plan = r.num_computed, []
        for g, a, ids in zip(self.groups, self._abs, r.held()):
            if g.kind == "circular":  # NOTE: the ring's k blocks for the request's whole life
                plan.append([] if ids else [True] * _ring_blocks(g))
                continue
            lo = 0 if g.kind == "full" else max(0, r.replay_start, c - g.window + 1) // a
            plan.append([j >= lo for j in range(len(ids), cdiv(c + n, a))])
        return plan

    def _allocate(self, r: _Req, plan) -> None:
        for ids, p in zip(r.held(), plan):
            ids.extend(self._take() if need else 0 for need in p)

    def _free_all(self, r: _Req) -> None:
        for ids in reversed(r.held()):
            for b in reversed(ids):  # NOTE: tail blocks first, so they are evicted first
                if b:
                    self._release(b)
        r.blocks = None

    def _register(self, r: _Req, upto: Optional[int] = None) -> None:
        if self._pg is None or not r.blocks:
            return
        ids = r.blocks[self._pg]
        for j in range(min(r.num_computed if upto is None else upto, r.prompt_len) // self._abs[self._pg]):
            key, b = r.keys[j], ids[j]
            if key not in self._cache and b not in self._block_key:
                self._cache[key] = b
                self._block_key[b] = key

    def _prefix_hit(self, r: _Req) -> List[int]:
        hits = []
        if self._pg is not None:
            for j in range(min(len(r.keys), (r.prompt_len - 1) // self._abs[self._pg])):
                b = self._cache.get(r.keys[j])
                if b is None:
                    break
                hits.append(b)
        return hits

    # ------------------------------------------------------------------ scheduling
    def _chunk(self, r: _Req, budget: int) -> int:
        if r.is_decode:
            n = min(1 + self.num_speculative_tokens, self.max_model_len - r.num_computed)
        else:
            n = r.num_tokens - r.num_computed
            if self.long_prefill_threshold is not None:
                n = min(n, self.long_prefill_threshold)
        return min(n, budget)

    def _preempt(self, r: _Req) -> None:
        self._free_all(r)
        self._running.remove(r.req_id)
        self._waiting.insert(0, r.req_id)
        r.status, r.num_computed, r.replay_start, r.prefix_hit, r.optimistic = "waiting", 0, 0, 0, 0
        r.in_batch, r.resumed = False, True

    def schedule(self) -> StepInput:
        """Schedule one step; call :meth:`update_after_step` before the next ``schedule()``."""
        if self._pending:
            raise RuntimeError("schedule() called twice without update_after_step()")
        budget, order, preempted = self.max_num_batched_tokens, [], []
        running = [self._reqs[rid] for rid in self._running]
        if self.free_policy == "eager":
            for r in running:
                self._trim(r)
        scheduled = set()
        for r in [r for r in running if r.is_decode] + [r for r in running if not r.is_decode]:
            if budget == 0:
                break
            if r.status != "running":
                continue  # preempted earlier in this step
            self._trim(r)  # NOTE: like vLLM's allocate_slots: only a request it schedules releases blocks
            n = self._chunk(r, budget)
            plan = self._plan(r, n)
            while sum(map(sum, plan)) > len(self._free):
                victim = next(self._reqs[v] for v in reversed(self._running) if v not in scheduled)
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is r:
                    break
            if r.status != "running":
                continue
            self._allocate(r, plan)
            if self._cache_when_scheduled:
                self._register(r, r.num_computed + n)
            order.append((r, n, r.is_decode))
            scheduled.add(r.req_id)
            budget -= n
        while not preempted and self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            r = self._reqs[self._waiting[0]]
            hits = self._prefix_hit(r)
            r.blocks = [[] for _ in self.groups]
            if hits:
                assert self._pg is not None  # NOTE: hits come from the prefix-cached group only
                r.prefix_hit = len(hits) * self._abs[self._pg]
                r.replay_start = r.num_computed = max(0, r.prefix_hit - self.max_window)
                r.blocks[self._pg] = list(hits)
            n = self._chunk(r, budget)
            plan = self._plan(r, n)
            if sum(map(sum, plan)) + sum(self._ref[b] == 0 for b in hits) > len(self._free):
                r.blocks, r.prefix_hit, r.replay_start, r.num_computed = None, 0, 0, 0
                break
            for b in hits:
                self._hold(b)
            self._allocate(r, plan)
            if self._cache_when_scheduled:
                self._register(r, r.num_computed + n)
            self._waiting.pop(0)
            self._running.append(r.req_id)
            r.status = "running"
            order.append((r, n, False))
            budget -= n

        new_reqs, running_reqs, views = [], [], []
        for r, n, dec in order:
            table = self._table(r)
            alloc = tuple(list(b) for b in r.held())  # NOTE: steps carry allocation ids; tables expand them
            if not r.in_batch and not r.resumed:
                new_reqs.append(NewRequest(r.req_id, alloc, r.num_computed))
            elif not r.in_batch:
                running_reqs.append(RunningRequest(r.req_id, alloc, r.num_computed, resumed=True))
            else:
                running_reqs.append(RunningRequest(r.req_id, tuple(t[s:] for t, s in zip(alloc, r.sent_len)),
                                                   r.num_computed))
            r.in_batch, r.resumed, r.sent_len = True, False, [len(t) for t in alloc]
            end = r.prefix_hit if r.num_computed < r.prefix_hit else 0  # NOTE: replayed positions
            views.append(ScheduledView(r.req_id, r.num_computed, n, table, r.replay_start, dec, end))
        step = StepInput(new_reqs, running_reqs, {r.req_id: n for r, n, _ in order},
                         finished_req_ids=list(self._finished), preempted_req_ids=preempted,
                         replay_start={r.req_id: r.replay_start for r, _, _ in order if r.prefix_hit},
                         replay_end={r.req_id: r.prefix_hit for r, _, _ in order
                                     if r.num_computed < r.prefix_hit})
        self._finished = []
        self._last, self._pending = (step, views), True
        return step

    def batch_view(self, step: StepInput) -> List[ScheduledView]:
        """The scheduler's view of ``step`` (must be the last scheduled step), in batch order."""
        if self._last is None or self._last[0] is not step:
            raise ValueError("step must be the StepInput returned by the last schedule()")
        return list(self._last[1])

    def random_acceptance(self, step: StepInput, rng: Optional[random.Random] = None) -> Dict[str, int]:
        """Accepted draft tokens per decode of ``step``, uniform in ``[0, spec]`` (seeded)."""
        rng = rng or self._rng
        return {v.req_id: rng.randint(0, v.num_scheduled_tokens - 1)
                for v in self.batch_view(step) if v.is_decode and v.num_scheduled_tokens > 1}

    def update_after_step(self, accepted: Optional[Dict[str, int]] = None) -> None:
        """Advance the requests of the last step. ``accepted[req_id]``: draft tokens accepted by a
        decode (missing = 0); a decode keeps ``1 + accepted`` tokens."""
        if not self._pending:
            raise RuntimeError("update_after_step() called without a scheduled step")
        accepted = dict(accepted or {})
        assert self._last is not None  # NOTE: _pending is set together with _last
        views = {v.req_id: v for v in self._last[1]}
        for rid, a in accepted.items():
            v = views.get(rid)
            if v is None or not v.is_decode or not is_int(a) or not 0 <= a < v.num_scheduled_tokens:
                raise ValueError(f"accepted[{rid!r}] = {a!r}: not a decode of the last step, or not in "
                                 f"[0, num_scheduled_tokens - 1]")
        self._pending = False
        for v in self._last[1]:
            r = self._reqs[v.req_id]
            r.optimistic = v.seq_len
            left = r.num_tokens - v.num_computed_tokens
            if v.num_scheduled_tokens < left:  # partial prefill chunk
                r.num_computed = v.seq_len
            else:
                a = min(accepted.get(r.req_id, 0), r.max_new_tokens - r.num_output - 1)
                r.num_computed = v.num_computed_tokens + left + a
                r.num_output += 1 + a
            self._register(r)
            if r.num_output >= r.max_new_tokens:
                self._free_all(r)
                self._running.remove(r.req_id)
                r.status = "finished"
                self._finished.append(r.req_id)

    # ------------------------------------------------------------------ traces
    def random_trace(self, num_steps: int, seed: Optional[int] = None, *, arrival_prob: float = 0.5,
                     max_arrivals: int = 2, prompt_len: Tuple[int, int] = (1, 700),
                     max_new_tokens: Tuple[int, int] = (1, 24), prefix_prob: float = 0.4,
                     ) -> Iterator[Tuple[StepInput, List[ScheduledView]]]:
        """Drive this scheduler with random arrivals (some sharing prefixes with earlier requests or
        named prefixes) and random acceptance; yields ``(step, batch_view(step))`` per step and
        advances after each yield. Deterministic given ``seed`` (default: the scheduler's)."""
        rng = random.Random(self.seed if seed is None else seed)
        cap = self.max_request_len()
        for _ in range(_int("num_steps", num_steps, 0)):
            for _ in range(rng.randint(1, max_arrivals) if rng.random() < arrival_prob else 0):
                new = rng.randint(max_new_tokens[0], min(max_new_tokens[1], cap - 1))
                plen = rng.randint(min(prompt_len[0], cap - new), min(prompt_len[1], cap - new))
                prefix_of, shared = None, 0
                if rng.random() < prefix_prob:  # an earlier request, or a named prefix of fixed length
                    prefix_of = rng.choice(list(self._keys)[-8:] + ["sys0", "sys1"])
                    base = (self._reqs[prefix_of].prompt_len if prefix_of in self._reqs
                            else prompt_len[1] // (2 if prefix_of == "sys0" else 1))
                    shared = base if rng.random() < 0.7 else rng.randint(0, base)
                    plen = max(plen, min(shared + rng.randint(1, 32), cap - new))
                    shared = min(shared, plen)
                self.add_request(f"r{len(self._keys)}", plen, new, prefix_of=prefix_of, prefix_len=shared)
            step = self.schedule()
            yield step, self.batch_view(step)
            self.update_after_step(self.random_acceptance(step, rng))


class CacheWrite(NamedTuple):
    """One cache write of a step (see :func:`cache_writes`)."""

    channel: str
    field: str         # "slot_mapping" or "compressed_slot_mapping"
    token: int         # token index in the step
    position: int
    req_id: str        # the writer
    slot: int
    block: int         # pool (allocation) block id holding the slot
    others: frozenset  # running requests other than the writer that hold ``block``
    owned: bool        # the writer holds ``block``


def cache_writes(meta, holders: Dict[int, Set[str]], channels: Optional[Sequence[str]] = None
                 ) -> List[CacheWrite]:
    """Every cache write of one step's metadata, with the block ownership it touches.

    Parameters
    ----------
    meta : DSV4Metadata
        Built from an id-keyed step (``meta.req_ids`` set), without DCP.
    holders : dict[int, set[str]]
        Pool id -> requests holding it: :meth:`ReferenceScheduler.block_holders` taken after the
        ``schedule()`` that produced the step.
    channels : sequence of str, optional
        Channels to read (default: all); a channel's ``slot_mapping`` and ``compressed_slot_mapping``.

    Returns
    -------
    list of CacheWrite
        One entry per (channel, field, token) with a slot ``>= 0``. A write with ``others`` non-empty
        lands in a block another live request holds (prefix-shared KV); ``owned`` False: in a block
        the writer does not hold. Both must never happen.
    """
    T = meta.num_tokens
    if meta.req_ids is None:
        raise ValueError("meta: needs req_ids (a step given as StepInput)")
    req = [meta.req_ids[b] for b in meta.token_to_req[:T].tolist()]
    pos = meta.positions[:T].tolist()
    out: List[CacheWrite] = []
    for name, ch in meta.channels.items():
        if channels is not None and name not in channels:
            continue
        f = meta.layout.groups[ch.gid].blocks_per_kv_block
        for fld in ("slot_mapping", "compressed_slot_mapping"):
            sm = getattr(ch, fld)
            if sm is None:
                continue
            for t, s in enumerate(sm[:T].tolist()):
                if s < 0:
                    continue
                b = s // ch.rows_per_block // f
                hs = holders.get(b, set())
                out.append(CacheWrite(name, fld, t, pos[t], req[t], s, b, frozenset(hs - {req[t]}), req[t] in hs))
    return out


def random_trace(groups, num_steps: int, seed: int = 0, *, num_blocks: int = 48,
                 max_num_batched_tokens: int = 64, max_num_seqs: int = 6, num_speculative_tokens: int = 2,
                 long_prefill_threshold: Optional[int] = None, enable_prefix_caching: bool = True,
                 cache_when_scheduled: bool = False, **trace_kwargs) -> Iterator[Tuple[StepInput, List[ScheduledView]]]:
    """A fresh :class:`ReferenceScheduler` over ``groups`` (or a layout) driven by
    :meth:`ReferenceScheduler.random_trace`; yields ``(step, views)``."""
    sched = ReferenceScheduler(groups, num_blocks, max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs, num_speculative_tokens=num_speculative_tokens,
                               long_prefill_threshold=long_prefill_threshold,
                               enable_prefix_caching=enable_prefix_caching, seed=seed,
                               cache_when_scheduled=cache_when_scheduled)
    return sched.random_trace(num_steps, seed, **trace_kwargs)


def scripted_trace(scheduler: ReferenceScheduler, script: Sequence[dict], *, drain: bool = False,
                   max_steps: int = 10_000) -> Iterator[Tuple[StepInput, List[ScheduledView]]]:
    """Deterministic trace for examples. ``script[i]`` describes step ``i``: ``{"add": [args or
    kwargs of add_request, ...], "accept": {req_id: accepted}}`` (both optional). With ``drain``,
    steps continue (accepting nothing) until every request finished. Yields ``(step, views)``."""
    i = 0
    while i < len(script) or (drain and scheduler.has_unfinished() and i < max_steps):
        entry = script[i] if i < len(script) else {}
        for args in entry.get("add", ()):
            if isinstance(args, dict):
                scheduler.add_request(**args)
            else:
                scheduler.add_request(*args)
        step = scheduler.schedule()
        yield step, scheduler.batch_view(step)
        scheduler.update_after_step(entry.get("accept"))
        i += 1
