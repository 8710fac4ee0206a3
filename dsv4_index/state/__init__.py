"""Host state of a pipeline, everything ``update()`` writes: request slots (:mod:`.requests`), block
tables by request slot (:mod:`.tables`), block ownership (:mod:`.owners`), the staging buffer
(:mod:`.staging`: its format, one compiled write pass), and the checks that turn a step into a plan before
anything changes (:mod:`.checks`: one compiled pass and its definition; every message in :mod:`.messages`);
the host index formulas live in :mod:`._index`."""

from .checks.naive import plan_step
from .plan import CHECK_LEVELS, StepPlan
from .requests import RequestState
from .staging import StageLayout, StepStaging
from .tables import BlockTables

__all__ = ["RequestState", "BlockTables", "StageLayout", "StepStaging", "StepPlan", "plan_step", "CHECK_LEVELS"]
