"""Host side of the fused launch: pack the builders' :class:`~dsv4_index.fused.tasks.FusedTask`
descriptors once (``constexpr`` specs + a device table of output addresses), compile the launch's
variants, then launch :func:`~dsv4_index.fused.kernel.fused_step_kernel` once per step. The plan
knows no builder class: it only packs what builders hand it.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .._common import cdiv, interpreting
from .._triton import triton
from ..state.staging import StageLayout
from .kernel import fused_step_kernel
from .tasks import (ESIZE, G_RING, GEO_WORDS, KINDS, MAX_OUTPUTS, NF, O_SCRATCH, OUTS_GEO, OUTS_WORDS, QUERY_KINDS,
                    REQUEST_KINDS, S_BT, S_REP, S_SPLIT, S_TASK, SPLIT_WORDS, TOKEN_KINDS, FusedTask, TileConfig,
                    code_order, geometry, request_specs, task_spec, token_units)

__all__ = ["FusedPlan", "TileConfig"]

# NOTE: the three variants (measured: BENCHMARKS.md "How the kernel is cut"): decode-sized steps want many
# small programs (8 token rows x one 128-column chunk; 8 warps while the step is a handful of tokens, 16-row
# 1-D tiles and 4 warps from 64 tokens on); prefill-sized steps want fewer, larger programs that write
# whole index-list rows (8 token rows, chunks past every token's length stored as -1). Causal lists
# read one table entry per block only in the whole-row variant (the small tiles are slower with it). There,
# one-chunk window lists load every table entry before their stores (fold=1); two sliding groups in one program
# (fold=2) measured slower (benchmarks/results/h200_2026-12-02_s10/PREFILL.md). Such lists whose chunk spans at most
# three blocks run split (split=32: 32 token rows a program, the per-row chain one row per lane, then the tiles;
# fused/rows.py), capped at 64 registers (8 programs per SM; no spill) (benchmarks/results/h200_2026-12-02_s11)
TINY = TileConfig(bt1=8, bt2=8, bc=128, whole_row=False, num_warps=8)
SMALL = TileConfig(bt1=16, bt2=8, bc=128, whole_row=False, num_warps=4)
LARGE = TileConfig(bt1=128, bt2=8, bc=128, whole_row=True, num_warps=4, block_loads=True, fold=1, split=32,
                  maxnreg=64)
SMALL_FROM, LARGE_FROM = 64, 2048
INTERP = TileConfig(bt1=64, bt2=16, bc=128, whole_row=False, num_warps=4)
INTERP_LARGE = TileConfig(bt1=64, bt2=16, bc=64, whole_row=True, num_warps=4, block_loads=True, fold=1, split=32)


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
    tiny, small, large : TileConfig — tiles of steps with ``T_pad < small_from``, ``< large_from``
        and the others (three compiled variants).
    block_r : request rows per program; num_writers, block_w : programs applying staged block ids,
        ids per store.

    Attributes
    ----------
    tasks : list of FusedTask (deduplicated, request tasks first).
    num_units : (request tasks, token programs per super tile of the small variant).
    configs : the three TileConfigs; variants equal configs share one compiled kernel.
    has_query : bool — some task runs over the query batch (``FLAG_QUERY`` or a query-map task): the variants
        compile the query paths (fused/query.py); False for a pipeline without ``query_batches``.
    """

    def __init__(self, tasks: Sequence[FusedTask], tables, group_cp, stage: torch.Tensor, next_n: int, *,
                 tiny: Optional[TileConfig] = None, small: Optional[TileConfig] = None,
                 large: Optional[TileConfig] = None, small_from: int = SMALL_FROM, large_from: Optional[int] = None,
                 block_r: int = 256, num_writers: Optional[int] = None, block_w: int = 256):
        interp = interpreting()
        small = small or (INTERP if interp else SMALL)
        self.configs = (tiny or (small if interp else TINY), small, large or (INTERP_LARGE if interp else LARGE))
        self.small_from = small_from
        self.large_from = large_from if large_from is not None else int(os.environ.get("DSV4_INDEX_LARGE_FROM",
                                                                                         LARGE_FROM))
        self.block_r, self.block_w = block_r, block_w
        self.num_writers = num_writers or (1 if interp else 8)
        for name, v in (("block_r", block_r), ("block_w", block_w)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        seen: Dict[tuple, FusedTask] = {}
        for t in tasks:
            if t.kind not in KINDS:
                raise ValueError(f"task kind {t.kind!r} is not one of {sorted(KINDS)}")
            if len(t.outputs) > MAX_OUTPUTS:
                raise ValueError(f"task {t.kind}: at most {MAX_OUTPUTS} outputs, got {len(t.outputs)}")
            seen.setdefault(t.key(), t)
        req = [t for t in seen.values() if t.kind in REQUEST_KINDS]
        tok = [t for t in seen.values() if t.kind in TOKEN_KINDS]
        tok = [tok[i] for i in code_order(tok)]  # NOTE: tasks of the same code adjacent: one unit (token_units)
        self.tasks: List[FusedTask] = req + tok
        dev = stage.device
        # NOTE: outputs are addressed as element offsets from 16-byte aligned bases, one per dtype
        # size, divided by the elements per 16 bytes when the output is 16-byte aligned too
        self._bases = {4: stage, 8: torch.zeros(2, dtype=torch.int64, device=dev),
                       1: torch.zeros(16, dtype=torch.int8, device=dev)}
        outs = np.zeros((max(len(self.tasks), 1), int(OUTS_WORDS)), dtype=np.int64)
        specs = []
        for i, t in enumerate(self.tasks):
            muls = [1] * MAX_OUTPUTS
            for k, o in enumerate(t.outputs):
                if o is None:
                    continue
                if not o.is_contiguous() or o.device != dev or o.dtype not in ESIZE:
                    raise ValueError(f"task {t.kind}: output {k} must be a contiguous int tensor on {dev}")
                es = ESIZE[o.dtype]
                off = (o.data_ptr() - self._bases[es].data_ptr()) // es
                muls[k] = 16 // es if o.data_ptr() % 16 == 0 else 1
                outs[i, k] = off // muls[k]
            outs[i, OUTS_GEO:OUTS_GEO + GEO_WORDS] = geometry(t, tables)
            specs.append(task_spec(i, t, group_cp, muls, bool(outs[i, OUTS_GEO + G_RING])))
        self._num_req = len(req)
        # NOTE: the query batch (fused/query.py): the staged query_start_loc_q the query tasks name (one array a
        # pipeline), and the search steps over batch rows (2^LOG_R > max_num_reqs); both 0 in a launch without query
        # code (plain_tasks), which then compiles once whatever max_num_reqs
        qx = {t.extra for t in self.tasks if t.kind in QUERY_KINDS}
        if len(qx) > 1:
            raise ValueError(f"query tasks name {len(qx)} staged query_start_loc_q arrays {sorted(qx)}; one a launch")
        self.has_query = bool(qx) or any(t.query for t in self.tasks)
        self._query = (max(qx.pop(), 0) if qx else 0,
                       max(int(tables.max_num_reqs), 1).bit_length() if self.has_query else 0)
        self._req = request_specs(specs[:len(req)])
        self._tok_specs, self._tok_tasks = specs[len(req):], tok
        self.next_n_pad = triton.next_power_of_2(max(next_n, 1))
        self._variants, cache = [], {}
        for c in self.configs:
            if c not in cache:
                cache[c] = self._variant(c)
            self._variants.append(cache[c])
        self.scratch = self._scratch(outs, stage)
        self._outs = torch.from_numpy(outs).to(dev)
        self._ptrs = (stage, tables.flat, self._bases[4], self._bases[8], self._bases[1], self._outs)
        self.num_units = (len(req), self._variants[1]["p_super"])
        self._direct = (dev.type == "cuda" and not interp
                        and os.environ.get("DSV4_INDEX_DIRECT_LAUNCH", "1") not in ("", "0"))
        self._compiled = None
        if self._direct:
            self.compile()

    def _scratch(self, outs: np.ndarray, stage: torch.Tensor) -> torch.Tensor:
        """The split window tasks' scratch (``SPLIT_WORDS`` int32 words per token row, in blocks of the unit's
        rows), allocated once; each task's offset from the 4-byte base goes to its ``O_SCRATCH`` word."""
        need: Dict[int, int] = {}
        nf = int(NF)
        for v in self._variants:
            tok = v["consts"]["TOK"]
            for u in (tok[i:i + nf] for i in range(0, len(tok), nf)):
                if u[S_SPLIT]:
                    for k in range(u[S_REP]):
                        n = self.tasks[u[S_TASK] + k].outputs[1].numel()
                        need[u[S_TASK] + k] = max(need.get(u[S_TASK] + k, 0), cdiv(n, u[S_BT]) * u[S_BT])
        words = int(SPLIT_WORDS)
        scratch = torch.zeros(max(sum(need.values()) * words, 1), dtype=torch.int32, device=stage.device)
        at = 0
        for i, n in sorted(need.items()):
            outs[i, O_SCRATCH] = (scratch.data_ptr() - stage.data_ptr()) // 4 + at
            at += n * words
        return scratch

    def _variant(self, cfg: TileConfig) -> dict:
        units, t_super, p_super = token_units(self._tok_specs, self._tok_tasks, cfg)
        consts = dict(REQ=self._req, TOK=units, NUM_REQ=self._num_req, NUM_TOK=len(units) // int(NF), T_SUPER=t_super,
                      P_SUPER=p_super, NUM_WRITERS=self.num_writers, BLOCK_W=self.block_w, BLOCK_R=self.block_r,
                      NEXT_N_PAD=self.next_n_pad, BLOCK_LOADS=bool(cfg.block_loads), QX=self._query[0],
                      LOG_R=self._query[1])
        return dict(cfg=cfg, t_super=t_super, p_super=p_super, consts=consts, kernel=None)

    def variant(self, t_pad: int) -> int:
        """0 (tiny tiles), 1 (small) or 2 (large) for a padded token count."""
        if t_pad >= self.large_from:
            return 2
        return int(t_pad >= self.small_from)

    def compile(self) -> None:
        """Compile every variant now (no compile while serving); the launches then call the compiled
        kernels' launchers directly."""
        lay = StageLayout.for_tokens(1, 1, 0, 1)
        for v in self._variants:
            if v["kernel"] is None:
                v["kernel"] = fused_step_kernel.warmup(*self._ptrs, 1, 1, *lay.kernel_args(), grid=(1,),
                                                       **self._options(v["cfg"]), **v["consts"])
        self._compiled = self._variants[0]["kernel"]

    def grid(self, t_pad: int) -> int:
        return self._grid(self._variants[self.variant(t_pad)], t_pad)

    def _grid(self, v: dict, t_pad: int) -> int:
        return (self.num_writers + self._num_req * cdiv(t_pad + 1, self.block_r)
                + cdiv(t_pad, v["t_super"]) * v["p_super"])


    def launch(self, lay: StageLayout) -> None:
        """One launch for the step staged with layout ``lay`` (no host sync, no allocation).

        NOTE: every runtime argument is an int (counts, offsets) or a persistent buffer, passed
        positionally; on CUDA the compiled kernel's launcher is called directly (skipping Triton's
        argument binding), unless ``DSV4_INDEX_DIRECT_LAUNCH=0``.
        """
        v = self._variants[self.variant(lay.t_pad)]
        if self._direct and v["kernel"] is not None:
            self._launch_direct(v, v["kernel"], lay)
            return
        self._launch_jit(v, lay)

    def _args(self, v: dict, lay: StageLayout):
        t_pad = lay.t_pad
        return self._grid(v, t_pad), (*self._ptrs, t_pad, cdiv(t_pad + 1, self.block_r), *lay.kernel_args())

    def _launch_jit(self, v: dict, lay: StageLayout):
        """The documented path: Triton's JIT call (binds arguments, picks the compiled kernel)."""
        grid, args = self._args(v, lay)
        return fused_step_kernel[(grid,)](*args, **self._options(v["cfg"]), **v["consts"])

    @staticmethod
    def _options(cfg: TileConfig) -> dict:
        return dict(num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))

    def _launch_direct(self, v: dict, k, lay: StageLayout) -> None:
        """Triton's private ``CompiledKernel.run`` with the positional layout of Triton 3.x (checked
        against :meth:`_launch_jit` by :meth:`check_direct_launch`)."""
        grid, args = self._args(v, lay)
        k.run(grid, 1, 1, torch.cuda.current_stream().cuda_stream, k.function, k.packed_metadata, None,
              None, None, *args, *v["consts"].values())

    def check_direct_launch(self, lay: StageLayout) -> bool:
        """Warm-up check of the direct launch: for every compiled variant, every output of the tasks is
        poisoned, the step staged with ``lay`` is launched through the JIT path and then through the
        direct path, and the outputs must be byte-identical. On any difference or error the plan falls
        back to the JIT path for good (a warning says why). Returns True when the direct launch stays on."""
        if not self._direct or self._compiled is None:
            return False
        outs = list({t.data_ptr(): t for task in self.tasks for t in task.outputs if t is not None}.values())

        def run(launch):
            for o in outs:
                o.fill_(True if o.dtype == torch.bool else -7)
            launch()
            if outs and outs[0].is_cuda:
                torch.cuda.synchronize(outs[0].device)
            return [o.clone() for o in outs]

        why = None
        try:
            for v in {id(v): v for v in self._variants}.values():
                k = v["kernel"]
                if k is None:
                    continue
                want = run(lambda: self._launch_jit(v, lay))
                got = run(lambda: self._launch_direct(v, k, lay))
                bad = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
                if bad:
                    why = f"{len(bad)} of {len(outs)} outputs differ from the JIT launch ({v['cfg']})"
                    break
        except Exception as e:  # NOTE: a changed private layout may raise anything
            why = f"{type(e).__name__}: {e}"
        if why is None:
            return True
        self._compiled, self._direct = None, False
        self.launch(lay)  # NOTE: leave this step's outputs as the documented path writes them
        warnings.warn(f"dsv4_index: the direct launch through triton's CompiledKernel.run does not match "
                      f"the JIT launch ({why}); using the JIT launch (set DSV4_INDEX_DIRECT_LAUNCH=0 to "
                      f"skip the check)", RuntimeWarning, stacklevel=3)
        return False

    @property
    def direct(self) -> bool:
        """True while launches go through the compiled kernels' launchers directly."""
        return self._direct and self._compiled is not None
