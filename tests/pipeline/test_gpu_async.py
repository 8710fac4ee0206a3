"""Async scheduling on a real GPU (DESIGN §5, issue #20 item 5): vLLM's async scheduler and SGLang's
overlap scheduler prepare step N+1 on the host while the GPU still runs step N. Here the stream is kept
busy (``torch.cuda._sleep``, a stand-in forward that then reads every output of its step and converts
top-k picks), ``update(N+1)`` / ``build(N+1)`` run while step N's forward is queued, for many steps with
spec rewinds; the host waits only for step N-1 (the engine's own wait for sampled tokens), never inside
``update()``. Checked: ``update()`` returns while step N's forward is still running, its host time stays
far below the forward's, and every output equals a synchronous run of the same trace.

Rule (README "Groups and channels"): the host may run ONE step ahead of the GPU. Staging is double-
buffered (pinned host buffers, ``state/staging.py``): ``update(N+2)`` reuses step N's host buffer and
waits for step N's copy. The forward must run on the pipeline's stream (or wait on it): every buffer is
rewritten by the next ``build()`` in stream order.
"""

import statistics
import time

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.testing.scheduler import random_trace

pytestmark = pytest.mark.gpu

BUSY_MS = 50.0
PADS = (64, 128, 192, 256)
FIELDS = ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu",
          "indices", "lens", "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")


def _pad(T):
    return next(p for p in PADS if p >= T)


def _cycles_per_ms():
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / a.elapsed_time(b)


def _forward(meta, picks):
    """The stand-in forward, queued on the current stream: busy, then read every output of the step."""
    snap = {"t": [meta.query_start_loc.clone(), meta.positions.clone(), meta.token_to_req.clone(),
                  meta.is_valid_token.clone()] + [bt.clone() for bt in meta.block_tables]}
    for name, ch in meta.channels.items():
        snap[name] = [getattr(ch, f).clone() for f in FIELDS if getattr(ch, f) is not None]
    if "c4a" in meta.channels:
        snap["topk"] = [x.clone() for x in meta.topk_to_slots("c4a", picks[:meta.num_tokens_padded])]
    return snap


def _trace(layout, seed):
    return [s for s, _ in random_trace(layout, 40, seed, num_blocks=400, max_num_batched_tokens=256,
                                       max_num_seqs=16, num_speculative_tokens=2, prompt_len=(1, 700),
                                       max_new_tokens=(2, 24))]


def _pipe(layout, graphs):
    pipe = MetadataPipeline(layout, 32, 256, "cuda", 2, cuda_graphs=graphs)
    pipe.warmup(pad_sizes=PADS)
    return pipe


def _run(layout, trace, picks, *, overlap, graphs, cycles):
    """(snapshots per step, update host times in ms, overlapped updates)."""
    pipe = _pipe(layout, graphs)
    snaps, times, overlapped, done = [], [], 0, []
    for step in trace:
        if overlap and len(done) >= 2:
            done[-2].synchronize()  # NOTE: the engine waits for step N-1's output, not for step N's
        t0 = time.perf_counter()
        pipe.update(step, pad_to=_pad(step.total_tokens))
        times.append((time.perf_counter() - t0) * 1e3)
        if overlap and done:
            overlapped += not done[-1].query()  # step N's forward still runs while update(N+1) is done
        meta = pipe.build()
        torch.cuda._sleep(cycles)
        snaps.append(_forward(meta, picks))
        ev = torch.cuda.Event()
        ev.record()
        done.append(ev)
        if not overlap:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return snaps, times, overlapped


LAYOUTS = {
    "flash": lambda: DSV4Layout.from_config("flash", max_model_len=8192),
    "flash-vllm-circular": lambda: DSV4Layout.from_config("flash", max_model_len=8192, groups="vllm",
                                                          circular={"c128_state": 256}),
}


@pytest.mark.parametrize("name,graphs", [("flash", False), ("flash", True), ("flash-vllm-circular", False)])
def test_update_overlaps_the_previous_forward(name, graphs):
    layout = LAYOUTS[name]()
    trace = _trace(layout, seed=7)
    picks = torch.randint(-2, 300, (256, layout.index_topk), dtype=torch.int32, device="cuda")
    cycles = int(_cycles_per_ms() * BUSY_MS)
    ref, t_idle, _ = _run(layout, trace, picks, overlap=False, graphs=graphs, cycles=cycles)
    got, t_busy, overlapped = _run(layout, trace, picks, overlap=True, graphs=graphs, cycles=cycles)
    # the host never waited for the GPU inside update(): each returned while step N still ran
    assert overlapped == len(trace) - 1, (overlapped, len(trace))
    med_idle, med_busy, worst = statistics.median(t_idle), statistics.median(t_busy), max(t_busy[1:])
    print(f"\n{name} graphs={graphs}: update() host ms idle GPU median {med_idle:.2f}, busy GPU median "
          f"{med_busy:.2f} max {worst:.2f} (forward {BUSY_MS} ms), overlapped {overlapped}/{len(trace) - 1}")
    # NOTE: a wait on the GPU would cost ~BUSY_MS on every step; host jitter of the shared VM (GC, other
    # processes) gives isolated outliers, so the median is compared and at most two outliers allowed
    assert med_busy < 2 * med_idle + 1.0, (med_idle, t_busy)
    assert sum(t > BUSY_MS / 2 for t in t_busy[1:]) <= 2, t_busy
    # same outputs as the synchronous run, every step, every field
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.keys() == b.keys()
        for k in a:
            for x, y in zip(a[k], b[k]):
                assert torch.equal(x, y), (name, graphs, i, k)
    # the trace had what async engines meet: spec rewinds and prefill chunks
    assert any(r.num_computed_tokens < prev.get(r.req_id, 0) for prev, s in _computed(trace) for r in
               s.running_requests)


def _computed(trace):
    """(num_computed + num_scheduled of the previous step per request, step): a rewind shows as less."""
    seen = {}
    for s in trace:
        yield dict(seen), s
        for r in list(s.new_requests) + list(s.running_requests):
            seen[r.req_id] = r.num_computed_tokens + s.num_scheduled_tokens[r.req_id]


def test_two_steps_ahead_waits_for_the_staging_copy():
    """The documented limit: ``update(N+2)`` while step N's copy is still queued waits for it (double
    buffering). Measured and printed; asserted only that the outputs stay right."""
    layout = LAYOUTS["flash"]()
    trace = _trace(layout, seed=8)[:12]
    picks = torch.randint(-2, 300, (256, layout.index_topk), dtype=torch.int32, device="cuda")
    cycles = int(_cycles_per_ms() * BUSY_MS)
    ref, _, _ = _run(layout, trace, picks, overlap=False, graphs=False, cycles=cycles)
    pipe = _pipe(layout, False)
    snaps, times = [], []
    for step in trace:  # no engine wait: the host runs as far ahead as staging lets it
        t0 = time.perf_counter()
        pipe.update(step, pad_to=_pad(step.total_tokens))
        times.append((time.perf_counter() - t0) * 1e3)
        meta = pipe.build()
        torch.cuda._sleep(cycles)
        snaps.append(_forward(meta, picks))
    torch.cuda.synchronize()
    print(f"\nunbounded lookahead: update() host ms median {statistics.median(times[2:]):.2f} "
          f"max {max(times[2:]):.2f} (forward {BUSY_MS} ms): waits for the copy of step N-2")
    for a, b in zip(ref, snaps):
        for k in a:
            for x, y in zip(a[k], b[k]):
                assert torch.equal(x, y)
