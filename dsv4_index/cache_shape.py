"""How big each channel's cache is (issue 40 item 4): :func:`cache_shape` (``DSV4Layout.cache_shape``).

The library owns no cache: it builds slot ids ``block * rows_per_block + offset`` into a cache the engine
allocates. A channel's cache of ``num_blocks`` blocks (the engine's blocks of the channel's group) therefore
has ``num_blocks * rows_per_block`` rows, row ``s`` for slot ``s``; what a row holds (its dtype and bytes) is
the engine's choice. The notes say what vLLM 0.33's DeepSeek-V4 modules declare (the spec arguments of
``tests/layout/make_vllm_fixtures.py``), for an engine that wants the same format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from ._common import check_int

__all__ = ["CacheShape", "cache_shape"]

_NOTES = {
    "swa": "one KV row per token of the window; vLLM 0.33 stores DeepSeek-V4's as uint8 rows of its FP8 "
           "'fp8_ds_mla' format (584 content bytes per token, 576-byte alignment; SlidingWindowMLASpec head_size 512)",
    "attention": "one compressed KV row per compress_ratio tokens (row pos // ratio); vLLM 0.33: uint8 rows of "
                 "FP8 'fp8_ds_mla' (584 content bytes per row; MLAAttentionSpec head_size 512)",
    "indexer": "one indexer key per compress_ratio tokens; vLLM 0.33: uint8 rows of 132 bytes (128 FP8 values and "
               "one float32 scale; MLAAttentionSpec head_size 132)",
    "state": "compressor state, one row per token of the group's window (a ring of the group's block); vLLM 0.33: "
             "float32, never FP8 (main compressor 2 * c * 512 values, c = 2 for ratio 4 else 1; the indexer's "
             "2 * 2 * 128)",
}


@dataclass(frozen=True)
class CacheShape:
    """``channel``'s cache for ``num_blocks`` blocks: ``shape = (num_blocks, rows_per_block)`` rows (``rows`` in
    all; a slot id ``s`` of the channel is row ``s``), its group ``gid``, and ``note``: what a row holds in
    vLLM 0.33 (the dtype / FP8 format; the library reads no cache contents)."""

    channel: str
    gid: int
    num_blocks: int
    rows_per_block: int
    rows: int
    shape: Tuple[int, int]
    note: str


def cache_shape(layout, channel: str, num_blocks: int) -> CacheShape:
    """The cache of ``channel`` (a name of ``layout.channels``) for ``num_blocks`` blocks of its group
    (``int >= 1``; :meth:`GroupSpec.blocks_for` says how many a request holds). ValueError for an unknown
    channel (naming the known ones) or a bad ``num_blocks``."""
    if channel not in layout.channels:
        raise ValueError(f"channel must be one of {sorted(layout.channels)}, got {channel!r}")
    check_int("num_blocks", num_blocks, lo=1)
    c = layout.channels[channel]
    kind = {"swa": "swa", "c4a": "attention", "c128a": "attention", "c4i": "indexer", "c4_state": "state",
            "c128_state": "state"}.get(c.role, "")  # NOTE: a V4.1 ratio-1 / ratio-2 channel has a c4 role
    note = _NOTES.get(kind, "a user-registered channel: its rows are what its consumer stores")
    rpb = int(c.rows_per_block)
    return CacheShape(channel, c.gid, int(num_blocks), rpb, int(num_blocks) * rpb, (int(num_blocks), rpb), note)
