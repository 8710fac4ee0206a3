"""Dense sanity of the small DSV4 attention (models/deepseek_v4): a per-token loop written here from
the formulas, visibility by perturbation, top-k, config and weights round trip."""

import math

import pytest
import torch

from models.deepseek_v4 import DSV4Attention, DSV4Config, init_weights, load, load_config, save
from models.deepseek_v4.attention import apply_rope

pytestmark = pytest.mark.slow  # model equivalence (./dev quick skips it)

TOL = 1e-4
CFG = load_config("tiny")
KINDS = {k: CFG.layer_ids(k)[0] for k in ("swa", "c4", "c128")}


def make(kind, seed=0):
    return init_weights(DSV4Attention(CFG, KINDS[kind]), seed).eval()


def inputs(L, seed=1):
    return torch.randn(L, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))


def _norm(v, w):
    return v / math.sqrt(float((v * v).mean()) + CFG.rms_norm_eps) * w


def _pool(comp, x, g, R, span):
    """Compressed row g: span [gR - R, gR + R) (span = 2R) or [gR, gR + R) (span = R), tokens < 0 out."""
    first = (g + 1) * R - span
    toks = [(i, s) for i, s in enumerate(range(first, first + span)) if s >= 0]
    logits = torch.stack([comp.wgate.weight @ x[s] + comp.pos_bias[i] for i, s in toks])  # [n, d]
    w = torch.softmax(logits, dim=0)
    acc = sum(w[k] * (comp.wkv.weight @ x[s]) for k, (_, s) in enumerate(toks))
    return _norm(acc, comp.norm)


def naive(m, x, t):
    """Output of token t, straight from the formulas (loops, no batching)."""
    c, R, W = CFG, m.ratio, CFG.sliding_window
    H, D = c.num_attention_heads, c.head_dim
    pos = torch.tensor([t])
    q = apply_rope((m.wq.weight @ x[t]).view(1, H, D), pos, c.qk_rope_head_dim, c.rope_theta)[0]
    keys = [apply_rope(_norm(m.wkv.weight @ x[s], m.kv_norm)[None], torch.tensor([s]),
                       c.qk_rope_head_dim, c.rope_theta)[0] for s in range(max(0, t - W + 1), t + 1)]
    n_c = (t + 1) // R if R else 0
    span = 2 * R if m.kind == "c4" else R
    rows = list(range(n_c))
    if m.kind == "c4" and n_c > c.index_topk:
        ix = m.indexer
        qi = (ix.wq.weight @ x[t]).view(c.index_n_heads, c.index_head_dim)
        wi = ix.wweights.weight @ x[t]
        score = {j: float((wi * torch.relu(qi @ _pool(ix.compressor, x, j, R, 2 * R))).sum()) for j in rows}
        rows = sorted(rows, key=lambda j: (-score[j], j))[:c.index_topk]
    keys += [_pool(m.compressor, x, g, R, span) for g in rows]
    K = torch.stack(keys)  # [N, D]
    out = []
    for h in range(H):
        logits = torch.cat([K @ q[h] / math.sqrt(D), m.sink[h:h + 1]])
        p = torch.softmax(logits, 0)[:-1]
        out.append(p @ K)
    return m.wo.weight @ torch.cat(out)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["swa", "c4", "c128"])
def test_dense_matches_per_token_loop(kind):
    m, x = make(kind), inputs(70)
    y = m.forward_dense(x)
    for t in range(70):
        assert (y[t] - naive(m, x, t)).abs().max() <= TOL, t


@torch.no_grad()
@pytest.mark.parametrize("kind,t,same,changed", [
    # W = 8: window [t-7, t]
    ("swa", 20, [12, 21, 30], [13, 17, 20]),
    # R = 16 (no overlap): t = 40 sees rows 0, 1 = tokens [0, 32); row 2 ends at 47
    ("c128", 40, [32, 41, 47], [0, 31, 33, 40]),
    # R = 4 (overlap): t = 14 sees rows 0..2 (spans up to token 11), n_c = 3 <= top-k
    ("c4", 14, [15, 16, 20], [0, 5, 7, 14]),
    # t = 2 (< R - 1): no compressed row; t = 3 completes row 0
    ("c4", 2, [3, 4], [0, 2]),
])
def test_dense_visibility(kind, t, same, changed):
    m, x = make(kind), inputs(48)
    y = m.forward_dense(x)
    for s in same + changed:
        x2 = x.clone()
        x2[s] += 1.0
        diff = (m.forward_dense(x2)[t] - y[t]).abs().max()
        if s in same:
            assert diff == 0, (s, diff)
        else:
            assert diff > 1e-3, (s, diff)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["c4", "c128"])
def test_first_tokens_see_no_compressed_row(kind):
    """Tokens t < R - 1 equal an SWA-only layer with the same shared weights; token R - 1 does not."""
    m, x = make(kind), inputs(20)
    swa = DSV4Attention(CFG, KINDS["swa"])
    swa.load_state_dict({k: v for k, v in m.state_dict().items() if k in swa.state_dict()})
    R = m.ratio
    y, y0 = m.forward_dense(x[:R]), swa.forward_dense(x[:R])
    assert (y[:R - 1] - y0[:R - 1]).abs().max() <= TOL
    assert (y[R - 1] - y0[R - 1]).abs().max() > 1e-3


@torch.no_grad()
def test_topk_all_rows_when_few():
    m, x = make("c4"), inputs(64)
    K, R = CFG.index_topk, m.ratio
    topk = m.dense_topk(x)
    assert topk.shape == (64, K) and topk.dtype == torch.int32
    for t in range(64):
        n_c = (t + 1) // R
        got = topk[t].tolist()
        if n_c <= K:
            assert sorted(got[:n_c]) == list(range(n_c)) and got[n_c:] == [-1] * (K - n_c), t
        else:
            assert len(set(got)) == K and all(0 <= j < n_c for j in got), t


def test_config():
    c = DSV4Config.from_dict(CFG.to_dict())
    assert c == CFG and c.to_dict()["compress_ratios"] == [0, 4, 16, 4, 0]
    assert [CFG.layer_kind(i) for i in range(5)] == ["swa", "c4", "c128", "c4", "swa"]
    flash, pro = load_config("flash"), load_config("pro")
    assert flash.layer_kind(0) == "swa" and flash.layer_kind(2) == "c4" and flash.layer_kind(3) == "c128"
    assert pro.layer_kind(0) == "c128" and pro.index_topk == 1024
    with pytest.raises(ValueError, match="name"):
        load_config("huge")
    with pytest.raises(ValueError, match="compress_ratios"):
        DSV4Config.from_dict({**CFG.to_dict(), "compress_ratios": [0, 4]})
    with pytest.raises(ValueError, match="layer_id"):
        CFG.layer_kind(5)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["swa", "c4", "c128"])
def test_weights_round_trip(kind, tmp_path):
    m, x = make(kind, seed=3), inputs(40)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), make(kind, seed=3).parameters()))
    save(m, tmp_path / "w.safetensors")
    other = make(kind, seed=4)
    assert not torch.equal(other.forward_dense(x), m.forward_dense(x))
    load(other, tmp_path / "w.safetensors")
    assert torch.equal(other.forward_dense(x), m.forward_dense(x))
    wrong = make("swa" if kind != "swa" else "c4")
    with pytest.raises(ValueError, match="path"):
        load(wrong, tmp_path / "w.safetensors")
