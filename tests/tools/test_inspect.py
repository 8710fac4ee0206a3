"""The step picture (dsv4_index.tools.plot, ``python -m dsv4_index inspect``) for the tiny and V4-Flash layouts."""

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")

from dsv4_index.tools.cli import main  # noqa: E402
from dsv4_index.tools.plot import EMPTY, STALE, WINDOW, WRITTEN, _occupancy, draw_step, sample_step  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), len(data)


@pytest.mark.slow  # ./dev quick skips it
def test_tiny_step_picture(tmp_path):
    pipe, meta = sample_step("tiny")
    assert meta.num_reqs == 6 and meta.num_decodes >= 3 and meta.num_prefills >= 1
    out = draw_step(meta, tmp_path / "sub" / "tiny.png", requests=[0, meta.num_reqs - 1])
    w, h, n = png_size(tmp_path / "sub" / "tiny.png")
    assert out.endswith("tiny.png") and w > 1500 and h > 1000 and n > 50_000, (w, h, n)


@pytest.mark.slow  # ./dev quick skips it
def test_flash_step_picture_cli(tmp_path, capsys):
    out = tmp_path / "flash.png"
    assert main(["inspect", "--config", "flash", "--requests", "200", "--out", str(out)]) == 0
    assert "flash: 200 requests" in capsys.readouterr().out
    w, h, n = png_size(out)
    assert w > 1500 and h > 1500 and n > 150_000, (w, h, n)


def test_occupancy_categories():
    """Independent of the drawing: the categories of the tiny step's tables, from its host counts."""
    pipe, meta = sample_step("tiny", seed=1)
    qsl, seq = meta.host_query_start_loc, meta.host_seq_lens
    for g in meta.layout.groups:
        cat, head, ids = _occupancy(meta, g, qsl, seq, 64)
        last = (seq - 1) // g.block_size
        if g.kind == "full":
            held = (cat != EMPTY).sum(1)
            assert np.array_equal(held, last + 1), (g.name, held, last)
            assert (ids[cat != EMPTY] > 0).all()       # every held block has a real id
        elif g.ring:
            ring = meta.ring_cols[g.gid]
            assert np.array_equal(head, last % ring)
            assert (cat[np.arange(len(head)), head] == WRITTEN).all()   # the newest block is written
            assert ((cat == WINDOW) | (cat == WRITTEN)).any(1).all() and (cat == STALE).any()


def test_requests_argument(tmp_path):
    pipe, meta = sample_step("tiny")
    with pytest.raises(ValueError, match="requests"):
        draw_step(meta, tmp_path / "x.png", requests=[99])


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    import sys
    pipe, meta = sample_step("tiny")
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # NOTE: `import matplotlib` now raises ImportError
    with pytest.raises(ImportError, match=r"dsv4-index\[plot\]"):
        draw_step(meta, tmp_path / "x.png")
