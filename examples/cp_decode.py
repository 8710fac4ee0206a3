"""Decode context parallelism (DCP) with the tiny DeepSeek-V4 attention, checked end to end.

Each rank stores the KV it owns under the interleave rule of DESIGN §4 (owner of position ``p`` is
``(p // I) % Wc``, local position ``(p // (I*Wc)) * I + p % I``; compressed rows likewise), builds its
own metadata with ``MetadataPipeline(..., cp_world_size=Wc, cp_rank=r, cp_interleave=I)``, runs the
paged attention over its shard and returns a partial output + log-sum-exp per head; partials are
all-gathered and merged. Rank 0 compares the merged output with the single-rank paged run and the
dense model over a randomized trace (chunked prefill, decodes, spec tokens, preemption), and checks
that the ranks' written slots partition the tokens (``validate.check_cp_partition``). See docs/CP.md.

::

    torchrun --nproc-per-node 2 examples/cp_decode.py                    # gloo on CPU
    torchrun --nproc-per-node 4 examples/cp_decode.py --interleave 2
    torchrun --nproc-per-node 2 examples/cp_decode.py --device cuda      # NCCL (gloo if ranks share a GPU)

Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import statistics
import sys
import threading
import time
import types
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index._common import cp_global, cp_owned_count  # noqa: E402
from dsv4_index.scheduler import ReferenceScheduler  # noqa: E402
from dsv4_index.step import NewRequest, RunningRequest, StepInput  # noqa: E402
from dsv4_index.validate import check_cp_partition, check_metadata  # noqa: E402
from models.deepseek_v4 import DSV4Attention, PagedCaches, init_weights, load_config  # noqa: E402
from models.deepseek_v4.attention import NEG_INF, merge_partials, select_topk  # noqa: E402

STATE_GROUPS = ("c4_state", "c128_state")  # NOTE: replicated on every rank (docs/CP.md)
CFG = load_config("tiny")
TOL = 1e-4


# ----------------------------------------------------------------------------------------------
# layouts and steps under DCP
# ----------------------------------------------------------------------------------------------
def sub_layout(layout: DSV4Layout, group_names: Sequence[str]) -> DSV4Layout:
    """The layout restricted to the groups named (in gid order, gids renumbered) and their channels."""
    keep = [g for g in layout.groups if g.name in group_names]
    new_gid = {g.gid: i for i, g in enumerate(keep)}
    groups = tuple(dataclasses.replace(g, gid=new_gid[g.gid]) for g in keep)
    channels = {n: dataclasses.replace(c, gid=new_gid[c.gid]) for n, c in layout.channels.items()
                if c.gid in new_gid}
    return dataclasses.replace(layout, groups=groups, channels=channels)


@dataclasses.dataclass(frozen=True)
class CPLayouts:
    """The layouts of one DCP deployment.

    sched : what the (DCP-unaware) scheduler allocates with: sharded groups (``mla``, ``swa``) with
        block sizes scaled by ``world`` (a *virtual block* of ``block_size * world`` global tokens),
        state groups unchanged. It is also the single-rank (``cp_world_size=1``) layout.
    rank : every group at its real block size, table widths per rank (``from_config(..., cp_*)``).
    kv : ``rank`` restricted to the sharded groups (built with ``cp_rank = r`` on rank ``r``).
    state : ``sched`` restricted to the state groups (built with ``cp_world_size = 1`` on every rank).
    """

    sched: DSV4Layout
    rank: DSV4Layout
    kv: DSV4Layout
    state: Optional[DSV4Layout]
    world: int
    interleave: int


def cp_layouts(config, max_model_len: int, world: int, interleave: int, *, mla_block_size: int = 256,
               swa_block_size: int = 64, **kw) -> CPLayouts:
    """Layouts for ``world`` ranks with interleave ``interleave`` (see :class:`CPLayouts`).

    Raises ValueError (naming ``cp_interleave``) unless the interleave divides the block size of
    every sharded raw channel and the rows per block of every compressed channel: then block id
    ``j`` of a request holds, on every rank, exactly the rank's owned tokens (rows) of virtual block
    ``j`` at local positions ``[j * block_size, (j + 1) * block_size)``.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"cp_world_size must be an int >= 1, got {world!r}")
    sched = DSV4Layout.from_config(config, max_model_len, mla_block_size=mla_block_size * world,
                                   swa_block_size=swa_block_size * world, **kw)
    rank = DSV4Layout.from_config(config, max_model_len, mla_block_size=mla_block_size,
                                  swa_block_size=swa_block_size, cp_world_size=world,
                                  cp_interleave=interleave, **kw)
    kv = sub_layout(rank, [g.name for g in rank.groups if g.name not in STATE_GROUPS])
    for c in kv.channels.values():
        unit = c.rows_per_block if c.compress_ratio > 1 else kv.groups[c.gid].block_size
        if world > 1 and unit % interleave:
            raise ValueError(f"cp_interleave={interleave} must divide the rows per block ({unit}) of "
                             f"channel {c.name!r} (virtual blocks of block_size * cp_world_size tokens)")
    state = None
    if any(g.name in STATE_GROUPS for g in sched.groups):
        state = sub_layout(sched, STATE_GROUPS)
    return CPLayouts(sched, rank, kv, state, world, interleave)


def project_step(step: StepInput, gids: Sequence[int]) -> StepInput:
    """``step`` with the block-id lists of groups ``gids`` only (in that order)."""
    pick = lambda lists: tuple(list(lists[g]) for g in gids)  # noqa: E731
    return StepInput(
        [NewRequest(r.req_id, pick(r.block_ids), r.num_computed_tokens) for r in step.new_requests],
        [RunningRequest(r.req_id, pick(r.new_block_ids), r.num_computed_tokens, r.resumed)
         for r in step.running_requests],
        dict(step.num_scheduled_tokens), list(step.finished_req_ids), list(step.preempted_req_ids),
        replay_start=dict(step.replay_start))


class CPRankPipeline:
    """One rank's metadata: a DCP pipeline over the sharded groups, a plain one over the state groups.

    ``build()`` returns one :class:`DSV4Metadata` with every channel (the kv pipeline's, plus the
    replicated state channels); ``last_kv`` is the kv pipeline's own metadata (for the checks).
    """

    def __init__(self, layouts: CPLayouts, rank: int, max_num_reqs: int, max_num_batched_tokens: int,
                 device="cpu", num_speculative_tokens: int = 0, **kw):
        L = layouts
        self.layouts, self.rank = L, rank
        self._kv_gids = [g.gid for g in L.sched.groups if g.name not in STATE_GROUPS]
        self._state_gids = [g.gid for g in L.sched.groups if g.name in STATE_GROUPS]
        self.kv = MetadataPipeline(L.kv, max_num_reqs, max_num_batched_tokens, device, num_speculative_tokens,
                                   cp_world_size=L.world, cp_rank=rank, cp_interleave=L.interleave, **kw)
        self.state = None if L.state is None else MetadataPipeline(
            L.state, max_num_reqs, max_num_batched_tokens, device, num_speculative_tokens, **kw)
        self.last_kv = None

    def update(self, step: StepInput, *, pad_to: Optional[int] = None) -> None:
        self.kv.update(project_step(step, self._kv_gids), pad_to=pad_to)
        if self.state is not None:
            self.state.update(project_step(step, self._state_gids), pad_to=pad_to)

    def build(self):
        mk = self.last_kv = self.kv.build()
        if self.state is None:
            return mk
        ms = self.state.build()
        # NOTE: both pipelines saw the same steps, so their batch rows (decode-first) agree.
        assert ms.req_ids == mk.req_ids and ms.num_tokens_padded == mk.num_tokens_padded
        return dataclasses.replace(mk, channels={**mk.channels, **ms.channels})


# ----------------------------------------------------------------------------------------------
# collectives: torch.distributed, or threads of one process (tests)
# ----------------------------------------------------------------------------------------------
class TorchComm:
    """The two collectives the example needs, over the default process group."""

    def __init__(self, dist, host_staging: bool):
        self.dist, self.world, self.rank = dist, dist.get_world_size(), dist.get_rank()
        self.host = host_staging  # NOTE: gloo with ranks sharing a GPU: collectives on host copies

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """float [...] -> [world, ...]."""
        src = t.contiguous().cpu() if self.host else t.contiguous()
        bufs = [torch.empty_like(src) for _ in range(self.world)]
        self.dist.all_gather(bufs, src)
        return torch.stack(bufs).to(t.device)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        src = t.contiguous().cpu() if self.host else t.contiguous()
        self.dist.all_reduce(src, op=self.dist.ReduceOp.MAX)
        return src.to(t.device)

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


class ThreadComm:
    """Collectives between ``world`` threads of one process (simulated ranks, no torch.distributed).

    :meth:`run` runs ``fn(comm_of_rank)`` on every rank. NOTE: one rank computes at a time (a baton
    lock released only inside a collective): the Triton interpreter is not thread-safe.
    """

    def __init__(self, world: int):
        self.world = world
        self._slots: List = [None] * world
        self._barrier = threading.Barrier(world)
        self._baton = threading.Lock()

    def for_rank(self, rank: int):
        view = types.SimpleNamespace(world=self.world, rank=rank)
        view.gather_objects = lambda obj: self._exchange(rank, obj)
        view.all_gather = lambda t: torch.stack(self._exchange(rank, t))
        view.all_reduce_max = lambda t: torch.stack(self._exchange(rank, t)).amax(0)
        return view

    def _wait(self) -> None:
        self._baton.release()
        try:
            self._barrier.wait()
        finally:
            self._baton.acquire()

    def _exchange(self, rank: int, obj) -> list:
        self._slots[rank] = obj
        self._wait()
        out = list(self._slots)
        self._wait()  # NOTE: nobody overwrites a slot before everyone has read it
        return out

    def run(self, fn) -> list:
        """``[fn(rank view) for every rank]``, ranks in threads; re-raises the first rank's error."""
        out, errors = [None] * self.world, []

        def go(r):
            with self._baton:
                try:
                    out[r] = fn(self.for_rank(r))
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    if not isinstance(e, threading.BrokenBarrierError):
                        errors.append(e)
                    self._barrier.abort()

        threads = [threading.Thread(target=go, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def global_topk_fn(comm, world: int, rank: int, interleave: int):
    """``topk_fn`` of :meth:`DSV4Attention.forward_paged` on a DCP rank: the indexer's top-k over the
    rows of *every* rank. This rank's scores (entry ``j`` = its ``j``-th owned row) are scattered to
    global row ids, max-reduced over ranks (every row is owned by one rank, ``-inf`` elsewhere), and
    the top-k is taken on the global scores (identical on every rank)."""
    def topk_fn(scores: torch.Tensor, k: int) -> torch.Tensor:
        T, N = scores.shape
        rows = cp_global(torch.arange(N, device=scores.device), world, rank, interleave)
        keep = rows < N  # NOTE: listed entries are rows < n_c <= N; the rest are -inf here anyway
        full = torch.full_like(scores, NEG_INF)
        full[:, rows[keep]] = scores[:, keep]
        return select_topk(comm.all_reduce_max(full), k)
    return topk_fn


# ----------------------------------------------------------------------------------------------
# the trace
# ----------------------------------------------------------------------------------------------
_ROWS: Dict[tuple, torch.Tensor] = {}


def _row(key) -> torch.Tensor:
    if key not in _ROWS:
        g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
        _ROWS[key] = torch.randn(CFG.hidden_size, generator=g)
    return _ROWS[key]


def x_of(rid: str, lo: int, hi: int, draft: bool) -> torch.Tensor:
    """Input rows of request ``rid`` at positions ``lo..hi-1`` (real, or draft tokens)."""
    rows = [_row((rid, p, draft)) for p in range(lo, hi)]
    return torch.stack(rows) if rows else torch.zeros(0, CFG.hidden_size)


def check_fit(meta, layouts: CPLayouts, rank: int) -> None:
    """Rank ``rank``'s local rows of every request fit the blocks its table holds (ValueError)."""
    L = layouts
    mla = [g for g in L.kv.groups if g.name == "mla"]
    if not mla:
        return
    g = mla[0]
    bt = meta.block_tables[g.gid].cpu()
    seq = meta.seq_lens.cpu().long()
    for b, rid in enumerate(meta.req_ids):
        n_blk = int((bt[b] != 0).sum())  # NOTE: a full group's row: its allocated blocks, then 0
        if not bool((bt[b, :n_blk] != 0).all()):
            raise ValueError(f"request {rid!r}: null block inside the mla row")
        for c in L.kv.channels.values():
            if c.gid == g.gid and c.compress_ratio > 1:
                need = int(cp_owned_count(seq[b] // c.compress_ratio, L.world, rank, L.interleave))
                if need > n_blk * c.rows_per_block:
                    raise ValueError(f"rank {rank}, request {rid!r}: {need} owned {c.name} rows, the table "
                                     f"holds {n_blk} blocks of {c.rows_per_block}")


def host_meta(meta, pipe):
    """A CPU copy of ``meta`` that can be pickled to rank 0 (for ``check_cp_partition``)."""
    cpu = lambda x: x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    chans = {n: dataclasses.replace(ch, **{f.name: cpu(getattr(ch, f.name)) for f in dataclasses.fields(ch)})
             for n, ch in meta.channels.items()}
    top = {f.name: cpu(getattr(meta, f.name)) for f in dataclasses.fields(meta)
           if f.name not in ("channels", "_pipeline", "block_tables")}
    stub = types.SimpleNamespace(layout=pipe.layout, cp=dict(pipe.cp), _ctx=None,
                                 num_speculative_tokens=pipe.num_speculative_tokens)
    return dataclasses.replace(meta, channels=chans, block_tables=[cpu(b) for b in meta.block_tables],
                               _pipeline=stub, **top)


def run_rank(comm, *, interleave: int = 1, steps: int = 20, seed: int = 0, device="cpu",
             max_len: int = 256, mla_block: int = 64, swa_block: int = 4, num_blocks: int = 40,
             budget: int = 24, chunk: int = 9, spec: int = 2, pad: int = 3, validate: bool = True,
             reference: bool = None) -> dict:
    """Run the trace on rank ``comm.rank`` of ``comm.world`` (every rank calls this, same arguments).

    Every rank schedules the same deterministic trace, builds its metadata, runs each layer's paged
    forward on its shard and merges the gathered partials. Rank 0 (``reference``, default ``rank == 0``)
    also runs the single-rank paged model (``cp_world_size=1``) and the dense model, and checks the
    partition of the written slots. Returns a summary dict (on every rank; errors are filled on rank 0).
    """
    W, r, dev = comm.world, comm.rank, torch.device(device)
    reference = r == 0 if reference is None else reference
    L = cp_layouts(CFG.to_dict(), max_len, W, interleave, mla_block_size=mla_block,
                   swa_block_size=swa_block, indexer_causal_indices=True)
    sched = ReferenceScheduler(L.sched, num_blocks, max_num_batched_tokens=budget, max_num_seqs=5,
                               num_speculative_tokens=spec, long_prefill_threshold=chunk,
                               enable_prefix_caching=False, seed=seed)
    cap = budget + pad
    pipe = CPRankPipeline(L, r, 8, cap, dev, spec)
    layers = [CFG.layer_ids(k)[0] for k in ("swa", "c4", "c128")]
    models = {l: init_weights(DSV4Attention(CFG, l), 10 + l).to(dev).eval() for l in layers}
    caches = PagedCaches(CFG, L.rank, num_blocks, device=dev)
    if reference:
        single = MetadataPipeline(L.sched, 8, cap, dev, spec)
        single_caches = PagedCaches(CFG, L.sched, num_blocks, device=dev)
    topk_fn = global_topk_fn(comm, W, r, interleave)
    rng = random.Random(seed)
    res = dict(world=W, interleave=interleave, steps=0, tokens=0, decode_tokens=0, prefill_tokens=0,
               spec_rejected=0, preempted=0,
               err_single=0.0, err_dense=0.0, build_ms=[], failures=[])
    n_req = 0
    for _ in range(steps):
        if rng.random() < 0.6 and len(sched.waiting_req_ids) < 3:
            sched.add_request(f"r{n_req}", rng.randint(1, 90), rng.randint(1, 12))
            n_req += 1
        step = sched.schedule()
        views = {v.req_id: v for v in sched.batch_view(step)}
        accepted = sched.random_acceptance(step, rng)
        res["preempted"] += len(step.preempted_req_ids)
        if not views:
            sched.update_after_step(accepted)
            continue
        T = sum(step.num_scheduled_tokens.values())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        pipe.update(step, pad_to=T + pad)
        meta = pipe.build()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        res["build_ms"].append((time.perf_counter() - t0) * 1e3)
        try:
            check_fit(meta, L, r)
            if validate:
                check_metadata(pipe.last_kv, num_blocks=num_blocks)
        except ValueError as e:
            res["failures"].append(f"rank {r} step {res['steps']}: {e}")
        qsl = meta.query_start_loc.tolist()
        x, dense_in = torch.zeros(T + pad, CFG.hidden_size), {}
        for b, rid in enumerate(meta.req_ids):
            v = views[rid]
            c, n = v.num_computed_tokens, v.num_scheduled_tokens
            keep = 1 + accepted.get(rid, n - 1) if v.is_decode else n  # tokens that stay real
            res["spec_rejected"] += n - keep
            seq = torch.cat([x_of(rid, 0, c + keep, False), x_of(rid, c + keep, c + n, True)])
            x[qsl[b]:qsl[b + 1]] = seq[c:]
            dense_in[rid] = seq
        x[T:] = float("nan")  # padded tokens: must give zeros and write nothing
        x = x.to(dev)
        if reference:
            single.update(step, pad_to=T + pad)
            meta1 = single.build()
            assert meta1.req_ids == meta.req_ids
        with torch.no_grad():
            for l, m in models.items():
                o, lse = m.forward_paged(x, meta, caches[l], return_lse=True, with_sink=r == 0,
                                         topk_fn=topk_fn)
                merged = merge_partials(comm.all_gather(o), comm.all_gather(lse))
                y = torch.where(meta.is_valid_token[:, None], m.project(merged), 0.0)
                if not reference:
                    continue
                y1 = m.forward_paged(x, meta1, single_caches[l])
                res["err_single"] = max(res["err_single"], float((y - y1).abs().max()))
                for b, rid in enumerate(meta.req_ids):
                    ref = m.forward_dense(dense_in[rid].to(dev))[views[rid].num_computed_tokens:]
                    res["err_dense"] = max(res["err_dense"], float((y[qsl[b]:qsl[b + 1]] - ref).abs().max()))
        metas = comm.gather_objects(host_meta(pipe.last_kv, pipe.kv) if validate else None)
        if reference and validate:
            try:
                check_cp_partition(metas, cp_interleave=interleave)
            except ValueError as e:
                res["failures"].append(f"partition step {res['steps']}: {e}")
        res["steps"] += 1
        res["tokens"] += T
        res["decode_tokens"] += meta.num_decode_tokens
        res["prefill_tokens"] += meta.num_prefill_tokens
        sched.update_after_step(accepted)
    # every rank's failures and build times to everyone
    allres = comm.gather_objects((res["failures"], res["build_ms"]))
    res["failures"] = [f for fails, _ in allres for f in fails]
    res["build_ms_median"] = [statistics.median(ms) if ms else 0.0 for _, ms in allres]
    if reference:
        for key in ("err_single", "err_dense"):
            if not res[key] <= TOL:  # NOTE: NaN fails too
                res["failures"].append(f"{key} = {res[key]:.3g} > {TOL}")
    return res


def summary(res: dict) -> str:
    ms = ", ".join(f"{t:.2f}" for t in res["build_ms_median"])
    return (f"DCP world={res['world']} interleave={res['interleave']}: {res['steps']} steps, "
            f"{res['tokens']} tokens ({res['prefill_tokens']} prefill, {res['decode_tokens']} decode, "
            f"{res['spec_rejected']} rejected spec, {res['preempted']} preempted)\n"
            f"  max |merged - single| = {res['err_single']:.3g}\n"
            f"  max |merged - dense|  = {res['err_dense']:.3g}\n"
            f"  metadata build (update + build) median ms per rank: [{ms}]\n"
            + ("  FAILED:\n    " + "\n    ".join(res["failures"][:10]) if res["failures"] else "  OK"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: nccl when every rank has its own GPU, else gloo")
    ap.add_argument("--no-validate", action="store_true", help="skip check_metadata / check_cp_partition")
    args = ap.parse_args(argv)

    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = "cpu"
    backend = "gloo"
    if args.device == "cuda":
        n_gpu = torch.cuda.device_count()
        if n_gpu == 0:
            raise SystemExit("--device cuda: no GPU visible")
        torch.cuda.set_device(local % n_gpu)
        device = f"cuda:{local % n_gpu}"
        # NOTE: NCCL refuses two ranks on one GPU; ranks sharing GPUs talk through gloo (host copies).
        backend = args.backend if args.backend != "auto" else ("nccl" if world <= n_gpu else "gloo")
    elif args.backend == "nccl":
        raise SystemExit("--backend nccl needs --device cuda")
    if "MASTER_ADDR" not in os.environ:  # plain `python examples/cp_decode.py`: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    # NOTE: a rank that fails mid-trace leaves the others in a collective: bounded by this timeout
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        comm = TorchComm(dist, host_staging=backend == "gloo" and device != "cpu")
        res = run_rank(comm, interleave=args.interleave, steps=args.steps, seed=args.seed, device=device,
                       validate=not args.no_validate)
        if rank == 0:
            print(f"[{backend}, {device}]", summary(res), flush=True)
        ok = not res["failures"]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
