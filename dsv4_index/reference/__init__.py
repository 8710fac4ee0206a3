"""Pure-PyTorch references of every functional op (same signatures as :mod:`dsv4_index`).

They define what each index means (DESIGN §4); the Triton kernels must equal them bit for bit.
"""

import importlib
import sys
import types

_OPS = ("token_to_req", "slot_mapping", "compressed_slot_mapping", "window_indices",
        "causal_compressed_indices", "topk_to_slots", "indexer_lengths")

__all__ = list(_OPS)


class _OpsModule(types.ModuleType):
    # NOTE: importing submodule ``reference.<op>`` (e.g. from a kernel wrapper) makes Python set the
    # package attribute ``<op>`` to that submodule; bind the op's function instead.
    def __setattr__(self, name, value):
        if name in _OPS and isinstance(value, types.ModuleType):
            value = getattr(value, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _OpsModule


def __getattr__(name):
    if name in _OPS:
        fn = getattr(importlib.import_module(f"{__name__}.{name}"), name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
