"""The math both forms of :class:`~.attention.DSV4Attention` share, and its two sub-modules: RMSNorm, RoPE,
sink attention (whole and as a DCP partial, with the partials' merge), top-k selection, index-list gathers
and cache writes, the gated :class:`Compressor` and the Lightning :class:`Indexer` (fp32 throughout)."""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from torch import nn

from .config import DSV4Config

__all__ = ["NEG_INF", "rms_norm", "apply_rope", "sink_attention", "sink_attention_lse", "merge_partials",
           "select_topk", "gather_rows", "write_rows", "Compressor", "Indexer"]

NEG_INF = float("-inf")


# math shared by both forms
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Rotate the last ``rope_dim`` dims of ``x [T, ..., D]`` by ``positions [T]`` (rotate-half pairs)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim)
    ang = positions.to(torch.float32)[:, None] * inv_freq  # [T, rope_dim / 2]
    ang = ang.reshape(ang.shape[:1] + (1,) * (x.dim() - 2) + ang.shape[1:])
    cos, sin = ang.cos(), ang.sin()
    keep, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    a, b = rot.chunk(2, dim=-1)
    return torch.cat([keep, a * cos - b * sin, b * cos + a * sin], dim=-1)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                   sink: torch.Tensor) -> torch.Tensor:
    """Per-token attention over its own key list, one softmax including a per-head sink logit.

    Parameters
    ----------
    q : float [T, H, D]
    keys : float [T, N, D] -- key = value; entries with ``valid`` False may hold anything (NaN too).
    valid : bool [T, N]
    sink : float [H]

    Returns
    -------
    float [T, H, D]
    """
    keys = torch.where(valid[..., None], keys, 0.0)
    s = torch.einsum("thd,tnd->thn", q, keys) * q.shape[-1] ** -0.5
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    s = torch.cat([s, sink.expand(q.shape[0], -1)[..., None]], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]  # the sink takes its share and gives nothing back
    return torch.einsum("thn,tnd->thd", p, keys)


def sink_attention_lse(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                       sink: Optional[torch.Tensor]):
    """Partial attention over one rank's share of the keys, with its log-sum-exp (for a DCP merge).

    Parameters
    ----------
    q : float [T, H, D]
    keys : float [T, N, D] -- key = value; entries with ``valid`` False may hold anything.
    valid : bool [T, N]
    sink : float [H] or None -- the per-head sink logit; give it on exactly one rank of a merge.

    Returns
    -------
    (float [T, H, D], float [T, H]) -- output normalised over this rank's keys (+ sink), and
    ``logsumexp`` of those logits (``-inf`` and a zero output where nothing is visible).
    """
    keys = torch.where(valid[..., None], keys, 0.0)
    s = torch.einsum("thd,tnd->thn", q, keys) * q.shape[-1] ** -0.5
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    if sink is not None:
        s = torch.cat([s, sink.expand(q.shape[0], -1)[..., None]], dim=-1)
    lse = torch.logsumexp(s, dim=-1)  # [T, H]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])[..., :keys.shape[1]]
    return torch.einsum("thn,tnd->thd", p, keys), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp merge of per-rank partial attention.

    Parameters
    ----------
    outs : float [Wc, T, H, D] -- each rank's normalised partial output.
    lses : float [Wc, T, H] -- each rank's log-sum-exp (``-inf``: the rank saw nothing).

    Returns
    -------
    float [T, H, D] -- the attention over the union of the ranks' keys (zero where no rank saw any).
    """
    total = torch.logsumexp(lses, dim=0)  # [T, H]
    w = torch.exp(lses - torch.where(torch.isfinite(total), total, 0.0))  # [Wc, T, H]; 0 for -inf ranks
    return (w[..., None] * outs).sum(0)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` columns of ``scores [T, N]`` (``-inf`` = not visible), best first, ties to the lower
    column; ``-1`` where fewer than ``k`` are visible. Returns int32 [T, k]."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    taken = scores.gather(1, order) > NEG_INF
    out = torch.where(taken, order, -1).to(torch.int32)
    return torch.nn.functional.pad(out, (0, k - out.shape[1]), value=-1)


def candidate_blocks(scores: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """V4.1's candidate source: the ``k`` best blocks of ``block`` consecutive rows of ``scores [T, N]`` (entry
    ``j`` = row ``j``, ``-inf`` = not visible), a block scoring the max of its visible rows (``-inf``: none, so a
    block whose first row is not visible is never picked); ties to the lower block. int32 [T, k], ``-1`` padded."""
    pad = (-scores.shape[1]) % block
    s = torch.nn.functional.pad(scores, (0, pad), value=NEG_INF)
    return select_topk(s.unflatten(1, (-1, block)).amax(-1), k)


def candidate_columns(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """The request-local row of every sparse column of a consumer: ``blocks [T, nb]`` -> int64 [T, nb * block],
    ``blocks[t, j // C] * C + j % C``, ``-1`` under a ``-1`` block (docs/DESIGN.md §4 "Candidate blocks")."""
    j = torch.arange(blocks.shape[1] * block, device=blocks.device)
    b = blocks.long()[:, j // block]
    return torch.where(b >= 0, b * block + j % block, -1)


def gather_rows(cache: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor):
    """Rows of ``cache`` named by an index list (``indices [T, N]``, first ``lens [T]`` entries, ``-1``
    masked). Returns (float [T, N, D], bool valid [T, N])."""
    n = torch.arange(indices.shape[1], device=indices.device)
    valid = (n[None, :] < lens[:, None]) & (indices >= 0)
    return cache[indices.clamp(min=0).long()], valid


def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, ok: torch.Tensor):
    """``cache[slots[t]] = values[t]`` for tokens with ``ok[t]`` and ``slots[t] >= 0``."""
    sel = ok & (slots >= 0)
    cache[slots[sel].long()] = values[sel]


# modules
class Compressor(nn.Module):
    """Gated pooling of a span of ``span`` tokens into one compressed row of ``dim``.

    Per-token state ``[kv_c | z]`` (``[2 * dim]``) is what the paged form caches in a state channel.
    """

    def __init__(self, hidden: int, dim: int, span: int, eps: float):
        super().__init__()
        self.dim, self.span, self.eps = dim, span, eps
        self.wkv = nn.Linear(hidden, dim, bias=False)
        self.wgate = nn.Linear(hidden, dim, bias=False)
        self.pos_bias = nn.Parameter(torch.zeros(span, dim))
        self.norm = nn.Parameter(torch.ones(dim))

    def state(self, x: torch.Tensor) -> torch.Tensor:
        """float [T, hidden] -> per-token state float [T, 2 * dim]."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def pool(self, state: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """float [G, span, 2 * dim] states of each row's span (oldest first), bool valid [G, span]
        -> float [G, dim] compressed rows."""
        state = torch.where(valid[..., None], state, 0.0)
        kv, z = state.split(self.dim, dim=-1)
        logits = (z + self.pos_bias).masked_fill(~valid[..., None], NEG_INF)
        w = torch.softmax(logits, dim=1)  # over the span's tokens, per dim
        return rms_norm((w * kv).sum(1), self.norm, self.eps)


class Indexer(nn.Module):
    """Lightning indexer: ``score(t, j) = sum_h w_h(t) relu(q_h(t) . k_j)``."""

    def __init__(self, config: DSV4Config, ratio: int, span: int = 0, own_keys: bool = True):
        super().__init__()
        h, d = config.index_n_heads, config.index_head_dim
        self.n_heads = h
        self.wq = nn.Linear(config.hidden_size, h * d, bias=False)
        self.wweights = nn.Linear(config.hidden_size, h, bias=False)
        # NOTE: the keys' compressor lives on the layer that owns the compressed caches (V4.1: its kv source)
        self.compressor = Compressor(config.hidden_size, d, span or 2 * ratio, config.rms_norm_eps) if own_keys \
            else None

    def scores(self, x: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x float [T, hidden], keys float [T, N, d], valid bool [T, N] -> float [T, N] (-inf if not valid)."""
        q = rearrange(self.wq(x), "t (h d) -> t h d", h=self.n_heads)
        keys = torch.where(valid[..., None], keys, 0.0)
        s = torch.relu(torch.einsum("thd,tnd->thn", q, keys))
        s = torch.einsum("th,thn->tn", self.wweights(x), s)
        return s.masked_fill(~valid, NEG_INF)
