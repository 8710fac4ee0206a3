"""The ``Examples`` of the public ops' docstrings run and print what they show (doctest).

Under ``TRITON_INTERPRET=1`` (``./dev test``) the ops run their Triton kernels, otherwise the PyTorch
reference: the printed values are the same either way.
"""

import doctest
import importlib

import pytest

import dsv4_index.ops as ops

OPS = sorted(n for n in ops.__all__ if n != "IndexerLengths")


@pytest.mark.parametrize("name", OPS)
def test_op_docstring_examples_run(name):
    module = importlib.import_module(f"dsv4_index.ops.{name}")
    fn = getattr(module, name)
    assert "Examples\n    --------\n    >>> " in fn.__doc__, f"{name} has no runnable Examples section"
    res = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False, report=True)
    assert res.attempted >= 3 and res.failed == 0, res


def test_check_int_examples():
    import dsv4_index._common as common
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    (test,) = [t for t in finder.find(common.check_int, "check_int", globs=vars(common)) if t.examples]
    r = runner.run(test)
    assert r.attempted == 3 and r.failed == 0, r
