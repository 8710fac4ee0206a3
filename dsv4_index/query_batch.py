"""The query batch of a step whose source rows != query rows (V4.1 decoder-suffix replay, docs/DESIGN.md §5).

A step may declare per batch row ``q_b`` (``StepBatch.query_lens``): the compressor / indexer source covers the
row's ``n_b`` scheduled tokens (the *source batch*: today's batch), the decoder queries only its last ``q_b`` (the
*query batch*). The query batch has its own ``query_start_loc_q`` (prefix sums of ``q_b``), ``T_q`` and ``T_q_pad``,
and the map ``q_to_src[u] = qsl[b] + n_b - q_b + (u - qsl_q[b])`` (the source row of query row ``u`` of batch row
``b``; ``-1`` for a padded query row). A query row sits at its source row's position, and the query batch reads
the same ``seq_lens``, so every per-token output of the query batch is the source batch's output at ``q_to_src``
(the definition the tests check).

Only a pipeline built with ``query_batches=True`` accepts a declaration (:func:`refuse_declared` refuses it otherwise:
that pipeline's fused kernel has no query code). This module holds the declaration's check (:func:`query_lens_of`),
the host values of the query batch (:class:`QueryBatch`) and the formula of ``q_to_src`` (:func:`q_to_src`, numpy,
and :func:`fill_q_to_src`, device tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import torch

__all__ = ["QueryBatch", "query_lens_of", "query_batch", "q_to_src", "fill_q_to_src", "staged_qsl_q", "plan_query",
           "build_query", "meta_query_fields", "refuse_declared"]


def query_lens_of(batch, rows: np.ndarray) -> Optional[np.ndarray]:
    """``batch.query_lens`` in device order (``rows``: the StepBatch row of each device batch row, decode first),
    int64 ``[B]``; None when the step declares none, or declares ``q == n`` on every row (the plain step).

    Raises ``ValueError`` naming the field and the row: not a 1-D integer array of one entry per row, or an entry
    outside ``1 .. num_scheduled_tokens`` (``0`` for a row of 0 tokens).
    """
    q = getattr(batch, "query_lens", None)
    if q is None:
        return None
    a = np.asarray(q)
    n = len(batch.req_slots)
    if a.ndim != 1 or a.shape[0] != n or a.dtype.kind not in "iu":
        raise ValueError(f"query_lens must be a 1-D integer array of {n} entries (one per batch row), got "
                         f"{a.dtype} of shape {a.shape}")
    a = a.astype(np.int64)
    ns = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
    bad = (a > ns) | (a < np.minimum(ns, 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        want = "0 (the row schedules no token)" if ns[i] == 0 else f"1..{int(ns[i])}"
        raise ValueError(f"query_lens[{i}] = {int(a[i])}: expected {want} (num_scheduled_tokens {int(ns[i])}; the "
                         f"decoder queries the row's last query_lens tokens)")
    if bool((a == ns).all()):
        return None
    return a.take(rows)


@dataclass
class QueryBatch:
    """Host values of a declared step's query batch (device order, decode rows first as the source batch).

    query_lens : int64 [B] — ``q_b``; qsl_q : int64 [B + 1] — ``query_start_loc_q``;
    num_tokens : int — ``T_q``; num_tokens_padded : int — ``T_q_pad`` (``T_q``, or the step's ``T_pad`` when the
    step is padded: the query views then keep the source batch's captured size); num_decode_tokens : int — query
    rows of the decode rows.
    """

    query_lens: np.ndarray
    qsl_q: np.ndarray
    num_tokens: int
    num_tokens_padded: int
    num_decode_tokens: int
    padded: bool = False


def query_batch(query_lens: np.ndarray, num_decodes: int, padded: bool, num_tokens_padded: int) -> QueryBatch:
    """The :class:`QueryBatch` of checked ``query_lens`` (int64 ``[B]``, device order)."""
    qsl_q = np.zeros(query_lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl_q[1:])
    T_q = int(qsl_q[-1])
    return QueryBatch(query_lens=query_lens, qsl_q=qsl_q, num_tokens=T_q,
                      num_tokens_padded=num_tokens_padded if padded else T_q,
                      num_decode_tokens=int(qsl_q[num_decodes]), padded=bool(padded))


def q_to_src(qsl: np.ndarray, qsl_q: np.ndarray, num_tokens_padded: int) -> np.ndarray:
    """int32 ``[T_q_pad]``: the source row of each query row, ``-1`` for padded query rows (the definition,
    row by row: ``q_to_src[u] = qsl[b] + n_b - q_b + (u - qsl_q[b])``)."""
    out = np.full(num_tokens_padded, -1, dtype=np.int32)
    for b in range(qsl_q.shape[0] - 1):
        n_b, q_b = int(qsl[b + 1] - qsl[b]), int(qsl_q[b + 1] - qsl_q[b])
        for u in range(int(qsl_q[b]), int(qsl_q[b + 1])):
            out[u] = int(qsl[b]) + n_b - q_b + (u - int(qsl_q[b]))
    return out


def fill_q_to_src(qsl: torch.Tensor, qsl_q: torch.Tensor, token_to_req_q: torch.Tensor, num_tokens: int,
                  out: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Device form of :func:`q_to_src` (torch ops, no allocation beyond temporaries): ``q_to_src[u] = u +
    qsl[b + 1] - qsl_q[b + 1]`` for the query rows ``u < T_q`` of batch row ``b = token_to_req_q[u]``, ``-1``
    after. ``qsl``, ``qsl_q`` int32 ``[B + 1]``; ``token_to_req_q`` int32 ``[T_q_pad]``; ``out`` int32
    ``[T_q_pad]``; ``token_ids`` int64 ``[>= T_q_pad]`` (``arange``)."""
    n = out.shape[0]
    if qsl.shape[0] < 2:
        return out.fill_(-1)
    b = token_to_req_q[:n].long().clamp(min=0, max=qsl.shape[0] - 2) + 1
    shift = qsl[b] - qsl_q[b]
    t = token_ids[:n]
    out.copy_(torch.where(t < num_tokens, t + shift, -1))
    return out


# NOTE: the staged query_start_loc_q's entry 0 (always 0 in the array itself) says what the step is: the fused
# kernel reads it first (fused/query.py), the unfused path restores the 0 (BuildContext.fill_query)
STAGED_PLAIN, STAGED_DECLARED, STAGED_PADDED = -1, -2, -3


def staged_qsl_q(seq_lens, num_scheduled, out, *, source) -> None:
    """Staged per-request input (``BuildContext.staged_input``), int32 ``[B + 1]``: ``query_start_loc_q`` of the
    declared step (``source()`` returns its :class:`QueryBatch`) with entry 0 replaced by ``STAGED_DECLARED``
    (``T_q_pad = T_q``) or ``STAGED_PADDED`` (``T_q_pad = T_pad``); a plain step (``source()`` None) writes
    ``STAGED_PLAIN`` into entry 0 only (nothing else is read then)."""
    qb = source()
    if qb is None:
        out[0] = STAGED_PLAIN
        return
    out[:] = qb.qsl_q
    out[0] = STAGED_PADDED if qb.padded else STAGED_DECLARED


# ----------------------------------------------------------------------------------------------
# the pipeline's three steps (MetadataPipeline.update, build, the meta)
# ----------------------------------------------------------------------------------------------
def refuse_declared(batch) -> None:
    """The first check of ``update()`` on a pipeline built without ``query_batches=True``: a step that declares
    ``query_lens`` (any declaration, ``q == n`` on every row too) is refused with a ``ValueError`` saying how to
    enable it; the pipeline is then unchanged. Such a pipeline's fused kernel has no query code (its tasks carry
    no ``FLAG_QUERY``: :func:`dsv4_index.fused.tasks.plain_tasks`)."""
    if getattr(batch, "query_lens", None) is not None:
        raise ValueError("query_lens: this pipeline was built without query_batches=True, so it cannot build a step "
                         "whose query rows differ from its source rows (V4.1 decoder-suffix replay); build it with "
                         "MetadataPipeline(..., query_batches=True) (its fused kernel then compiles the query paths)")


def plan_query(batch, plan, pad_to: Optional[int], builders: Dict[str, Any], ctx) -> None:
    """The last check of ``update()``: the step's query batch, set as ``ctx.query`` once it passed (None for a
    plain step; the staging reads it). ``ValueError`` naming the field and row, or the channels whose builders
    know no query batch; ``ctx`` is then unchanged."""
    qlens = query_lens_of(batch, plan.rows)
    if qlens is not None:
        lacking = sorted(n for n, b in builders.items() if not b.query_batch)
        if lacking:
            raise ValueError(f"query_lens: channels {lacking} have builders without a query batch "
                             f"(ChannelBuilder.query_batch); this pipeline cannot build a step whose query rows "
                             f"differ from its source rows")
    ctx.query = None if qlens is None else query_batch(qlens, plan.num_decodes, pad_to is not None,
                                                         plan.num_tokens_padded)


def build_query(ctx, staging, fused: bool) -> None:
    """``build()`` of a declared step on the unfused path (nothing for a plain step, nor after the fused launch,
    which builds the query batch itself: fused/query.py): the query batch's map from the staged
    ``query_start_loc_q``, before the builders' ``launch`` reads it."""
    if ctx.query is None or fused:
        return
    lay = staging.lay
    assert lay is not None  # NOTE: build() follows an update(), which staged the step
    at = lay.extra_at(ctx.qsl_q_index)
    ctx.fill_query(staging.dev[at:at + ctx.num_reqs + 1])


def meta_query_fields(ctx, plan) -> Dict[str, Any]:
    """The meta's query-batch fields (``DSV4Metadata``); the source batch's counts for a plain step."""
    q = ctx.query
    if q is None:
        return dict(num_query_tokens=ctx.num_tokens, num_query_tokens_padded=ctx.num_tokens_padded,
                    num_query_decode_tokens=plan.num_decode_tokens)
    B, Tqp = ctx.num_reqs, q.num_tokens_padded
    return dict(num_query_tokens=q.num_tokens, num_query_tokens_padded=Tqp, num_query_decode_tokens=q.num_decode_tokens,
                query_lens=q.query_lens, host_query_start_loc_q=q.qsl_q,
                query_start_loc_q=ctx.query_start_loc_q[:B + 1], q_to_src=ctx.q_to_src[:Tqp])
