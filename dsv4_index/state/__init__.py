"""Host state of a pipeline, everything ``update()`` writes but the slot map (:mod:`dsv4_index.slot_map`):
request slots (:mod:`.requests`), block tables by request slot (:mod:`.tables`), the staging buffer and its
format (:mod:`.staging`), and the checks that turn a step into a plan before anything changes (:mod:`.plan`,
:mod:`.contract`, :mod:`.steady`)."""

from .plan import CHECK_LEVELS, StepPlan, plan_step
from .requests import RequestState
from .staging import StageLayout, StepStaging
from .tables import BlockTables

__all__ = ["RequestState", "BlockTables", "StageLayout", "StepStaging", "StepPlan", "plan_step", "CHECK_LEVELS"]
