"""Host side of the fused launch: pack the builders' :class:`~dsv4_index.fused.tasks.FusedTask`
descriptors into a device table once, then launch :func:`~dsv4_index.fused.kernel.fused_step_kernel`
once per step. The plan knows no builder class: it only packs what builders hand it.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, List, Sequence

import numpy as np
import torch
import triton

from .._common import cdiv, interpreting
from ..state.staging import StageLayout
from .kernel import fused_step_kernel
from .tasks import (F_A, F_B, F_CPI, F_CPR, F_CPW, F_EXTRA, F_FLAGS, F_GROUP, F_KIND, F_OUT0, F_OUT1, F_OUT2, F_OUT3, F_RING, F_STRIDE,
                    F_TABLE, F_TWIDTH, F_WIDTH, FLAG_WINDOW_FLOOR, FLAG_WRITE_FLOOR, KINDS, NUM_FIELDS,
                    REQUEST_KINDS, TOKEN_KINDS, FusedTask)

__all__ = ["FusedPlan"]


class FusedPlan:
    """One fused launch per step for a list of tasks.

    Parameters
    ----------
    tasks : sequence of FusedTask — every builder's tasks plus the pipeline's own (identical
        tasks run once).
    tables : BlockTables — the flat device tables (addresses, strides, rings, widths).
    group_cp : callable gid -> (world, rank, interleave).
    stage : int32 device buffer (the staging buffer's device twin).
    next_n : int — decode view width.
    block_t, block_c, block_r : token rows, index-list columns and request rows per program.
    num_writers, block_w : programs applying staged block ids, ids per store.

    Attributes
    ----------
    tasks : list of FusedTask (deduplicated, request tasks first).
    num_units : (request units, token units).
    """

    def __init__(self, tasks: Sequence[FusedTask], tables, group_cp, stage: torch.Tensor, next_n: int, *,
                 block_t: int = None, block_c: int = 128, block_r: int = 256, num_writers: int = None,
                 block_w: int = 256, num_warps: int = 4):
        interp = interpreting()
        # NOTE: H200 sweep (BENCHMARKS.md): 8 tokens x 4 warps per program is the best or within 10 % of
        # the best of {8, 16, 32} x {2, 4, 8} for decode B=1, B=256 and an 8K prefill
        self.block_t = block_t or (64 if interp else 8)
        self.num_warps = num_warps
        self.block_c, self.block_r, self.block_w = block_c, block_r, block_w
        self.num_writers = num_writers or (1 if interp else 8)
        for name, v in (("block_t", self.block_t), ("block_c", block_c), ("block_r", block_r), ("block_w", block_w)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        seen: Dict[tuple, FusedTask] = {}
        for t in tasks:
            if t.kind not in KINDS:
                raise ValueError(f"task kind {t.kind!r} is not one of {sorted(KINDS)}")
            seen.setdefault(t.key(), t)
        req = [t for t in seen.values() if t.kind in REQUEST_KINDS]
        tok = [t for t in seen.values() if t.kind in TOKEN_KINDS]
        self.tasks: List[FusedTask] = req + tok
        desc = np.zeros((max(len(self.tasks), 1), NUM_FIELDS), dtype=np.int64)
        units = []
        for i, t in enumerate(self.tasks):
            d = desc[i]
            d[F_KIND] = KINDS[t.kind]
            if len(t.outputs) > 4:
                raise ValueError(f"task {t.kind}: at most four outputs, got {len(t.outputs)}")
            for k, out in enumerate(t.outputs):
                if out is not None:
                    if not out.is_contiguous() or out.device != stage.device:
                        raise ValueError(f"task {t.kind}: output {k} must be a contiguous tensor on {stage.device}")
                    d[(F_OUT0, F_OUT1, F_OUT2, F_OUT3)[k]] = out.data_ptr()
            if t.gid is not None:
                g = t.gid
                d[F_TABLE] = tables.tables[g].data_ptr()
                d[F_STRIDE] = tables.tables[g].stride(0)
                d[F_TWIDTH] = tables.width[g]
                d[F_RING] = tables.ring[g]
                d[F_CPW], d[F_CPR], d[F_CPI] = group_cp(g)
                d[F_GROUP] = g
            else:
                d[F_CPW], d[F_CPI] = 1, 1
            d[F_A], d[F_B], d[F_WIDTH], d[F_EXTRA] = t.a, t.b, t.width, t.extra
            d[F_FLAGS] = (FLAG_WRITE_FLOOR.value if t.write_floor else 0) | \
                         (FLAG_WINDOW_FLOOR.value if t.window_floor else 0)
            tiles = cdiv(t.width, self.block_c) if t.kind in ("window", "causal") else 1
            units += [(i, c) for c in range(tiles)]
        self.num_units = (len(req), len(units) - len(req))
        self.next_n_pad = triton.next_power_of_2(max(next_n, 1))
        self._desc = torch.from_numpy(desc).to(stage.device)
        self._units = torch.tensor(units or [(0, 0)], dtype=torch.int32, device=stage.device)
        self._head = (stage.data_ptr(), tables.flat.data_ptr(), self._desc.data_ptr(), self._units.data_ptr())
        self._stage = stage
        # NOTE: without DCP every task is unsharded: the kernel folds the ownership math away
        self.has_cp = bool((desc[:, F_CPW] > 1).any())
        self._consts = (NUM_FIELDS, self.num_writers, self.block_w, self.block_r, self.block_t, self.block_c,
                        self.next_n_pad, self.has_cp)
        self._compiled = None
        self._direct = (stage.device.type == "cuda" and not interp
                        and os.environ.get("DSV4_INDEX_DIRECT_LAUNCH", "1") not in ("", "0"))

    def num_programs(self, t_pad: int) -> int:
        n_req, n_tok = self.num_units
        return self.num_writers + n_req * cdiv(t_pad + 1, self.block_r) + cdiv(t_pad, self.block_t) * n_tok

    def launch(self, lay: StageLayout) -> None:
        """One launch for the step staged with layout ``lay`` (no host sync, no allocation).

        NOTE: every argument is an int (addresses of persistent buffers, counts, offsets), passed
        positionally; after the first launch the compiled kernel's launcher is called directly
        (``direct``), skipping Triton's argument binding, unless ``DSV4_INDEX_DIRECT_LAUNCH=0``.
        """
        k = self._compiled
        if k is not None:
            self._launch_direct(k, lay)
            return
        k = self._launch_jit(lay)
        if self._direct and hasattr(k, "run") and hasattr(k, "packed_metadata") and hasattr(k, "function"):
            self._compiled = k

    def _args(self, lay: StageLayout):
        n_req, n_tok = self.num_units
        t_pad = lay.t_pad
        req_tiles = cdiv(t_pad + 1, self.block_r)
        grid = self.num_writers + n_req * req_tiles + cdiv(t_pad, self.block_t) * n_tok
        return grid, (*self._head, t_pad, n_req, req_tiles, n_tok, *lay.kernel_args())

    def _launch_jit(self, lay: StageLayout):
        """The documented path: Triton's JIT call (binds arguments, picks the compiled kernel)."""
        grid, args = self._args(lay)
        return fused_step_kernel[(grid,)](*args, *self._consts, num_warps=self.num_warps)

    def _launch_direct(self, k, lay: StageLayout) -> None:
        """Triton's private ``CompiledKernel.run`` with the positional layout of Triton 3.x (checked
        against :meth:`_launch_jit` by :meth:`check_direct_launch`)."""
        grid, args = self._args(lay)
        k.run(grid, 1, 1, torch.cuda.current_stream().cuda_stream, k.function, k.packed_metadata, None,
              None, None, *args, *self._consts)

    def check_direct_launch(self, lay: StageLayout) -> bool:
        """Warm-up check of the direct launch: every output of the tasks is poisoned, the step staged
        with ``lay`` is launched through the JIT path and then through the direct path, and the
        outputs must be byte-identical. On any difference or error the plan falls back to the JIT
        path for good (a warning says why). Returns True when the direct launch stays on."""
        k = self._compiled
        if k is None:
            return False
        outs = list({t.data_ptr(): t for task in self.tasks for t in task.outputs if t is not None}.values())

        def run(launch):
            for o in outs:
                o.fill_(True if o.dtype == torch.bool else -7)
            launch()
            if o.is_cuda:
                torch.cuda.synchronize(o.device)
            return [o.clone() for o in outs]

        why = None
        try:
            want = run(lambda: self._launch_jit(lay))
            got = run(lambda: self._launch_direct(k, lay))
            bad = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
            if bad:
                why = f"{len(bad)} of {len(outs)} outputs differ from the JIT launch"
        except Exception as e:  # NOTE: a changed private layout may raise anything
            why = f"{type(e).__name__}: {e}"
        if why is None:
            return True
        self._compiled, self._direct = None, False
        self._launch_jit(lay)  # NOTE: leave this step's outputs as the documented path writes them
        warnings.warn(f"dsv4_index: the direct launch through triton's CompiledKernel.run does not match "
                      f"the JIT launch ({why}); using the JIT launch (set DSV4_INDEX_DIRECT_LAUNCH=0 to "
                      f"skip the check)", RuntimeWarning, stacklevel=3)
        return False

    @property
    def direct(self) -> bool:
        """True while launches go through the compiled kernel's launcher directly."""
        return self._compiled is not None
