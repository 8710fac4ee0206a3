"""The query batch in the fused launch (docs/DESIGN.md §5 "Source rows ≠ query rows"): a task flagged
``FLAG_QUERY`` (:mod:`dsv4_index.fused.tasks`) reads the step's staged ``query_start_loc_q`` (the extra array
``QX``, :mod:`dsv4_index.query_batch`): its entry 0 says whether the step declares query rows; a plain step runs
the task as an unflagged one (one load more); a pipeline built without ``query_batches`` has no flagged task and
no query-map task (:func:`~dsv4_index.fused.tasks.plain_tasks`), so none of this is compiled. A declared step's
query row ``u`` belongs to batch row ``b``, the last row with ``qsl_q[b] <= u`` (a count, then binary steps, over
the staged array: :func:`query_rows`), and sits at the position of its source row: ``seq_lens[b] - qsl_q[b + 1] + u``.

The staging format's numbers come from :mod:`dsv4_index.state.staging`, the flag values from
:mod:`dsv4_index.query_batch`.
"""

from __future__ import annotations

from .._triton import triton, tl

from ..query_batch import STAGED_PADDED, STAGED_PLAIN
from ..state.staging import H_NUM_REQS, ROW_ARRAY_PAD
from .window import out_ptr

# NOTE: plain ints wrapped as tl.constexpr (kernel.py says why)
_H_NUM_REQS: tl.constexpr = tl.constexpr(H_NUM_REQS)
_ROW_ARRAY_PAD: tl.constexpr = tl.constexpr(ROW_ARRAY_PAD)
_PLAIN: tl.constexpr = tl.constexpr(STAGED_PLAIN)
_PADDED: tl.constexpr = tl.constexpr(STAGED_PADDED)
_COUNT_LOG: tl.constexpr = tl.constexpr(5)  # query_rows: the search's first level counts over up to 2^5 entries


@triton.jit
def query_array(stage_ptr, off_extra, rows, QX: tl.constexpr):
    """Pointer to the staged ``query_start_loc_q`` (entry 0: the step's flag)."""
    return stage_ptr + off_extra + QX * (rows + _ROW_ARRAY_PAD)


@triton.jit
def declared(qslq):
    """True when the step declares query rows (a scalar)."""
    return tl.load(qslq) != _PLAIN


@triton.jit
def query_rows(stage_ptr, qslq, t0, T_pad, rows, off_seq, BT: tl.constexpr, LOG_R: tl.constexpr):
    """Query rows ``u = t0 + [0, BT)`` of a declared step, as :func:`~dsv4_index.fused.window.token_rows` gives
    token rows: (u, in_out, batch row b, valid, seq_len, query end, position)."""
    u, in_out, b, valid, seq, end, pos, Tqp = query_rows_padded(stage_ptr, qslq, t0, T_pad, rows, off_seq, BT, LOG_R)
    return u, in_out, b, valid, seq, end, pos


@triton.jit
def query_rows_padded(stage_ptr, qslq, t0, T_pad, rows, off_seq, BT: tl.constexpr, LOG_R: tl.constexpr):
    """:func:`query_rows`, and ``T_q_pad`` (a scalar)."""
    u = t0 + tl.arange(0, BT)
    B = tl.load(stage_ptr + _H_NUM_REQS)
    # NOTE: b = the last row with qsl_q[b] <= u over entries [1, B) (entry 0, the flag, is never compared; 2^LOG_R >
    # max_num_reqs >= B; the entries rise): a count over the 2^C entries k * STEP, then binary-search steps STEP/2
    # .. 1 from there. The count's loads wait on nothing (masked inside the staged array's rows + 1 entries), no
    # step's on T_q; with no binary step (LOG_R <= _COUNT_LOG) the count's entries hold T_q = qsl_q[B] too, so b
    # and valid are one load level deep, as token_rows' token map and T
    C: tl.constexpr = LOG_R if LOG_R < _COUNT_LOG else _COUNT_LOG
    STEP: tl.constexpr = tl.constexpr(1) << (LOG_R - C)
    k = tl.arange(0, tl.constexpr(1) << C) * STEP
    v = tl.load(qslq + k, mask=k <= rows, other=0)
    hit = ((k > 0) & (k < B))[None, :] & (v[None, :] <= u[:, None])
    b = tl.sum(hit.to(tl.int32), axis=1) * STEP
    if STEP == 1:
        Tq = tl.sum(tl.where(k == B, v, 0), axis=0)
    else:
        Tq = tl.load(qslq + B)
    for s in tl.static_range(LOG_R - C):
        cand = b + (STEP >> (s + 1))
        ok = cand < B
        v = tl.load(qslq + cand, mask=ok, other=0)
        b = tl.where(ok & (v <= u), cand, b)
    Tqp = tl.where(tl.load(qslq) == _PADDED, T_pad, Tq)
    valid = u < Tq
    # NOTE: unmasked (b < max(B, 1) <= rows): the loads wait on b only, not on T_q
    seq = tl.where(valid, tl.load(stage_ptr + off_seq + b), 0)
    end = tl.where(valid, tl.load(qslq + b + 1), 0)
    return u, u < Tqp, tl.where(valid, b, 0), valid, seq, end, tl.where(valid, seq - end + u, 0), Tqp


@triton.jit
def query_map_task(stage_ptr, qslq, base32, base64, base8, orow, t0, T_pad, rows, off_qsl, off_seq,
                   TAB: tl.constexpr, TI: tl.constexpr, BT: tl.constexpr, LOG_R: tl.constexpr):
    """QUERY_MAP (a declared step only): each query row's batch row (0 when padded) and source row
    ``u + qsl[b + 1] - qsl_q[b + 1]`` (``-1`` when padded)."""
    if declared(qslq):
        u, in_out, b, valid, seq, end, pos = query_rows(stage_ptr, qslq, t0, T_pad, rows, off_seq, BT, LOG_R)
        src_end = tl.load(stage_ptr + off_qsl + b + 1, mask=valid, other=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + u, b, mask=in_out)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 1, 4) + u, tl.where(valid, u + src_end - end, -1),
                 mask=in_out)


@triton.jit
def query_qsl_task(qslq, base32, base64, base8, orow, r, B, T_pad, TAB: tl.constexpr, TI: tl.constexpr):
    """QUERY_QSL (a declared step only): ``query_start_loc_q`` rows ``r`` (entry 0 is 0, rows past ``B`` hold
    ``T_q``)."""
    if declared(qslq):
        Tq = tl.load(qslq + B)
        v = tl.load(qslq + r, mask=(r > 0) & (r <= B), other=0)
        tl.store(out_ptr(base32, base64, base8, orow, TAB, TI, 0, 4) + r, tl.where(r <= B, v, Tq), mask=r <= T_pad)
