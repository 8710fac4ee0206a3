# over 400 lines: every index formula of DESIGN §4 in one module (the fused kernel and the ops share them)
"""Every index formula of docs/DESIGN.md §4, once, as Triton device functions.

The per-op kernels (``ops/<op>/kernel.py``) and the fused step kernel (``dsv4_index/fused/kernel.py``)
both call these; only the token prologue differs (a binary search over ``query_start_loc`` in the
ops, a token -> batch-row map staged by the host in the fused launch). The PyTorch references
(``ops/<op>/naive.py``) are the readable spec these must equal bit for bit.

Conventions
-----------
* Token tiles: ``t`` int32 ``[BT]``; ``b`` the token's batch row; ``row`` the block-table row that
  holds the request (``b`` itself, or ``idx_mapping[b]`` for slot-indexed tables); ``pos`` int32;
  ``valid`` bool (a live token; padded tokens read nothing and get ``-1`` / ``0``).
* Positions, rows and block ids are int32 (every value is checked to fit on the host); a slot is
  computed in int64 and stored as int64 (slot mappings) or int32 (index lists, whose slots are
  checked to fit int32 by the callers' value checks).
* Block tables: ``bt_ptr`` points at row 0 of an int32 table with row stride ``row_stride``;
  ``table_width`` bounds the *logical* block index (reads past it give ``-1``); ``ring_cols > 0``
  makes the row a ring, logical block ``i`` living in column ``i % ring_cols`` (docs/DESIGN.md §4 "Sliding
  tables as rings"; a circular group is a ring of one column whose block size is its capacity).
* Overlay (``HAS_OVERLAY``, fused launch only): this step's staged block ids of logical blocks
  ``[ov_lo, ov_hi)`` of the row sit at ``stage[ov_pay + blk - ov_lo]``; the same launch writes them
  into the table, so readers take them from the stage (no program reads an entry another writes).
* DCP (``cp_world``, ``cp_rank``, ``cp_interleave``): position / row ``p`` is owned by rank
  ``(p // I) % cpw`` and stored there at local ``(p // (I * cpw)) * I + p % I``; pass ``(1, 0, 1)`` for
  groups that are not sharded.
"""

from __future__ import annotations

from .._triton import triton, tl


# ----------------------------------------------------------------------------------------------
# tokens, requests, ownership
# ----------------------------------------------------------------------------------------------
@triton.jit
def find_request(qsl_ptr,  # [B + 1] int32
                 t, num_reqs, n_iter):
    """Largest ``b < num_reqs`` with ``qsl[b] <= t`` (0 when ``num_reqs == 0``), elementwise.

    NOTE: ``n_iter = num_reqs.bit_length()`` (host); every load stays inside ``qsl[1 .. B]``.
    """
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + num_reqs
    for _ in range(n_iter):
        active = lo < hi
        mid = (lo + hi) // 2
        le = tl.load(qsl_ptr + 1 + mid, mask=active, other=0) <= t
        lo = tl.where(active & le, mid + 1, lo)
        hi = tl.where(active & (le == 0), mid, hi)
    return tl.maximum(tl.minimum(lo, num_reqs - 1), 0)


@triton.jit
def searched_tokens(qsl_ptr,       # [B + 1] int32
                    seq_lens_ptr,  # [B] int32
                    idx_ptr,       # [B] int32 table row of each batch row (read when HAS_IDX)
                    t, T_out, num_reqs, n_iter, HAS_IDX: tl.constexpr):
    """Token prologue of the per-op kernels: (b, row, valid, pos) of token tile ``t``.

    ``valid = t < T_out and t < qsl[B]`` (the device value: padded tokens are never trusted to the
    host count); ``pos = seq_lens[b] - qsl[b + 1] + t`` (0 where not valid).
    """
    b = find_request(qsl_ptr, t, num_reqs, n_iter)
    valid = (t < T_out) & (t < tl.load(qsl_ptr + num_reqs)) & (b < num_reqs)
    seq = tl.load(seq_lens_ptr + b, mask=valid, other=0)
    end = tl.load(qsl_ptr + b + 1, mask=valid, other=0)
    pos = tl.where(valid, seq - end + t, 0)
    if HAS_IDX:
        row = tl.load(idx_ptr + b, mask=valid, other=0)
    else:
        row = b
    return b, row, valid, pos


@triton.jit
def row_in_table(row, valid, table_rows, HAS_IDX: tl.constexpr):
    """``valid`` narrowed to tokens whose table row lies in ``[0, table_rows)``: a row read from
    ``idx_mapping`` is checked on the host only under value checks, so unchecked inputs must not
    send a token outside the table (such a token reads nothing and gets ``-1`` / ``0``)."""
    if HAS_IDX:
        return valid & (row >= 0) & (row < table_rows)
    else:
        return valid


@triton.jit
def owned_count(n, cp_world, cp_rank, cp_interleave):
    """How many of ``0 .. n - 1`` (``n >= 0``) rank ``cp_rank`` owns."""
    cycle = cp_interleave * cp_world
    part = tl.minimum(tl.maximum(n % cycle - cp_rank * cp_interleave, 0), cp_interleave)
    return (n // cycle) * cp_interleave + part


@triton.jit
def cp_local(p, cp_world, cp_rank, cp_interleave):
    """(owned by this rank, local position) of position / row ``p >= 0``."""
    own = ((p // cp_interleave) % cp_world) == cp_rank
    return own, (p // (cp_interleave * cp_world)) * cp_interleave + p % cp_interleave


# ----------------------------------------------------------------------------------------------
# block-table read
# ----------------------------------------------------------------------------------------------
@triton.jit
def table_entry(bt_ptr,     # [rows, >= cols] int32
                row, blk, ok, row_stride, ring_cols,
                stage_ptr,  # [*] int32 (read when HAS_OVERLAY)
                ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr):
    """Block id of logical block ``blk`` of table row ``row`` as of this step (0 where not ``ok``).

    NOTE: callers bound ``blk`` (``0 <= blk < table_width``) inside ``ok``; the ring maps it to a
    column inside the row, so no read leaves the table.
    """
    col = blk
    if ring_cols > 0:
        col = blk % ring_cols
    k = blk - ov_lo  # NOTE: the staged run's entry for this logical block, if it holds one (HAS_OVERLAY)
    if HAS_OVERLAY:
        if ring_cols > 0:
            # NOTE: a ring column holds the newest block written to it, and a staged run keeps at most
            # ring_cols ids (one per column): match by column, so every block of a circular group (one
            # column, any position) and a wrapped ring read what the table holds after this step
            lo_col = ov_lo % ring_cols  # NOTE: per row; Triton's % truncates, so fold into [0, ring_cols)
            lo_col = tl.where(lo_col < 0, lo_col + ring_cols, lo_col)
            k = col - lo_col            # in (-ring_cols, ring_cols): one add instead of a second modulo
            k = tl.where(k < 0, k + ring_cols, k)
    return _entry_at(bt_ptr, row, col, k, ok, row_stride, stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY)


@triton.jit
def no_block(slot):
    """``-1`` for the slots of a negative block id (vLLM's ``-1`` placeholder: no block), the slot
    otherwise. NOTE: ``slot = bid * S + off`` with ``0 <= off < S`` is negative iff ``bid`` is, so one
    clamp masks it; the reference is :func:`dsv4_index._common.no_block`."""
    return tl.maximum(slot, -1)


# ----------------------------------------------------------------------------------------------
# one body per index
# ----------------------------------------------------------------------------------------------
@triton.jit
def raw_slot(bt_ptr, row, pos, valid, write_floor, block_size, table_width, ring_cols, row_stride,
             cp_world, cp_rank, cp_interleave, stage_ptr, ov_lo, ov_hi, ov_pay,
             HAS_OVERLAY: tl.constexpr):
    """Slot written by a token (int64; ``-1``: padded, owned by another rank, below ``write_floor``
    (bounded replay of a prefix-cacheable group), or outside the table).

    ``slot(pos) = bt[lp // block_size] * block_size + lp % block_size`` with ``lp`` the local position.
    """
    own, lp = cp_local(pos, cp_world, cp_rank, cp_interleave)
    blk = lp // block_size
    # NOTE: pos >= 0 guards garbage inputs (seq_lens < q_len, negative floor): Triton's // and %
    # truncate toward zero, so a negative position would give a negative column
    ok = valid & (pos >= 0) & (pos >= write_floor) & own & (blk < table_width)
    bid = table_entry(bt_ptr, row, blk, ok, row_stride, ring_cols, stage_ptr, ov_lo, ov_hi, ov_pay,
                      HAS_OVERLAY)
    return no_block(tl.where(ok, bid.to(tl.int64) * block_size + lp % block_size, -1))


@triton.jit
def compressed_slot(bt_ptr, row, pos, valid, write_floor, compress_ratio, rows_per_block,
                    table_width, row_stride, cp_world, cp_rank, cp_interleave,
                    stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr):
    """Slot of the compressed row a token completes (int64), ``-1`` unless ``(pos + 1) % R == 0``.

    Row ``c = pos // R`` (local ``lc`` under DCP) lives at ``bt[lc // S] * S + lc % S``. Tokens below
    ``write_floor`` (replayed positions of a prefix-cacheable group) write nothing.
    """
    c = pos // compress_ratio
    own, lc = cp_local(c, cp_world, cp_rank, cp_interleave)
    blk = lc // rows_per_block
    ok = valid & (pos >= 0) & ((pos + 1) % compress_ratio == 0) & (pos >= write_floor) & own \
        & (blk < table_width)
    bid = table_entry(bt_ptr, row, blk, ok, row_stride, 0, stage_ptr, ov_lo, ov_hi, ov_pay,
                      HAS_OVERLAY)
    return no_block(tl.where(ok, bid.to(tl.int64) * rows_per_block + lc % rows_per_block, -1))


@triton.jit
def window_len(pos, valid, floor, window, cp_world, cp_rank, cp_interleave):
    """(first local position, entries) of a token's window ``[max(pos - W + 1, floor, 0), pos]``:
    the owned positions of the window are the consecutive local positions ``first .. first + n - 1``."""
    start = tl.maximum(tl.maximum(pos - window + 1, floor), 0)
    first = owned_count(start, cp_world, cp_rank, cp_interleave)
    n = owned_count(pos + 1, cp_world, cp_rank, cp_interleave) - first
    return first, tl.where(valid, tl.maximum(n, 0), 0)


@triton.jit
def window_row(bt_ptr, row, first, n, j, block_size, table_width, ring_cols, row_stride,
               stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr):
    """Columns ``j`` (int32 ``[1, BC]``) of window rows: the slots of local positions
    ``first + j`` for ``j < n`` (oldest first, the token itself last), ``-1`` after. int32 ``[BT, BC]``.

    NOTE: entries past the table's logical width are ``-1`` (only on bad input: hosts check widths).
    """
    lp = first[:, None] + j
    blk = lp // block_size
    ok = (j < n[:, None]) & (blk < table_width)
    bid = table_entry(bt_ptr, row[:, None], blk, ok, row_stride, ring_cols, stage_ptr,
                      ov_lo[:, None], ov_hi[:, None], ov_pay[:, None], HAS_OVERLAY)
    slot = no_block(bid.to(tl.int64) * block_size + lp % block_size).to(tl.int32)
    return tl.where(ok, slot, -1)


@triton.jit
def window_row_blocks(bt_ptr, row, first, n, j0, block_size: tl.constexpr, table_width, ring_cols, row_stride,
                      stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr, BC: tl.constexpr):
    """:func:`window_row` of the ``BC`` columns ``j0 + [0, BC)``, one table read per block: the chunk spans at most
    three blocks when ``2 * block_size >= BC`` (callers' condition), read once per row (:func:`window_blocks`),
    selected per column (:func:`window_from_blocks`). int32 ``[BT, BC]``."""
    e = window_blocks(bt_ptr, row, first, n, j0, block_size, table_width, ring_cols, row_stride, stage_ptr, ov_lo,
                      ov_hi, ov_pay, HAS_OVERLAY, BC)
    return window_from_blocks(e[0], e[1], e[2], first, n, j0, block_size, table_width, BC)


@triton.jit
def window_blocks(bt_ptr, row, first, n, j0, block_size: tl.constexpr, table_width, ring_cols, row_stride,
                  stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr, BC: tl.constexpr):
    """The entries :func:`table_entry` reads for the blocks ``b0 + [0, 3)`` of :func:`window_row_blocks`' chunk
    (``b0 = (first + j0) // block_size >= 0``), the ring column and staged index stepped from b0's: 3 x ``[BT]``."""
    b0 = (first + j0) // block_size
    last = (first + tl.minimum(n, j0 + BC) - 1) // block_size  # NOTE: the chunk's last listed block
    col, k = b0, b0 - ov_lo
    if ring_cols > 0:
        col = b0 % ring_cols  # NOTE: table_entry's column match, once; the next blocks' step and wrap
        lo_col = ov_lo % ring_cols
        k = col - tl.where(lo_col < 0, lo_col + ring_cols, lo_col)
        k = tl.where(k < 0, k + ring_cols, k)
    e = ()  # type: tuple
    for i in tl.static_range(3):  # NOTE: b0 <= last wherever n > j0
        e = e + (_entry_at(bt_ptr, row, col, k, (n > j0) & (b0 + i <= last) & (b0 + i < table_width), row_stride,
                           stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY),)
        col, k = col + 1, k + 1
        if ring_cols > 0:
            col = tl.where(col >= ring_cols, col - ring_cols, col)
            k = tl.where(k >= ring_cols, k - ring_cols, k)
    return e


@triton.jit
def _entry_at(bt_ptr, row, col, k, ok, row_stride, stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr):
    """:func:`table_entry`'s read once its table column ``col`` and staged index ``k`` are known."""
    if HAS_OVERLAY:
        staged = ok & (k >= 0) & (k < ov_hi - ov_lo)
        v = tl.load(bt_ptr + row.to(tl.int64) * row_stride + col, mask=ok & (staged == 0), other=0)
        return tl.where(staged, tl.load(stage_ptr + ov_pay + k, mask=staged, other=0), v)
    return tl.load(bt_ptr + row.to(tl.int64) * row_stride + col, mask=ok, other=0)


@triton.jit
def window_from_blocks(e0, e1, e2, first, n, j0, block_size: tl.constexpr, table_width, BC: tl.constexpr):
    """Columns ``j0 + [0, BC)`` of window rows from their blocks' entries (:func:`window_blocks`), int32."""
    j = j0 + tl.arange(0, BC)[None, :]
    lp = first[:, None] + j
    blk = lp // block_size
    ok = (j < n[:, None]) & (blk < table_width)
    k = blk - ((first + j0) // block_size)[:, None]
    bid = tl.where(k == 0, e0[:, None], tl.where(k == 1, e1[:, None], e2[:, None]))
    slot = no_block(bid.to(tl.int64) * block_size + lp % block_size).to(tl.int32)
    return tl.where(ok, slot, -1)


@triton.jit
def window_chunk(bt_ptr, row, first, n, j0, j, block_size: tl.constexpr, table_width, ring_cols, row_stride,
                 stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY: tl.constexpr, BC: tl.constexpr,
                 BLOCK_LOADS: tl.constexpr):
    """Window columns ``j = j0 + [0, BC)``: one table read per block where a chunk spans at most three blocks
    (``BLOCK_LOADS``, :func:`window_row_blocks`), else one per column (:func:`window_row`)."""
    if BLOCK_LOADS and 2 * block_size >= BC:
        return window_row_blocks(bt_ptr, row, first, n, j0, block_size, table_width, ring_cols, row_stride,
                                 stage_ptr, ov_lo, ov_hi, ov_pay, HAS_OVERLAY, BC)
    else:
        return window_row(bt_ptr, row, first, n, j, block_size, table_width, ring_cols, row_stride, stage_ptr,
                          ov_lo, ov_hi, ov_pay, HAS_OVERLAY)


@triton.jit
def circular_split(idx, t, pos, first, n, j, q_start):
    """Window entries of a circular group (docs/DESIGN.md §4 "circular group"): an entry whose position
    ``p = first + j`` lies inside the request's chunk of this step is read from the step's own token
    row ``r = t - (pos - p)`` (in the chunk iff ``r >= q_start``, the request's ``query_start``) and
    encoded ``-2 - r``; earlier entries keep their ring slot. int32 ``[BT, BC]``."""
    r = t[:, None] - pos[:, None] + first[:, None] + j
    in_step = (j < n[:, None]) & (r >= q_start[:, None])
    return tl.where(in_step, -2 - r, idx)


@triton.jit
def window_count(first, n, block_size, table_width):
    """Entries of :func:`window_row` that are slots: the ``n`` local positions ``first ..`` whose
    block lies inside the table's logical width (``== n`` on checked inputs; int32)."""
    room = tl.maximum((first.to(tl.int64) * 0 + table_width) * block_size - first, 0)  # int64: no wrap
    return tl.minimum(n.to(tl.int64), room).to(tl.int32)


@triton.jit
def visible_rows(pos, valid, compress_ratio, cp_world, cp_rank, cp_interleave):
    """Compressed rows a token sees, ``n_c(pos) = (pos + 1) // R`` (owned count under DCP); 0 if not valid."""
    n = owned_count(tl.maximum(pos + 1, 0) // compress_ratio, cp_world, cp_rank, cp_interleave)
    return tl.where(valid, n, 0)


@triton.jit
def causal_row(bt_ptr, row, n, j, rows_per_block, row_stride, stage_ptr, ov_lo, ov_hi, ov_pay,
               HAS_OVERLAY: tl.constexpr):
    """Columns ``j`` (int32 ``[1, BC]``) of causal compressed rows: local row ``j`` ->
    ``bt[j // S] * S + j % S`` for ``j < n``, ``-1`` after. int32 ``[BT, BC]``.

    NOTE: callers clamp ``n`` to the row width and the table's rows (``table_width * S``)."""
    ok = j < n[:, None]
    bid = table_entry(bt_ptr, row[:, None], j // rows_per_block, ok, row_stride, 0, stage_ptr,
                      ov_lo[:, None], ov_hi[:, None], ov_pay[:, None], HAS_OVERLAY)
    slot = no_block(bid.to(tl.int64) * rows_per_block + j % rows_per_block).to(tl.int32)
    return tl.where(ok, slot, -1)


@triton.jit
def causal_row_blocks(bt_ptr, row, n, j0, rows_per_block: tl.constexpr, row_stride, stage_ptr, ov_lo, ov_hi,
                      ov_pay, HAS_OVERLAY: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """:func:`causal_row` of the ``BC`` columns ``j0 + [0, BC)`` with one table read per block instead
    of one per column: blocks ``j0 // S + [0, BC // S)`` are read (and their overlay), then each block
    id ``bid`` expands to the ``S`` slots ``bid * S + [0, S)``. int32 ``[BT, BC]``.

    NOTE: ``j0 % S == 0`` and ``BC % S == 0`` (callers: ``S`` a power of two dividing the chunk); int32
    arithmetic equals the int64 product truncated to int32 in :func:`causal_row` for every slot of a
    checked table (slots fit int32) and for negative block ids of magnitude ``< 2**31 / S``.
    """
    NB: tl.constexpr = BC // rows_per_block
    blk = j0 // rows_per_block + tl.arange(0, NB)[None, :]
    ok = blk * rows_per_block < n[:, None]
    bid = table_entry(bt_ptr, row[:, None], blk, ok, row_stride, 0, stage_ptr,
                      ov_lo[:, None], ov_hi[:, None], ov_pay[:, None], HAS_OVERLAY)
    base = bid * rows_per_block
    if rows_per_block == 2:
        slot = tl.interleave(base, base + 1)
    else:
        slot = tl.reshape(base[:, :, None] + tl.arange(0, rows_per_block)[None, None, :], [BT, BC])
    j = j0 + tl.arange(0, BC)[None, :]
    return tl.where(j < n[:, None], no_block(slot), -1)


@triton.jit
def completed_rows(qsl_ptr,       # [B + 1] int32
                   seq_lens_ptr,  # [B] int32
                   j, mask, compress_ratio):
    """(first row, count) of the compressed rows requests ``j`` complete this step (0 where not
    ``mask``): rows ``c`` with ``ctx <= c * R + R - 1 < seq_len``, ``ctx = seq_len - q_len``.

    NOTE: negatives from garbage inputs are clamped to 0 (the reference does the same).
    """
    start = tl.load(qsl_ptr + j, mask=mask, other=0)
    end = tl.load(qsl_ptr + j + 1, mask=mask, other=0)
    seq = tl.load(seq_lens_ptr + j, mask=mask, other=0)
    first = tl.maximum(seq - (end - start), 0) // compress_ratio
    n = tl.maximum(tl.maximum(seq, 0) // compress_ratio - first, 0)
    return first, tl.where(mask, n, 0)


@triton.jit
def rows_before(seq_lens_ptr,  # [B] int32
                b, num_reqs, n_req_tiles, compress_ratio, cp_world, cp_rank, cp_interleave,
                BLOCK_B: tl.constexpr):
    """``sum_{b' < b} owned(seq_lens[b'] // R)`` (int64) for each entry of ``b``: the indexer's
    ``cu[b]`` (``n_req_tiles = cdiv(B, BLOCK_B)``; negative lengths count as 0)."""
    acc = b.to(tl.int64) * 0
    for i in range(n_req_tiles):
        bb = i * BLOCK_B + tl.arange(0, BLOCK_B)
        sl = tl.load(seq_lens_ptr + bb, mask=bb < num_reqs, other=0)
        c = owned_count(tl.maximum(sl, 0) // compress_ratio, cp_world, cp_rank, cp_interleave)
        acc += tl.sum(tl.where(bb[None, :] < b[:, None], c[None, :], 0).to(tl.int64), axis=1)
    return acc


@triton.jit
def decode_row_lens(seq_len, q_len, j, next_n, compress_ratio, cp_world, cp_rank, cp_interleave):
    """Indexer decode view: entry ``[r, j]`` is the request's token ``j - (next_n - q)``, position
    ``seq_len - next_n + j``; its visible rows, 0 before the request's first token (right-aligned)."""
    pos = seq_len[:, None] - next_n + j
    n = owned_count(tl.maximum(pos + 1, 0) // compress_ratio, cp_world, cp_rank, cp_interleave)
    return tl.where(j >= next_n - q_len[:, None], n, 0)


@triton.jit
def topk_slot(bt_ptr, row, pick, ok, n_c, rows_per_block, table_width, row_stride,
              cp_world, cp_rank, cp_interleave):
    """Top-k pick ``l`` (request-local compressed row, any int dtype) -> (slot int32, valid).

    Valid iff ``ok``, ``0 <= l < n_c``, this rank owns row ``l`` and its local block lies inside the
    table; the slot is ``bt[lc // S] * S + lc % S`` (``-1`` when not valid).
    """
    ok = ok & (pick >= 0) & (pick < n_c)
    pick = tl.where(ok, pick, 0).to(tl.int32)
    own, lc = cp_local(pick, cp_world, cp_rank, cp_interleave)
    blk = lc // rows_per_block
    ok = ok & own & (blk < table_width)
    bid = tl.load(bt_ptr + row.to(tl.int64) * row_stride + blk, mask=ok, other=0)
    ok = ok & (bid >= 0)  # NOTE: a negative block id is no block (see no_block)
    return tl.where(ok, bid * rows_per_block + lc % rows_per_block, -1), ok


@triton.jit
def store_topk_slots(picks, t, row, valid, n_c,
                     bt_ptr,    # [table_rows, cols] int32, row stride row_stride
                     out_ptr,   # [>= T_out, K] int32, row stride out_stride
                     lens_ptr,  # [>= T_out] int32
                     row_stride, table_width, out_stride, T_out, K,
                     S: tl.constexpr, CP_WORLD: tl.constexpr, CP_RANK: tl.constexpr,
                     CP_INTERLEAVE: tl.constexpr, COMPACT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Convert a tile of picks ``[BLOCK_T, BLOCK_K]`` (:func:`topk_slot`) and store slots and valid counts
    of rows ``t < T_out`` (``compact``: valid entries first, order kept). Shared by ``topk_to_slots`` and
    ``candidate_topk_to_slots``."""
    k = tl.arange(0, BLOCK_K)[None, :]
    slot, ok = topk_slot(bt_ptr, row[:, None], picks, valid[:, None], n_c[:, None], S, table_width,
                         row_stride, CP_WORLD, CP_RANK, CP_INTERLEAVE)
    n = tl.sum(ok.to(tl.int32), axis=1)
    in_out = t < T_out
    tl.store(lens_ptr + t, n, mask=in_out)
    dst = out_ptr + t.to(tl.int64)[:, None] * out_stride
    st = in_out[:, None] & (k < K)
    if COMPACT:
        # NOTE: a valid pick goes to column (valid picks up to it) - 1, columns from n on get -1:
        # the two stores hit disjoint columns
        col = tl.cumsum(ok.to(tl.int32), axis=1) - 1
        tl.store(dst + col, slot, mask=st & ok)
        tl.store(dst + k, tl.zeros_like(slot) - 1, mask=st & (k >= n[:, None]))
    else:
        tl.store(dst + k, slot, mask=st)


# ----------------------------------------------------------------------------------------------
# V4.1 candidate blocks (DESIGN §4 "Candidate blocks")
# ----------------------------------------------------------------------------------------------
@triton.jit
def candidate_visible(blk, ok, n_c, C: tl.constexpr):
    """``ok`` narrowed to candidate blocks whose first row is visible: ``0 <= blk`` and ``blk * C < n_c``
    (compared as ``blk < cdiv(n_c, C)``, so no product of an unchecked id is formed)."""
    return ok & (blk >= 0) & (blk < (n_c + C - 1) // C)


@triton.jit
def candidate_row(blocks_ptr,  # [>= rows, >= nb] int32 | int64, row stride blocks_stride
                  blocks_stride, t, rd, col, n_c, NB, C: tl.constexpr):
    """A consumer's sparse column ``col`` (any int dtype) of token ``t`` -> its request-local compressed
    row ``blocks[t, col // C] * C + col % C`` (int32), or ``-1`` where ``col < 0``, ``col // C >= NB``, the
    block is ``-1`` or not visible (``blk * C >= n_c``: every row of it would be invalid in
    :func:`topk_slot` anyway, and the row stays inside int32). Reads only ``blocks[t, 0 .. NB)`` where ``rd``."""
    ok = rd & (col >= 0) & (col < NB * C)
    j = tl.where(ok, col, 0)
    blk = tl.load(blocks_ptr + t.to(tl.int64) * blocks_stride + j // C, mask=ok, other=-1)
    ok = candidate_visible(blk, ok, n_c, C)
    return tl.where(ok, tl.where(ok, blk, 0).to(tl.int32) * C + (j % C).to(tl.int32), -1)


@triton.jit
def candidate_phys(bt_ptr, row, blk, ok, n_c, rows_per_block, table_width, row_stride, C: tl.constexpr):
    """Candidate block ``blk`` -> (physical candidate block ``slot(blk * C) / C`` int32, valid): valid iff
    ``ok``, the block is visible (:func:`candidate_visible`) and its first row converts (:func:`topk_slot`,
    no DCP); ``-1`` otherwise. ``C`` divides ``rows_per_block``, so the slot is a multiple of ``C``."""
    ok = candidate_visible(blk, ok, n_c, C)
    first = tl.where(ok, blk, 0).to(tl.int32) * C
    slot, ok = topk_slot(bt_ptr, row, first, ok, n_c, rows_per_block, table_width, row_stride, 1, 0, 1)
    return tl.where(ok, slot // C, -1), ok
