"""DeepSeek-V4-Flash decode at real shape, fed only by dsv4_index metadata: a check every step and the
metadata's share of a decode step (issue 15).

One attention layer of each kind (SWA-only, C4A + indexer, C128A) at the config's shapes (64 query heads,
one KV head of dim 512 with 64 rope dims, window 128, top-k 512), bf16 caches, random q / sinks. B requests
decode with one speculative token (random acceptance; a request's last step before max_model_len has one
token, and the step is padded) through ``MetadataPipeline.update / build`` (array-form steps). Contexts
start in 4K..max_model_len; a few start next to max_model_len, finish there and are replaced. All a layer
touches comes from the metadata: KV writes through ``meta["swa"].slot_mapping`` and, when a token
completes a compressed row (random content, no real compressor), ``compressed_slot_mapping``; reads
through ``meta.sparse_decode_args(kind, topk_slots, padded=True)`` -> ``sparse_decode_attention`` (Triton), with
``meta.topk_to_slots("c4a", picks, compact=True)`` on C4A. Picks are the top-k of random scores over the
visible rows plus ~2 % garbage (-1, rows not visible yet, 2**31 - 1) that must be dropped.

Check, every step, on ``--check-reqs`` requests (the longest context + random ones, every token): the keys
each token must see are recomputed from positions (window, visible C128A rows, valid picks), their slots
from the workload's own block lists (not the metadata), and the rows gathered by those slots must equal
bit for bit what the token model wrote; the metadata's index rows must equal those slots exactly; then a
dense fp32 softmax with the sink. Tolerances: relative Frobenius error of a token's [H, D] output < 1e-2,
|lse error| < 1e-3. Why: bf16 keeps 8 significant bits, so each rounding is within 2**-8 = 3.9e-3; the
kernel rounds twice (P before the PV dot, then the output), <= 7.8e-3 in all (~2e-3 on random data with
round-to-nearest casts, emulated; ~5.5e-3 in Triton 3.6's interpreter, whose casts truncate). The logits
are exact bf16 products summed in fp32 (lse error ~1e-6; 1e-3 bounds 512-term fp32 sums). A wrong key of
average weight among N ~ 640 moves the output by ~sqrt(2 / N) ~ 5e-2; any wrong slot fails the exact check.

Large values (issue point 3): block ids are taken from the top of a pool whose largest slot is 2**31 - 1
(ids ~2**25: ``id * 64`` just below 2**31 for the SWA and C4A caches; C128A / state slots, ``id * 2 / 4 /
8``, are as large as one shared pool allows), and contexts reach max_model_len (last table column, full
causal width). Each cache reaches the kernel as a [2**31, D] tensor with the metadata's slots unchanged:
the storage layer RESERVES 2**31 rows of address space and backs only the pool's rows with memory (CUDA
driver virtual memory on the GPU; mmap PROT_NONE + mprotect on the CPU), so a read outside the pool
faults. Unwritten rows hold NaN. Only the example's own writes and checks use the physical view (row =
slot - first pool row). Before the run, two rows at both ends of each pool are read back through the
kernel on these views; if reserving or that probe fails, the run falls back (printed, and in the JSON) to
``--storage dense``: low block ids and plain tensors.

Timing (CUDA; medians over steps 1.., step 0 admits the batch): ``update()`` host time; GPU time (CUDA
events, the GPU kept busy meanwhile so host latency is excluded) of ``build()`` with update's H2D copy,
of one ``topk_to_slots`` per C4A layer, and of each layer kind's attention kernel, multiplied by the
config's layer counts (V4-Flash: 2 SWA + 21 C4A + 20 C128A; the MTP layer is listed, not counted). The
share is metadata / (metadata + attention): attention is only part of a step, so this is an upper bound.

    python examples/flash_decode_step.py                        # CUDA: B=256, 300 steps, V4-Flash shapes
    python examples/flash_decode_step.py --small                # CPU: scaled down, Triton interpreter
    python examples/flash_decode_step.py --device cpu --steps 2 --batch 4 --ctx 300 4000   # full shapes

Exit code 1 when any check fails.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # examples/_progress.py, _threads.py

import argparse
import ctypes
import json
import statistics
import time
from collections import Counter

import numpy as np
import torch  # NOTE: does not import triton; TRITON_INTERPRET is set before anything does
from _progress import progress  # examples/_progress.py: tqdm on a terminal, plain lines otherwise
from _threads import add_threads_option, set_threads  # examples/_threads.py: --threads (default 1)

KINDS = ("swa", "c4", "c128")
SALT = {"swa": 0, "c4": 1, "c128": 2}
TOL_REL, TOL_LSE = 1e-2, 1e-3
VROWS = 1 << 31            # rows of each cache's address space: every int32 slot
GRAN = 2 << 20             # mapping granularity in bytes (CUDA's)
P_A, P_B = 65521, 65519    # rows of the two value tables (primes)
Q_STD, SINK_MEAN, SINK_STD = 2.0, 8.0, 2.0   # peaked softmax; the sink takes real mass on some heads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 300; --small: 6)")
    ap.add_argument("--batch", type=int, default=None, help="requests (default 256; --small: 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="4 heads, dim 64, max_model_len 8192, B=8, 6 steps (CPU)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 131072 (--small: 8192)")
    ap.add_argument("--ctx", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="initial contexts drawn from [LO, HI] (default 4096 .. max_model_len)")
    ap.add_argument("--check-reqs", type=int, default=4, help="requests checked per step (default 4)")
    ap.add_argument("--storage", choices=("virtual", "dense"), default="virtual")
    ap.add_argument("--busy-us", type=float, default=4000.0,
                    help="CUDA: the GPU busy wait behind which update() + build() are enqueued (default 4000); "
                         "the build() GPU figure holds only while the host stays under it (the summary counts "
                         "the steps that did not)")
    ap.add_argument("--cuda-graphs", action="store_true", help="build() replays a CUDA graph")
    ap.add_argument("--kernels", action="store_true", help="CPU: metadata by the Triton kernels (interpreter)")
    ap.add_argument("--attn-reference", action="store_true", help="attention by the PyTorch reference")
    ap.add_argument("--fault", choices=KINDS, nargs="+", default=(),
                    help="self-test: entry 0 of each token's list of these kinds repeats entry 1 (must FAIL)")
    add_threads_option(ap)
    a = ap.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sized = any(v is not None for v in (a.steps, a.batch, a.max_model_len, a.ctx))
    if not a.device.startswith("cuda") and not a.small:
        if not sized:   # NOTE: full V4-Flash shapes (B=256, 300 steps) in the Triton interpreter take hours
            a.small = True
            print("CPU without --small: full V4-Flash shapes would take hours in the Triton interpreter; running "
                  "--small (under 10 s). Give --steps / --batch / --ctx to run full head shapes at your size.",
                  file=sys.stderr, flush=True)
        else:
            print("CPU, full head shapes (64 heads, dim 512) in the Triton interpreter: expect tens of seconds "
                  "per step and more with --batch; progress below.", file=sys.stderr, flush=True)
    a.steps, a.batch = a.steps or (6 if a.small else 300), a.batch or (8 if a.small else 256)
    a.max_model_len = a.max_model_len or (8192 if a.small else 131072)
    a.ctx = a.ctx or [200 if a.small else 4096, a.max_model_len]
    if a.steps < 1 or a.batch < 1 or a.check_reqs < 1 or not 1 <= a.ctx[0] <= a.ctx[1] <= a.max_model_len:
        ap.error("need --steps, --batch, --check-reqs >= 1 and 1 <= ctx LO <= HI <= max_model_len")
    if a.cuda_graphs and not a.device.startswith("cuda"):
        ap.error("--cuda-graphs needs --device cuda")
    return a


def layer_counts(config) -> dict:
    """Attention layers per kind, counted from the config: ``{"main": {kind: n}, "mtp": {kind: n}}``."""
    from dsv4_index import DSV4Layout
    from dsv4_index.config import normalize_config
    cfg = normalize_config(config)
    lay, n = DSV4Layout.from_config(cfg, max_model_len=1024), cfg["num_hidden_layers"]
    main, mtp = (Counter(lay.layer_kind(i) for i in r) for r in (range(n), range(n, lay.num_layers)))
    return {"main": {k: main[k] for k in KINDS}, "mtp": {k: mtp[k] for k in KINDS}}


# ----------------------------------------------------------------------------------------------
# storage: 2**31 rows of address space per cache, memory only at the pool's rows
# ----------------------------------------------------------------------------------------------
class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp (allocFlags inlined)
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("location", _Loc), ("win32", ctypes.c_void_p),
                ("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


def _reserve_cuda(nbytes, spans, device):
    """Reserve ``nbytes`` of GPU addresses, map fresh memory at byte ``spans``; (base, release)."""
    lib, u64, sz = ctypes.CDLL("libcuda.so.1"), ctypes.c_uint64, ctypes.c_size_t
    done = []  # undo actions, last first

    def call(name, *a):
        r = getattr(lib, name)(*a)
        if r != 0:
            raise RuntimeError(f"{name} returned CUresult {r}")

    def release():
        while done:
            done.pop()()
    torch.empty(1, device=device)  # NOTE: makes the primary context current on this thread
    dev = device.index if device.index is not None else torch.cuda.current_device()
    prop, gran, base = _Prop(type=1, location=_Loc(1, dev)), sz(), u64()  # pinned device memory
    call("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    assert GRAN % gran.value == 0, gran.value
    call("cuMemAddressReserve", ctypes.byref(base), sz(nbytes), sz(GRAN), u64(0), u64(0))
    done.append(lambda: lib.cuMemAddressFree(base, sz(nbytes)))
    try:
        for lo, hi in spans:
            h, at = u64(), u64(base.value + lo)
            call("cuMemCreate", ctypes.byref(h), sz(hi - lo), ctypes.byref(prop), u64(0))
            done.append(lambda h=h: lib.cuMemRelease(h))
            call("cuMemMap", at, sz(hi - lo), sz(0), h, u64(0))
            done.append(lambda at=at, n=hi - lo: lib.cuMemUnmap(at, sz(n)))
            call("cuMemSetAccess", at, sz(hi - lo), ctypes.byref(_Access(_Loc(1, dev), 3)), sz(1))  # read-write
    except Exception:
        release()
        raise
    return base.value, release


def _reserve_cpu(nbytes, spans):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = libc.mmap(None, nbytes, 0, 0x02 | 0x20 | 0x4000, -1, 0)  # PROT_NONE; PRIVATE|ANONYMOUS|NORESERVE
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the cache address space failed")
    if any(libc.mprotect(base + lo, hi - lo, 3) for lo, hi in spans):  # PROT_READ | PROT_WRITE
        libc.munmap(base, nbytes)
        raise OSError(ctypes.get_errno(), "mprotect failed")
    return base, lambda: libc.munmap(base, nbytes)


def _tensor_at(ptr, nbytes, D, dtype, device):
    st = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)  # NOTE: does not own the memory
    rows = nbytes // (D * torch.empty(0, dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype, device=device).set_(st, 0, (rows, D), (D, 1))


class Cache:
    """One paged cache. ``full``: what the kernel gets ([2**31, D] reserved, or [hi, D] dense); ``phys``:
    rows ``[lo, hi)``: the pool's rows, the first ``scratch`` of them a never-allocated block."""

    def __init__(self, name, lo, hi, D, dtype, device, virtual, scratch=1):
        self.name, self.lo, self.hi, self.scratch, self._release = name, lo, hi, scratch, None
        if not virtual:
            self.full = torch.full((hi, D), float("nan"), dtype=dtype, device=device)
            self.phys = self.full[lo:hi]
            return
        rb = D * torch.empty(0, dtype=dtype).element_size()
        # NOTE: granule 0 is backed too (the tensor's base pointer must be valid; slot 0 = null block reads NaN)
        spans = [(0, GRAN), (lo * rb // GRAN * GRAN, -(-hi * rb // GRAN) * GRAN)]
        spans = [(0, spans[1][1])] if spans[1][0] <= GRAN else spans
        base, self._release = (_reserve_cuda if device.type == "cuda" else
                               lambda n, s, d: _reserve_cpu(n, s))(VROWS * rb, spans, device)
        for a, b in spans:
            _tensor_at(base + a, b - a, D, dtype, device).fill_(float("nan"))
        self.full = _tensor_at(base, VROWS * rb, D, dtype, device)
        self.phys = _tensor_at(base + lo * rb, (hi - lo) * rb, D, dtype, device)

    def write(self, slots, values, bad):
        """Scatter ``values`` [T, D] to int64 ``slots`` (-1: none; they land in the scratch block) and
        count slots outside the pool in ``bad``."""
        ok = (slots >= self.lo + self.scratch) & (slots < self.hi)
        bad += ((slots != -1) & ~ok).sum()
        self.phys.index_copy_(0, torch.where(ok, slots - self.lo, 0), values)

    def rows(self, slots: np.ndarray):
        """Rows at host-computed slots (the independent read path)."""
        assert slots.size == 0 or (slots.min() >= self.lo + self.scratch and slots.max() < self.hi), self.name
        return self.phys[torch.from_numpy(slots - self.lo).to(self.phys.device)]

    def close(self):
        self.full = self.phys = None
        if self._release is not None:
            self._release()
            self._release = None


# ----------------------------------------------------------------------------------------------
# the token model and the workload
# ----------------------------------------------------------------------------------------------
class Values:
    """What a cache row holds: bf16 ``A[h1] + B[h2]`` (hashes of salt, request uid, position or row,
    version; version 1 = a rejected draft), RoPE on the last ``rope`` dims at ``pos * scale``."""

    def __init__(self, D, rope, device, seed):
        g = torch.Generator().manual_seed(seed)
        self.A, self.B = (torch.randn(n, D, generator=g).to(device) for n in (P_A, P_B))
        self.inv = (10000.0 ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)).float().to(device)
        self.rope, self.device = rope, device

    def rotate(self, x, pos):
        r, h = self.rope, self.rope // 2
        ang = pos.to(torch.float32)[:, None] * self.inv
        c, s = (f(ang).view(ang.shape[:1] + (1,) * (x.dim() - 2) + ang.shape[1:]) for f in (torch.cos, torch.sin))
        x1, x2 = x[..., -r:-h], x[..., -h:]
        return torch.cat([x[..., :-r], x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def __call__(self, kind, uid, pos, ver, scale=1):
        uid, pos, ver = (torch.as_tensor(v, dtype=torch.int64, device=self.device) for v in (uid, pos, ver))
        salt = SALT[kind]
        ia = (uid * 7919 + pos + ver * 4099 + salt * 101) % P_A
        ib = (uid * 104729 + pos * 31 + ver * 7 + salt * 13) % P_B
        return self.rotate(self.A[ia] + self.B[ib], pos.expand(ia.shape) * scale).to(torch.bfloat16)


class Workload:
    """``B`` decoding requests, ``next_n = 2`` tokens per step (one speculative), in request slots
    ``0..B-1``. One pool of block ids ``[trash + 1, top)``: the mla group's at the top, the sliding groups'
    below; id ``trash`` is never handed out (the storage's scratch block), id 0 is the null block."""

    def __init__(self, layout, B, ctx, max_model_len, steps, seed, virtual, next_n=2):
        self.B, self.next_n, self.L, self.ctx, self.steps = B, next_n, max_model_len, ctx, steps
        self.rng = np.random.default_rng(seed)
        self.bs = [g.block_size for g in layout.groups]
        self.win = [g.window for g in layout.groups]
        self.mla = layout.group("mla").gid
        unit = max(c.rows_per_block if c.compress_ratio > 1 else self.bs[c.gid] for c in layout.channels.values())
        n_mla = B * -(-max_model_len // self.bs[self.mla])
        n_small = 2 * B * sum(-(-(w - 1 + next_n) // b) + 1 for b, w in zip(self.bs, self.win) if w)  # NOTE: fresh
        self.top = VROWS // unit if virtual else 2 + n_small + n_mla
        self.mla_lo = self.top - n_mla
        self.trash = self.mla_lo - n_small - 1
        # NOTE: a joining request's context blocks are prefix hits (its KV came from elsewhere): they must be ids never
        # filled at another position (DESIGN §5), so joiners take never-used ids; freed ids serve the running ones
        self.fresh = {True: list(range(self.mla_lo, self.top)), False: list(range(self.trash + 1, self.mla_lo))}
        self.free: dict = {True: [], False: []}
        self.reqs, self.uid, self.max_pos, self.finished = [None] * B, 0, 0, 0

    def _alloc(self, g, n, joining):
        used, fresh = self.free[g == self.mla], self.fresh[g == self.mla]
        assert len(fresh) + (0 if joining else len(used)) >= n, "block pool exhausted (workload bug)"
        # NOTE: highest ids first; a running request reuses freed ids first
        return [used.pop() if used and not joining else fresh.pop() for _ in range(n)]

    def _context(self, s):
        if s < max(1, self.B // 32):  # NOTE: these reach max_model_len during the run
            return int(max(self.ctx[0], self.L - self.next_n - self.rng.integers(0, self.steps)))
        return int(self.rng.integers(self.ctx[0], self.ctx[1] - self.next_n + 1))

    def next_step(self):
        """(StepBatch, per-row (c, q, draft version) host arrays, admitted slots). A request keeps, per
        group, its first live logical block and the ids from there on (sliding groups drop old ones)."""
        from dsv4_index.batch import APPEND, StepBatch
        free, new, runs = [], np.zeros(self.B, bool), []
        for s in range(self.B):
            r = self.reqs[s]
            if r is not None and r["c"] >= self.L:  # finished at max_model_len
                for g, (_, ids) in enumerate(r["blocks"]):
                    self.free[g == self.mla].extend(ids)
                free.append(s)
                self.finished += 1
                r = None
            if r is None:
                self.uid += 1
                r = self.reqs[s] = dict(uid=self.uid, c=self._context(s), blocks=[(0, [])] * len(self.bs))
                new[s] = True
            c = r["c"]
            r["q"] = min(self.next_n, self.L - c)  # NOTE: the last step before max_model_len has 1 token
            for g, (b, w) in enumerate(zip(self.bs, self.win)):
                first, ids = r["blocks"][g]
                need = -(-(c + r["q"]) // b)
                lo = max(c - w + 1, 0) // b if w else 0  # NOTE: the lowest block this step reads
                if new[s]:
                    first = lo
                elif lo > first:  # blocks below it left the window: back to the pool
                    self.free[False].extend(ids[:lo - first])
                    first, ids = lo, ids[lo - first:]
                add = self._alloc(g, need - first - len(ids), bool(new[s]))
                r["blocks"][g] = (first, ids + add)
                if new[s]:  # NOTE: a new request's list starts at logical block 0: null before `first`
                    runs.append((g, s, 0, np.concatenate([np.zeros(first, np.int64), np.asarray(add, np.int64)])))
                elif add:
                    runs.append((g, s, APPEND, np.asarray(add, np.int64)))
        c = np.array([r["c"] for r in self.reqs], np.int64)
        q = np.array([r["q"] for r in self.reqs], np.int64)
        self.acc = self.rng.random(self.B) < 0.7
        self.max_pos = max(self.max_pos, int((c + q).max()) - 1)
        col = lambda i: np.array([x[i] for x in runs], np.int64)
        batch = StepBatch(req_slots=np.arange(self.B, dtype=np.int64), num_computed_tokens=c, num_scheduled_tokens=q,
                          is_new=new, free_slots=np.asarray(free, np.int64), write_gids=col(0), write_slots=col(1),
                          write_starts=col(2), write_cu=np.cumsum([0] + [len(x[3]) for x in runs]).astype(np.int64),
                          write_ids=np.concatenate([np.zeros(0, np.int64)] + [x[3] for x in runs]))
        return batch, c, q, ((q == self.next_n) & ~self.acc).astype(np.int64), np.flatnonzero(new)

    def advance(self):
        for r, a in zip(self.reqs, self.acc):
            r["c"] += 1 + int(a) if r["q"] == self.next_n else r["q"]

    def slots(self, s, g, pos, S):
        """Host slots of positions (or compressed rows) ``pos`` of slot ``s`` in group ``g``."""
        first, ids = self.reqs[s]["blocks"][g]
        k = pos // S - first
        assert k.size == 0 or k.min() >= 0, "workload bug: a read position's block was released"
        return np.asarray(ids, np.int64)[k] * S + pos % S


# ----------------------------------------------------------------------------------------------
# timing, picks, reference
# ----------------------------------------------------------------------------------------------
class Timer:
    """GPU time (CUDA events) of what ``fn`` enqueues, with the GPU kept busy (``_sleep``) while the
    host enqueues it, so host latency never counts as GPU time; ``starved``: host overran the wait."""

    def __init__(self, device):
        self.cuda, self.starved = device.type == "cuda", 0
        if self.cuda:
            self.e0, self.e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.cycles_per_us = 1.0
            for _ in range(2):  # NOTE: the first launch loads the kernel
                self.cycles_per_us = 2e6 / self(lambda: torch.cuda._sleep(2_000_000), 0)[1]

    def __call__(self, fn, busy_us):
        if not self.cuda:
            return fn(), None
        torch.cuda._sleep(int(busy_us * self.cycles_per_us))
        self.e0.record()
        h = time.perf_counter()
        r = fn()
        self.starved += (time.perf_counter() - h) * 1e6 > 0.9 * busy_us > 0
        self.e1.record()
        self.e1.synchronize()
        return r, self.e0.elapsed_time(self.e1) * 1e3


def make_picks(pos, R, K, width, gen):
    """Indexer top-k: the K best random scores over each token's rows ``[0, (pos + 1) // R)`` (-1 past
    them), then ~2 % garbage: -1, rows not visible yet, 2**31 - 1. int32 [T, K]."""
    T, nc, dev = pos.shape[0], (pos + 1) // R, pos.device
    scores = torch.rand(T, max(width, 1), generator=gen, device=dev)
    scores.masked_fill_(torch.arange(scores.shape[1], device=dev)[None] >= nc[:, None], -1.0)
    val, idx = scores.topk(min(K, scores.shape[1]), dim=1)
    picks = torch.full((T, K), -1, dtype=torch.int64, device=dev)
    picks[:, :idx.shape[1]] = torch.where(val >= 0, idx, -1)
    u = torch.rand(T, K, generator=gen, device=dev)
    picks = torch.where(u < 0.01, -1, torch.where(u < 0.018, nc[:, None] + (u * 1e5).long() % 64, picks))
    return torch.where(u >= 0.998, 2 ** 31 - 1, picks).to(torch.int32)


def dense_reference(q, keys, sink, scale):
    """fp32 attention of one token: q [H, D], keys [N, D] (key = value), sink [H] -> (o [H, D], lse [H])."""
    s = torch.cat([q @ keys.T * scale, sink[:, None]], 1)
    lse = torch.logsumexp(s, 1)
    return torch.exp(s - lse[:, None])[:, :-1] @ keys, lse


def probe(caches, attend, T, H, D, device):
    """Two rows at both ends of each pool, written by the storage layer and read back through the kernel
    on the [2**31, D] views (what fails here falls back to dense storage); the rows are NaN again after."""
    g, i32 = torch.Generator().manual_seed(1), torch.int32
    q = torch.randn(T, 1, H, D, generator=g).to(device, torch.bfloat16)
    sink, lists = torch.zeros(H, device=device), {}
    for k, c in caches.items():
        slots = torch.tensor([c.lo + c.scratch, c.hi - 1], device=device)
        rows = torch.randn(2, D, generator=g).to(device, torch.bfloat16)
        c.write(slots, rows, torch.zeros((), dtype=torch.int64, device=device))
        idx = torch.full((T, 1, 128 if k == "swa" else 512), -1, dtype=i32, device=device)
        idx[:, 0, :2] = slots.to(i32)
        lists[k] = (idx, torch.full((T,), 2, dtype=i32, device=device), rows)
    for k in KINDS:
        extra = (None, None, None) if k == "swa" else (caches[k].full,) + lists[k][:2]
        out, _ = attend(q, caches["swa"].full, *lists["swa"][:2], *extra, sink)
        keys = torch.cat([lists["swa"][2]] + ([] if k == "swa" else [lists[k][2]])).float()
        ref, _ = dense_reference(q[0, 0].float(), keys, sink, D ** -0.5)
        assert float((out[0, 0].float() - ref).norm()) <= TOL_REL * float(ref.norm()), f"probe of the {k} cache"
    for c in caches.values():
        c.phys[torch.tensor([c.scratch, c.hi - c.lo - 1], device=device)] = float("nan")


def stats(xs):
    s = sorted(x for x in xs if x is not None)
    if not s:
        return None
    return dict(median=statistics.median(s), p10=s[(len(s) - 1) // 10], p90=s[9 * (len(s) - 1) // 10], n=len(s))


# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: the reference is fp32, not TF32
    if dev.type == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"
        os.environ.pop("DSV4_INDEX_BACKEND", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"  # NOTE: the attention kernel runs in the interpreter
        os.environ["DSV4_INDEX_BACKEND"] = "triton" if args.kernels else "reference"
    # NOTE: one intra-op thread, as an engine's GPU worker runs (and DESIGN §8's host method): tiny ops only
    # contend with intra-op threads (on the H200 host update() read 606 µs with torch's default, 477 with one)
    set_threads(args.threads)
    md_backend = "triton" if dev.type == "cuda" or args.kernels else "reference (PyTorch)"
    attn_backend = "reference" if args.attn_reference else "triton"
    from dsv4_index import DSV4Layout, MetadataPipeline
    from dsv4_index.config import normalize_config
    from models.deepseek_v4.sparse_decode import sparse_decode_attention

    cfg = normalize_config("flash")
    counts = layer_counts(cfg)
    H, D, rope = (4, 64, 16) if args.small else (cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"])
    layout = DSV4Layout.from_config(cfg, args.max_model_len)
    W, K, R = layout.sliding_window, layout.index_topk, {"c4": layout.c4_ratio, "c128": layout.c128_ratio}
    L, B, next_n = args.max_model_len, args.batch, 2
    Tp, scale = B * next_n, D ** -0.5
    g_swa, g_mla = layout.group("swa").gid, layout.group("mla").gid
    S = {"swa": layout.groups[g_swa].block_size, "c4": layout.channels["c4a"].rows_per_block,
         "c128": layout.channels["c128a"].rows_per_block}
    # NOTE: the interpreter's cost is per tile op: fewer, wider key tiles on CPU; CUDA keeps its tuned tiles
    tiles = dict(BLOCK_N=256) if dev.type != "cuda" and attn_backend == "triton" else None
    attend = lambda *a: sparse_decode_attention(*a, sm_scale=scale, backend=attn_backend, config=tiles)
    storage, note = args.storage, ""
    while True:
        wl = Workload(layout, B, args.ctx, L, args.steps, args.seed, storage == "virtual")
        caches = {}
        try:
            for k in KINDS:
                caches[k] = Cache(k, wl.trash * S[k], (wl.mla_lo if k == "swa" else wl.top) * S[k], D, torch.bfloat16,
                                  dev, storage == "virtual", scratch=S[k])
            probe(caches, attend, Tp, H, D, dev)
            break
        except Exception as e:  # NOTE: reservation, mapping or the kernel refusing the views
            for c in caches.values():
                c.close()
            if storage == "dense":
                raise
            storage, note = "dense", f"2**31-row caches failed ({e!r}); fell back to --storage dense"
            print("WARNING: " + note)
    print(f"V4-Flash decode: H={H} D={D} (rope {rope}) W={W} top-k={K} R={R['c4']}/{R['c128']}; "
          f"B={B} x {next_n} tokens (1 speculative), max_model_len={L}, contexts from {args.ctx[0]}..{args.ctx[1]}, "
          f"{args.steps} steps")
    print(f"device {dev}; metadata {md_backend}; attention {attn_backend}; layers from the config: "
          f"{counts['main']} (+ MTP {counts['mtp']})")
    print(f"storage {storage}: block ids [{wl.trash + 1}, {wl.top}), mla from {wl.mla_lo}; " + (
        "each cache is a [2**31, D] tensor whose address space is reserved and backed only at the pool's rows; "
        "the kernel reads the metadata's slots unchanged" if storage == "virtual" else "plain tensors, low block ids"))
    cols = sum(g.columns(max(8192, Tp))[0] for g in layout.groups)
    pipe = MetadataPipeline(layout, max(256, B), max(8192, Tp), dev, num_speculative_tokens=next_n - 1,
                            cuda_graphs=args.cuda_graphs, max_staged_blocks=max(1 << 20, B * cols + 1024))
    pipe.warmup(pad_sizes=(Tp,))
    vals = Values(D, rope, dev, args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    sinks = {k: torch.randn(H, generator=gen, device=dev) * SINK_STD + SINK_MEAN for k in KINDS}
    outs = {k: torch.empty(Tp, 1, H, D, dtype=torch.bfloat16, device=dev) for k in KINDS}
    timer, crng = Timer(dev), np.random.default_rng(args.seed + 1)
    cnt = {k: torch.zeros((), dtype=torch.int64, device=dev) for k in ("bad_writes", "lens", "below_-1", "pad_out")}
    max_slot = {k: torch.full((), -1, dtype=torch.int64, device=dev) for k in ("w_swa", "w_c4", "w_c128", *KINDS)}
    err = {k: dict(rel=0.0, lse=0.0, index_mismatch=0, value_mismatch=0, tokens=0) for k in KINDS}
    times = {k: [] for k in ("update_host_us", "build_gpu_us", "topk_gpu_us", *(f"attn_{k}_us" for k in KINDS))}
    t_start = time.perf_counter()

    def fill_prefix(s):
        """A new request's earlier rows (its prompt's KV), written by host slots: not this step's work."""
        r = wl.reqs[s]
        p = np.arange(max(0, r["c"] - W + 1), r["c"])
        caches["swa"].phys[torch.from_numpy(wl.slots(s, g_swa, p, S["swa"]) - caches["swa"].lo).to(dev)] = \
            vals("swa", r["uid"], p, 0)
        for k in ("c4", "c128"):
            rows = np.arange(r["c"] // R[k])
            caches[k].phys[torch.from_numpy(wl.slots(s, g_mla, rows, S[k]) - caches[k].lo).to(dev)] = \
                vals(k, r["uid"], rows, 0, scale=R[k])

    bar = progress(args.steps)
    for step in range(args.steps):
        batch, c_h, q_h, vd_h, admitted = wl.next_step()
        T, qsl = int(q_h.sum()), np.concatenate([[0], np.cumsum(q_h)])
        row = np.repeat(np.arange(B), q_h)
        tok = {"uid": np.array([r["uid"] for r in wl.reqs])[row], "pos": c_h[row] + np.arange(T) - qsl[row],
               "ver": np.where(np.arange(T) == qsl[row] + next_n - 1, vd_h[row], 0)}
        tok = {k: torch.from_numpy(np.concatenate([v, np.full(Tp - T, -1 if k == "pos" else 0)])).to(dev)
               for k, v in tok.items()}  # NOTE: padded tokens: position -1
        uid, pos, ver = tok["uid"], tok["pos"], tok["ver"]

        def metadata():
            h = time.perf_counter()
            pipe.update(batch, pad_to=Tp)
            times["update_host_us"].append((time.perf_counter() - h) * 1e6 if step else None)
            return pipe.build()
        meta, t = timer(metadata, args.busy_us)
        times["build_gpu_us"].append(t if step else None)
        assert (meta.req_slots == np.arange(B)).all() and meta.num_decode_tokens == T == meta.num_tokens
        for s in admitted:
            fill_prefix(s)
        sm = {"swa": meta["swa"].slot_mapping, "c4": meta["c4a"].compressed_slot_mapping,
              "c128": meta["c128a"].compressed_slot_mapping}
        for k in KINDS:  # this step's KV / completed compressed rows, through the metadata's slot mappings
            v = vals(k, uid, pos, ver) if k == "swa" else vals(k, uid, (pos + 1) // R[k] - 1, ver, scale=R[k])
            caches[k].write(sm[k], v, cnt["bad_writes"])
            torch.maximum(max_slot["w_" + k], sm[k].max(), out=max_slot["w_" + k])

        q_all, lists, picks = {}, {}, None
        for kind in KINDS:
            q = torch.randn(Tp, H, D, generator=gen, device=dev) * Q_STD
            q = q_all[kind] = vals.rotate(q, pos)[:, None].bfloat16()
            topk = None
            if kind == "c4":
                picks = make_picks(pos, R["c4"], K, int(c_h.max() + next_n) // R["c4"], gen)
                n = counts["main"]["c4"] if dev.type == "cuda" else 1  # NOTE: one conversion per C4A layer
                topk, t = timer(lambda: [meta.topk_to_slots("c4a", picks, compact=True) for _ in range(n)][-1], 8000)
                times["topk_gpu_us"].append(t if step else None)
            a = lists[kind] = meta.sparse_decode_args(kind, topk, padded=True)
            if kind in args.fault:  # NOTE: self-test only: the check must catch this
                key = "indices" if kind == "swa" else "extra_indices"
                a[key] = a[key].clone()
                a[key][:, 0, 0] = torch.where(a[key][:, 0, 1] >= 0, a[key][:, 0, 1], a[key][:, 0, 0])
            xc = None if kind == "swa" else caches[kind].full
            (_, a["lse"]), t = timer(lambda: sparse_decode_attention(
                q, caches["swa"].full, a["indices"], a["topk_length"], xc, a["extra_indices"], a["extra_topk_length"],
                sinks[kind], sm_scale=scale, out=outs[kind], backend=attn_backend, config=tiles), 3000)
            times[f"attn_{kind}_us"].append(t if step else None)
            # every token: list lengths, no entry below -1 (an int32 wrap), padded tokens' outputs 0
            want = [(a["topk_length"], torch.clamp(pos + 1, max=W))]
            if kind != "swa":
                nc = (pos + 1) // R[kind]
                valid = nc if kind == "c128" else ((picks >= 0) & (picks < nc[:, None])).sum(1)
                want.append((a["extra_topk_length"], valid))
            for got, exp in want:
                cnt["lens"] += (got != exp).sum()
            for key in ["extra_indices" if R.get(kind) else "indices"]:  # NOTE: one SWA list for all kinds
                cnt["below_-1"] += (a[key] < -1).sum()
                torch.maximum(max_slot[kind], a[key].max().long(), out=max_slot[kind])
            cnt["pad_out"] += (outs[kind][T:] != 0).sum()

        # -- sampled requests against the dense fp32 reference, keys found independently ----------
        sample = [int(np.argmax(c_h))]
        others = np.setdiff1d(np.arange(B), sample)
        sample += [int(x) for x in crng.choice(others, min(args.check_reqs, B) - 1, replace=False)]
        picks_h = picks.cpu().numpy()
        for s in sample:
            c, u = int(c_h[s]), wl.reqs[s]["uid"]
            last = c + next_n - 1 if vd_h[s] else -1  # NOTE: the rejected draft's position (its KV differs)
            for t in range(qsl[s], qsl[s + 1]):
                p = c + t - qsl[s]
                wp = np.arange(max(0, p - W + 1), p + 1)
                win = (caches["swa"], wl.slots(s, g_swa, wp, S["swa"]), vals("swa", u, wp, wp == last),
                       "indices", "topk_length")
                for kind in KINDS:
                    parts = [win]
                    if kind != "swa":
                        nc = (p + 1) // R[kind]
                        pk = picks_h[t].astype(np.int64)
                        rows = np.arange(nc) if kind == "c128" else pk[(pk >= 0) & (pk < nc)]
                        parts.append((caches[kind], wl.slots(s, g_mla, rows, S[kind]),
                                      vals(kind, u, rows, (rows + 1) * R[kind] - 1 == last, scale=R[kind]),
                                      "extra_indices", "extra_topk_length"))
                    keys, e = [], err[kind]
                    for cache, slots, expect, ikey, lkey in parts:
                        got = cache.rows(slots)
                        e["value_mismatch"] += int((got.view(torch.int16) != expect.view(torch.int16)).any(1).sum())
                        keys.append(got.float())
                        lst, n = lists[kind][ikey][t, 0].cpu().numpy(), len(slots)
                        e["index_mismatch"] += int(int(lists[kind][lkey][t]) != n or not np.array_equal(lst[:n], slots)
                                                   or bool((lst[n:] != -1).any()))
                    o, lse = dense_reference(q_all[kind][t, 0].float(), torch.cat(keys), sinks[kind], scale)
                    rel = float((outs[kind][t, 0].float() - o).norm() / o.norm())
                    dl = float((lists[kind]["lse"][t, 0] - lse).abs().max())
                    e["rel"] = max(e["rel"], rel if rel == rel else 9e9)  # NOTE: NaN counts as a failure
                    e["lse"] = max(e["lse"], dl if dl == dl else 9e9)
                    e["tokens"] += 1
        wl.advance()
        timer.starved *= step > 0  # NOTE: admission (step 0) is not timed
        bar.set_postfix_str("rel err " + " ".join(f"{k} {err[k]['rel']:.1e}" for k in KINDS))
        bar.update(1)
    bar.close()
    res = dict(args=vars(args), shape=dict(H=H, D=D, rope=rope, W=W, K=K, B=B, T_pad=Tp, max_model_len=L),
               layer_counts=counts, storage=storage, storage_note=note, metadata_backend=md_backend,
               attention_backend=attn_backend, pool=dict(first_id=wl.trash + 1, mla_first_id=wl.mla_lo, top=wl.top),
               tolerances=dict(rel=TOL_REL, lse=TOL_LSE), errors=err, counts={k: int(v) for k, v in cnt.items()},
               max_slot={k: int(v) for k, v in max_slot.items()}, max_pos=wl.max_pos, finished=wl.finished,
               starved=timer.starved, num_launches=pipe.num_launches, wall_s=time.perf_counter() - t_start)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for c in caches.values():
        c.close()
    return report(res, times, args.out)


def report(res, times, out_path) -> int:
    """Print the table (medians over steps 1.., step 0 admits the batch) and the verdict; write the JSON."""
    n, err, cnt, ms = res["layer_counts"]["main"], res["errors"], res["counts"], res["max_slot"]
    steps = [i for i, b in enumerate(times["build_gpu_us"]) if b is not None]
    meta = [times["update_host_us"][i] + times["build_gpu_us"][i] + times["topk_gpu_us"][i] for i in steps]
    gpu = [times["build_gpu_us"][i] + times["topk_gpu_us"][i] for i in steps]
    attn = [sum(n[k] * times[f"attn_{k}_us"][i] for k in KINDS) for i in steps]
    res["timings"], res["per_step"] = {k: stats(v) for k, v in times.items()}, times
    res["timings"].update(step_metadata_us=stats(meta), step_attention_us=stats(attn),
                          metadata_share=stats([m / (m + a) for m, a in zip(meta, attn)]),
                          metadata_share_gpu=stats([g / (g + a) for g, a in zip(gpu, attn)]))
    md = lambda k: res["timings"][k]["median"]
    rows = [(f"max error {k} ({err[k]['tokens']} tokens): rel Frobenius / lse",
             f"{err[k]['rel']:.2e} / {err[k]['lse']:.2e}") for k in KINDS]
    rows += [("index rows != own slots (swa / c4 / c128); cache rows != values",
              " / ".join(str(err[k]["index_mismatch"]) for k in KINDS)
              + f"; {sum(err[k]['value_mismatch'] for k in KINDS)}"),
             ("wrong lengths / entries < -1 / bad writes / padded out != 0",
              f"{cnt['lens']} / {cnt['below_-1']} / {cnt['bad_writes']} / {cnt['pad_out']}"),
             ("largest slot written: swa / c4a / c128a", f"{ms['w_swa']} / {ms['w_c4']} / {ms['w_c128']}"),
             ("largest slot listed: swa / c4 / c128 lists", f"{ms['swa']} / {ms['c4']} / {ms['c128']}"),
             ("largest position / finished at max_model_len", f"{res['max_pos']} / {res['finished']}")]
    if steps:
        rows += [("metadata: update() host", f"{md('update_host_us'):.1f} us"),
                 ("metadata: build() GPU (+ update's H2D copy)", f"{md('build_gpu_us'):.1f} us"),
                 (f"metadata: {n['c4']} x topk_to_slots GPU", f"{md('topk_gpu_us'):.1f} us"),
                 ("metadata per step", f"{md('step_metadata_us'):.1f} us")]
        rows += [(f"attention {k}: {n[k]} layers x {md(f'attn_{k}_us'):.1f} us", f"{n[k] * md(f'attn_{k}_us'):.1f} us")
                 for k in KINDS]
        rows += [(f"attention per step ({sum(n.values())} layers)", f"{md('step_attention_us'):.1f} us"),
                 ("metadata share of (metadata + attention)", f"{100 * md('metadata_share'):.2f} %"),
                 ("  GPU only: (build + top-k) / (that + attention)", f"{100 * md('metadata_share_gpu'):.2f} %")]
    rows.append(("timed steps / host outran the busy wait / wall time",
                 f"{len(steps)} / {res['starved']} / {res['wall_s']:.1f} s" if steps else
                 f"none (need --device cuda, --steps >= 2) / - / {res['wall_s']:.1f} s"))
    w = max(len(k) for k, _ in rows)
    print(f"\nsummary (B={res['shape']['B']}, T_pad={res['shape']['T_pad']}, {res['storage']} storage)")
    print("-" * (w + 24))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("-" * (w + 24))
    fails = [f"{k} numerics" for k in KINDS
             if not (err[k]["rel"] < TOL_REL and err[k]["lse"] < TOL_LSE and err[k]["tokens"])]
    fails += [f"{k} index rows" for k in KINDS if err[k]["index_mismatch"]]
    fails += ["cache values"] * any(err[k]["value_mismatch"] for k in KINDS) + [k for k, v in cnt.items() if v]
    if res["storage"] == "virtual" and min(ms["w_swa"], ms["w_c4"], ms["swa"], ms["c4"]) < 2 ** 30:
        fails.append("large slots not reached")
    res.update(ok=not fails, fails=fails)
    print(f"FAIL: {', '.join(fails)}" if fails else
          f"OK: every checked token within rel {TOL_REL:g} / lse {TOL_LSE:g} of the dense fp32 reference; "
          f"index rows and cache rows exact")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
