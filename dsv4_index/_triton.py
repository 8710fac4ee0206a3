"""Optional Triton: ``from .._triton import triton, tl`` in every kernel module.

With triton installed these are the real ``triton`` and ``triton.language``. Without it (macOS, Windows,
hosts where no wheel exists) they are stand-ins that let the kernel modules import: ``@triton.jit``
returns a kernel that raises :class:`TritonUnavailable` when launched, ``tl.constexpr`` is a plain int,
``triton.cdiv`` / ``triton.next_power_of_2`` are computed in Python. The reference backend then runs
everything (:func:`dsv4_index._common.use_triton` never picks Triton without it).
"""

from __future__ import annotations

__all__ = ["HAVE_TRITON", "TritonUnavailable", "MISSING_MESSAGE", "triton", "tl"]

MISSING_MESSAGE = ("the Triton backend needs the `triton` package, which is not installed "
                   "(pip install 'dsv4-index[triton]', the tested Triton; there is no wheel for macOS or Windows). "
                   "The PyTorch reference runs without it: backend='reference', or unset TRITON_INTERPRET")


class TritonUnavailable(ImportError):
    """A Triton path was asked for and triton is not installed."""


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _Kernel:
        """What ``@triton.jit`` gives without triton: importable, never launchable."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")
            self.__doc__ = getattr(fn, "__doc__", None)

        def __getitem__(self, grid):
            raise TritonUnavailable(f"{self.__name__}: {MISSING_MESSAGE}")

        def __call__(self, *args, **kwargs):
            raise TritonUnavailable(f"{self.__name__}: {MISSING_MESSAGE}")

    class _Triton:
        @staticmethod
        def jit(fn=None, **kwargs):
            return _Kernel(fn) if fn is not None else _Kernel

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

        def __getattr__(self, name):
            raise TritonUnavailable(f"triton.{name}: {MISSING_MESSAGE}")

    class _Constexpr(int):
        """``tl.constexpr(v)`` stand-in: an int with the ``.value`` the host code reads."""

        @property
        def value(self) -> int:
            return int(self)

    class _Language:
        constexpr = _Constexpr

        def __getattr__(self, name):
            raise TritonUnavailable(f"triton.language.{name}: {MISSING_MESSAGE}")

    # NOTE: the ignores: without Triton the module names are stand-ins that raise on use
    triton = _Triton()  # type: ignore[assignment]
    tl = _Language()  # type: ignore[assignment]
