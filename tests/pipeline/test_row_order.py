"""The engine's row order (issue 40 item 2): ``row_order="caller"`` keeps a decode-first caller's rows and refuses
any other order naming the row; ``dsv4_index.integrations.vllm.VllmStepAdapter`` builds a step in a vLLM
runner's ``InputBatch`` order (vLLM-style stand-ins: ``tests/helpers/vllm_stub.py``; vLLM's own scheduler:
``tests/integration/test_vllm_adapter.py``), every output equal to the default pipeline's row for row, mapped
through the request ids."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers.layouts import tiny_layout
from helpers.pipelines import CHANNEL_FIELDS, Pool
from helpers.vllm_stub import from_step

from dsv4_index import MetadataPipeline, NewRequest, RunningRequest, StepInput
from dsv4_index.integrations.vllm import LayerMetadata, VllmStepAdapter, pad_sizes_from_capture_sizes
from dsv4_index.testing.scheduler import random_trace


def _pipe(layout, **kw):
    return MetadataPipeline(layout, 6, 96, "cpu", 2, backend="reference", **kw)


def test_bad_row_order_value():
    with pytest.raises(ValueError, match=r"row_order must be one of \('decode_first', 'caller'\), got 'engine'"):
        _pipe(tiny_layout(), row_order="engine")


def _prefill_then_decode(layout):
    pool = Pool(layout)
    a, b = pool.blocks(40), pool.blocks(40)
    s1 = StepInput([NewRequest("a", a, 0), NewRequest("b", b, 0)], [], {"a": 20, "b": 30})
    keep = tuple([] for _ in a)
    # NOTE: "a" prefills 10 more tokens (a prefill row first), "b" decodes 1: not decode-first
    s2 = StepInput([], [RunningRequest("a", keep, 20), RunningRequest("b", keep, 30)], {"a": 10, "b": 1})
    return s1, s2


def test_caller_order_refuses_a_decode_after_a_prefill_and_changes_nothing():
    layout = tiny_layout()
    pipe, ref = _pipe(layout, row_order="caller"), _pipe(layout)
    s1, s2 = _prefill_then_decode(layout)
    for p in (pipe, ref):
        p.update(s1)
        p.build()
    with pytest.raises(ValueError, match=r"row_order='caller': row 1 \(request 'b'\), slot 1, is a decode "
                                         r"\(1 tokens <= next_n = 3\) after the prefill row 0 \(10 tokens\)"):
        pipe.update(s2)
    ref.update(s2)
    assert ref.build().req_ids == ["b", "a"]  # NOTE: the default path reorders the same step
    # NOTE: nothing was committed: the same step listed decode-first (b's decode, then a's prefill) goes through
    keep = tuple([] for _ in layout.groups)
    ok = StepInput([], [RunningRequest("b", keep, 30), RunningRequest("a", keep, 20)], {"b": 1, "a": 10})
    pipe.update(ok)
    m = pipe.build()
    assert m.req_ids == ["b", "a"] and m.num_decodes == 1 and m.host_query_start_loc.tolist() == [0, 1, 11]


def test_caller_order_refuses_a_row_without_tokens():
    from dsv4_index.batch import StepBatch
    pipe = _pipe(tiny_layout(), row_order="caller")
    b = StepBatch(req_slots=np.array([0, 1]), num_computed_tokens=np.array([0, 0]),
                  num_scheduled_tokens=np.array([1, 0]), is_new=np.array([True, True]))
    with pytest.raises(ValueError, match=r"row 1, slot 1, schedules 0 tokens; every row must schedule a token"):
        pipe.update(b)


def test_caller_order_equals_default_when_decode_first():
    """A decode-first caller: the same bytes as the default path (which keeps such an order)."""
    layout = tiny_layout()
    pipe, ref = _pipe(layout, row_order="caller"), _pipe(layout)
    trace = random_trace(layout, 25, 3, num_blocks=200, max_num_batched_tokens=64, max_num_seqs=6,
                         num_speculative_tokens=2, prompt_len=(1, 60), max_new_tokens=(1, 8))
    n = 0
    for step, _ in trace:
        ref.update(step)
        m_ref = ref.build()
        if list(m_ref.req_ids) != _step_order(step):
            # NOTE: not decode-first as listed: the caller's pipeline must refuse it, then take it reordered
            with pytest.raises(ValueError, match="row_order='caller'"):
                pipe.update(step)
            step = _reordered(step, list(m_ref.req_ids))
        else:
            n += 1
        pipe.update(step)
        m = pipe.build()
        assert list(m.req_ids) == list(m_ref.req_ids)
        _assert_rows_equal(m, m_ref)
    assert n > 5


def _step_order(step):
    """The rows of an id-keyed step as listed (running, then new), only those that schedule tokens."""
    ids = [r.req_id for r in step.running_requests] + [r.req_id for r in step.new_requests]
    return [i for i in ids if step.num_scheduled_tokens.get(i, 0) > 0]


def _reordered(step, order):
    pos = {rid: i for i, rid in enumerate(order)}
    run = sorted(step.running_requests, key=lambda r: pos.get(r.req_id, len(pos)))
    new = sorted(step.new_requests, key=lambda r: pos.get(r.req_id, len(pos)))
    if any(pos[r.req_id] < max(pos[n.req_id] for n in run) for r in new) and run:
        pytest.skip("a new request before a running one: a StepInput lists running requests first")
    return StepInput(new, run, step.num_scheduled_tokens, step.finished_req_ids, step.preempted_req_ids,
                     step.replay_start, step.replay_end)


def _token_tensors(meta):
    """name -> host tensor of every per-token output ``[T_pad, ...]`` (channels and common)."""
    out = {"positions": meta.positions, "is_valid_token": meta.is_valid_token}
    for name, ch in meta.channels.items():
        for f in CHANNEL_FIELDS:
            x = getattr(ch, f)
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == meta.num_tokens_padded \
                    and f not in ("compact_cu", "cu", "ks", "ke"):
                out[f"{name}.{f}"] = x
        if ch.ks is not None:  # NOTE: ks / ke are offsets into the batch's concatenated rows: their span
            out[f"{name}.ke-ks"] = ch.ke - ch.ks  # is the request's own, their base follows the row order
    return {k: v.cpu().clone() for k, v in out.items()}


def _assert_rows_equal(m, m_ref):
    """Every per-token output of each request equal between two metadata of one step (rows mapped by id)."""
    ids, ref_ids = list(m.req_ids), list(m_ref.req_ids)
    assert sorted(ids) == sorted(ref_ids) and m.num_tokens == m_ref.num_tokens
    a, b = _token_tensors(m), _token_tensors(m_ref)
    assert a.keys() == b.keys()
    qa, qb = m.host_query_start_loc, m_ref.host_query_start_loc
    for i, rid in enumerate(ids):
        j = ref_ids.index(rid)
        assert m.req_slots[i] == m_ref.req_slots[j] and m.host_seq_lens[i] == m_ref.host_seq_lens[j], rid
        for k in a:
            assert torch.equal(a[k][qa[i]:qa[i + 1]], b[k][qb[j]:qb[j + 1]]), (rid, k)
    assert (m.token_to_req[:m.num_tokens].tolist() ==
            [i for i in range(len(ids)) for _ in range(int(qa[i + 1] - qa[i]))])


def _runner_order(so, rng):
    """A vLLM runner's InputBatch order of a step: persistent rows shuffled, then decodes first (stable), as
    ``reorder_batch_to_split_decodes_and_prefills`` leaves them (threshold 1 + num_spec = 3)."""
    ids = [i for i, q in so.num_scheduled_tokens.items() if q > 0]
    rng.shuffle(ids)
    return [i for i in ids if so.num_scheduled_tokens[i] <= 3] + [i for i in ids if so.num_scheduled_tokens[i] > 3]


def test_vllm_adapter_in_runner_order_equals_the_default_path():
    layout = tiny_layout()
    pipe, ref = _pipe(layout, row_order="caller"), _pipe(layout)
    adapter, rng = VllmStepAdapter(pipe), random.Random(0)
    # NOTE: no prefix caching: its bounded replay needs replay_end, which a SchedulerOutput does not carry
    # (vLLM's real scheduler with prefix caching: tests/integration/test_vllm_adapter.py)
    trace = random_trace(layout, 40, 5, num_blocks=200, max_num_batched_tokens=64, max_num_seqs=6,
                         num_speculative_tokens=2, prompt_len=(1, 60), max_new_tokens=(1, 8),
                         enable_prefix_caching=False)
    moved = 0
    for step, _ in trace:
        so = from_step(step)
        ref.update(so)
        m_ref = ref.build()
        order = _runner_order(so, rng)
        m = adapter.prepare(so, order, num_input_tokens=m_ref.num_tokens_padded)
        assert list(m.req_ids) == order == adapter.req_ids  # NOTE: meta row i IS the runner's row i
        moved += order != list(m_ref.req_ids)
        _assert_rows_equal(m, m_ref)
        common = type("Common", (), dict(num_reqs=m.num_reqs, num_actual_tokens=m.num_tokens,
                                         query_start_loc_cpu=torch.tensor(m.host_query_start_loc),
                                         seq_lens_cpu=torch.tensor(m.host_seq_lens)))
        adapter.check_common(m, common)
        per = adapter.layer_metadata(m, {f"model.layers.{i}.self_attn": i for i in range(layout.num_layers)})
        assert all(isinstance(v, LayerMetadata) for v in per.values())
        assert per["model.layers.1.self_attn"].kind == "c4" and \
            per["model.layers.1.self_attn"].channels["c4a"] is m["c4a"]
    assert moved > 5  # NOTE: the runner's order differed from the default path's in many steps


def test_vllm_adapter_refusals():
    layout = tiny_layout()
    with pytest.raises(ValueError, match="row_order='caller'"):
        VllmStepAdapter(_pipe(layout))
    adapter = VllmStepAdapter(_pipe(layout, row_order="caller"))
    s1, s2 = _prefill_then_decode(layout)
    so = from_step(s1)
    for bad, msg in ((["a"], "req_ids leaves out request 'b'"), (["a", "b", "c"], r"req_ids\[2\] = 'c' is not"),
                     (["a", "a"], r"req_ids\[1\] = 'a' is listed twice")):
        with pytest.raises(ValueError, match=msg):
            adapter.prepare(so, bad)
    m = adapter.prepare(so, ["b", "a"])
    assert m.req_ids == ["b", "a"] and m.host_query_start_loc.tolist() == [0, 30, 50]
    with pytest.raises(ValueError, match=r"row 1, slot 1, is a decode .* \[slot 1 = request 'b'\]"):
        adapter.prepare(from_step(s2), ["a", "b"])
    bad_common = type("Common", (), dict(num_reqs=2, num_actual_tokens=11, seq_lens_cpu=torch.tensor([30, 31]),
                                         query_start_loc_cpu=torch.tensor([0, 10, 11])))
    m = adapter.prepare(from_step(s2), ["b", "a"])
    with pytest.raises(ValueError, match=r"common.query_start_loc\[1\] = 10, meta.query_start_loc\[1\] = 1"):
        adapter.check_common(m, bad_common)


def test_pad_sizes_from_capture_sizes():
    assert pad_sizes_from_capture_sizes([512, 1, 2, 4, 8, 16, 8], 256) == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes\[1\] must be a positive int, got 0"):
        pad_sizes_from_capture_sizes([1, 0], 8)
    with pytest.raises(ValueError, match="no size of cudagraph_capture_sizes"):
        pad_sizes_from_capture_sizes([512], 256)
    pipe = _pipe(tiny_layout(), row_order="caller")
    pipe.warmup(pad_sizes=pad_sizes_from_capture_sizes([1, 2, 4, 8, 512], 96))  # NOTE: warmup takes them
