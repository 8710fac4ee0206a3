"""Host state of a pipeline, everything ``update()`` writes: request slots (:mod:`.requests`), block
tables by request slot (:mod:`.tables`), the staging buffer and its format (:mod:`.staging`), and the
checks that turn a step into a plan before anything changes: the general checks and the source of
every message (:mod:`.plan`, :mod:`.plan_runs`, :mod:`.contract`), and the incremental path that plans
any step from the last accepted batch at the cost of what changed (:mod:`.steady`, :mod:`.fast_runs`,
:mod:`.fast_full`); the host index formulas live in :mod:`._index`."""

from .plan import CHECK_LEVELS, StepPlan, plan_step
from .requests import RequestState
from .staging import StageLayout, StepStaging
from .tables import BlockTables

__all__ = ["RequestState", "BlockTables", "StageLayout", "StepStaging", "StepPlan", "plan_step", "CHECK_LEVELS"]
