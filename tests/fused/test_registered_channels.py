"""Issue 11, "builders own their part of the fused launch": channels registered from outside the
package, one of each built-in kind, join the one fused launch and equal the per-op kernels and the
references bit for bit; a builder that declares no fused task keeps its own launch.

The channels (tiny layout, ``max_model_len`` 256):

* ``c2``    — the README's example: ``CausalCompressedChannel``, ratio 2 on the mla group
* ``swa5``  — ``WindowChannel`` on the swa group, window 5 (not a power of two)
* ``c8a``   — ``CompressedChannel`` (compressed slots + top-k conversion), ratio 8
* ``c8i``   — ``IndexerChannel`` with a causal list, ratio 8 (shares ``c8a``'s compressed mapping)
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_index import ChannelSpec, MetadataPipeline, register_channel
from dsv4_index._common import cdiv, round_up
from dsv4_index.channels import (CausalCompressedChannel, CompressedChannel, IndexerChannel, WindowChannel,
                                 registered_channels)
from dsv4_index.channels.base import _REGISTRY
from dsv4_index.geometry import CHANNEL_OUTPUTS
from dsv4_index.validate import check_metadata, check_topk

from helpers.layouts import tiny_layout
from helpers.pipelines import (DEVICE, HAS_TRITON, Blocks, compare_over_trace, compare_step, eventful_trace,
                               random_step, step_all, three_pipelines)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

L = 256
NUM_BLOCKS = 40


@pytest.fixture
def registry():
    """Restore the channel registry (a module dict) after the test, whatever it registered."""
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


# NOTE: user subclasses, defined here, outside the package
class C2(CausalCompressedChannel):
    """README example: compressed slots + every visible row, ratio 2."""


class Swa5(WindowChannel):
    """A second window cache on the swa group."""


class C8a(CompressedChannel):
    """A second top-k-read compressed cache."""


class C8i(IndexerChannel):
    """A second indexer."""


class LoneWindow(WindowChannel):
    """A builder with no share in the fused launch: it runs its own per-op kernels."""

    def fused_tasks(self, ctx):
        return []


def user_layout(**kw):
    base = tiny_layout(max_model_len=L, **kw)
    mla, swa = base.group("mla"), base.group("swa")
    specs = [
        ChannelSpec(name="c2", gid=mla.gid, compress_ratio=2, rows_per_block=mla.block_size // 2,
                    index_width=round_up(cdiv(L, 2), 128), outputs={"compressed_slot_mapping", "indices", "lens"}),
        ChannelSpec(name="swa5", gid=swa.gid, compress_ratio=1, rows_per_block=swa.block_size, window=5,
                    index_width=5, outputs={"slot_mapping", "indices", "lens"}),
        ChannelSpec(name="c8a", gid=mla.gid, compress_ratio=8, rows_per_block=mla.block_size // 8,
                    outputs=CHANNEL_OUTPUTS["c4a"]),
        ChannelSpec(name="c8i", gid=mla.gid, compress_ratio=8, rows_per_block=mla.block_size // 8,
                    index_width=round_up(cdiv(L, 8), 128), outputs=CHANNEL_OUTPUTS["c4i"] | {"indices"}),
    ]
    for s in specs:
        base = base.with_channel(s)
    return base


def register_all(window=Swa5):
    for name, cls in (("c2", C2), ("swa5", window), ("c8a", C8a), ("c8i", C8i)):
        register_channel(name, cls, replace=True)


USER = ("c2", "swa5", "c8a", "c8i")


def test_registry_fixture_restores(registry):
    before = registered_channels()
    register_all()
    assert registered_channels()["c2"] is C2
    with pytest.raises(ValueError, match="already registered"):
        register_channel("c2", C8a)
    with pytest.raises(ValueError, match="ChannelBuilder subclass"):
        register_channel("x", int)
    _REGISTRY.clear()
    _REGISTRY.update(before)
    assert "c2" not in registered_channels() and registered_channels() == before


def test_every_registered_kind_joins_the_one_launch(registry):
    register_all()
    layout = user_layout()
    pipe = MetadataPipeline(layout, 4, 40, DEVICE, num_speculative_tokens=2)
    assert pipe.num_launches == 1 and pipe.unfused_builders == []
    for name in USER:
        b = pipe.builders[name]
        assert type(b).__module__ == __name__
        tasks = b.fused_tasks(pipe.ctx)
        assert tasks, name
        keys = {t.key() for t in pipe.fused_plan.tasks}
        assert all(t.key() in keys for t in tasks), f"{name}: a task is missing from the fused plan"
    # c8a / c8i share one compressed mapping (one geometry), distinct from c4a's and c128a's
    kinds = [(t.kind, t.a) for t in pipe.fused_plan.tasks if t.kind == "compressed"]
    assert sorted(kinds) == [("compressed", 2), ("compressed", 4), ("compressed", 8), ("compressed", 16)]
    assert pipe.builders["c8a"].compressed is pipe.builders["c8i"].compressed


@pytest.mark.slow  # ./dev quick skips it
def test_registered_channels_fused_equals_unfused_equals_reference(registry):
    register_all()
    layout = user_layout()
    trace = eventful_trace(layout, 7, num_blocks=NUM_BLOCKS, seeds=range(200))
    pipes = three_pipelines(layout, 4, 40, num_speculative_tokens=2)
    checked = []

    def check(m):
        check_metadata(m, num_blocks=NUM_BLOCKS)
        topk = torch.randint(-2, 40, (m.num_tokens_padded, 4), dtype=torch.int32, device=DEVICE)
        check_topk(m, "c8a", topk, *m.topk_to_slots("c8a", topk), num_blocks=NUM_BLOCKS)
        checked.append((int(m["c2"].lens.max()) if m.num_tokens else 0, int(m["swa5"].lens.max())
                        if m.num_tokens else 0, int(m["c8i"].lens.max()) if m.num_tokens else 0))

    seen = compare_over_trace(pipes, trace, pad=(0, 3), check=check)
    assert seen["steps"] == 7 and seen["topk"] and seen["padded"]
    assert max(c[1] for c in checked) == 5                   # full windows of 5
    assert max(c[0] for c in checked) > max(c[2] for c in checked) > 0  # ratio 2 sees more rows than 8
    m = pipes["fused"].build()
    assert m["c8i"].ks is not None and m["c8i"].indices.shape[1] == 128 and m["c2"].indices.shape[1] == 128


@pytest.mark.slow  # ./dev quick skips it
def test_builder_without_fused_tasks_runs_its_own_launch(registry):
    register_all()
    layout = user_layout()
    fused = MetadataPipeline(layout, 4, 40, DEVICE, num_speculative_tokens=2)
    register_all(window=LoneWindow)
    lone = MetadataPipeline(layout, 4, 40, DEVICE, num_speculative_tokens=2)
    ref = MetadataPipeline(layout, 4, 40, DEVICE, num_speculative_tokens=2, backend="reference")
    assert fused.num_launches == 1 and lone.num_launches == 2
    assert [type(b) for b in lone.unfused_builders] == [LoneWindow]
    trace = eventful_trace(layout, 5, need=("finished", "spec"), num_blocks=NUM_BLOCKS, seeds=range(200))
    for i, (step, _) in enumerate(trace):
        compare_step({"fused": fused, "lone": lone, "reference": ref}, step, step.total_tokens + i % 2, tag=i,
                     check=lambda m: check_metadata(m, num_blocks=NUM_BLOCKS))
        assert lone.last_step_stats.num_launches == 2 and fused.last_step_stats.num_launches == 1


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_registered_window_subclass_joins_the_fused_launch(registry):
    class MyWindow(WindowChannel):
        pass

    register_channel("test_fused_win", MyWindow)
    base = tiny_layout()
    swa = base.group("swa")
    layout = base.with_channel(ChannelSpec("test_fused_win", swa.gid, 1, swa.block_size, window=4,
                                           index_width=4, outputs={"slot_mapping", "indices", "lens"}))
    rng = random.Random(9)
    pipes = three_pipelines(layout, 6, 160)  # NOTE: a plain subclass inherits its kind's fused tasks
    assert pipes["fused"].num_launches == 1 and type(pipes["fused"].builders["test_fused_win"]) is MyWindow
    step = random_step(rng, Blocks(layout, rng), "mixed", n_reqs=3, max_ctx=150, replay=True)
    m = step_all(pipes, step, pad_to=step.total_tokens + 1)
    assert int(m["test_fused_win"].lens.max()) == 4


@pytest.mark.slow  # ./dev quick skips it
def test_readme_example_verbatim(registry):
    """The README's "Adding a channel" code, run as written on V4-Flash at 128K: one launch, and a
    step's c2 rows (512 column tiles of the fused launch) equal the reference."""
    import re
    from pathlib import Path

    from dsv4_index import DSV4Layout, NewRequest, StepInput

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("### Adding a channel"):], re.S).group(1)
    ns = {"layout": DSV4Layout.from_config("flash", max_model_len=131072)}
    exec(code, ns)
    layout = ns["layout"]
    pipes = {"fused": MetadataPipeline(layout, 2, 8, DEVICE), "reference": MetadataPipeline(layout, 2, 8, DEVICE,
                                                                                           backend="reference")}
    assert pipes["fused"].num_launches == 1 and type(pipes["fused"].builders["c2"]) is CausalCompressedChannel
    lists = tuple(list(range(1 + 1000 * g, 1 + 1000 * g + cdiv(1030, b.alloc_block_size))) for g, b in
                  enumerate(layout.groups))
    m = step_all(pipes, StepInput([NewRequest("a", lists, 1024)], [], {"a": 6}), pad_to=8)
    assert m["c2"].lens.tolist() == [512, 513, 513, 514, 514, 515, 0, 0] and m["c2"].indices.shape == (8, 65536)


@pytest.mark.parametrize("builder, kw, field", [
    ("swa", dict(index_width=8), "window"),                                        # WindowChannel
    ("c128a", dict(), "index_width"),                                              # CausalCompressedChannel
    ("c4i", dict(outputs=CHANNEL_OUTPUTS["c4i"] | {"indices"}), "index_width"),    # IndexerChannel with indices
])
def test_builder_refuses_a_spec_without_the_field_it_needs(builder, kw, field):
    layout = tiny_layout(max_model_len=L)
    gid = layout.group("mla").gid if builder != "swa" else layout.group("swa").gid
    ratio = 1 if builder == "swa" else 8
    spec = ChannelSpec("mine", gid, ratio, layout.groups[gid].block_size // ratio, builder=builder, **kw)
    with pytest.raises(ValueError, match=rf"^spec\.{field} of channel 'mine' is None; its builder \w+ needs it$"):
        MetadataPipeline(layout.with_channel(spec), 4, 64, DEVICE)
