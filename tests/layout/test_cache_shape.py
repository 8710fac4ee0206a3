"""``layout.cache_shape(channel, num_blocks)`` (issue 40 item 4): rows ``num_blocks * rows_per_block`` (the slot ids'
range), the group, and a dtype note per kind of channel."""

from __future__ import annotations

import pytest

from dsv4_index import DSV4Layout


def test_flash_cache_shapes():
    lay = DSV4Layout.from_config("flash", 4096)
    # NOTE: rows per block by hand from the flash config: mla blocks of 256 tokens hold 256 / 4 = 64 c4 rows and
    # 256 / 128 = 2 c128 rows; swa blocks of 64 tokens; the state groups' blocks of 4 and 8 rows
    want = {"c4a": 64, "c4i": 64, "c128a": 2, "swa": 64, "c4_state": 4, "c128_state": 8}
    for name, rpb in want.items():
        s = lay.cache_shape(name, 10)
        assert (s.shape, s.rows, s.rows_per_block, s.num_blocks) == ((10, rpb), 10 * rpb, rpb, 10), name
        assert s.gid == lay.channels[name].gid
    assert "FP8" in lay.cache_shape("swa", 1).note and "132 bytes" in lay.cache_shape("c4i", 1).note
    assert "float32, never FP8" in lay.cache_shape("c128_state", 1).note


def test_every_slot_is_a_row():
    """The largest slot id of a block list equals rows - 1 of the cache of that many blocks."""
    lay = DSV4Layout.from_config("tiny", 256, mla_block_size=32, swa_block_size=4)
    for name, c in lay.channels.items():
        s = lay.cache_shape(name, 7)
        assert (7 - 1) * c.rows_per_block + (c.rows_per_block - 1) == s.rows - 1


def test_v41_ratio_one_and_two_channels():
    lay = DSV4Layout.from_config("v41_flash", 4096)
    for name, c in lay.channels.items():
        s = lay.cache_shape(name, 3)
        assert s.rows == 3 * c.rows_per_block and "user-registered" not in s.note, name


def test_refusals():
    lay = DSV4Layout.from_config("tiny", 256)
    with pytest.raises(ValueError, match=r"channel must be one of \[.*'swa'.*\], got 'kv'"):
        lay.cache_shape("kv", 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises((ValueError, TypeError), match="num_blocks"):
            lay.cache_shape("swa", bad)
