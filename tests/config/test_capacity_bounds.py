"""Every capacity of a pipeline has an upper bound, checked before anything is allocated, whose message
gives the largest allowed value and the reason; the memory a pipeline will allocate is known before it
allocates (``MetadataPipeline.memory_estimate``), and equals what a built pipeline holds."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.capacity import BOUNDS


def flash(max_model_len=32768):
    return DSV4Layout.from_config("flash", max_model_len=max_model_len)


@pytest.mark.parametrize("kw,match", [
    (dict(num_speculative_tokens=2 ** 40), r"num_speculative_tokens must be an int in \[0, 1024\] \(at most 1024: "),
    (dict(max_num_reqs=2 ** 40), r"max_num_reqs must be an int in \[1, 65536\] \(at most 65536: request slots"),
    (dict(max_num_batched_tokens=2 ** 62), r"max_num_batched_tokens must be an int in \[1, 1048576\] \(at most"),
    (dict(max_staged_blocks=2 ** 31), r"max_staged_blocks must be an int in \[1, 67108864\] \(at most 67108864: "),
    (dict(max_num_reqs=65536, layout=flash(1 << 23)),
     r"max_num_reqs must be at most \d+ for this layout \(max_model_len "
     r"8388608: \d+ block-table columns per request, int32"),
    (dict(max_num_batched_tokens=1 << 20, layout=flash(1 << 22)), r"max_num_batched_tokens must be at most \d+ for "
     r"this layout \(c128a.indices holds 32768 entries per token; one per-token buffer is bounded at 2\*\*31 - 1"),
])
def test_each_capacity_has_an_upper_bound_checked_first(kw, match):
    args = dict(layout=flash(), max_num_reqs=256, max_num_batched_tokens=8192, num_speculative_tokens=1)
    args.update(kw)
    t0 = time.perf_counter()
    for fn in (MetadataPipeline, MetadataPipeline.memory_estimate):
        with pytest.raises(ValueError, match=match) as e:
            fn(**args)
        assert "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 2.0          # NOTE: nothing of the 70 TB / 2**40 slots was attempted


def test_bounds_have_reasons():
    for name, (hi, why) in BOUNDS.items():
        assert hi >= 1 and len(why) > 20, name


def _held_bytes(pipe) -> int:
    """Bytes of every tensor and numpy array reachable from the pipeline (each storage once)."""
    seen, storages, total = set(), set(), 0
    stack = [pipe]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            key = ("t", x.untyped_storage().data_ptr())
            if key not in storages:
                storages.add(key)
                total += x.untyped_storage().nbytes()
            continue
        if isinstance(x, np.ndarray):
            base = x
            while isinstance(base.base, np.ndarray):
                base = base.base
            key = ("a", id(base) if base.base is None else id(base.base))
            if key not in storages and base.base is None:
                storages.add(key)
                total += base.nbytes
            continue
        if isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += list(x)
        elif type(x).__module__.startswith("dsv4_index") and hasattr(x, "__dict__"):
            stack += list(vars(x).values())
    return total


@pytest.mark.parametrize("name,kw", [
    ("tiny", dict(max_num_reqs=8, max_num_batched_tokens=64, num_speculative_tokens=1)),
    ("flash", dict(max_num_reqs=64, max_num_batched_tokens=512, num_speculative_tokens=1)),
    ("flash-circular", dict(max_num_reqs=16, max_num_batched_tokens=256)),
])
def test_the_estimate_is_what_a_pipeline_holds(name, kw):
    if name == "tiny":
        lay = DSV4Layout.from_config("tiny", max_model_len=1024)
    elif name == "flash":
        lay = flash(8192)
    else:
        lay = DSV4Layout.from_config("flash", max_model_len=8192, circular={"swa": 256})
    est = MetadataPipeline.memory_estimate(lay, device="cpu", **kw)
    pipe = MetadataPipeline(lay, device="cpu", backend="reference", **kw)
    held = _held_bytes(pipe)
    counted = est["device"] + est["host"] + est["pinned"]
    assert est["pinned"] == 0 and est["device"] > est["host"] / 4
    assert abs(counted - held) <= 0.02 * held + (64 << 10), (counted, held, est["parts"])


def test_readme_states_what_the_defaults_cost():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    est = MetadataPipeline.memory_estimate(flash(), 256, 8192, "cuda", 1)
    mib = round(est["device"] / 2 ** 20)
    assert f"{mib} MiB" in text and "memory_estimate" in text, mib


def test_the_ownership_state_estimate_is_exact():
    """The host bytes of ``state/owners`` (``BlockOwners``: per-slot state, scratch, marks, the first hash table) equal
    what a fresh pipeline allocates, for one and several groups and two slot counts."""
    import numpy as np
    for lay, slots in ((DSV4Layout.from_config("tiny", max_model_len=1024), 8), (flash(8192), 64)):
        pipe = MetadataPipeline(lay, slots, 64, device="cpu", backend="reference")
        held = sum(v.nbytes for v in vars(pipe.requests.owners).values() if isinstance(v, np.ndarray))
        est = MetadataPipeline.memory_estimate(lay, slots, 64, device="cpu")
        assert est["parts"]["ownership state"] == ("host", held)
