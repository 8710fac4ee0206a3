"""A geometry audit of a layout (issue 28): what an engine's prefix cache and chunk admission will do with
its groups, found from the layout alone, before a 0 % hit rate or a stuck queue shows it.

``python -m dsv4_index audit --config flash [--groups vllm] [--spec N] [--json]`` or
:func:`audit` ``(layout) -> dict``.

The model (vLLM's hybrid KV-cache manager as the upstream threads describe it; each number below is
computed, never looked up):

* Every group that is not a ring is hashed for prefix caching at its own block size (its *hash
  granularity*); the scheduler aligns cache writes and hits to ``L = lcm`` of those block sizes (the
  *scheduler block*; vllm-ascend #16270: ``LCM(128, 4096, 32, 2, 8) = 4096``). A hit is a multiple of
  ``L`` shorter than the prompt, so the *minimum prefix-hit length* is ``L``: a prompt of at most ``L``
  tokens never hits. With speculative decoding (MTP / EAGLE) the draft group drops its last matched block,
  which costs one more scheduler block: ``2 L`` (vllm-ascend #10710: block 128 x ratio 128 -> 16 K, 32 K
  with speculation). vLLM 0.33 drops a whole scheduler block (``kv_cache_coordinator.py``: "the excluded
  tail is scheduler_block_size, not the group's own block size"); engines before that fix dropped the
  group's own block (``draft_drop="block"``).
* *Write mask*: the blocks of a sliding group (window ``w``, block ``b``) that stay cached are those a hit
  at a scheduler-block boundary ``k L`` reads, the blocks covering ``[k L - w, k L)``. *Read rule*: a layer
  resuming at ``P`` reads the blocks covering ``[P - w, P)`` of its sliding group; the draft group's read
  point is ``k L - L`` (vLLM 0.33) or ``k L - b`` (its own last block, ``draft_drop="block"``). When the
  blocks a read needs are never in the write mask for any ``k``, every hit of that group misses and the
  whole request misses (vLLM #51041: V4-Flash at 0 % with groups of different block sizes).
* *Chunk demand*: a chunk of ``C`` tokens needs ``cdiv(w - 1 + C, b) + f`` blocks of a sliding ring
  table (``f`` kernel blocks per allocation block), ``cdiv(C, b)`` new blocks of a full group, its ring's
  blocks of a circular group; a ring whose columns (sized for ``max_num_batched_tokens``) are fewer never
  admits that chunk (vllm-ascend #15204).
* *Bytes per token*: vLLM's DeepSeek-V4 cache rows (``fp8_ds_mla``: 584 B per MLA / SWA row, 132 B per
  indexer row, float32 compressor states of ``2 * coff * head_dim`` values, ``coff = 2`` for C4): the
  bytes one token of every layer of the group costs while it is held.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

from .._common import cdiv, check_int
from ..engine_plan import kv_owners
from ..specs import ratio_kinds
from .argtypes import int_in

__all__ = ["audit", "format_audit", "add_arguments", "audit_cmd", "ROW_BYTES"]

ROW_BYTES = {"mla": 584, "indexer": 132, "swa": 584, "c4_state": 2 * 2 * 512 * 4 + 2 * 2 * 128 * 4,
             "c128_state": 2 * 1 * 512 * 4}
"""Bytes of one cache row (vLLM 0.33, ``fp8_ds_mla``, head_dim 512, index head 128): the MLA / SWA
row 448 fp8 + 64 bf16 + 8 scale bytes; the indexer row 128 fp8 + 4 fp32 scale bytes; a C4 state row
holds the C4A and C4I compressor states (kv + score, ``coff = 2``), a C128 state row the C128A one."""

DEFAULT_CHUNKS = (512, 2048, 8192)


def _group_layers(layout, g) -> List[int]:
    """The layers whose ``g.role`` cache ``g`` serves (its ``layers``, else every layer with such a cache)."""
    if g.layers is not None:
        return list(g.layers)
    state_of = {k.state: k.ratio for k in ratio_kinds(layout.compress_ratios) if k.state}
    kind = {"mla": lambda r: r > 0, "swa": lambda r: True}.get(g.role or "")
    if kind is None:
        kind = (lambda r: r == state_of[g.role]) if g.role in state_of else (lambda r: False)
    return [i for i, r in enumerate(layout.compress_ratios) if kind(r)]


def _bytes_per_token(layout, g) -> float:
    """Bytes one token costs in group ``g``: every layer that holds its own cache there (a V4.1 layer that reads
    its kv source's cache and state holds none), a compressed row of ratio ``R`` per ``R`` tokens (an indexed
    ratio adds its indexer row), a state row of its ratio's kind, an SWA row per token."""
    kinds = {k.ratio: k for k in ratio_kinds(layout.compress_ratios)}
    owner = kv_owners(layout.compress_ratios, layout.kv_sources)
    total = 0.0
    for i in _group_layers(layout, g):
        r = layout.compress_ratios[i]
        if g.role == "swa":
            total += ROW_BYTES["swa"]
        elif r > 0 and owner.get(i) == i and g.role is not None:
            indexed = kinds[r].kind == "c4"
            if g.role == "mla":
                total += (ROW_BYTES["mla"] + (ROW_BYTES["indexer"] if indexed else 0)) / r
            elif g.role == kinds[r].state:
                total += ROW_BYTES["c4_state" if indexed else "c128_state"]
    return total


def _covering(lo: int, hi: int, b: int) -> range:
    """Block indices of block size ``b`` covering tokens ``[lo, hi)`` (``lo`` clamped at 0)."""
    lo = max(lo, 0)
    return range(lo // b, cdiv(hi, b)) if hi > lo else range(0)


def _overlap(g, L: int, drop: int, reps: int = 8) -> bool:
    """Whether some hit point's read of group ``g`` lies inside its write mask (module docstring)."""
    if g.kind != "sliding":
        return True
    b, w = g.alloc_block_size, g.window
    mask: set = set()
    for k in range(1, reps + 1):
        mask.update(_covering(k * L - w, k * L, b))
    for k in range(1, reps + 1):
        p = k * L - drop
        if p > 0 and set(_covering(p - w, p, b)) <= mask:
            return True
    return False


def audit(layout, *, num_speculative_tokens: int = 0, max_num_batched_tokens: int = 8192,
          chunks: Sequence[int] = DEFAULT_CHUNKS, short_prompt: int = 4096,
          draft_groups: Optional[Sequence[str]] = None, num_hidden_layers: Optional[int] = None,
          draft_drop: str = "scheduler") -> dict:
    """The audit of ``layout`` (module docstring) as a JSON-ready dict.

    Parameters
    ----------
    layout : DSV4Layout
    num_speculative_tokens : int — > 0: speculative decoding (the draft group drops its last block).
    max_num_batched_tokens : int — sizes the sliding ring tables (``GroupSpec.columns``).
    chunks : sequence of int — chunk lengths whose block demand is reported.
    short_prompt : int — warn when prompts of this many tokens get no prefix hit.
    draft_groups : names of the groups the draft (MTP) layers read; default: the groups that hold a
        layer at or past ``num_hidden_layers`` (an ``*_mtp`` group, or the SWA sub-group holding it).
    draft_drop : ``"scheduler"`` (vLLM 0.33: a hit drops one scheduler block for the draft) or ``"block"``
        (the draft group's own last block, engines before the #51041 fix).
    num_hidden_layers : int, optional — the config's (the CLI passes it); default: the layers of a
        ``*_mtp`` group, else DeepSeek-V4's one SWA-only MTP layer after a compressed one when the plan
        serves it.

    Returns
    -------
    dict with ``scheduler_block``, ``hash_block`` (the engine's hash granularity, the smallest hashed block
    size: vLLM's ``cache_config.block_size``), ``min_prefix_hit`` / ``min_prefix_hit_spec`` (tokens), ``groups``
    (one dict per gid: name, kind, block_size, hash_granularity, window, hashed, draft,
    bytes_per_token, demand ``{chunk: blocks}``, columns, overlap, overlap_spec) and ``warnings`` (list
    of one-line str).
    """
    if draft_drop not in ("scheduler", "block"):
        raise ValueError(f"draft_drop must be 'scheduler' or 'block', got {draft_drop!r}")
    chunks = _check_args(layout, num_speculative_tokens, max_num_batched_tokens, chunks, short_prompt, draft_groups,
                         num_hidden_layers)
    first = num_hidden_layers if num_hidden_layers is not None else layout.num_layers - _num_mtp(layout)
    mtp = set(range(first, layout.num_layers))
    if draft_groups is None:
        draft_groups = [g.name for g in layout.groups if g.role == "swa" and mtp & set(_group_layers(layout, g))]
    hashed = [g for g in layout.groups if g.kind != "circular"]
    L = math.lcm(*(g.alloc_block_size for g in hashed)) if hashed else 0
    spec = num_speculative_tokens > 0
    out: Dict = {"draft_drop": draft_drop, "scheduler_block": L,
                 "hash_block": min((g.alloc_block_size for g in hashed), default=0),
                 "min_prefix_hit": L, "min_prefix_hit_spec": 2 * L,
                 "num_speculative_tokens": num_speculative_tokens,
                 "max_num_batched_tokens": max_num_batched_tokens, "groups": [], "warnings": []}
    warn = out["warnings"]
    hit = 2 * L if spec else L
    if hashed and hit >= short_prompt:
        sizes = ", ".join(str(g.alloc_block_size) for g in hashed)
        warn.append(f"prefix hits need prompts longer than {hit} tokens (scheduler block lcm({sizes}) = {L}"
                    + (", doubled by speculative decoding" if spec else "")
                    + f"): prompts of up to {short_prompt} tokens get 0 % hits (vllm-ascend #16270 / #10710)")
    for g in layout.groups:
        draft = g.name in draft_groups
        cols, ring = g.columns(max_num_batched_tokens)
        demand = {}
        for c in chunks:
            if g.kind == "circular":
                demand[c] = g.ring_blocks
            elif g.kind == "sliding":
                demand[c] = cdiv(g.window - 1 + c, g.block_size) + g.blocks_per_kv_block
            else:
                demand[c] = cdiv(c, g.block_size)
        row = {"gid": g.gid, "name": g.name, "kind": g.kind, "block_size": g.alloc_block_size,
               "hash_granularity": g.alloc_block_size if g.kind != "circular" else None, "window": g.window,
               "hashed": g.kind != "circular", "draft": draft, "bytes_per_token": _bytes_per_token(layout, g),
               "columns": cols, "demand": demand, "overlap": _overlap(g, L, 0),
               "overlap_spec": _overlap(g, L, (L if draft_drop == "scheduler" else g.alloc_block_size) if draft
                                        else 0)}
        out["groups"].append(row)
        for who, ok in (("", row["overlap"]), (" with speculative decoding", row["overlap_spec"] or not spec)):
            if not ok:
                warn.append(f"group {g.name!r} (block {g.alloc_block_size}, window {g.window}): the blocks a "
                            f"prefix hit reads{who} are never in its write mask (scheduler block {L}): 0 % prefix "
                            f"hits (vLLM #51041)")
        if g.kind == "sliding" and ring:  # NOTE: a full-width table holds any chunk of the request
            for c, need in demand.items():
                if c > max_num_batched_tokens or need > cols:
                    warn.append(f"group {g.name!r}: a chunk of {c} tokens needs {need} blocks, its ring has {cols} "
                                f"(max_num_batched_tokens {max_num_batched_tokens}): never admitted "
                                f"(vllm-ascend #15204)")
    return out


def _check_args(layout, num_speculative_tokens, max_num_batched_tokens, chunks, short_prompt, draft_groups,
                num_hidden_layers) -> Tuple[int, ...]:
    """:func:`audit`'s arguments (the pipeline's bounds, :data:`dsv4_index.capacity.BOUNDS`); ``chunks`` as a
    tuple. TypeError / ValueError naming the argument."""
    from ..capacity import BOUNDS
    from ..geometry import DSV4Layout

    if not isinstance(layout, DSV4Layout):
        raise TypeError(f"layout must be a DSV4Layout (DSV4Layout.from_config(...)), got {type(layout).__name__}")
    check_int("num_speculative_tokens", num_speculative_tokens, lo=0, hi=BOUNDS["num_speculative_tokens"][0])
    check_int("max_num_batched_tokens", max_num_batched_tokens, lo=1, hi=BOUNDS["max_num_batched_tokens"][0])
    check_int("short_prompt", short_prompt, lo=0)
    if num_hidden_layers is not None:
        check_int("num_hidden_layers", num_hidden_layers, lo=0, hi=layout.num_layers)
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, (list, tuple, range)):
        raise TypeError(f"chunks must be a list of chunk lengths (ints), got {type(chunks).__name__}")
    for i, c in enumerate(chunks):
        check_int(f"chunks[{i}]", c, lo=1, hi=BOUNDS["max_num_batched_tokens"][0])
    if draft_groups is not None:
        names = [g.name for g in layout.groups]
        if isinstance(draft_groups, (str, bytes)) or not isinstance(draft_groups, (list, tuple, set, frozenset)):
            raise TypeError(f"draft_groups must be a list of group names, got {draft_groups!r}")
        bad = [x for x in draft_groups if x not in names]
        if bad:
            raise ValueError(f"draft_groups names {bad!r}, not groups of this layout ({names})")
    return tuple(chunks)


def _num_mtp(layout) -> int:
    # NOTE: DeepSeek-V4's MTP layers are the SWA-only tail of compress_ratios past num_hidden_layers; the layout
    # keeps num_layers only, so the draft layers are those the engine left unserved or put in a *_mtp group
    mtp = {x for g in layout.groups if g.name.endswith("_mtp") for x in (g.layers or ())}
    if mtp:
        return len(mtp)
    served = {x for g in layout.groups if g.role == "swa" for x in _group_layers(layout, g)}
    return 1 if layout.num_layers - 1 in served and layout.compress_ratios[-1] == 0 and \
        len(layout.compress_ratios) > 1 and layout.compress_ratios[-2] > 0 else 0


def format_audit(a: dict) -> str:
    """The audit as a table for a person."""
    lines = [f"hash block {a['hash_block']}, scheduler block (lcm of hashed block sizes) {a['scheduler_block']} "
             f"tokens; minimum prefix hit "
             f"{a['min_prefix_hit']} tokens ({a['min_prefix_hit_spec']} with speculative decoding)",
             f"{'gid':>3}  {'group':<12}{'kind':<9}{'block':>6}{'hash':>6}{'window':>7}{'B/token':>9}"
             f"{'overlap':>9}{'spec':>6}{'cols':>6}  demand per chunk (blocks)"]
    for g in a["groups"]:
        dem = ", ".join(f"{c}: {n}" for c, n in g["demand"].items())
        name = g["name"] + ("*" if g["draft"] else "")
        lines.append(f"{g['gid']:>3}  {name:<12}{g['kind']:<9}{g['block_size']:>6}"
                     f"{g['hash_granularity'] or '-':>6}{g['window'] or '-':>7}{g['bytes_per_token']:>9.0f}"
                     f"{'yes' if g['overlap'] else 'NO':>9}{'yes' if g['overlap_spec'] else 'NO':>6}"
                     f"{g['columns']:>6}  {dem}")
    lines.append("(* = a group the draft/MTP layers read; overlap = a prefix hit's reads lie in the write mask)")
    lines += [f"WARNING: {w}" for w in a["warnings"]] or ["no warnings"]
    return "\n".join(lines)


def add_arguments(p) -> None:
    """The ``audit`` command's own options (``--config`` / ``--max-model-len`` come from the CLI)."""
    p.add_argument("--groups", default=None, help="vllm (vLLM 0.33's plan), or a JSON file of the engine's "
                   "kv_cache_groups (a KVCacheConfig dump); default: one group per role")
    from ..capacity import BOUNDS

    p.add_argument("--spec", type=int_in(0, BOUNDS["num_speculative_tokens"][0]), default=0, metavar="N",
                   help="speculative tokens (default 0)")
    p.add_argument("--max-num-batched-tokens", type=int_in(1, BOUNDS["max_num_batched_tokens"][0]), default=8192,
                   metavar="N",
                   help="token budget of a step; sizes the sliding ring tables (default 8192)")
    p.add_argument("--draft-drop", default="scheduler", choices=("scheduler", "block"),
                   help="what a prefix hit drops for the draft group: one scheduler block (vLLM 0.33, the "
                   "default) or the group's own block (engines before the vLLM #51041 fix)")
    p.add_argument("--json", action="store_true", help="print the audit as JSON")


MAX_GROUPS_BYTES = 16 << 20
"""Largest ``--groups`` file read (vLLM's plan of a 61-layer model is a few KiB)."""


def read_groups_file(path: str):
    """The JSON of an ``audit --groups`` file, bounded in size and depth before parsing; an
    ``ValueError`` reading ``"--groups: ..."`` and naming the file otherwise (the CLI prints it as one line)."""
    from .._json import BadJSON, decode_utf8, loads_bounded

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_GROUPS_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--groups: cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_GROUPS_BYTES:
        raise ValueError(f"--groups: {path} is larger than {MAX_GROUPS_BYTES} bytes; not a KV-cache plan")
    try:
        return loads_bounded(decode_utf8(raw, path), path, raw=raw)
    except BadJSON as e:
        raise ValueError(f"--groups: {path} is not valid JSON: line {e.line}: {e.msg}") from None


def audit_cmd(args) -> int:
    """``python -m dsv4_index audit``."""
    from .. import DSV4Layout

    n = args.max_model_len or 32768   # NOTE: the CLI sets the documented default (cli.max_model_len_of)
    if args.groups and args.groups != "vllm":
        plan = read_groups_file(args.groups)
        try:
            layout = DSV4Layout.from_kv_cache_config(plan, args.config, n)
        except ValueError as e:
            raise ValueError(f"--groups: {args.groups}: {e}") from None
    else:
        layout = DSV4Layout.from_config(args.config, n, groups=args.groups)
    from ..config import normalize_config

    hidden = normalize_config(args.config)["num_hidden_layers"]
    a = audit(layout, num_speculative_tokens=args.spec, max_num_batched_tokens=args.max_num_batched_tokens,
              num_hidden_layers=hidden, draft_drop=args.draft_drop)
    print(json.dumps(a, indent=1) if args.json else format_audit(a))
    return 0
