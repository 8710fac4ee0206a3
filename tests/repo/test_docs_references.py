"""The design the code cites is in the repository, and every citation of it is true.

* Nothing in the package, the docs, the README or the other top-level documents points at a file outside the
  repository (``../shared/...``, ``shared/DESIGN``, ``shared/reviews``): a fresh clone must hold what it cites.
* Every ``DESIGN §N`` / ``docs/DESIGN.md §N`` cites a section that exists in ``docs/DESIGN.md``; a quoted name
  after it (``DESIGN §4 "circular group"``) appears in that section.
* Every link to ``DESIGN.md#anchor`` names a heading of ``docs/DESIGN.md``.
* The names the documents quote exist (issue 39; the documents: the top-level ``*.md`` but the CHANGELOG,
  which is history, ``docs/*.md``, ``benchmarks/*.md``): a backticked file path (``state/plan.py``,
  ``tools/{trace,replay}.py``) is a file of the repository; a backticked ``dsv4_index.x.y`` imports (a module,
  then attributes); no module the CHANGELOG's move tables retired (``step_rules``, ``slot_map``, ...) is named as
  a module, in backticks or in DESIGN §9's listing; and every keyword of a documented call of a public
  constructor or entry (``MetadataPipeline(...)``, ``from_config(...)``, ``record_steps(...)``, ...) and every
  name of a signature listing (one with a bare ``*``) is a parameter of it. :data:`NAME_EXCEPTIONS` lists the
  intended exceptions with their reasons; an exception that no longer matches fails too (the list only shrinks).
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|shared/reviews")
CITE = re.compile(r"DESIGN(?:\.md)? §(\d+)(?: \"([^\"]+)\")?")
ANCHOR = re.compile(r"DESIGN\.md#([a-z0-9-]+)")


def texts(with_tests: bool = False):
    """(repo-relative path, text) of every file a reader of the repository meets."""
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "dsv4_index").rglob("*.py"),
             *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.md"), *(ROOT / "models").rglob("*.py"), ROOT / "pyproject.toml"]
    if with_tests:
        files += [p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name]
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in sorted(set(files))]


def sections() -> dict:
    """``N -> (heading, body)`` of the numbered ``## N. ...`` sections of docs/DESIGN.md."""
    parts = re.split(r"^## (\d+)\. (.*)$", DESIGN.read_text(encoding="utf-8"), flags=re.M)
    return {int(parts[i]): (parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3)}


def flat(text: str) -> str:
    """Lower case, runs of white space as one blank (a quoted name may wrap a docstring line)."""
    return " ".join(text.lower().split())


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_the_design_is_in_the_repository_and_numbered():
    secs = sections()
    assert sorted(secs) == list(range(1, len(secs) + 1)), sorted(secs)
    assert len(secs) >= 10  # NOTE: the numbers §1 - §10 are cited all over the tree


def test_nothing_points_outside_the_repository():
    hits = [f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for path, text in texts() for m in OUTSIDE.finditer(text)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("with_tests", [False, True], ids=["package-and-docs", "tests"])
def test_every_citation_names_a_section_that_says_it(with_tests):
    secs = sections()
    bad, n = [], 0
    for path, text in texts(with_tests):
        for m in CITE.finditer(text):
            n += 1
            num, name = int(m.group(1)), m.group(2)
            where = f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            if num not in secs:
                bad.append(f"{where}: no section {num}")
            elif name is not None and flat(name) not in flat(secs[num][1]):
                bad.append(f"{where}: section {num} ({secs[num][0]}) does not say {name!r}")
    assert n > 20, n  # NOTE: the citations are found at all
    assert not bad, "\n".join(bad)


def test_every_anchor_names_a_heading():
    heads = {slug(h) for h in re.findall(r"^#+ (.*)$", DESIGN.read_text(encoding="utf-8"), flags=re.M)}
    bad = [f"{path}: #{a}" for path, text in texts() for a in ANCHOR.findall(text) if a not in heads]
    assert not bad, "\n".join(bad)


def test_the_slug_rule():
    assert slug("8. Performance budget and how it is measured") == "8-performance-budget-and-how-it-is-measured"


# ---------------------------------------------------------------------------------------------------------------
# the names the documents use (issue 39)
_VLLM = "a file of vLLM, not of this repository"
_HISTORY = "history: a benchmark round of a module since removed, said as such"
NAME_EXCEPTIONS = {
    ("README.md", "config.json"): "a model's own config.json (any folder), not a file of this repository",
    ("RELIABILITY.md", "config.json"): "a model's own config.json (any folder), not a file of this repository",
    ("README.md", "vllm/v1/core/sched/output.py"): _VLLM,
    ("README.md", "vllm/v1/core/kv_cache_planning.py"): _VLLM,
    ("README.md", "deepseek_v41/attention.py"): _VLLM,
    ("benchmarks/HOST.md", "swa_metadata.py"): _VLLM,
    ("BENCHMARKS.md", "state/steady.py"): _HISTORY,
    ("benchmarks/HOST.md", "state/steady.py"): _HISTORY,
    ("benchmarks/HOST.md", "state/fast_runs.py"): _HISTORY,
    ("benchmarks/HOST.md", "state/fast_full.py"): _HISTORY,
    ("benchmarks/HOST.md", "state/plan_runs.py"): _HISTORY,
    ("RELIABILITY.md", "state/ownership_checks.py"): _HISTORY,
    ("RELIABILITY.md", "state/ownership_rules.py"): _HISTORY,
    ("benchmarks/HOST.md", "state/owners.py"): _HISTORY,
    ("benchmarks/HOST.md", "tests/state/test_holder_scans.py"): _HISTORY,
    ("benchmarks/FRONTEND.md", "frontend.py"): _HISTORY,
    ("benchmarks/FRONTEND.md", "step_rules.py"): _HISTORY,
    ("benchmarks/FRONTEND.md", "steady_step._fast"): _HISTORY,
    ("CONTRIBUTING.md", ".venv/install.log"): "written by `./dev setup`, not kept in the repository",
}
"""(document, name) -> why the name need not exist in the repository."""

TICK = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"[\w./{},-]+\.(?:py|md|json|toml|txt|sh|jsonl|csv|log)")
DOTTED = re.compile(r"dsv4_index(?:\.\w+)+")


def documents():
    """(repo-relative path, text) of the documents whose names are checked (module docstring)."""
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in sorted(files)
            if p.name != "CHANGELOG.md"]


def _expand(tok: str) -> list:
    """``a/{b,c}.py`` -> ``["a/b.py", "a/c.py"]`` (nested braces too)."""
    m = re.search(r"\{([^{}]*)\}", tok)
    if not m:
        return [tok]
    return [x for alt in m.group(1).split(",") for x in _expand(tok[:m.start()] + alt.strip() + tok[m.end():])]


def _repo_files() -> list:
    """Files of the checkout as a clean clone holds them (``git ls-files``: tracked, plus new files git does not
    ignore), so that a venv, ./dev's .venv-* or a local copy of another tree never makes a quoted name exist;
    outside a git checkout (an sdist), every file but caches."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        return [f for f in out.splitlines() if (ROOT / f).is_file()]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "__pycache__", "node_modules"}
        return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)
                and not any(part.startswith(".venv-") for part in p.parts)]


def _imports(name: str) -> bool:
    """Whether ``dsv4_index.a.b.c`` is a module, or a module's attribute chain."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        try:
            for a in parts[k:]:
                obj = getattr(obj, a)
        except AttributeError:
            return False
        return True
    return False


def retired_modules() -> set:
    """Modules the CHANGELOG's move tables name as moved (``| `dsv4_index/step_rules.py` ... | new place |``)
    that exist nowhere in the package today."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    named = set(re.findall(r"^\| `dsv4_index/(\w+)\.py`", text, flags=re.M))
    alive = {p.stem for p in (ROOT / "dsv4_index").rglob("*.py")} | {
        p.name for p in (ROOT / "dsv4_index").rglob("*") if p.is_dir()}
    return named - alive


def missing_names(docs=None) -> list:
    """``"path:line: name (what)"`` of every quoted name that does not exist, exceptions left out; and the
    exceptions that matched, as ``("path", "name")`` keys (second value)."""
    files = _repo_files()
    retired = retired_modules()
    out, used = [], set()

    def report(path, text, pos, name, what):
        if (path, name) in NAME_EXCEPTIONS:
            used.add((path, name))
        else:
            out.append(f"{path}:{text[:pos].count(chr(10)) + 1}: {name} ({what})")

    for path, text in documents() if docs is None else docs:
        for m in TICK.finditer(text):
            tok = m.group(1).strip()
            if PATH.fullmatch(tok) and "<" not in tok:
                for t in _expand(tok):
                    t = t.removeprefix("./")
                    if not any(f == t or f.endswith("/" + t) for f in files):
                        report(path, text, m.start(), t, "no such file in the repository")
            elif DOTTED.fullmatch(tok) and not _imports(tok):
                report(path, text, m.start(), tok, "does not import")
            first = re.split(r"[./(]", tok, maxsplit=1)[0]
            if first in retired and (PATH.fullmatch(tok) or re.fullmatch(r"[\w.]+", tok)):
                report(path, text, m.start(), tok, f"module {first!r} was retired (CHANGELOG)")
        if path == "docs/DESIGN.md":
            body = sections().get(9, ("", ""))[1]
            listing = "".join(re.findall(r"```(.*?)```", body, flags=re.S))
            items = re.findall(r"(?<=[(,])\s*([a-z_]\w*)\s*(?=[,)])", " ".join(listing.split()))  # NOTE: list items
            for word in sorted(set(items) & retired):
                report(path, text, text.find(listing), f"§9: {word}", "a retired module in the repository layout")
    return out, used


CALLS = ("MetadataPipeline", "from_config", "from_kv_cache_config", "memory_estimate", "record_steps", "Recorder",
         "audit", "replay_trace")


def _parameters() -> dict:
    from dsv4_index import DSV4Layout, MetadataPipeline
    from dsv4_index.tools.audit import audit
    from dsv4_index.tools.replay import replay_trace
    from dsv4_index.tools.trace import Recorder, record_steps

    def names(fn):
        return set(inspect.signature(fn).parameters) - {"self", "cls", "kwargs"}
    out = {"MetadataPipeline": names(MetadataPipeline.__init__), "from_config": names(DSV4Layout.from_config),
           "memory_estimate": names(MetadataPipeline.memory_estimate), "record_steps": names(record_steps),
           "Recorder": names(Recorder.__init__), "audit": names(audit), "replay_trace": names(replay_trace)}
    from dsv4_index.engine_plan import PLAN_OWNS

    out["from_kv_cache_config"] = names(DSV4Layout.from_kv_cache_config) | (out["from_config"] - set(PLAN_OWNS))
    return out


def _call_items(text: str, start: int):
    """The depth-0 comma-separated items of the call whose ``(`` ends at ``start``, or None (unclosed)."""
    depth, cur, out = 0, "", []
    for c in text[start:]:
        if c in ")]}" and depth == 0:
            return out + [cur]
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    return None


def wrong_arguments(docs=None) -> list:
    """``"path:line: Callable(name)"`` of every documented keyword / signature name that is no parameter."""
    params = _parameters()
    call = re.compile(r"\b(" + "|".join(CALLS) + r")\(")
    bad = []
    for path, text in documents() if docs is None else docs:
        for m in call.finditer(text):
            items = _call_items(text, m.end())
            if items is None:
                continue
            items = [" ".join(x.split()) for x in items]
            listing = "*" in items   # NOTE: a signature listing: its bare names are parameter names
            for x in items:
                k = re.match(r"^(\w+)\s*=", x)
                name = k.group(1) if k else x if listing and re.fullmatch(r"[a-z_]\w*", x) else None
                if name is not None and name not in params[m.group(1)]:
                    bad.append(f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group(1)}({name})")
    return bad


def test_every_name_the_documents_quote_exists():
    bad, used = missing_names()
    assert not bad, ("names the documents quote that do not exist (fix the text, or add an exception with its "
                     "reason to NAME_EXCEPTIONS):\n" + "\n".join(bad))
    stale = sorted(set(NAME_EXCEPTIONS) - used)
    assert not stale, f"exceptions that no longer match (remove them from NAME_EXCEPTIONS): {stale}"


def test_every_documented_argument_is_a_parameter():
    bad = wrong_arguments()
    assert not bad, "documented arguments the code does not take:\n" + "\n".join(bad)


def test_the_name_checks_can_fail():
    doc = [("docs/X.md", "see `state/no_such_module.py`, `dsv4_index.tools.trace.no_such_name`, "
                         "`dsv4_index.no_such_module`, `step_rules.explain` and `tools/{trace,nope}.py`.\n"
                         "`MetadataPipeline(layout, max_num_reqs, *, fused, record)` and "
                         "`from_config(cfg, 1, mla_block=2)` and `record_steps(pipe, path, values_limit=3)`")]
    bad, _ = missing_names(doc)
    assert [b.split(": ", 1)[1].split(" (")[0] for b in bad] == [
        "state/no_such_module.py", "dsv4_index.tools.trace.no_such_name", "dsv4_index.no_such_module",
        "step_rules.explain", "tools/nope.py"], bad
    assert [b.split(": ", 1)[1] for b in wrong_arguments(doc)] == ["MetadataPipeline(record)",
                                                                  "from_config(mla_block)"]
    assert {"step", "step_rules", "slot_map"} <= retired_modules()
