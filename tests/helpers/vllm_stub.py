"""Stand-ins for vLLM's scheduler dataclasses (``vllm/v1/core/sched/output.py`` at HEAD; ``NewRequestData``
as of vLLM 0.33, with V4.1's ``replay_start``), the fields this library reads with their real names and types,
the others present and ignored; and the ``SchedulerOutput`` of a :class:`~dsv4_index.frontend.StepInput` (as
vLLM would send the same step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from dsv4_index.frontend import StepInput


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: Optional[List[int]]
    mm_features: list
    sampling_params: object
    pooling_params: object
    block_ids: Tuple[List[int], ...]
    num_computed_tokens: int
    lora_request: object
    prompt_embeds: object = None
    prompt_is_token_ids: Optional[List[bool]] = None
    prefill_token_ids: Optional[List[int]] = None
    replay_start: int = 0  # NOTE: vLLM 0.33, DeepSeek-V4.1 bounded replay (0: none)


@dataclass
class CachedRequestData:
    req_ids: List[str]
    resumed_req_ids: Set[str]
    new_token_ids: List[List[int]]
    all_token_ids: Dict[str, List[int]]
    new_block_ids: List[Optional[Tuple[List[int], ...]]]
    num_computed_tokens: List[int]
    num_output_tokens: List[int]


@dataclass
class OldCachedRequestData:  # NOTE: vLLM <= 0.10: a list of flags instead of the set
    req_ids: List[str]
    resumed_from_preemption: List[bool]
    new_token_ids: List[List[int]]
    new_block_ids: List[Optional[Tuple[List[int], ...]]]
    num_computed_tokens: List[int]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: Optional[Dict[str, List[int]]]
    scheduled_encoder_inputs: Dict[str, List[int]]
    num_common_prefix_blocks: List[int]
    finished_req_ids: Set[str]
    free_encoder_mm_hashes: List[str]
    preempted_req_ids: Optional[Set[str]] = None
    pending_structured_output_tokens: bool = False
    kv_connector_metadata: object = None
    ec_connector_metadata: object = None


def from_step(step: StepInput, *, old: bool = False, none_when_empty: bool = True) -> SchedulerOutput:
    """vLLM's output for ``step``: ``new_block_ids`` None for a running request without new blocks
    (vLLM's ``get_block_ids(allow_none=True)``), ``old``: the list-of-flags form of older vLLM."""
    run = step.running_requests
    nbs = [None if (none_when_empty and not r.resumed and not any(r.new_block_ids or ())) else
           tuple(map(list, r.new_block_ids or ())) for r in run]
    ids, ncs = [r.req_id for r in run], [r.num_computed_tokens for r in run]
    if old:
        cached = OldCachedRequestData(ids, [bool(r.resumed) for r in run], [[] for _ in run], nbs, ncs)
    else:
        cached = CachedRequestData(ids, {r.req_id for r in run if r.resumed}, [[] for _ in run], {}, nbs, ncs,
                                   [1] * len(run))
    new = [NewRequestData(r.req_id, [], [], None, None, tuple(map(list, r.block_ids)), r.num_computed_tokens, None)
           for r in step.new_requests]
    # NOTE: the step's own draft counts, as vLLM lists them (a request not listed has none); a step that gives
    # none sends no dict, so both forms leave the counts to the default rule (StepInput.drafts)
    drafts = getattr(step, "drafts", None)
    spec = {r: [0] * int(d) for r, d in drafts.items()} if drafts else None
    return SchedulerOutput(new, cached, dict(step.num_scheduled_tokens), step.total_tokens, spec, {}, [],
                           set(step.finished_req_ids), [], set(step.preempted_req_ids))
