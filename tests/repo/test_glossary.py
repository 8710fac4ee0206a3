"""The glossary (docs/INTERFACES.md, "one meaning per name") checked where a machine can check it.

Each rule finds the places in the package that use a name in a retired meaning; ``ALLOWED`` lists
today's places in modules whose rename is still to come, with their count (``"rule path": count``),
so the list only shrinks: a new place fails, and so does an entry that is gone or smaller (remove or
lower it).

Rules:

* ``R``: a compress ratio, never a request count (``max_num_reqs`` / ``num_slots`` are spelled out).
* ``W``: a sliding window, never a world size (``cp_world_size``, ``world``).
* ``slots``: cache slots only; request slots are ``req_slots``, the slot map ``slot_map``.
* the speculative count: ``num_speculative_tokens`` (what engines pass) and ``next_n``
  (``1 + num_speculative_tokens``, the query tokens of a decode row; ``NEXT_N`` in kernels) only.
* ``commit``: a host apply (``BlockTables.commit``, ``RequestState.commit``, ``SlotMap.commit``); the
  host-to-device copy of :class:`~dsv4_index.BlockTable` is ``upload``.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dsv4_index"

# other spellings of the speculative count (and of its row bound)
SPEC_RETIRED = ("decode_threshold", "n_spec", "num_spec", "num_spec_tokens", "spec_tokens", "num_draft_tokens",
                "draft_tokens", "num_spec_decode_tokens", "spec_len")
_SPEC = re.compile(r"\b(" + "|".join(SPEC_RETIRED) + r")\b")
_REQUEST_COUNT = {"max_num_reqs", "num_reqs", "num_requests", "B", "num_slots"}
_REQUEST_SLOTS = {"req_slots", "held_slots"}

# "rule path" -> places today, in modules other changes are editing (shrink only)
ALLOWED: Dict[str, int] = {}


def _modules() -> Iterator[Tuple[str, str, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text(encoding="utf-8")
        yield path.relative_to(ROOT).as_posix(), src, ast.parse(src)


def _names(node: ast.AST) -> set:
    """Every identifier (names and attribute names) in an expression."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def _bindings(tree: ast.AST) -> Iterator[Tuple[str, ast.AST, int]]:
    """``(name, value expression, line)`` of every plain assignment, tuples paired element-wise."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        else:
            continue
        while pairs:
            t, v = pairs.pop()
            if isinstance(t, ast.Name):
                yield t.id, v, node.lineno
            elif isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                pairs += list(zip(t.elts, v.elts, strict=True))
            elif isinstance(t, ast.Tuple):
                pairs += [(e, v) for e in t.elts]


def find() -> Dict[str, List[str]]:
    """``{"rule path": ["line: what", ...]}`` of every place that uses a retired meaning."""
    found: Dict[str, List[str]] = {}

    def hit(rule: str, path: str, line: int, what: str) -> None:
        found.setdefault(f"{rule} {path}", []).append(f"{line}: {what}")

    for path, src, tree in _modules():
        for name, value, line in _bindings(tree):
            used = _names(value)
            if name == "R" and used & _REQUEST_COUNT:
                hit("R-request-count", path, line, f"R bound to {sorted(used & _REQUEST_COUNT)}")
            if name == "W" and any("world" in u for u in used):
                hit("W-world-size", path, line, "W bound to a world size")
            if name == "slots" and used & _REQUEST_SLOTS:
                hit("slots-request-slots", path, line, f"slots bound to {sorted(used & _REQUEST_SLOTS)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.arg == "slots" and node.annotation is not None \
                    and "SlotMap" in _names(node.annotation):
                hit("slots-request-slots", path, node.lineno, "a SlotMap named slots")
        for i, text in enumerate(src.splitlines(), 1):
            if re.search(r"``R``\s+(request\s+)?slots|\bR\s*=\s*max_num_reqs", text):
                hit("R-request-count", path, i, text.strip())
            if re.search(r"%\s*W\b", text):
                hit("W-world-size", path, i, text.strip())
            for m in _SPEC.finditer(text):
                hit("speculative-count", path, i, m.group(1))
    return found


def test_no_retired_meaning_outside_the_allow_list():
    found = find()
    new = {k: v for k, v in found.items() if k not in ALLOWED or len(v) > ALLOWED[k]}
    assert not new, f"names used in a retired meaning (docs/INTERFACES.md glossary): {new}"


def test_the_allow_list_only_shrinks():
    found = find()
    stale = {k: (n, len(found.get(k, ()))) for k, n in ALLOWED.items() if len(found.get(k, ())) < n}
    assert not stale, f"fewer places than allowed (lower or remove these entries; allowed, now): {stale}"


def test_the_rules_catch_each_retired_meaning():
    """Each rule fires on a one-line example (and not on the glossary's meaning)."""
    bad = ["R = max_num_reqs or B", "W, r = cp_world_size, 0", "slots = batch.req_slots",
           "def f(slots: SlotMap): pass", "n_spec = 2", "x = decode_threshold"]
    good = ["R = ch.compress_ratio", "W = layout.sliding_window", "slots = bt * S + off",
            "def f(slot_map: SlotMap): pass", "next_n = 1 + num_speculative_tokens"]
    rules = Counter()
    for src in bad + good:
        tree = ast.parse(src)
        for name, value, _ in _bindings(tree):
            used = _names(value)
            rules[src] += (name == "R" and bool(used & _REQUEST_COUNT)) + (name == "W" and "cp_world_size" in used) \
                + (name == "slots" and bool(used & _REQUEST_SLOTS))
        rules[src] += sum(isinstance(n, ast.arg) and n.arg == "slots" for n in ast.walk(tree))
        rules[src] += bool(_SPEC.search(src))
    assert all(rules[s] >= 1 for s in bad), {s: rules[s] for s in bad}
    assert all(rules[s] == 0 for s in good), {s: rules[s] for s in good}


def test_block_table_uploads_and_the_state_commits():
    from dsv4_index import BlockTable, MultiGroupBlockTable
    from dsv4_index.state import BlockTables, RequestState
    from dsv4_index.state.requests import SlotMap

    for cls in (BlockTable, MultiGroupBlockTable):
        assert hasattr(cls, "upload") and not hasattr(cls, "commit"), cls
    for cls in (BlockTables, RequestState, SlotMap):
        assert hasattr(cls, "commit"), cls
