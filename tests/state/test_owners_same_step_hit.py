"""Two holes found by mutating vLLM 0.33's own SchedulerOutputs (``benchmarks/vllm_scheduler_loop.py``): a running
request fills a fresh sliding block X while a request admitted in the same step takes X as a prefix hit at
*another* block position, and reads it. The fill check (``state/ownership_checks.py`` ``check_runs``) counts
the holders from before the step and the other fills of the step, not the same step's hits, so the step is
accepted under ``checks="safe"`` and ``"full"``: the filler's token lands in the block the new request reads.
The legitimate twin (vLLM's same-step hit: the new request holds X at the filler's block position, below its
own write start, and the filler writes the whole block) is accepted. Second hole: the same-position exemption
takes a fill as "fresh" when it starts at or after the filler's write start, also when the step writes only part
of the block (``state/ownership_rules.py`` ``_acquisitions``: ``acq_fresh``).

Layout ``tiny``: mla (blocks of 32), swa (W 16, blocks of 8), c4_state (blocks of 4), c128_state (blocks of 8).
"""

from __future__ import annotations

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

TINY = dict(num_hidden_layers=2, compress_ratios=[4, 16], sliding_window=16, index_topk=8)
BS = (32, 8, 4, 8)  # block size per gid
X = 5000  # the swa block the running request fills in step 2


def _pipe(checks):
    lay = DSV4Layout.from_config(TINY, 256, mla_block_size=32, swa_block_size=8, c4_state_block_size=4,
                                 c128_state_block_size=8)
    return MetadataPipeline(lay, 4, 64, "cpu", 2, backend="reference", checks=checks, fused=False)


def _lists(base, upto):
    """Fresh block lists of a request holding positions ``[0, upto)``: ids ``base + 100 * gid + j``."""
    return tuple([base + 100 * g + j for j in range(-(-upto // bs))] for g, bs in enumerate(BS))


def _steps(hit_pos: int, b_nc: int, a_q: int = 10):
    """Step 1: 'a' prefills 30 tokens. Step 2: 'a' schedules positions ``30 .. 30 + a_q - 1`` (its swa block 4,
    positions 32..39, is the fresh X: written whole when ``a_q = 10``) and 'b' is admitted with ``b_nc``
    computed tokens and X at swa block ``hit_pos``."""
    a1 = StepInput([NewRequest("a", _lists(1000, 30), 0)], [], {"a": 30})
    a_new = tuple([1000 + 100 * g + j for j in range(-(-30 // bs), -(-(30 + a_q) // bs))] for g, bs in enumerate(BS))
    a_new[1][:] = [X]  # NOTE: swa block position 4 (positions 32..39)
    b = _lists(3000, b_nc + 1)
    b[1][hit_pos] = X
    a2 = StepInput([NewRequest("b", b, b_nc)], [RunningRequest("a", a_new, 30)], {"a": a_q, "b": 1})
    return a1, a2


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_same_step_hit_at_the_fillers_position_is_accepted(checks):
    pipe = _pipe(checks)
    for step in _steps(hit_pos=4, b_nc=40):
        pipe.update(step)


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_fill_of_a_block_another_new_request_hits_elsewhere_is_rejected(checks):
    pipe = _pipe(checks)
    first, second = _steps(hit_pos=1, b_nc=16)  # NOTE: 'b' reads swa blocks 0..2 (positions 1..16): X at 1
    pipe.update(first)
    with pytest.raises(ValueError, match="another live request holds"):
        pipe.update(second)


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_a_same_position_hit_of_a_block_the_filler_writes_only_in_part_is_rejected(checks):
    """Found the same way (an MTP lookahead block): 'a' writes positions 32, 33 of X this step, 'b' claims
    32..39 computed through a hit of X at the same block position and reads 34..39, which nobody wrote."""
    pipe = _pipe(checks)
    first, second = _steps(hit_pos=4, b_nc=40, a_q=4)
    pipe.update(first)
    with pytest.raises(ValueError, match="another live request holds"):
        pipe.update(second)
