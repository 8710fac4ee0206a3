"""The write runs of the blocks a step's running requests append (the front door's one compiled pass).

The repeat conversion (:mod:`dsv4_index.frontend.fast`) packs a step's columns into one int64 array ``a``:
``a[:n_checked]`` the scheduler's counts and block ids (to be range-checked: ``0 <= v <= LIMIT``), then
``lens`` — the length of every per-gid block list of the rows that carry a block tuple, ``G`` per row, row
after row — and the batch row of each such row (``rows``; none: the rows are the batch rows ``0, 1, ...``).
:func:`~.kernel.runs_of` turns it into the write runs of :class:`~dsv4_index.batch.StepBatch`: one run per
non-empty list, in list order, with its gid, its row's request slot and the run offsets ``write_cu``.

* :mod:`.kernel`: the compiled pass (one loop), range-checking what it reads through;
* :mod:`.naive`: its definition in whole-array numpy (``tests/frontend/test_runs_kernel.py`` compares them).
"""

from .kernel import runs_of

__all__ = ["runs_of"]
