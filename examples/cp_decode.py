"""Decode context parallelism (DCP) with the tiny DeepSeek-V4 attention, checked end to end.

Every rank runs ONE ``MetadataPipeline(layout, ..., cp_world_size=Wc, cp_rank=r, cp_interleave=I)``
over every group: the sharded groups (``mla``, ``swa``) follow the interleave rule of docs/DESIGN.md §4 (owner
of position ``p`` is ``(p // I) % Wc``, local position ``(p // (I*Wc)) * I + p % I``; compressed rows
likewise), the compressor-state groups are replicated (``GroupSpec.sharded`` False). Each rank runs
the paged attention over its shard and returns a partial output + log-sum-exp per head; partials are
all-gathered and merged. Rank 0 compares the merged output with the single-rank paged run and the
dense model at every step of a trace with chunked prefill, decodes, rejected spec tokens, preemption
and prefix-cache hits with bounded replay, and checks that the ranks' written slots partition the
tokens (``validate.check_cp_partition``) and that the replicated channels agree. See docs/CP.md.

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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # examples/_threads.py

from _threads import add_threads_option, set_threads  # noqa: E402  (examples/_threads.py)

from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index._common import check_int, cp_global, cp_owned_count  # noqa: E402
from dsv4_index.testing.scheduler import ReferenceScheduler  # noqa: E402
from dsv4_index.validate import check_cp_partition, check_metadata  # noqa: E402
from models.deepseek_v4 import DSV4Attention, PagedCaches, init_weights, load_config  # noqa: E402
from models.deepseek_v4.attention import NEG_INF, merge_partials, select_topk  # noqa: E402

CFG = load_config("tiny")
TOL = 1e-4
REPLICATED_FIELDS = ("slot_mapping", "indices", "lens")


# ----------------------------------------------------------------------------------------------
# layouts under DCP
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CPLayouts:
    """The layouts of one DCP deployment.

    sched : what the (DCP-unaware) scheduler allocates with, and the single-rank layout: sharded
        groups with block sizes scaled by ``world`` (a *virtual block* of ``block_size * world``
        global tokens), replicated groups unchanged.
    rank : every rank's layout (``from_config(..., cp_world_size, cp_interleave)``): sharded groups
        at their real block size with per-rank table widths, replicated groups as in ``sched``.
    """

    sched: DSV4Layout
    rank: DSV4Layout
    world: int
    interleave: int


def cp_layouts(config, max_model_len: int, world: int, interleave: int, *, mla_block_size: int = 256,
               swa_block_size: int = 64, **kw) -> CPLayouts:
    """Layouts for ``world`` ranks with interleave ``interleave`` (see :class:`CPLayouts`).

    Raises ValueError (naming ``cp_interleave``) unless the interleave divides the block size of every
    sharded raw channel and the rows per block of every sharded compressed channel: then block id
    ``j`` of a request holds, on every rank, exactly the rank's owned tokens (rows) of virtual block
    ``j`` at local positions ``[j * block_size, (j + 1) * block_size)``.
    """
    check_int("cp_world_size", world, lo=1)
    check_int("cp_interleave", interleave, lo=1)
    sched = DSV4Layout.from_config(config, max_model_len, mla_block_size=mla_block_size * world,
                                   swa_block_size=swa_block_size * world, **kw)
    rank = DSV4Layout.from_config(config, max_model_len, mla_block_size=mla_block_size,
                                  swa_block_size=swa_block_size, cp_world_size=world,
                                  cp_interleave=interleave, **kw)
    for c in rank.channels.values():
        g = rank.groups[c.gid]
        unit = c.rows_per_block if c.compress_ratio > 1 else g.alloc_block_size
        if world > 1 and g.sharded and unit % interleave:
            raise ValueError(f"cp_interleave={interleave} must divide the rows per block ({unit}) of "
                             f"channel {c.name!r} (virtual blocks of block_size * cp_world_size tokens)")
    return CPLayouts(sched, rank, world, interleave)


# ----------------------------------------------------------------------------------------------
# collectives: torch.distributed, or threads of one process (tests)
# ----------------------------------------------------------------------------------------------
class TorchComm:
    """The collectives the example needs, over the default process group."""

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
        self._slots = [None] * world
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
        N = scores.shape[1]
        rows = cp_global(torch.arange(N, device=scores.device), world, rank, interleave)
        keep = rows < N  # NOTE: listed entries are rows < n_c <= N; the rest are -inf here anyway
        full = torch.full_like(scores, NEG_INF)
        full[:, rows[keep]] = scores[:, keep]
        return select_topk(comm.all_reduce_max(full), k)
    return topk_fn


# ----------------------------------------------------------------------------------------------
# the trace
# ----------------------------------------------------------------------------------------------
class Inputs:
    """Deterministic hidden states: ``real(rid, n)`` rows of positions ``0..n-1`` (a prompt block shared
    through the prefix cache takes its content owner's rows, so shared blocks hold identical KV);
    ``draft(rid, n)`` rows of rejected draft tokens."""

    def __init__(self, block: int, max_len: int):
        self.block, self.max_len, self.keys, self._tables = block, max_len, {}, {}

    def _table(self, name) -> torch.Tensor:
        if name not in self._tables:
            g = torch.Generator().manual_seed(zlib.crc32(repr(name).encode()))
            self._tables[name] = torch.randn(self.max_len, CFG.hidden_size, generator=g)
        return self._tables[name]

    def add(self, rid: str, prompt_len: int, prefix_of=None, prefix_len: int = 0) -> None:
        shared = prefix_len // self.block
        own = self.keys[prefix_of][:shared] if prefix_of in self.keys else [(prefix_of, j) for j in range(shared)]
        self.keys[rid] = own + [(rid, j) for j in range(len(own), prompt_len // self.block)]

    def real(self, rid: str, n: int) -> torch.Tensor:
        keys = self.keys[rid]
        rows = [self._table(keys[p // self.block][0] if p // self.block < len(keys) else rid)[p] for p in range(n)]
        return torch.stack(rows) if rows else torch.zeros(0, CFG.hidden_size)

    def draft(self, rid: str, n: int) -> torch.Tensor:
        return self._table(("draft", rid))[:n]


def make_trace(sched: ReferenceScheduler, inputs: Inputs, steps: int, seed: int):
    """Random arrivals plus two requests sharing one prefix block (the second one hits the first's
    cached block: bounded replay), identical on every rank. Yields ``(step, views, accepted)`` and
    advances the scheduler after each."""
    rng, vb, n = random.Random(seed), inputs.block, 0
    hit_ok = vb + 24 + 8 <= min(sched.max_model_len, sched.max_request_len())
    pending = [("p0", vb + 12, "sys"), ("p1", vb + 24, "sys")] if hit_ok else []
    for _ in range(steps):
        adds = []
        if pending and (pending[0][0] == "p0" or sched.req_state("p0").num_computed_tokens >= vb
                        or sched.req_state("p0").status == "finished"):
            rid, plen, pre = pending.pop(0)  # NOTE: p1 arrives once p0's first block is cached
            adds.append(dict(req_id=rid, prompt_len=plen, max_new_tokens=12, prefix_of=pre, prefix_len=vb))
        elif rng.random() < 0.6 and len(sched.waiting_req_ids) < (1 if pending else 3):
            new = rng.randint(1, 12)
            adds.append(dict(req_id=f"r{n}", prompt_len=rng.randint(1, min(90, sched.max_request_len() - new)),
                             max_new_tokens=new))
            n += 1
        for kw in adds:
            sched.add_request(**kw)
            inputs.add(kw["req_id"], kw["prompt_len"], kw.get("prefix_of"), kw.get("prefix_len", 0))
        step = sched.schedule()
        views = sched.batch_view(step)
        accepted = sched.random_acceptance(step, rng)
        yield step, views, accepted
        sched.update_after_step(accepted)


# ----------------------------------------------------------------------------------------------
# per-rank checks
# ----------------------------------------------------------------------------------------------
def check_fit(meta, views: dict, layouts: CPLayouts) -> None:
    """Each request's mla row on this rank holds the scheduler's (virtual) block ids, and the rank's
    owned compressed rows fit them (ValueError)."""
    L = layouts
    if not L.rank.has_group("mla"):
        return
    g = L.rank.group("mla")
    tab, req_slots, seq = meta.block_tables[g.gid].cpu(), meta.idx_mapping.cpu(), meta.seq_lens.cpu().long()
    _, r, inter = meta.cp
    for b, rid in enumerate(meta.req_ids):
        ids = list(views[rid].block_ids[g.gid])
        row = tab[int(req_slots[b]), :len(ids)].tolist()
        if row != ids:
            raise ValueError(f"request {rid!r}: mla row {row} != scheduler's {ids}")
        for c in L.rank.channels_of(g.gid):
            if c.compress_ratio > 1:
                need = int(cp_owned_count(seq[b] // c.compress_ratio, L.world, r, inter))
                if need > len(ids) * c.rows_per_block:
                    raise ValueError(f"rank {r}, request {rid!r}: {need} owned {c.name} rows, the table "
                                     f"holds {len(ids)} blocks of {c.rows_per_block}")


def host_meta(meta):
    """A CPU copy of ``meta`` that pickles (for ``check_cp_partition`` on rank 0): tensors copied,
    builders and converters dropped (the metadata describes itself: layout, cp, tables)."""
    cpu = lambda x: x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    chans = {n: dataclasses.replace(ch, **{f.name: cpu(getattr(ch, f.name)) for f in dataclasses.fields(ch)})
             for n, ch in meta.channels.items()}
    top = {f.name: cpu(getattr(meta, f.name)) for f in dataclasses.fields(meta)
           if f.name not in ("channels", "block_tables", "builders", "_converters")}
    return dataclasses.replace(meta, channels=chans, block_tables=[cpu(t) for t in meta.block_tables],
                               builders={}, _converters={}, **top)


def check_replicated(metas, single) -> None:
    """Channels of replicated groups are identical on every rank and equal the single-rank ones."""
    for name, c in metas[0].channels.items():
        if metas[0].layout.groups[c.gid].sharded:
            continue
        for f in REPLICATED_FIELDS:
            want = getattr(single[name], f).cpu()
            for r, m in enumerate(metas):
                if not torch.equal(getattr(m[name], f).cpu(), want):
                    raise ValueError(f"replicated channel {name!r}: {f} of rank {r} != single-rank {f}")


# ----------------------------------------------------------------------------------------------
# one rank
# ----------------------------------------------------------------------------------------------
def run_rank(comm, *, interleave: int = 1, steps: int = 30, seed: int = 0, device="cpu", max_len: int = 256,
             mla_block: int = None, swa_block: int = 4, num_blocks: int = 40, budget: int = 32, chunk: int = 16,
             spec: int = 2, pad: int = 3, validate: bool = True, reference: bool = None) -> dict:
    """Run the trace on rank ``comm.rank`` of ``comm.world`` (every rank calls this, same arguments).

    Every rank schedules the same deterministic trace, builds its metadata with one DCP pipeline, runs
    each layer's paged forward on its shard and merges the gathered partials. Rank 0 (``reference``,
    default ``rank == 0``) also runs the single-rank paged model (``cp_world_size=1``) and the dense
    model and checks the partition of the written slots. ``mla_block`` defaults to the smallest block
    the interleave allows (``max ratio * interleave``: virtual blocks small enough for prefix hits).
    Returns a summary dict (every rank; errors and checks are filled on rank 0).
    """
    cpw, r, dev = comm.world, comm.rank, torch.device(device)
    reference = r == 0 if reference is None else reference
    mla_block = mla_block or max(CFG.ratios) * interleave
    L = cp_layouts(CFG.to_dict(), max_len, cpw, interleave, mla_block_size=mla_block,
                   swa_block_size=swa_block, indexer_causal_indices=True)
    sched = ReferenceScheduler(L.sched, num_blocks, max_num_batched_tokens=budget, max_num_seqs=5,
                               num_speculative_tokens=spec, long_prefill_threshold=chunk,
                               enable_prefix_caching=True, seed=seed)
    cap = budget + pad
    pipe = MetadataPipeline(L.rank, 8, cap, dev, spec, cp_world_size=cpw, cp_rank=r, cp_interleave=interleave)
    layers = [CFG.layer_ids(k)[0] for k in ("swa", "c4", "c128")]
    models = {layer: init_weights(DSV4Attention(CFG, layer), 10 + layer).to(dev).eval() for layer in layers}
    caches = PagedCaches(CFG, L.rank, num_blocks, device=dev)
    if reference:
        single = MetadataPipeline(L.sched, 8, cap, dev, spec)
        single_caches = PagedCaches(CFG, L.sched, num_blocks, device=dev)
    topk_fn = global_topk_fn(comm, cpw, r, interleave)
    inputs = Inputs(L.sched.group("mla").alloc_block_size, max_len)
    res = dict(world=cpw, interleave=interleave, steps=0, tokens=0, decode_tokens=0, prefill_tokens=0,
               spec_rejected=0, preempted=0, prefix_hits=0, replayed=0, compared=0,
               err_single=0.0, err_dense=0.0, build_ms=[], failures=[])
    worst = lambda d: float(torch.nan_to_num(d.abs(), nan=float("inf")).max()) if d.numel() else 0.0  # noqa: E731
    for step, view_list, accepted in make_trace(sched, inputs, steps, seed):
        views = {v.req_id: v for v in view_list}
        T = step.total_tokens
        res["preempted"] += len(step.preempted_req_ids)
        res["prefix_hits"] += sum(v.replay_end > 0 and v.num_computed_tokens == v.replay_start for v in view_list)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        pipe.update(step, pad_to=T + pad)  # NOTE: every step, empty ones too (they carry finished ids)
        meta = pipe.build()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        res["build_ms"].append((time.perf_counter() - t0) * 1e3)
        if reference:
            single.update(step, pad_to=T + pad)
            meta1 = single.build()
            assert meta1.req_ids == meta.req_ids
        if T == 0:
            continue
        try:
            check_fit(meta, views, L)
            if validate:
                check_metadata(meta, num_blocks=num_blocks)
        except ValueError as e:
            res["failures"].append(f"rank {r} step {res['steps']}: {e}")
        qsl = meta.query_start_loc.tolist()
        x, dense_in = torch.zeros(T + pad, CFG.hidden_size), {}
        for b, rid in enumerate(meta.req_ids):
            v = views[rid]
            c, n = v.num_computed_tokens, v.num_scheduled_tokens
            keep = 1 + accepted.get(rid, n - 1) if v.is_decode else n  # tokens that stay real
            res["spec_rejected"] += n - keep
            seq = torch.cat([inputs.real(rid, c + keep), inputs.draft(rid, c + n)[c + keep:]])
            x[qsl[b]:qsl[b + 1]] = seq[c:]
            dense_in[rid] = seq
        x[T:] = float("nan")  # padded tokens: must give zeros and write nothing
        x = x.to(dev)
        with torch.no_grad():
            for layer, m in models.items():
                o, lse = m.forward_paged(x, meta, caches[layer], return_lse=True, with_sink=r == 0, topk_fn=topk_fn)
                merged = merge_partials(comm.all_gather(o), comm.all_gather(lse))
                y = torch.where(meta.is_valid_token[:, None], m.project(merged), 0.0)
                if not reference:
                    continue
                y1 = m.forward_paged(x, meta1, single_caches[layer])
                res["err_single"] = max(res["err_single"], worst(y - y1), worst(y[T:]))
                for b, rid in enumerate(meta.req_ids):
                    v = views[rid]
                    ref = m.forward_dense(dense_in[rid].to(dev))[v.num_computed_tokens:]
                    # NOTE: replayed tokens whose window reaches below replay_start only rebuild caches
                    # (an engine discards their outputs): compared with the single rank, not with dense.
                    skip = min(v.num_scheduled_tokens, max(0, v.replay_start + CFG.sliding_window - 1
                                                          - v.num_computed_tokens)) if v.replay_end else 0
                    res["err_dense"] = max(res["err_dense"], worst(y[qsl[b] + skip:qsl[b + 1]] - ref[skip:]))
                    if layer == layers[0]:
                        res["compared"] += v.num_scheduled_tokens - skip
                        res["replayed"] += max(0, min(v.seq_len, v.replay_end) - v.num_computed_tokens)
        metas = comm.gather_objects(host_meta(meta) if validate else None)
        if reference and validate:
            try:
                check_cp_partition(metas)
                check_replicated(metas, meta1)
            except ValueError as e:
                res["failures"].append(f"step {res['steps']}: {e}")
        res["steps"] += 1
        res["tokens"] += T
        res["decode_tokens"] += meta.num_decode_tokens
        res["prefill_tokens"] += meta.num_prefill_tokens
    # every rank's failures and build times to everyone
    allres = comm.gather_objects((res["failures"], res["build_ms"]))
    res["failures"] = [f for fails, _ in allres for f in fails]
    res["build_ms_median"] = [statistics.median(ms) if ms else 0.0 for _, ms in allres]
    if reference:
        for key in ("err_single", "err_dense"):
            if not res[key] <= TOL:
                res["failures"].append(f"{key} = {res[key]:.3g} > {TOL}")
    return res


def summary(res: dict) -> str:
    ms = ", ".join(f"{t:.2f}" for t in res["build_ms_median"])
    return (f"DCP world={res['world']} interleave={res['interleave']}: {res['steps']} steps, "
            f"{res['tokens']} tokens ({res['prefill_tokens']} prefill, {res['decode_tokens']} decode, "
            f"{res['spec_rejected']} rejected spec, {res['preempted']} preempted, {res['prefix_hits']} prefix "
            f"hits, {res['replayed']} replayed)\n"
            f"  max |merged - single| = {res['err_single']:.3g}  (every token)\n"
            f"  max |merged - dense|  = {res['err_dense']:.3g}  ({res['compared']} tokens per layer)\n"
            f"  metadata update + build median ms per rank: [{ms}]\n"
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
    add_threads_option(ap)
    args = ap.parse_args(argv)

    import torch.distributed as dist
    set_threads(args.threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    device, backend = "cpu", "gloo"
    if args.device == "cuda":
        n_gpu = torch.cuda.device_count()
        if n_gpu == 0:
            raise SystemExit("--device cuda: no GPU visible")
        torch.cuda.set_device(local % n_gpu)
        device = f"cuda:{local % n_gpu}"
        torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: fp32 math on both sides of the comparison
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
