"""DESIGN §4 in plain Python, independent of the package's builders and references: the expected outputs of one
scheduled request from its block lists and positions (:func:`expected_rows`), and the check of a built step
against them row by row (:func:`check_rows`)."""

from __future__ import annotations

from types import SimpleNamespace


def _slot(bt, x, rows):
    b = x // rows
    return bt[b] * rows + x % rows if b < len(bt) else -1


def expected_rows(layout, view, next_n, q_start=0):
    """Plain-Python DESIGN §4 for one scheduled request: {channel: {field: list per token}}.
    ``q_start``: the request's first token row (circular windows read in-step rows ``-2 - row``)."""
    out = {}
    for name, ch in layout.channels.items():
        g = layout.groups[ch.gid]
        bt = view.block_ids[ch.gid]
        if g.kind == "circular":  # NOTE: one block of `capacity` rows, written as a ring
            assert len(bt) == 1

            def slot(q, bt=bt, cap=g.block_size):
                return bt[0] * cap + q % cap
        else:
            def slot(q, bt=bt, bs=g.block_size):
                return _slot(bt, q, bs)
        replayed = g.prefix_cacheable  # NOTE: replayed tokens write nothing into prefix-cacheable groups
        rows = {}
        for p in view.positions:
            if ch.compress_ratio == 1:  # raw-token window channel
                lo = max(p - ch.window + 1, view.replay_start)
                s0 = view.num_computed_tokens
                win = [-2 - (q_start + q - s0) if g.kind == "circular" and q >= s0 else slot(q)
                       for q in range(lo, p + 1)]
                width = ch.index_width
                rows.setdefault("slot_mapping", []).append(-1 if replayed and p < view.replay_end else slot(p))
                if g.kind == "circular":  # NOTE: the write plan: the chunk's last `capacity` tokens
                    rows.setdefault("tail_slot_mapping", []).append(slot(p) if p >= view.seq_len - g.block_size
                                                                    else -1)
                rows.setdefault("indices", []).append(win + [-1] * (width - len(win)))
                rows.setdefault("lens", []).append(len(win))
                continue
            R, S = ch.compress_ratio, ch.rows_per_block
            n_c = (p + 1) // R
            done = (p + 1) % R == 0 and not (replayed and p < view.replay_end)
            rows.setdefault("compressed_slot_mapping", []).append(_slot(bt, p // R, S) if done else -1)
            if "ks" in ch.outputs:
                rows.setdefault("lens", []).append(n_c)
            if "indices" in ch.outputs:
                width = ch.index_width
                assert n_c <= width  # NOTE: widths come from capacity; rows are never cut
                ids = [_slot(bt, j, S) for j in range(n_c)]
                rows.setdefault("indices", []).append(ids + [-1] * (width - len(ids)))
                if "ks" not in ch.outputs:
                    rows.setdefault("lens", []).append(len(ids))
        out[name] = rows
    return out


def request_view(block_ids, num_computed: int, num_scheduled: int, replay_start: int = 0, replay_end: int = 0,
                 req_id=None):
    """What :func:`expected_rows` reads of one request: its block list per gid (logical order), its positions."""
    return SimpleNamespace(req_id=req_id, block_ids=block_ids, num_computed_tokens=num_computed,
                           num_scheduled_tokens=num_scheduled, seq_len=num_computed + num_scheduled,
                           positions=range(num_computed, num_computed + num_scheduled), replay_start=replay_start,
                           replay_end=replay_end)


def check_rows(layout, meta, views, next_n: int) -> None:
    """Every channel output of ``meta`` (host copies) equals :func:`expected_rows` of ``views[b]`` (batch row
    ``b``'s request), decode rows first; the indexer's ``ks`` / ``ke`` / ``cu`` are the running sums of the rows'
    compressed lengths; padded tokens hold the sentinels."""
    qsl = meta.query_start_loc.cpu().tolist()
    q = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
    assert q == [v.num_scheduled_tokens for v in views]
    assert all(x <= next_n for x in q[:meta.num_decodes]) and all(x > next_n for x in q[meta.num_decodes:])
    assert meta.positions.cpu().tolist()[:meta.num_tokens] == [p for v in views for p in v.positions]
    chans = {n: {f: getattr(meta[n], f).cpu().tolist() for f in
                 ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "indices", "lens", "ks", "ke", "cu")
                 if getattr(meta[n], f) is not None} for n in meta.channels}
    cu = {n: 0 for n in chans}
    for b, v in enumerate(views):
        lo, hi = qsl[b], qsl[b + 1]
        for name, fields in expected_rows(layout, v, next_n, lo).items():
            for field, rows in fields.items():
                assert chans[name][field][lo:hi] == rows, f"{name}.{field} of batch row {b}"
            if "ks" in chans[name]:
                R = layout.channels[name].compress_ratio
                assert chans[name]["ks"][lo:hi] == [cu[name]] * (hi - lo), (name, b)
                assert chans[name]["ke"][lo:hi] == [cu[name] + (p + 1) // R for p in v.positions], (name, b)
                assert chans[name]["cu"][b] == cu[name], (name, b)
                cu[name] += v.seq_len // R
    T, Tp = meta.num_tokens, meta.num_tokens_padded
    for name, fields in chans.items():
        for field, vals in fields.items():
            if field in ("ks", "ke", "cu"):
                continue
            for t in range(T, Tp):
                sentinel = 0 if field == "lens" else -1
                row = vals[t] if isinstance(vals[t], list) else [vals[t]]
                assert all(x == sentinel for x in row), f"padded token {t} {name}.{field}"
