"""The shared helpers of the test suite (``tests/`` is on ``sys.path``: ``from helpers.layouts import tiny_layout``).

Test modules import helpers from here and never from another test module (``tests/repo/test_test_tree.py``
checks it). One module per kind of helper:

* :mod:`helpers.layouts`: the small layouts the tests share (``tiny_layout``, ``two_layer_layout``, ``flash_layout``);
* :mod:`helpers.pipelines`: hand-written steps, poisoned three-way comparisons of pipelines (fused == per-op ==
  reference), eventful reference-scheduler traces;
* :mod:`helpers.rejections`: the transactional-update harness: its two layouts and trace, and every state and
  output of a pipeline frozen for comparison (``state``, ``outputs``, ``diff``);
* :mod:`helpers.batches`: ``StepBatch`` steps for the ownership tests: hand-written rows and runs, and random
  serving steps with one mutation each;
* :mod:`helpers.slot_batches`: random batches and block tables for the per-op kernel tests;
* :mod:`helpers.paged_model`: the paged == dense harness of the small attention model over a scheduler trace;
* :mod:`helpers.scripts`: run the scripts of ``benchmarks/`` and ``examples/`` in a subprocess, hang guards;
* :mod:`helpers.vllm_stub`: a stand-in for vLLM's ``SchedulerOutput`` types.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
