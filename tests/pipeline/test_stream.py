"""``MetadataPipeline(stream=...)`` (dsv4_index/streams.py): the argument's checks on any machine, and on a GPU
that ``update()``'s copy and ``build()`` run on the given stream whatever stream is current, with the outputs of a
pipeline without one."""

from __future__ import annotations

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.streams import check_stream
from dsv4_index.testing.scheduler import random_trace


def _layout():
    return DSV4Layout.from_config("tiny", 256)


def test_no_stream_is_the_default_and_runs_as_before():
    pipe = MetadataPipeline(_layout(), 4, 64, "cpu", num_speculative_tokens=2)
    assert pipe.stream is None
    steps = [s for s, _ in random_trace(pipe.layout, 6, 0, num_blocks=64, max_num_batched_tokens=64,
                                        max_num_seqs=4)]
    for s in steps:
        pipe.update(s)
        assert pipe.build().num_tokens == sum(s.num_scheduled_tokens.values())


@pytest.mark.parametrize("bad", [object(), "cuda", 0])
def test_a_stream_that_is_not_one_names_stream(bad):
    with pytest.raises(ValueError, match=r"^stream must be a torch.cuda.Stream or None"):
        MetadataPipeline(_layout(), 4, 64, "cpu", stream=bad)


def _a_cuda_stream():
    """A real stream where CUDA is; else an instance made without the CUDA constructor (a CUDA build of torch
    refuses that: ``object.__new__(FakeStream) is not safe``, seen on an H100)."""
    if torch.cuda.is_available():
        return torch.cuda.Stream()

    class FakeStream(torch.cuda.Stream):
        def __new__(cls):
            return object.__new__(cls)

        def __init__(self):
            pass

    return FakeStream()


def test_a_cuda_stream_on_a_cpu_pipeline_names_stream():
    with pytest.raises(ValueError, match=r"^stream: a CUDA stream needs a CUDA pipeline, this one's device is cpu"):
        check_stream(_a_cuda_stream(), torch.device("cpu"))


@pytest.mark.gpu
def test_update_and_build_run_on_the_stream():
    """With the pipeline's stream kept busy, ``update()`` + ``build()`` queue nothing on the current (default)
    stream; once the stream drains, every output equals a pipeline without ``stream=`` fed the same trace."""
    layout = _layout()
    side = torch.cuda.Stream()
    pipe = MetadataPipeline(layout, 8, 128, "cuda", num_speculative_tokens=2, stream=side)
    ref = MetadataPipeline(layout, 8, 128, "cuda", num_speculative_tokens=2)
    pipe.warmup()
    ref.warmup()
    torch.cuda.synchronize()
    steps = [s for s, _ in random_trace(layout, 20, 1, num_blocks=200, max_num_batched_tokens=128, max_num_seqs=8,
                                        num_speculative_tokens=2)]
    for s in steps:
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)  # NOTE: ~0.5 s busy: update + build wait behind it even on a host
            # shared with other test workers
        pipe.update(s)
        meta = pipe.build()
        assert torch.cuda.current_stream().query(), "update/build queued work on the current stream"
        assert not side.query(), "the pipeline's stream drained before the check (make the sleep longer)"
        ref.update(s)
        want = ref.build()
        side.synchronize()
        for name in meta.channels:
            for f in ("slot_mapping", "indices", "lens"):
                got, exp = getattr(meta[name], f, None), getattr(want[name], f, None)
                assert (got is None) == (exp is None) and (got is None or torch.equal(got, exp)), (name, f)
        assert torch.equal(meta.positions, want.positions) and torch.equal(meta.query_start_loc, want.query_start_loc)
