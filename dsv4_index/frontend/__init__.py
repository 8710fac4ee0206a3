"""The front door: what a scheduler hands over (:class:`StepInput`, or a vLLM-style ``SchedulerOutput``)
converted into the array-form :class:`~dsv4_index.batch.StepBatch`, through the request-id -> slot map
of :class:`~dsv4_index.state.requests.SlotMap`.

* :mod:`.step_input`: ``StepInput``, ``NewRequest``, ``RunningRequest`` and their static check;
* :mod:`.rules`: every rule of an id-keyed step (imports nothing of the front door);
* :mod:`.convert`: the general conversion and :func:`explain` (array errors in the scheduler's terms);
* :mod:`.fast`: the same conversion for a step that repeats the last batch (None when unsure).

Both conversions are pure: they return the batch and a ``SlotMapDelta`` that the caller commits only
after the pipeline accepted the batch, so a rejected step changes nothing.
"""

from .convert import batch_from_scheduler_output, batch_from_step, explain
from .rules import LIMIT, StepTypeError
from .step_input import NewRequest, RunningRequest, StepInput, check_step

__all__ = ["StepInput", "NewRequest", "RunningRequest", "StepTypeError", "check_step", "batch_from_step",
           "batch_from_scheduler_output", "explain", "LIMIT"]
