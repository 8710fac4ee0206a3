"""The per-step metadata pipeline (DESIGN §5): scheduler output in, per-channel device metadata out.

::

    pipe = MetadataPipeline(layout, max_num_reqs=256, max_num_batched_tokens=8192, device="cuda")
    pipe.warmup()
    for step in scheduler:                 # StepInput per step
        pipe.update(step)                  # host: request rows, block tables, decode-first order, one H2D
        meta = pipe.build()                # device: kernels only, no host sync
        out = model(hidden, meta)          # meta["swa"].indices, meta["c128a"].lens, meta.topk_to_slots(...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ._common import cdiv, cp_owned_count
from .block_table import SEGMENT_INTS, MultiGroupBlockTable, apply_segments
from .channels import BuildContext, ChannelMetadata, builder_for
from .step import StepInput


@dataclass
class DSV4Metadata:
    """One step's metadata. Device tensors are views of the pipeline's persistent buffers.

    Attributes
    ----------
    num_reqs, num_tokens, num_tokens_padded : int — live requests, live tokens, tokens incl. padding (host).
    req_ids : list[str] — request of each batch row, decode requests first.
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens : int (host).
    query_start_loc : int32 [num_reqs + 1]; seq_lens : int32 [num_reqs].
    positions : int64 [T]; token_to_req : int32 [T]; is_valid_token : bool [T]  (T = num_tokens_padded).
    block_tables : list of int32 [num_reqs, table_width], one per gid.
    channels : dict name -> ChannelMetadata; ``meta["swa"]`` is ``meta.channels["swa"]``.
    """

    num_reqs: int
    num_tokens: int
    num_tokens_padded: int
    req_ids: List[str]
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    token_to_req: torch.Tensor
    is_valid_token: torch.Tensor
    block_tables: List[torch.Tensor]
    channels: Dict[str, ChannelMetadata] = field(default_factory=dict)
    _pipeline: Optional["MetadataPipeline"] = field(default=None, repr=False)

    def __getitem__(self, name: str) -> ChannelMetadata:
        try:
            return self.channels[name]
        except KeyError:
            raise KeyError(f"no channel {name!r} in this layout; channels: {sorted(self.channels)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.channels

    def topk_to_slots(self, channel: str, topk: torch.Tensor):
        """Convert one layer's indexer picks into physical slots of ``channel``'s cache.

        Parameters
        ----------
        channel : str — a channel with top-k conversion (``"c4a"``).
        topk : int32 or int64 [T, K] — request-local compressed row ids, ``-1`` = none (T = num_tokens_padded).

        Returns
        -------
        (slots int32 [T, K], lens int32 [T]) — views of persistent buffers, overwritten by the next call.
        """
        if channel not in self.channels:
            raise KeyError(f"no channel {channel!r} in this layout; channels: {sorted(self.channels)}")
        pipe = self._pipeline
        return pipe._builders[channel].topk_to_slots(pipe._ctx, topk)


@dataclass
class StepStats:
    """What one ``update()`` sent and what the following ``build()`` will launch (host counts).

    Attributes
    ----------
    num_h2d_copies : int — host-to-device copies made by ``update()`` (1).
    h2d_bytes : int — bytes of that copy: step arrays, segment headers, block-table segments, overlays.
    table_bytes : int — of which block-table descriptors + payload entries.
    num_segments : int — segment descriptors (pieces) over every group.
    num_launches : int or None — kernel launches ``build()`` makes: 1 fused launch + one per channel the
        plan does not cover; None on the unfused path (several per channel).
    num_applies : int — device applies of segments made by ``update()`` itself (unfused path: one per
        group with segments; fused path: only for a previous step that was never built).
    """

    num_h2d_copies: int = 0
    h2d_bytes: int = 0
    table_bytes: int = 0
    num_segments: int = 0
    num_launches: Optional[int] = None
    num_applies: int = 0


class MetadataPipeline:
    """Persistent request rows + block tables per group + one builder per channel.

    Parameters
    ----------
    layout : DSV4Layout — groups and channels (``DSV4Layout.from_config``).
    max_num_reqs : int — request rows (capacity of every per-request buffer).
    max_num_batched_tokens : int — token capacity of every per-token buffer (padding included).
    device : str or torch.device.
    num_speculative_tokens : int — a request is a decode when it schedules at most ``1 + this`` tokens
        (one threshold for every channel).
    cp_world_size, cp_rank, cp_interleave : decode context parallelism (DESIGN §4); tables hold this
        rank's local blocks.
    fused : bool — build with one fused Triton launch (:mod:`dsv4_index.kernels.fused`) where the
        Triton backend is in use; False launches each channel's per-op kernels (same results).
    validate : bool — debug: run :func:`dsv4_index.validate.check_metadata` after every ``build()``
        (host copies; never in serving).
    """

    def __init__(self, layout, max_num_reqs: int, max_num_batched_tokens: int, device="cpu",
                 num_speculative_tokens: int = 0, *, cp_world_size: int = 1, cp_rank: int = 0,
                 cp_interleave: int = 1, fused: bool = True, validate: bool = False):
        for name, v, lo in (("max_num_reqs", max_num_reqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                            ("num_speculative_tokens", num_speculative_tokens, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        from ._common import check_cp
        check_cp(cp_world_size, cp_rank, cp_interleave,
                 min(g.alloc_block_size for g in layout.groups) if cp_world_size > 1 else None)
        self.layout = layout
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.cp = dict(cp_world_size=cp_world_size, cp_rank=cp_rank, cp_interleave=cp_interleave)
        self.validate = bool(validate)  # NOTE: debug only: check_metadata after every build (host syncs)

        self.tables = MultiGroupBlockTable(layout.groups, max_num_reqs, self.device)
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        R, G = max_num_reqs, len(layout.groups)
        # One staging buffer (pinned on CUDA), allocated once at capacity, copied with ONE H2D per step:
        #   query_start_loc [R+1] | seq_lens [R] | replay_start [R] | header [3 per gid] | per gid:
        #   descriptors + payload (block_table.py segment format), overlay [3 per batch row] or none.
        # NOTE: header of gid g = (pieces, first descriptor, overlay base or -1); the fused launch applies
        # the segments and reads staged entries through the overlay; the unfused path applies them here.
        self._hdr = 3 * R + 1
        self._fixed = self._hdr + 3 * G
        cap = self._fixed + 3 * R * G + self.tables.capacity_numel(self._PIECE)
        self._host = torch.zeros(cap, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._host_np[self._hdr + 2:self._fixed:3] = -1
        self._dev = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self._dev[self._hdr + 2:self._fixed:3] = -1
        self._async = pin
        self._event = None
        qsl, seq_lens, replay = self._dev[:R + 1], self._dev[R + 1:2 * R + 1], self._dev[2 * R + 1:3 * R + 1]
        T = max_num_batched_tokens
        self.positions = torch.zeros(T, dtype=torch.int64, device=self.device)
        self.token_to_req = torch.zeros(T, dtype=torch.int32, device=self.device)
        self.is_valid_token = torch.zeros(T, dtype=torch.bool, device=self.device)
        self._token_ids = torch.arange(T, dtype=torch.int64, device=self.device)

        self._ctx = BuildContext(
            layout=layout, device=self.device, max_num_reqs=R, max_num_tokens=T,
            num_speculative_tokens=num_speculative_tokens, cp_world_size=cp_world_size, cp_rank=cp_rank,
            cp_interleave=cp_interleave, query_start_loc=qsl, seq_lens=seq_lens, replay_start=replay,
            block_tables=tuple(self.tables[g.gid].device_table for g in layout.groups))
        self._builders = {name: builder_for(spec, layout) for name, spec in layout.channels.items()}
        for b in self._builders.values():
            b.allocate(self._ctx)
        # NOTE: the fused plan (one launch for the common tensors and every built-in channel it knows)
        # replaces the builders' own launches; channels it does not cover still launch their kernels.
        self._fused = None
        from ._common import use_triton
        if fused and use_triton(self.device):
            from .kernels.fused import MAX_GROUPS, FusedPlan, segment_header
            if G <= MAX_GROUPS:
                assert segment_header(R) == self._hdr
                self._fused = FusedPlan(self._ctx, self._builders, token_to_req=self.token_to_req,
                                        positions=self.positions, is_valid_token=self.is_valid_token,
                                        stage=self._dev)
        from .channels.base import ChannelBuilder
        self._views = None  # (key, channel views, common slices) of the last build
        self._views_cacheable = all(type(b).views.__module__ == "dsv4_index.channels.builtin"
                                    and type(b)._meta is ChannelBuilder._meta for b in self._builders.values())
        self._launches = (None if self._fused is None else
                          1 + sum(1 for n in self._builders if n not in self._fused.covered))

        # request state per row (numpy), decode-first batch in rows [0, B)
        self._row_of: Dict[str, int] = {}           # requests holding a row
        self._known: Dict[str, int] = {}            # preempted requests (id -> num_computed), may resume
        self._row_req: List[Optional[str]] = [None] * R
        self._occupied = np.zeros(R, dtype=bool)
        self._computed = np.zeros(R, dtype=np.int64)
        self._sched = np.zeros(R, dtype=np.int64)   # tokens scheduled this step per row
        self._replay = np.zeros(R, dtype=np.int64)  # replay_start of this step per row
        self._key = np.zeros(R, dtype=np.int8)
        self._width_arr = np.array([g.table_width for g in layout.groups], dtype=np.int64)
        self._bs_arr = np.array([g.block_size for g in layout.groups], dtype=np.int64)
        self._f_arr = np.array([g.blocks_per_kv_block for g in layout.groups], dtype=np.int64)
        self._rows_cache = None   # (req ids, int64 rows) of the last bulk step without new requests
        self._sched_plan = None   # (rows, scheduled tokens) of the step being applied, from _plan_step
        self._gmeta = [(g.block_size, g.table_width, g.blocks_per_kv_block, g.kind == "full") for g in layout.groups]
        self._batch: List[str] = []
        self._counts = dict(num_decodes=0, num_prefills=0, num_decode_tokens=0, num_prefill_tokens=0)
        self._pending: List[tuple] = []  # (gid, first descriptor, pieces, payload) staged, not yet applied
        self.last_step_stats = StepStats()
        self._updated = False

    _PIECE = 4096  # NOTE: a row's staged range is split into pieces of at most this many columns

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def _owned(self, n):
        W, r, I = self.cp["cp_world_size"], self.cp["cp_rank"], self.cp["cp_interleave"]
        if W == 1:
            return n
        return (n // (I * W)) * I + np.clip(n % (I * W) - r * I, 0, I)

    def _blocks_needed(self, group, seq_len: int) -> int:
        local = seq_len
        if self.cp["cp_world_size"] > 1:
            local = int(cp_owned_count(torch.tensor(seq_len), self.cp["cp_world_size"], self.cp["cp_rank"],
                                       self.cp["cp_interleave"]))
        return cdiv(local, group.block_size)

    def _num_computed(self, rid: str) -> int:
        return int(self._computed[self._row_of[rid]])

    def _check_step(self, step: StepInput):
        """Every check that can reject the step, before any state changes (ValueError).

        Returns the bulk plan of :meth:`_plan_step` when the step passes the bulk checks, else None
        after the one-by-one checks of :meth:`_check_step_slow` passed (they raise naming the culprit).
        """
        if not isinstance(step, StepInput):
            raise ValueError(f"step must be a StepInput, got {type(step).__name__}")
        if type(step).validate_static is StepInput.validate_static:
            summary = step._summary()
            if summary is not None:
                plan = self._plan_step(step, summary)
                if plan is not None:
                    return plan
        self._check_step_slow(step)
        return None

    def _plan_step(self, step: StepInput, sm):
        """Bulk checks (numpy over the scheduled requests); None when a check fails or the step needs
        the one-by-one path (resumed requests, ids past int32, appends past the table width).

        NOTE: a plan is returned only when every check of :meth:`_check_step_slow` would pass."""
        G = len(self._gmeta)
        row_of, known = self._row_of, self._known
        new, running = step.new_requests, step.running_requests
        if running and True in [r.resumed for r in running]:
            return None
        fin, pre = step.finished_req_ids, step.preempted_req_ids
        gone = set(fin) | set(pre) if fin or pre else ()
        n_live = len(row_of)
        for rid in gone:
            if rid in row_of:
                n_live -= 1
            elif rid not in known:
                return None
        S, n_new = len(sm.reqs), len(new)
        if S and sm.width != G:
            return None
        for rid in sm.rids[:n_new]:
            if (rid in row_of and rid not in gone) or rid in known and rid not in gone:
                return None
        rc = self._rows_cache
        if n_new or rc is None or rc[0] != sm.rids:
            rc = None
            rows_l = [row_of.get(rid, -1) for rid in sm.rids[n_new:]] if n_new else list(map(row_of.get, sm.rids))
            if None in rows_l or -1 in rows_l:
                return None
        n_live += n_new
        if n_live > self.max_num_reqs:
            return None
        nst = step.num_scheduled_tokens
        q = np.fromiter(nst.values(), dtype=np.int64, count=S)
        if int(q.sum()) > self.max_num_tokens:
            return None
        if rc is None:
            rows = np.full(S, -1, dtype=np.int64)
            rows[n_new:] = rows_l
            if not n_new:
                # NOTE: the same requests in the same order next step map to the same rows unless a row
                # moves (swap, drop, add): those clear the cache
                self._rows_cache = (sm.rids, rows)
        else:
            rows = rc[1]
        c = np.array(sm.ncs, dtype=np.int64)
        # scheduled-token counts in request order (nst may list them in another order)
        if list(nst) != sm.rids:
            q = np.fromiter(map(nst.__getitem__, sm.rids), dtype=np.int64, count=S)
        have = np.zeros((S, G), dtype=np.int64)
        run_rows = rows[n_new:]
        tables = self.tables.tables
        for gid, t in enumerate(tables):
            have[n_new:, gid] = t.num_blocks[run_rows]
        # appended entries of running requests (entry = one id of one per-gid list)
        nz, lens, flat = sm.nz, sm.lens, sm.flat
        f = self._f_arr
        entries = None
        if nz.size:
            have[nz] += lens * f
            if flat.size and int(flat.max()) > (np.iinfo(np.int32).max - int(f.max()) + 1) // int(f.max()):
                return None
            run = nz >= n_new
            if run.any():
                if bool((have[nz[run]] > self._width_arr).any()):
                    return None  # NOTE: appends past the table width: the slow path raises in append_row
                ln = lens.reshape(-1)
                e_list = np.repeat(np.arange(ln.size), ln)
                e_req, e_gid = nz[e_list // G], e_list % G
                if n_new:
                    keep = e_req >= n_new
                    e_req, e_gid, flat = e_req[keep], e_gid[keep], flat[keep]
                    lens = lens[run]
                e_rows = rows[e_req]
                lens_rows = rows[nz[run]]
                order = np.argsort(e_gid, kind="stable")  # NOTE: entries by gid, request order kept
                cut = np.cumsum(np.bincount(e_gid, minlength=G)).tolist()
                by_gid = flat[order]
                entries = []
                for gid, g in enumerate(self.layout.groups):
                    a, b = cut[gid - 1] if gid else 0, cut[gid]
                    if a == b:
                        continue
                    sel = lens[:, gid] > 0
                    r, ids = lens_rows[sel], by_gid[a:b]
                    entries.append((gid, r, lens[sel, gid], ids))
                    if g.kind != "full":
                        continue
                    # NOTE: duplicates against the blocks already in the row (full groups keep every block)
                    er, fg = e_rows[order[a:b]], int(f[gid])
                    nb = tables[gid].num_blocks[er].astype(np.int64) // fg
                    w = int(nb.max())
                    if w == 0:
                        continue
                    cols = np.arange(w)
                    old = tables[gid].np[er[:, None], cols * fg] // fg
                    if bool(((old == ids[:, None]) & (cols < nb[:, None]) & (ids != 0)[:, None]).any()):
                        return None
        local = self._owned(c + q)
        bs, width = self._bs_arr, self._width_arr
        need = -(-local[:, None] // bs[None, :])
        if bool(((need > width[None, :]) | ((q[:, None] > 0) & (need > have))).any()):
            return None
        for rid, rs in step.replay_start.items():
            # NOTE: statically checked already: scheduled, int, <= num_computed when it schedules tokens
            if nst[rid] == 0:
                return None
        self._sched_plan = (rows, q) if not n_new else None
        return rows, entries, sm.ncs

    def _check_step_slow(self, step: StepInput) -> None:
        """The checks one request at a time (names the culprit). Table capacity runs vectorized, and
        only a failing step re-runs it one by one."""
        if hasattr(step, "validate_static"):
            step.validate_static()
        G = len(self.layout.groups)
        row_of, known = self._row_of, self._known
        gone = set(step.finished_req_ids) | set(step.preempted_req_ids)
        for rid in gone:
            if rid not in row_of and rid not in known:
                raise ValueError(f"finished/preempted request {rid!r} is unknown to the pipeline")
        n_live = len(row_of) - sum(1 for rid in gone if rid in row_of)
        blocks: Dict[str, Sequence[int]] = {}   # rows (re)set by this step: kernel blocks per gid
        appended: Dict[str, Sequence] = {}      # running requests: appended block-id lists per gid
        computed: Dict[str, int] = {}
        for r in step.new_requests:
            rid = r.req_id
            if (rid in row_of and rid not in gone) or rid in known and rid not in gone:
                raise ValueError(f"new request {rid!r} is already known to the pipeline")
            if len(r.block_ids) != G:
                raise ValueError(f"new request {rid!r}: block_ids has {len(r.block_ids)} lists, "
                                 f"the layout has {G} groups")
            n_live += 1
            blocks[rid] = [len(b) * m[2] for b, m in zip(r.block_ids, self._gmeta)]
            computed[rid] = r.num_computed_tokens
        for r in step.running_requests:
            rid = r.req_id
            if len(r.new_block_ids) != G:
                raise ValueError(f"running request {rid!r}: new_block_ids has {len(r.new_block_ids)} "
                                 f"lists, the layout has {G} groups")
            if r.resumed:
                if rid not in known and rid not in row_of:
                    raise ValueError(f"resumed request {rid!r} is unknown to the pipeline")
                blocks[rid] = [len(b) * m[2] for b, m in zip(r.new_block_ids, self._gmeta)]
                if rid not in row_of or rid in gone:
                    n_live += 1
            else:
                if rid not in row_of or rid in gone:
                    raise ValueError(f"running request {rid!r} is unknown to the pipeline "
                                     "(never added, finished or preempted without resumed=True)")
                if any(r.new_block_ids):
                    appended[rid] = r.new_block_ids
                    self._check_duplicates(rid, r.new_block_ids)
            computed[rid] = r.num_computed_tokens
        if n_live > self.max_num_reqs:
            raise ValueError(f"the step holds {n_live} requests, max_num_reqs is {self.max_num_reqs}")
        nst = step.num_scheduled_tokens
        total = 0
        for rid, n in nst.items():
            if rid not in computed and (rid not in row_of or rid in gone):
                raise ValueError(f"num_scheduled_tokens names request {rid!r}, which is not in the batch")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"num_scheduled_tokens[{rid!r}] must be an int >= 0, got {n!r}")
            total += n
        if nst:
            self._check_capacity(nst, computed, blocks, appended)
        for rid, rs in step.replay_start.items():
            if rid not in nst:
                raise ValueError(f"replay_start names request {rid!r}, which schedules no tokens")
            c = computed[rid] if rid in computed else self._num_computed(rid)
            if not 0 <= rs <= c:
                raise ValueError(f"replay_start[{rid!r}] = {rs} must lie in [0, num_computed_tokens = {c}]")
        if total > self.max_num_tokens:
            raise ValueError(f"the step schedules {total} tokens, max_num_batched_tokens is {self.max_num_tokens}")

    def _check_duplicates(self, rid: str, new_block_ids) -> None:
        # NOTE: duplicates against the blocks already in the row; only full groups keep every
        # block — a sliding group's released (stale) entries may come back.
        row = self._row_of[rid]
        for g, new in zip(self.layout.groups, new_block_ids):
            if new and g.kind == "full":
                f = g.blocks_per_kv_block
                old = self._row_blocks(row, g)[::f] // f
                dup = np.intersect1d(np.asarray(new, dtype=np.int64), old)
                dup = dup[dup != 0]
                if dup.size:
                    raise ValueError(f"running request {rid!r}: block id {int(dup.min())} appears twice "
                                     f"in group {g.name!r}")

    def _check_capacity(self, nst, computed, blocks, appended) -> None:
        """Vectorized: every scheduled request fits the tables and has the blocks its tokens need."""
        rids = list(nst)
        S, G = len(rids), len(self._gmeta)
        q = np.fromiter(nst.values(), dtype=np.int64, count=S)
        c = np.fromiter((computed[r] if r in computed else self._computed[self._row_of[r]] for r in rids),
                        dtype=np.int64, count=S)
        rows = np.fromiter((-1 if r in blocks else self._row_of[r] for r in rids), dtype=np.int64, count=S)
        have = np.empty((S, G), dtype=np.int64)
        kept = rows >= 0
        for gid, t in enumerate(self.tables.tables):
            have[kept, gid] = t.num_blocks[rows[kept]]
        for i in np.flatnonzero(~kept):
            have[i] = blocks[rids[i]]
        if appended:
            index = {r: i for i, r in enumerate(rids)}
            for rid, lists in appended.items():
                if rid in index:
                    have[index[rid]] += [len(b) * m[2] for b, m in zip(lists, self._gmeta)]
        local = self._owned(c + q)
        bs = np.array([m[0] for m in self._gmeta], dtype=np.int64)
        width = np.array([m[1] for m in self._gmeta], dtype=np.int64)
        need = -(-local[:, None] // bs[None, :])
        bad = (need > width[None, :]) | ((q[:, None] > 0) & (need > have))
        if not bad.any():
            return
        i, gid = (int(x) for x in np.argwhere(bad)[0])
        g, rid, seq_len = self.layout.groups[gid], rids[i], int(c[i] + q[i])
        if need[i, gid] > g.table_width:
            raise ValueError(f"request {rid!r}: {seq_len} tokens need {int(need[i, gid])} blocks in group "
                             f"{g.name!r}, the table holds {g.table_width}")
        raise ValueError(f"request {rid!r}: block ids missing for gid {g.gid} ({g.name}): "
                         f"{seq_len} tokens need {int(need[i, gid])} blocks, the row has {int(have[i, gid])}")

    def _row_blocks(self, row: int, group) -> np.ndarray:
        return self.tables[group.gid].row(row)

    def update(self, step: StepInput, *, pad_to: Optional[int] = None) -> None:
        """Apply one scheduler step on the host and copy what changed to the device (ONE H2D copy:
        step arrays + the changed block-table column ranges of every group; see ``last_step_stats``).

        Parameters
        ----------
        step : StepInput
        pad_to : int, optional — pad the token count to this size (a CUDA-graph batch size); padded
            tokens are invalid (``-1`` slots and rows, ``0`` lengths).

        Raises ValueError on bad input; the pipeline state is then unchanged.
        """
        self._sched_plan = None
        plan = self._check_step(step)
        T = step.total_tokens if hasattr(step, "total_tokens") else sum(step.num_scheduled_tokens.values())
        Tp = T if pad_to is None else pad_to
        if isinstance(Tp, bool) or not isinstance(Tp, int) or not T <= Tp <= self.max_num_tokens:
            raise ValueError(f"pad_to must be an int in [{T}, {self.max_num_tokens}], got {pad_to!r}")
        self._drop_gone(step)
        if plan is None:
            self._apply_slow(step)
        else:
            self._apply_plan(step, plan)
        self._order_batch(step)
        self._fill_host(step, T, Tp)
        self._updated = True

    def _drop_gone(self, step: StepInput) -> None:
        tables, row_of, known = self.tables, self._row_of, self._known
        if step.finished_req_ids or step.preempted_req_ids:
            self._rows_cache = None
        preempted = step.preempted_req_ids
        for rid in (*step.finished_req_ids, *preempted):
            row = row_of.pop(rid, None)
            if row is not None:
                tables.clear_row(row)
                self._row_req[row] = None
                self._occupied[row] = False
            if rid in preempted:
                known[rid] = int(self._computed[row]) if row is not None else known.get(rid, 0)
            else:
                known.pop(rid, None)

    def _add_fresh(self, fresh) -> None:
        if fresh:
            self._rows_cache = None
            row_of, computed = self._row_of, self._computed
            free = np.flatnonzero(~self._occupied)[:len(fresh)].tolist()
            for row, (rid, ids, nc) in zip(free, fresh):
                self.tables.add_row(ids, row)
                self._row_req[row] = rid
                row_of[rid] = row
                computed[row] = nc
            self._occupied[free] = True

    def _apply_plan(self, step: StepInput, plan) -> None:
        """Bulk apply of a step checked by :meth:`_plan_step` (no resumed requests)."""
        rows, entries, ncs = plan
        n_new = len(step.new_requests)
        if rows.size > n_new:
            self._computed[rows[n_new:]] = ncs[n_new:]
        if entries is not None:
            tables = self.tables.tables
            for gid, r, counts, ids in entries:
                tables[gid]._append_rows(r, counts, ids)
        self._add_fresh([(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests])

    def _apply_slow(self, step: StepInput) -> None:
        self._rows_cache = self._sched_plan = None
        tables, row_of, known = self.tables, self._row_of, self._known
        fresh = [(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests]
        computed = self._computed
        for r in step.running_requests:
            if r.resumed:
                if r.req_id in row_of:
                    tables.add_row(r.new_block_ids, row_of[r.req_id])
                    computed[row_of[r.req_id]] = r.num_computed_tokens
                else:
                    fresh.append((r.req_id, r.new_block_ids, r.num_computed_tokens))
                known.pop(r.req_id, None)
            else:
                row = row_of[r.req_id]
                if any(r.new_block_ids):
                    tables.append_row(r.new_block_ids, row)
                computed[row] = r.num_computed_tokens
        self._add_fresh(fresh)

    def _swap(self, a: int, b: int) -> None:
        self._rows_cache = None
        self.tables.swap_row(a, b)
        rr = self._row_req
        ra, rb = rr[a], rr[b]
        rr[a], rr[b] = rb, ra
        if ra is not None:
            self._row_of[ra] = b
        if rb is not None:
            self._row_of[rb] = a
        for arr in (self._occupied, self._computed, self._sched, self._key):
            arr[a], arr[b] = arr[b], arr[a]

    def _order_batch(self, step: StepInput) -> None:
        """Decode-first batch order in rows ``[0, B)``: scheduled decodes, scheduled prefills, the rest.

        NOTE: rows already in their class's region stay; each misplaced row is swapped with one of its
        class from further down (no re-sort, no move when the order is unchanged; order inside a class
        is not preserved)."""
        nst = step.num_scheduled_tokens
        sched, key = self._sched, self._key
        sched[:] = 0
        if self._sched_plan is not None:
            rows, q = self._sched_plan
            sched[rows] = q
        elif nst:
            rows = np.fromiter(map(self._row_of.__getitem__, nst), dtype=np.int64, count=len(nst))
            sched[rows] = np.fromiter(nst.values(), dtype=np.int64, count=len(nst))
        threshold = 1 + self.num_speculative_tokens
        # key: 0 decode, 1 prefill, 2 held but not scheduled, 3 free
        np.copyto(key, np.where(self._occupied, np.where(sched == 0, 2, np.where(sched <= threshold, 0, 1)), 3))
        counts = np.bincount(key, minlength=4)
        lo = 0
        for cls in range(3):
            hi = lo + int(counts[cls])
            wrong = np.flatnonzero(key[lo:hi] != cls)
            if wrong.size:
                src = np.flatnonzero(key[hi:] == cls)[:wrong.size] + hi
                for a, b in zip((wrong + lo).tolist(), src.tolist()):
                    self._swap(a, b)
            lo = hi
        nd, npf = int(counts[0]), int(counts[1])
        self._batch = self._row_req[:nd + npf]
        self._counts = dict(num_decodes=nd, num_prefills=npf, num_decode_tokens=int(sched[:nd].sum()),
                            num_prefill_tokens=int(sched[nd:nd + npf].sum()))

    def _fill_host(self, step: StepInput, T: int, Tp: int) -> None:
        R = self.max_num_reqs
        B = len(self._batch)
        ctx = self._ctx
        stats = StepStats(num_h2d_copies=1, num_launches=self._launches)
        if self._pending:
            # NOTE: the previous step was staged but never built: apply it before its staging is reused
            self._apply_pending()
            stats.num_applies += 1
        if self._event is not None:
            if not self._event.query():  # NOTE: the previous H2D may still read the pinned buffer
                self._event.synchronize()
            self._event = None
        h = self._host_np
        qsl, seq_lens, replay = h[:R + 1], h[R + 1:2 * R + 1], h[2 * R + 1:3 * R + 1]
        q = self._sched[:B]
        qsl[0] = 0
        np.cumsum(q, out=qsl[1:B + 1]) if B else None
        qsl[B + 1:] = T                    # NOTE: rows past the batch are zero-length requests
        np.add(self._computed[:B], q, out=seq_lens[:B], casting="unsafe")
        seq_lens[B:] = 0
        rs = step.replay_start
        replay[:] = 0
        if rs:
            rows = np.fromiter((self._row_of[r] for r in rs), dtype=np.int64, count=len(rs))
            replay[rows] = np.fromiter(rs.values(), dtype=np.int64, count=len(rs))
            replay[B:] = 0
        # block-table segments of every group, each with its overlay of the batch rows
        off, hdr = self._fixed, self._hdr
        pending = []
        for gid, t in enumerate(self.tables.tables):
            k, end, rows, lo, n = t._pack(h, off, self._PIECE)
            if k == 0:
                h[hdr + 3 * gid: hdr + 3 * gid + 3] = (0, off, -1)
                continue
            p = end - off - SEGMENT_INTS * k
            pending.append((gid, off, k, p))
            stats.num_segments += k
            stats.table_bytes += 4 * (end - off)
            ov = -1
            nb = int(np.searchsorted(rows, B))  # NOTE: rows are ascending: rows[:nb] are batch rows
            if nb:
                ov = end
                o = h[end:end + 3 * B].reshape(B, 3)
                o[:] = 0
                sel = rows[:nb]
                o[sel, 0] = lo[:nb]
                o[sel, 1] = lo[:nb] + n[:nb]
                o[sel, 2] = (end - p) + (np.cumsum(n[:nb]) - n[:nb])
                end += 3 * B
            h[hdr + 3 * gid: hdr + 3 * gid + 3] = (k, off, ov)
            off = end
        used = off
        self._dev[:used].copy_(self._host[:used], non_blocking=self._async)
        if self._async:
            self._event = torch.cuda.Event()
            self._event.record()
        stats.h2d_bytes = 4 * used
        self._pending = pending
        if self._fused is None:
            stats.num_applies += len(pending)
            self._apply_pending()
        self.last_step_stats = stats
        ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded = B, T, Tp
        ctx.num_decodes = self._counts["num_decodes"]

    def _apply_pending(self) -> None:
        """Apply the staged segments with torch ops on the device (unfused path; no host sync)."""
        for gid, off, k, p in self._pending:
            apply_segments(self.tables[gid].device_table, self._dev, off, k, p)
        self._pending = []

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    def build(self) -> DSV4Metadata:
        """Fill every channel's buffers for the step given to the last :meth:`update` (no host sync).

        On the fused path the one launch also applies the step's block-table segments (idempotent: a
        second build of the same step, or a CUDA-graph replay, writes the same entries)."""
        if not self._updated:
            raise RuntimeError("build() needs a prior update(step)")
        ctx = self._ctx
        ctx.new_step()
        B, T, Tp = ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded
        qsl, seq_lens = ctx.query_start_loc, ctx.seq_lens
        covered = ()
        if self._fused is not None:
            self._fused.launch(ctx)
            self._pending = []
            covered = self._fused.covered
        else:
            self._build_common()
        for name, builder in self._builders.items():
            if name not in covered:
                builder.launch(ctx)
        key = (B, Tp, ctx.num_decodes)
        views = self._views if self._views is not None and self._views[0] == key else None
        if views is None:
            # NOTE: built-in views depend on (B, Tp, num_decodes) only: reuse them while those repeat
            channels = {name: builder.views(ctx) for name, builder in self._builders.items()}
            views = (key, channels, qsl[:B + 1], seq_lens[:B], self.positions[:Tp], self.token_to_req[:Tp],
                     self.is_valid_token[:Tp], [bt[:B] for bt in ctx.block_tables])
            if self._views_cacheable:
                self._views = views
        _, channels, q_v, s_v, pos, ttr, valid, bts = views
        meta = DSV4Metadata(
            num_reqs=B, num_tokens=T, num_tokens_padded=Tp, req_ids=list(self._batch), **self._counts,
            query_start_loc=q_v, seq_lens=s_v, positions=pos, token_to_req=ttr,
            is_valid_token=valid, block_tables=list(bts), channels=dict(channels), _pipeline=self)
        if self.validate:
            from .validate import check_metadata
            check_metadata(meta)
        return meta

    def _build_common(self) -> None:
        """Unfused path: token -> request, validity and positions (a few small launches)."""
        from . import token_to_req as token_to_req_op
        ctx = self._ctx
        Tp = ctx.num_tokens_padded
        qsl, seq_lens = ctx.query_start_loc, ctx.seq_lens
        ttr = token_to_req_op(qsl, Tp, out=self.token_to_req[:Tp])
        t = self._token_ids[:Tp]
        valid = torch.lt(t, qsl[-1].to(torch.int64), out=self.is_valid_token[:Tp])
        b = ttr.long()
        pos = self.positions[:Tp]
        torch.add(seq_lens[b].long() - qsl[b + 1].long(), t, out=pos)
        pos.masked_fill_(~valid, 0)

    def warmup(self) -> None:
        """Run one empty build and one top-k conversion per channel that has one (int32 ``[1, index_topk]``
        of ``-1``), so every kernel the pipeline uses is compiled before serving."""
        saved = (self._updated, self._ctx.num_reqs, self._ctx.num_tokens, self._ctx.num_tokens_padded,
                 self._pending)
        head = self._dev[:self._fixed]
        saved_dev = head.clone()
        head.zero_()
        head[self._hdr + 2::3] = -1  # NOTE: no segments, no overlay
        ctx = self._ctx
        ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded = 0, 0, 1
        self._updated = True
        self.build()
        # NOTE: top-k conversion kernels too (one [1, index_topk] int32 call each), so that a trace after
        # warmup compiles nothing new
        from .channels.base import ChannelBuilder
        k_default = max(1, int(getattr(self.layout, "index_topk", 0) or 1))
        for b in self._builders.values():
            if type(b).topk_to_slots is not ChannelBuilder.topk_to_slots:
                K = int(getattr(b, "k_capacity", k_default))
                b.topk_to_slots(ctx, torch.full((1, K), -1, dtype=torch.int32, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        head.copy_(saved_dev)
        self._updated, ctx.num_reqs, ctx.num_tokens, ctx.num_tokens_padded, self._pending = saved

    # convenience
    @property
    def req_ids(self) -> List[str]:
        return list(self._batch)

    def row_of(self, req_id: str) -> int:
        return self._row_of[req_id]
