import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from dsv4_index.block_table import BlockTable, MultiGroupBlockTable
from dsv4_index.geometry import DSV4Layout
from dsv4_index.state import StepStaging


def sent(n: int, groups: int = 1) -> int:
    """Bytes an upload of ``n`` changed entries copies: the staging format of ``state/staging.py`` for
    ``T_pad = 0`` (header 8, five per-row regions of 2 and ``tok_row`` of 1, the overlay of 3 per
    group), then ``n`` values and ``n`` destinations; nothing when nothing changed."""
    return 4 * (8 + 5 * 2 + 1 + 3 * groups + 2 * n) if n else 0


class Model:
    """Plain-Python block table: rows of kernel-block ids + the changed column range of each row."""

    def __init__(self, n, width, f):
        self.rows = [[] for _ in range(n)]
        self.width, self.f = width, f
        self.ranges = {}  # row -> (lo, hi), non-empty ranges only

    @property
    def dirty(self):
        return set(self.ranges)

    def expand(self, ids):
        return [b * self.f + j for b in ids for j in range(self.f)]

    def _prefix(self, r):
        self.ranges.pop(r, None)
        if self.rows[r]:
            self.ranges[r] = (0, len(self.rows[r]))

    def add(self, ids, r):
        ids = self.expand(ids)
        if len(ids) > self.width:
            return False
        self.rows[r] = ids
        self._prefix(r)
        return True

    def append(self, ids, r):
        ids = self.expand(ids)
        if len(self.rows[r]) + len(ids) > self.width:
            return False
        if ids:
            old = len(self.rows[r])
            self.rows[r] = self.rows[r] + ids
            lo = self.ranges[r][0] if r in self.ranges else old
            self.ranges[r] = (lo, len(self.rows[r]))
        return True

    def clear(self, r):
        self.rows[r] = []
        self.ranges.pop(r, None)

    def move(self, s, d):
        if s != d:
            self.rows[d] = list(self.rows[s])
            self._prefix(d)

    def swap(self, a, b):
        if a != b:
            self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            self._prefix(a)
            self._prefix(b)

    def upload_bytes(self):
        """The changed entries only (as (value, destination) pairs in the staging format)."""
        return sent(sum(hi - lo for lo, hi in self.ranges.values()))


def check_host(t, model):
    for r, row in enumerate(model.rows):
        assert t.num_blocks[r] == len(row)
        assert t.np[r, : len(row)].tolist() == row
        assert t.row(r).tolist() == row


N = 5
ops = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 1000), max_size=6), st.integers(0, N - 1)),
    st.tuples(st.just("append"), st.lists(st.integers(0, 1000), max_size=3), st.integers(0, N - 1)),
    st.tuples(st.just("clear"), st.integers(0, N - 1)),
    st.tuples(st.just("move"), st.integers(0, N - 1), st.integers(0, N - 1)),
    st.tuples(st.just("swap"), st.integers(0, N - 1), st.integers(0, N - 1)),
    st.tuples(st.just("upload")),
)


@given(f=st.sampled_from([1, 2, 3]), width=st.integers(1, 9), seq=st.lists(ops, max_size=30))
def test_row_ops_match_model(f, width, seq):
    t = BlockTable(N, width, device="cpu", block_size=16, blocks_per_kv_block=f)
    m = Model(N, width, f)
    t.device_table.fill_(-7)  # poison: columns never sent must stay -7
    sent = [set() for _ in range(N)]
    for op in seq:
        name, args = op[0], op[1:]
        if name in ("add", "append"):
            ok = getattr(m, name)(*args)
            if ok:
                getattr(t, f"{name}_row")(*args)
            else:
                before = t.np.copy(), t.num_blocks.copy()
                with pytest.raises(ValueError, match=f"row {args[1]}"):
                    getattr(t, f"{name}_row")(*args)
                assert np.array_equal(t.np, before[0]) and np.array_equal(t.num_blocks, before[1])
        elif name == "upload":
            nbytes = t.upload()
            assert nbytes == m.upload_bytes()  # only the changed column ranges travel
            for r, (lo, hi) in m.ranges.items():
                sent[r] |= set(range(lo, hi))
            m.ranges = {}
            for r in range(N):
                n = len(m.rows[r])
                assert t.device_table[r, :n].tolist() == m.rows[r]  # the valid prefix is current
                for c in range(width):
                    if c not in sent[r]:
                        assert int(t.device_table[r, c]) == -7
        else:
            getattr(m, name)(*args)
            getattr(t, f"{name}_row")(*args)
        check_host(t, m)
        assert t.num_dirty == len(m.dirty)


def test_upload_moves_only_changed_rows():
    t = BlockTable(6, 4, device="cpu", block_size=64)
    for r in range(6):
        t.add_row([r + 1, r + 10], r)
    assert t.upload() == sent(6 * 2)  # 6 rows of 2 entries
    assert torch.equal(t.device_table[:, :2], t.host[:, :2])
    assert t.upload() == 0
    t.device_table.fill_(-3)
    t.append_row([99], 2)
    t.swap_row(4, 5)
    t.clear_row(1)  # length only; nothing to send
    t.append_row([], 0)  # no-op
    # row 2: only the appended column; rows 4, 5: their 2-entry prefixes
    assert t.upload() == sent(1 + 2 * 2)
    for r in range(6):
        if r in (4, 5):
            assert torch.equal(t.device_table[r, :2], t.host[r, :2])
            assert bool((t.device_table[r, 2:] == -3).all())
        elif r == 2:
            assert t.device_table[2].tolist() == [-3, -3, 99, -3]
        else:
            assert bool((t.device_table[r] == -3).all())
    assert t.np[2, :3].tolist() == [3, 12, 99]
    assert t.np[4, :2].tolist() == [6, 15] and t.np[5, :2].tolist() == [5, 14]


def test_hybrid_expansion():
    t = BlockTable(2, 8, device="cpu", block_size=64, blocks_per_kv_block=4)
    t.add_row([5], 0)
    t.append_row([0], 0)
    assert t.row(0).tolist() == [20, 21, 22, 23, 0, 1, 2, 3]
    assert t.num_blocks[0] == 8
    with pytest.raises(ValueError, match="row 0"):
        t.append_row([1], 0)
    with pytest.raises(ValueError, match="row 1"):
        t.add_row([1, 2, 3], 1)
    t.upload()
    assert torch.equal(t.device_table, t.host)


def test_errors():
    t = BlockTable(3, 4, device="cpu", block_size=16)
    with pytest.raises(ValueError, match="row"):
        t.add_row([1], 3)
    with pytest.raises(ValueError, match="src"):
        t.move_row(-1, 0)
    with pytest.raises(ValueError, match="b must"):
        t.swap_row(0, 7)
    with pytest.raises(ValueError, match="block_ids"):
        t.add_row([-1], 0)
    with pytest.raises(ValueError, match="block_ids"):
        BlockTable(1, 2, device="cpu", block_size=16, blocks_per_kv_block=4).add_row([2 ** 30], 0)
    for kw, name in [(dict(max_num_reqs=0), "max_num_reqs"), (dict(width=0), "width"),
                     (dict(blocks_per_kv_block=0), "blocks_per_kv_block")]:
        args = dict(max_num_reqs=2, width=2, blocks_per_kv_block=1)
        args.update(kw)
        with pytest.raises(ValueError, match=name):
            BlockTable(args["max_num_reqs"], args["width"], device="cpu", block_size=16,
                       blocks_per_kv_block=args["blocks_per_kv_block"])


def test_multi_group_one_copy(monkeypatch):
    lay = DSV4Layout.from_config(
        {"num_hidden_layers": 2, "num_nextn_predict_layers": 0, "compress_ratios": [4, 16],
         "sliding_window": 8, "index_topk": 4}, 200, mla_block_size=64, swa_block_size=16,
        c4_state_block_size=4, c128_state_block_size=8, kernel_block_size=32)
    m = MultiGroupBlockTable(lay, 3, "cpu")
    assert len(m) == 4 and [t.width for t in m.tables] == [g.table_width for g in lay.groups]
    assert m[0].blocks_per_kv_block == 2 and m[1].blocks_per_kv_block == 1
    copies = []
    orig = StepStaging.copy
    monkeypatch.setattr(StepStaging, "copy", lambda self, n: (copies.append(n), orig(self, n)))
    m.add_row([[1, 2], [3], [4, 5], [6]], 0)
    m.add_row([[7], [], [8], []], 2)
    for t in m.tables:
        t.device_table.fill_(-9)
    nbytes = m.upload()
    assert copies == [nbytes // 4]
    # kernel-block entries per gid (f = 2 on gid 0): rows 0 / 2 = [4, 1, 2, 1] / [2, 0, 1, 0]
    assert nbytes == sent((4 + 1 + 2 + 1) + (2 + 1), groups=4)  # 6 non-empty rows over the 4 gids
    assert m[0].row(0).tolist() == [2, 3, 4, 5] and m[2].row(2).tolist() == [8]
    for t in m.tables:
        for r in (0, 2):
            n = int(t.num_blocks[r])
            assert torch.equal(t.device_table[r, :n], t.host[r, :n])
            assert bool((t.device_table[r, n:] == -9).all())
        assert bool((t.device_table[1] == -9).all())
    m.swap_row(0, 1)
    m.append_row([[9], [], [], []], 1)
    m.clear_row(2)
    m.move_row(1, 2)
    # row 0 is empty after the swap; rows 1 and 2 send their whole valid prefixes (6 + 1 + 2 + 1)
    assert m.upload() == sent(2 * (6 + 1 + 2 + 1), groups=4)
    assert len(copies) == 2 and m.upload() == 0
    for t in m.tables:
        for r in range(3):
            n = int(t.num_blocks[r])
            assert torch.equal(t.device_table[r, :n], t.host[r, :n])
        assert t.row(1).tolist() == t.row(2).tolist()
    assert m[0].row(2).tolist() == [2, 3, 4, 5, 18, 19]
    with pytest.raises(ValueError, match="per-gid"):
        m.add_row([[1]], 0)


def test_multi_group_from_tuples():
    m = MultiGroupBlockTable([(4, 16, 1), (3, 8)], 2, "cpu")
    assert [t.width for t in m.tables] == [4, 3] and m[1].block_size == 8
    with pytest.raises(ValueError, match="groups"):
        MultiGroupBlockTable([(4,)], 2, "cpu")
    with pytest.raises(ValueError, match="groups"):
        MultiGroupBlockTable([], 2, "cpu")


@pytest.mark.gpu
def test_cuda_pinned_upload():
    t = BlockTable(64, 32, device="cuda", block_size=64, blocks_per_kv_block=2)
    assert t.device_table.is_cuda
    rng = np.random.default_rng(0)
    for _step in range(20):
        for r in rng.choice(64, size=5, replace=False):
            t.add_row(rng.integers(1, 10_000, size=rng.integers(0, 17)).tolist(), int(r))
        t.swap_row(int(rng.integers(64)), int(rng.integers(64)))
        t.upload()
    assert t.staging.async_copy and t.staging.host[0].is_pinned()  # NOTE: the transfer buffers are pinned
    torch.cuda.synchronize()
    dev = t.device_table.cpu()
    for r in range(64):
        n = int(t.num_blocks[r])
        assert torch.equal(dev[r, :n], t.host[r, :n])


def test_upload_sends_only_new_columns_of_wide_rows():
    """A decode-like append to a very wide row moves one entry, not the row."""
    t = BlockTable(8, 32768, device="cpu", block_size=4)
    for r in range(8):
        t.add_row(list(range(1 + r, 1 + r + 100)), r)
    assert t.upload() == sent(8 * 100)
    for r in (1, 5, 6):
        t.append_row([7000 + r], r)
    t.append_row([8000], 5)  # two appends to one row: one segment of 2 entries
    assert t.upload() == sent(1 * 2 + 2)
    for r in range(8):
        n = int(t.num_blocks[r])
        assert torch.equal(t.device_table[r, :n], t.host[r, :n])
    assert t.device_table[5, 100:102].tolist() == [7005, 8000]


def test_swap_and_clear_send_valid_prefixes_only():
    t = BlockTable(3, 1000, device="cpu", block_size=4)
    t.add_row(list(range(1, 501)), 0)
    t.add_row([7, 8], 1)
    t.upload()
    t.swap_row(0, 1)
    t.clear_row(2)
    assert t.upload() == sent(2 + 500)
    assert t.device_table[0, :2].tolist() == [7, 8] and t.device_table[1, :500].tolist() == list(range(1, 501))


@pytest.mark.parametrize("f", [1, 2])
def test_append_rows_matches_append_row(f):
    rng = np.random.default_rng(f)
    a = BlockTable(6, 24, device="cpu", block_size=4, blocks_per_kv_block=f)
    b = BlockTable(6, 24, device="cpu", block_size=4, blocks_per_kv_block=f)
    for t in (a, b):
        t.add_row([7], 0)
        t.add_row([1, 2], 3)
        t._clean()
        t.append_row([9], 3)  # a dirty range before the bulk append: the hull must cover it
    nxt = 100
    for _ in range(6):
        rows = rng.permutation(6)[:rng.integers(0, 5)]
        counts = rng.integers(0, 3, size=rows.size)
        ids = np.arange(nxt, nxt + counts.sum())
        nxt += int(counts.sum())
        a.append_rows(rows, counts, ids)
        for r, c, s in zip(rows.tolist(), counts.tolist(), (np.cumsum(counts) - counts).tolist(), strict=True):
            b.append_row(ids[s:s + c].tolist(), r)
        assert np.array_equal(a.num_blocks, b.num_blocks)
        assert np.array_equal(a.dirty_lo, b.dirty_lo) and np.array_equal(a.dirty_hi, b.dirty_hi)
        for r in range(6):
            assert np.array_equal(a.row(r), b.row(r))


def test_append_rows_errors_write_nothing():
    t = BlockTable(4, 3, device="cpu", block_size=4)
    t.add_row([1, 2], 0)
    before = (t.np.copy(), t.num_blocks.copy(), t.dirty_hi.copy())
    for args, match in [(([0, 0], [1, 1], [5, 6]), "rows"), (([4], [1], [5]), "rows"),
                        (([1], [2], [5]), "counts"), (([1], [-1], []), "counts"),
                        (([1], [1], [-5]), "block_ids"), (([1], [1], [2 ** 31]), "block_ids"),
                        (([1, 0], [1, 2], [5, 6, 7]), "width")]:
        with pytest.raises(ValueError, match=match):
            t.append_rows(*args)
        assert all(np.array_equal(x, y) for x, y in zip(before, (t.np, t.num_blocks, t.dirty_hi), strict=True))


def test_the_facade_stores_in_the_state_tables():
    """One implementation: every group's device table is a view of one flat buffer, and an upload is
    one staged copy of (value, destination) pairs applied on the device by the state staging."""
    m = MultiGroupBlockTable([(4, 16, 1), (3, 8, 2)], 3, "cpu")
    ptrs = {t.device_table.untyped_storage().data_ptr() for t in m.tables}
    assert len(ptrs) == 1
    m.add_row([[1, 2], [5]], 1)
    assert m.upload() == sent(2 + 2, groups=2)
    assert isinstance(m[0].staging, StepStaging) and m[0].staging is m[1].staging
    assert m[0].device_table[1, :2].tolist() == [1, 2] and m[1].device_table[1, :2].tolist() == [10, 11]
    assert m[0].staging.pending_writes == 0  # NOTE: applied by the upload itself


@pytest.mark.parametrize("f", [1, 2, 3])
def test_block_id_bound_is_the_write_runs_bound(f):
    """The largest allocation id whose kernel-block ids fit int32, ``(2**31 - 1 - (f - 1)) // f``, is
    accepted by every entry point; one more is refused and nothing is written."""
    top = (2 ** 31 - 1 - (f - 1)) // f
    t = BlockTable(2, 8, device="cpu", block_size=4, blocks_per_kv_block=f)
    t.add_row([top], 0)
    t.append_rows([1], [1], [top])
    assert t.row(0).tolist() == t.row(1).tolist() == [top * f + j for j in range(f)]
    assert int(t.row(0)[-1]) <= 2 ** 31 - 1 < (top + 1) * f + f - 1  # the next id's last kernel block would not
    before = (t.np.copy(), t.num_blocks.copy())
    for op in (lambda: t.add_row([top + 1], 0), lambda: t.add_row(np.array([top + 1]), 0),
               lambda: t.append_row([top + 1], 1), lambda: t.append_rows([1], [1], [top + 1])):
        with pytest.raises(ValueError, match="block_ids"):
            op()
        assert np.array_equal(t.np, before[0]) and np.array_equal(t.num_blocks, before[1])


@pytest.mark.parametrize("f", [1, 2, 4])
def test_rows_are_the_state_expansion_at_the_state_destinations(f):
    """What an upload stores equals ``BlockTables.expand`` of the allocation ids, at the flat
    offsets of the row's first columns (DESIGN §4: ``base + slot * cols + column``)."""
    rng = np.random.default_rng(f)
    m = MultiGroupBlockTable([(12, 16, 1), (12, 8, f)], 5, "cpu")
    t, store = m[1], m[1]._upload.store
    ids = {r: rng.integers(0, 10 ** 6, size=int(rng.integers(1, 12 // f + 1))) for r in (0, 2, 4)}
    for r, x in ids.items():
        t.add_row(x.tolist(), r)
    m.upload()
    flat = store.flat.numpy()
    for r, x in ids.items():
        gid = np.ones(1, dtype=np.int64)
        _, cu, want = store.expand(gid, np.zeros(1, dtype=np.int64), np.array([0, x.size]), x.astype(np.int64))
        dst = store.base[1] + r * store.cols[1] + np.arange(int(cu[-1]))  # NOTE: a plain table: columns 0..n-1
        assert flat[dst].tolist() == want.tolist() == t.row(r).tolist()
