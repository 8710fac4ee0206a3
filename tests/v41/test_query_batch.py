"""Source rows != query rows (issue 38 item 2, docs/DESIGN.md §5): a step declaring per request ``q_b`` decoder
queries (``StepBatch.query_lens`` / ``StepInput.query_lens``).

The definition checked here is independent of the build: the declared step's per-query-token outputs equal the
SAME step built without the declaration, gathered at ``q_to_src`` (written here row by row from ``query_start_loc``
and ``q_b``); its per-source-token outputs equal that plain step's byte for byte. Both pipelines' outputs are
poisoned before each build; the reference backend, the per-op Triton kernels and the fused launch (Triton
interpreter on CPU) are each compared with a reference-backend plain pipeline."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.batch import StepBatch
from dsv4_index.testing.scheduler import ReferenceScheduler

from dsv4_index.validate import MetadataError, check_metadata, check_topk

from helpers.pipelines import DEVICE, HAS_TRITON, POISONS, clone_meta, poison
from helpers.rejections import diff, state

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

SPEC, R, T_MAX = 3, 4, 96
# per source token: one row per scheduled token of the source batch
SOURCE_FIELDS = ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "compact_slot_mapping")
QUERY_FIELDS = ("indices", "lens", "ks", "ke", "lens_clamped")
LAYOUTS = {
    "tiny_v41": lambda: DSV4Layout.from_config("tiny_v41", max_model_len=512, mla_block_size=16, swa_block_size=8,
                                               indexer_causal_indices=True),
    "tiny": lambda: DSV4Layout.from_config("tiny", max_model_len=512, mla_block_size=16, swa_block_size=8,
                                           indexer_causal_indices=True),
    # NOTE: sliding blocks of 32: the large tiles' split window programs (fused/rows.py) run its sliding groups
    "tiny_v41_b32": lambda: DSV4Layout.from_config("tiny_v41", max_model_len=512, mla_block_size=16,
                                                   swa_block_size=32, indexer_causal_indices=True),
    "tiny_v41_per_layer": lambda: DSV4Layout.from_config("tiny_v41", max_model_len=512, mla_block_size=16,
                                                         swa_block_size=8, swa_group_per_layer=True),
    "tiny_circular": lambda: DSV4Layout.from_config("tiny", max_model_len=512, mla_block_size=16, swa_block_size=8,
                                                    circular={"c4_state": 12}),
}
_LAYOUTS: dict = {}


def layout(name):
    if name not in _LAYOUTS:
        _LAYOUTS[name] = LAYOUTS[name]()
    return _LAYOUTS[name]


def pipe(lay, kind, reqs=R, **kw):
    kw.setdefault("query_batches", True)  # NOTE: the pipelines here build declared steps (test_query_optin.py: off)
    kw.update(dict(reference=dict(backend="reference"), unfused=dict(fused=False, backend="triton"),
                   fused=dict(fused=True, backend="triton"))[kind])
    return MetadataPipeline(lay, reqs, T_MAX, DEVICE, SPEC, **kw)


def expected_q_to_src(qsl, q):
    """Row by row: the last q_b source rows of each batch row, -1 after."""
    out = []
    for b, qb in enumerate(q):
        out += list(range(qsl[b + 1] - qb, qsl[b + 1]))
    return out


def declare(step, rng, frac_all=0.3):
    """``step`` with random query_lens (some rows keep every token)."""
    q = {}
    forced = False
    for rid, n in step.num_scheduled_tokens.items():
        if n > 1 and not forced:   # NOTE: one row of each step queries fewer tokens than it schedules
            q[rid], forced = int(rng.integers(1, n)), True
        elif n > 0 and rng.random() > frac_all:
            q[rid] = int(rng.integers(1, n + 1))
    return dataclasses.replace(step, query_lens=q)


def check_declared(mp, md, tag):
    """``md`` (declared) against ``mp`` (the same step, plain): the definition of the module docstring."""
    B, Tp = mp.num_reqs, mp.num_tokens_padded
    qsl = mp.host_query_start_loc.tolist()
    if md.query_lens is None:   # NOTE: every row declared q == n: the plain step
        assert md.q_to_src is None and md.num_query_tokens == mp.num_tokens, tag
        q = [qsl[b + 1] - qsl[b] for b in range(B)]
    else:
        q = md.query_lens.tolist()
        assert md.host_query_start_loc_q.tolist() == [sum(q[:b]) for b in range(B + 1)], tag
        assert md.query_start_loc_q.cpu().tolist() == md.host_query_start_loc_q.tolist(), tag
    Tq = sum(q)
    src = expected_q_to_src(qsl, q)
    Tqp = md.num_query_tokens_padded
    assert md.num_query_tokens == Tq and Tqp in (Tq, Tp), tag
    assert md.num_query_decode_tokens == sum(q[:mp.num_decodes]), tag
    if md.q_to_src is not None:
        assert md.q_to_src.cpu().tolist() == src + [-1] * (Tqp - Tq), tag
    idx = torch.tensor(src, dtype=torch.long)
    for f in ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token"):
        assert torch.equal(getattr(md, f).cpu(), getattr(mp, f).cpu()), (tag, f)
    for name, cd in md.channels.items():
        cp = mp[name]
        for f in SOURCE_FIELDS + ("compact_cu", "cu"):
            a, b = getattr(cd, f), getattr(cp, f)
            assert (a is None) == (b is None), (tag, name, f)
            if a is not None:
                assert torch.equal(a.cpu(), b.cpu()), (tag, name, f)
        source_lists = cd.tail_slot_mapping is not None or name.endswith("_state")  # compressor-state windows
        for f in QUERY_FIELDS:
            a, b = getattr(cd, f), getattr(cp, f)
            assert (a is None) == (b is None), (tag, name, f)
            if a is None:
                continue
            a, b = a.cpu(), b.cpu()
            if source_lists:
                assert torch.equal(a, b), (tag, name, f)
                continue
            assert a.shape[0] == Tqp, (tag, name, f, a.shape)
            assert torch.equal(a[:Tq], b[idx]), (tag, name, f)
            pad = -1 if f == "indices" else (1 if f == "lens_clamped" else 0)
            # NOTE: padded query rows read as the plain step's padded rows do
            assert bool((a[Tq:] == pad).all()) and bool((b[mp.num_tokens:] == pad).all()), (tag, name, f)
        if cd.decode_lens is not None:
            nd, dl = mp.num_decodes, cd.decode_lens.cpu()
            lens = cp.lens.cpu()
            nn = dl.shape[1] if dl.dim() == 2 else 0
            for r in range(nd):
                qsl_q = sum(q[:r])
                want = [0] * (nn - q[r]) + [int(lens[src[qsl_q + k]]) for k in range(q[r])]
                assert dl[r].tolist() == want, (tag, name, r)


def check_conversions(mp, md, gen, tag):
    """Top-k / candidate conversions of the declared step on T_q rows == the plain step's on the source rows."""
    if md.q_to_src is None:
        return
    Tq, Tqp, Tp = md.num_query_tokens, md.num_query_tokens_padded, mp.num_tokens_padded
    src = md.q_to_src[:Tq].long().cpu()
    for ch in [n for n in md.channels if n in md._converters]:
        R_ = md.layout.channels[ch].compress_ratio
        n_c = (mp.positions.long().cpu() + 1) // R_
        picks = ((torch.rand(Tp, 4, generator=gen) * (n_c[:, None] + 3)).long() - 2).to(torch.int32)
        qp = torch.full((Tqp, 4), -1, dtype=torch.int32)
        qp[:Tq] = picks[src]
        want_s, want_l = (x.cpu().clone() for x in mp.topk_to_slots(ch, picks.to(DEVICE)))
        got_s, got_l = (x.cpu() for x in md.topk_to_slots(ch, qp.to(DEVICE)))
        check_topk(md, ch, qp, got_s, got_l)
        assert got_s.shape[0] == Tqp, (tag, ch)
        assert torch.equal(got_s[:Tq], want_s[src]) and torch.equal(got_l[:Tq], want_l[src]), (tag, ch)
        assert bool((got_l[Tq:] == 0).all()), (tag, ch)
        C, nb = md.layout.candidate_block_size, md.layout.candidate_topk_blocks
        if C is None:
            continue
        blocks = ((torch.rand(Tp, nb, generator=gen) * (n_c[:, None] // C + 2)).long() - 1).to(torch.int32)
        cols = (torch.rand(Tp, 4, generator=gen) * (nb * C + 1)).long().to(torch.int32) - 1
        qb = torch.full((Tqp, nb), -1, dtype=torch.int32)
        qb[:Tq] = blocks[src]
        qc = torch.full((Tqp, 4), -1, dtype=torch.int32)
        qc[:Tq] = cols[src]
        want = [x.cpu().clone() for x in mp.candidate_blocks_to_physical(ch, blocks.to(DEVICE))]
        got = [x.cpu() for x in md.candidate_blocks_to_physical(ch, qb.to(DEVICE))]
        assert all(torch.equal(g[:Tq], w[src]) for g, w in zip(got, want)), (tag, ch, "phys")
        want = [x.cpu().clone() for x in mp.candidate_topk_to_slots(ch, blocks.to(DEVICE), cols.to(DEVICE))]
        got = [x.cpu() for x in md.candidate_topk_to_slots(ch, qb.to(DEVICE), qc.to(DEVICE))]
        assert all(torch.equal(g[:Tq], w[src]) for g, w in zip(got, want)), (tag, ch, "candidate slots")


def poke_negative(pipes, rng, n=8):
    """``-1`` (no block) at the same ``n`` random entries of every sliding device table of each pipeline (the split
    tiles' slow path, fused/rows.py); returns what :func:`unpoke` restores (the host mirror never changes)."""
    lay = pipes[0].layout
    tabs = pipes[0].tables.tables
    picks = [(g, int(rng.integers(tabs[g].shape[0])), int(rng.integers(tabs[g].shape[1])))
             for g, grp in enumerate(lay.groups) if grp.window for _ in range(n)]
    old = [[(g, r, c, int(p.tables.tables[g][r, c])) for g, r, c in picks] for p in pipes]
    for p in pipes:
        for g, r, c in picks:
            p.tables.tables[g][r, c] = -1
    return old


def unpoke(pipes, old):
    for p, o in zip(pipes, old):
        for g, r, c, v in reversed(o):
            p.tables.tables[g][r, c] = v


def run_trace(lay_name, kind, seed, steps, pad, reqs=R, arrivals=2, prompt_len=(10, 200), negative=False):
    lay = layout(lay_name)
    # NOTE: validate: check_metadata each step (not with -1 block ids: it names them)
    plain, decl = pipe(lay, "reference", reqs), pipe(lay, kind, reqs, validate=not negative)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    sched = ReferenceScheduler(lay, 900, max_num_batched_tokens=T_MAX, max_num_seqs=reqs, num_speculative_tokens=SPEC,
                               seed=seed)
    seen = dict(declared=0, shorter=0, decode_declared=0, max_rows=0)
    for i, (step, _views) in enumerate(sched.random_trace(steps, seed, arrival_prob=0.9, max_arrivals=arrivals,
                                                          prompt_len=prompt_len, max_new_tokens=(2, 8))):
        pad_to = min(T_MAX, step.total_tokens + int(rng.integers(1, 4))) if pad and i % 2 else None
        dstep = declare(step, rng)
        plain.update(step, pad_to=pad_to)
        decl.update(dstep, pad_to=pad_to)
        if negative:  # NOTE: after update (its checks refuse a null block where a step reads), for this build only
            old = poke_negative((plain, decl), rng)
        poison(plain, POISONS[0])
        mp = plain.build()
        poison(decl, POISONS[1])
        md = decl.build()
        if negative:
            unpoke((plain, decl), old)
        check_declared(mp, md, (lay_name, kind, seed, i))
        check_conversions(mp, md, gen, (lay_name, kind, seed, i))
        if md.query_lens is not None:
            seen["max_rows"] = max(seen["max_rows"], mp.num_reqs)
            seen["declared"] += 1
            seen["shorter"] += int((md.query_lens < np.diff(mp.host_query_start_loc)).sum())
            seen["decode_declared"] += int((md.query_lens[:mp.num_decodes]
                                            < np.diff(mp.host_query_start_loc)[:mp.num_decodes]).sum())
    return seen


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), lay_name=st.sampled_from(sorted(LAYOUTS)), pad=st.booleans())
def test_declared_step_is_the_plain_step_gathered_reference(seed, lay_name, pad):
    seen = run_trace(lay_name, "reference", seed, 6, pad)
    assert seen["declared"] >= 1 and seen["shorter"] >= 1


@pytest.mark.slow  # pipeline traces in the interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), lay_name=st.sampled_from(sorted(LAYOUTS)), kind=st.sampled_from(["unfused",
                                                                                                      "fused"]))
def test_declared_step_is_the_plain_step_gathered_triton(seed, lay_name, kind):
    seen = run_trace(lay_name, kind, seed, 5, True)
    assert seen["declared"] >= 1


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("lay_name,fold,negative", [("tiny_v41_b32", 1, False), ("tiny_circular", 1, False),
                                                    ("tiny_v41_per_layer", 1, False), ("tiny_v41_per_layer", 2, True)])
def test_declared_step_in_the_large_tiles(monkeypatch, lay_name, fold, negative):
    """Steps from 16 tokens on take the large tiles: a declared step runs the split window programs over its query
    rows (fused/rows.py ``window_split``, ``QUERY``; slot mappings per source token); a circular group's (source
    rows, unflagged) and per-layer sliding groups' (several tasks a unit, ``fold`` of them a program) too; ``negative``:
    some sliding tables' entries are -1 (the tiles' slow path)."""
    from dsv4_index.fused import plan as plan_mod
    from dsv4_index.fused.tasks import FLAG_CIRCULAR, FLAG_QUERY, NF, S_FLAGS, S_FOLD, S_REP, S_SPLIT
    monkeypatch.setenv("DSV4_INDEX_LARGE_FROM", "16")
    for name in ("INTERP_LARGE", "LARGE"):  # NOTE: the interpreter's large tiles, or the GPU's
        monkeypatch.setattr(plan_mod, name, dataclasses.replace(getattr(plan_mod, name), fold=fold))
    p = pipe(layout(lay_name), "fused")
    tok = p.fused_plan._variants[2]["consts"]["TOK"]
    units = [tok[i:i + int(NF)] for i in range(0, len(tok), int(NF))]
    split = [u for u in units if u[S_SPLIT]]
    assert any(u[S_FLAGS] & int(FLAG_QUERY) for u in split)
    assert lay_name != "tiny_circular" or any(u[S_FLAGS] & int(FLAG_CIRCULAR) for u in split)
    assert lay_name != "tiny_v41_per_layer" or any(u[S_FLAGS] & int(FLAG_QUERY) and u[S_REP] > 1
                                                   and u[S_FOLD] == fold for u in split)
    seen = run_trace(lay_name, "fused", 11, 6, True, negative=negative)
    assert seen["declared"] >= 3


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (CUDA or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("large", [False, True])
def test_declared_step_of_many_batch_rows(monkeypatch, large):
    """max_num_reqs 40: the query rows' batch-row search (fused/query.py ``query_rows``) counts over every second
    entry, then takes one binary step; steps of up to 40 rows."""
    if large:
        monkeypatch.setenv("DSV4_INDEX_LARGE_FROM", "16")
    seen = run_trace("tiny_v41_b32", "fused", 5, 6, True, reqs=40, arrivals=8, prompt_len=(4, 24))
    assert seen["declared"] >= 3 and seen["max_rows"] >= 6


def test_a_trace_declares_decode_rows_too():
    """The traces above reach decode rows that declare fewer queries than tokens (spec decode, next_n > 1)."""
    seen = run_trace("tiny_v41", "reference", 3, 10, False)
    assert seen["decode_declared"] >= 1 and seen["shorter"] >= 3, seen


# ----------------------------------------------------------------------------------------------
# the declaration: checked, and a step that does not declare it is the plain step
# ----------------------------------------------------------------------------------------------
def _first_steps(lay, n=3, seed=5):
    sched = ReferenceScheduler(lay, 900, max_num_batched_tokens=T_MAX, max_num_seqs=R, num_speculative_tokens=SPEC,
                               seed=seed)
    return [s for s, _ in sched.random_trace(n, seed, arrival_prob=1.0, prompt_len=(20, 60), max_new_tokens=(4, 8))]


def test_declaring_every_token_is_byte_identical_to_not_declaring():
    lay = layout("tiny_v41")
    a, b = pipe(lay, "reference"), pipe(lay, "reference")
    for i, step in enumerate(_first_steps(lay)):
        full = dataclasses.replace(step, query_lens=dict(step.num_scheduled_tokens))
        a.update(step)
        poison(a, POISONS[0])
        ma = a.build()
        b.update(full)
        poison(b, POISONS[1])
        mb = b.build()
        assert mb.q_to_src is None and mb.query_lens is None and mb.num_query_tokens == ma.num_tokens
        for name in ma.channels:
            for f in dataclasses.fields(ma[name]):
                x, y = getattr(ma[name], f.name), getattr(mb[name], f.name)
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x, y), (i, name, f.name)


@pytest.mark.parametrize("bad, match", [
    (lambda n: n + 1, r"query_lens\[0\] = \d+: expected 1\.\.\d+"),
    (lambda n: n * 0, r"query_lens\[0\] = 0: expected 1\.\.\d+"),
])
def test_a_bad_query_count_names_field_and_row_and_changes_nothing(bad, match):
    lay = layout("tiny_v41")
    p = pipe(lay, "reference")
    s0, s1, _ = _first_steps(lay)
    p.update(s0)
    p.build()
    before = state(p)
    from dsv4_index.frontend import batch_from_step
    batch, _ = batch_from_step(s1, p.slot_map, len(lay.groups))
    q = np.asarray(batch.num_scheduled_tokens).copy()
    q[0] = bad(q[0])
    with pytest.raises(ValueError, match=match):
        p.update(dataclasses.replace(batch, query_lens=q))
    assert diff(before, state(p)) == []


def test_query_lens_shape_and_unknown_request_are_refused():
    lay = layout("tiny_v41")
    p = pipe(lay, "reference")
    s0 = _first_steps(lay, 1)[0]
    from dsv4_index.frontend import batch_from_step
    batch, _ = batch_from_step(s0, p.slot_map, len(lay.groups))
    with pytest.raises(ValueError, match=r"query_lens must be a 1-D integer array of \d+ entries"):
        p.update(dataclasses.replace(batch, query_lens=np.ones(batch.num_rows + 1, np.int64)))
    with pytest.raises(ValueError, match=r"query_lens\['nope'\]: request 'nope' is not scheduled"):
        p.update(dataclasses.replace(s0, query_lens={"nope": 1}))


def test_a_builder_without_a_query_batch_refuses_the_declared_step():
    from dsv4_index.channels import registered_channels
    lay = layout("tiny_v41")
    p = pipe(lay, "reference")
    b = p.builders["swa"]
    b.query_batch = False   # NOTE: an instance attribute: a user builder that knows no query batch
    s0 = _first_steps(lay, 1)[0]
    rid, n = next((r, n) for r, n in s0.num_scheduled_tokens.items() if n > 1)
    with pytest.raises(ValueError, match=r"query_lens: channels \['swa'\] have builders without a query batch"):
        p.update(dataclasses.replace(s0, query_lens={rid: n - 1}))
    p.update(s0)   # the plain step still runs
    assert registered_channels()["swa"].query_batch


def test_step_batch_json_keeps_its_schema_without_query_lens():
    b = StepBatch(req_slots=np.array([0]), num_computed_tokens=np.array([0]), num_scheduled_tokens=np.array([4]))
    assert "query_lens" not in b.to_json()
    c = dataclasses.replace(b, query_lens=np.array([2]))
    assert c.to_json()["query_lens"] == [2] and StepBatch.from_json(c.to_json()).query_lens.tolist() == [2]


def test_check_metadata_finds_a_wrong_query_row():
    """``validate`` of a declared step reads the query rows at their source tokens: a corrupted query-side entry,
    or the plain step's rows handed out as query rows, is found."""
    lay = layout("tiny_v41")
    p = pipe(lay, "reference")
    rng = np.random.default_rng(2)
    for step in _first_steps(lay, 2):
        p.update(declare(step, rng))
        m = p.build()
    assert m.q_to_src is not None and m.num_query_tokens < m.num_tokens
    check_metadata(m)
    bad = clone_meta(m)
    bad["swa"].lens[0] += 1
    with pytest.raises(MetadataError, match="swa"):
        check_metadata(bad)
    bad = clone_meta(m)
    bad["c1i"].lens[: m.num_query_tokens] = m["c1i"].lens[: m.num_query_tokens].flip(0)
    with pytest.raises(MetadataError, match="c1i"):
        check_metadata(bad)


def test_a_declared_trace_records_and_replays(tmp_path):
    """``query_lens`` travels in a trace (StepBatch JSON, trace schema) and replays equal to the recording."""
    from dsv4_index.tools.replay import replay_trace
    from dsv4_index.tools.trace import read_trace, record_steps
    lay = layout("tiny_v41")
    p = pipe(lay, "reference")
    rng = np.random.default_rng(4)
    path = tmp_path / "declared.jsonl"
    with record_steps(p, path):
        for step in _first_steps(lay, 3):
            p.update(declare(step, rng))
            p.build()
    _, steps = read_trace(path)
    assert any(d["step"].get("query_lens") for d in steps)
    res = replay_trace(path, backend="reference", log=lambda *a: None)
    assert res.problem is None and res.stats["accepted steps"] == 3, res


@pytest.mark.gpu
def test_declared_steps_replay_the_plain_steps_graph():
    """CUDA graphs (one per T_pad): a declared step replays the graph captured by a plain step of its size (the
    declaration is read from the staged step), and the other way round; each equals the reference."""
    lay = layout("tiny_v41")
    g = MetadataPipeline(lay, R, T_MAX, "cuda", SPEC, cuda_graphs=True, query_batches=True)
    g.warmup(pad_sizes=(T_MAX,))
    ref = MetadataPipeline(lay, R, T_MAX, "cpu", SPEC, backend="reference", query_batches=True)
    rng = np.random.default_rng(9)
    for i, step in enumerate(_first_steps(lay, 6)):
        s = declare(step, rng) if i % 2 else step
        g.update(s, pad_to=T_MAX)
        mg = g.build()
        ref.update(s, pad_to=T_MAX)
        mr = ref.build()
        assert (mg.q_to_src is None) == (mr.q_to_src is None) and len(g._graphs) == 1, i
        for name in mr.channels:
            for f in dataclasses.fields(mr[name]):
                x, y = getattr(mg[name], f.name), getattr(mr[name], f.name)
                if isinstance(y, torch.Tensor) and f.name not in ("block_table", "idx_mapping"):
                    assert torch.equal(x.cpu(), y), (i, name, f.name)
        if mr.q_to_src is not None:
            assert torch.equal(mg.q_to_src.cpu(), mr.q_to_src) and torch.equal(mg.query_start_loc_q.cpu(),
                                                                            mr.query_start_loc_q)


def test_decode_view_counts_query_rows_of_query_lists_only():
    lay = layout("tiny_v41")
    p = pipe(lay, "reference")
    rng = np.random.default_rng(3)
    for step in _first_steps(lay, 8, seed=3):
        p.update(declare(step, rng))
        m = p.build()
        if m.q_to_src is not None and m.num_query_decode_tokens < m.num_decode_tokens:
            break
    else:
        pytest.fail("no step with a decode row declaring fewer queries than tokens")
    idx, lens = m.decode_view("swa")
    assert idx.shape[0] == lens.shape[0] == m.num_query_decode_tokens
    assert torch.equal(lens, m["swa"].lens[:m.num_query_decode_tokens])
    idx, lens = m.decode_view("c2_state")   # compressor-state windows: per source token
    assert idx.shape[0] == m.num_decode_tokens
    assert m.decode_view("swa", padded=True)[0].shape[0] == m.num_query_tokens_padded
