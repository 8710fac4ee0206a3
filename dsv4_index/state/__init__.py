"""Host state of a pipeline: block tables by request slot, the staging buffer and its format, and
the checks that turn a step into a plan before anything changes."""

from .plan import CHECK_LEVELS, StepPlan, plan_step
from .staging import StageLayout, StepStaging
from .tables import BlockTables

__all__ = ["BlockTables", "StageLayout", "StepStaging", "StepPlan", "plan_step", "CHECK_LEVELS"]
