"""Fuzz the two readers of user files: step traces (``replay_trace``) and config files
(``normalize_config`` / ``DSV4Layout.from_config`` / ``MetadataPipeline``). Random mutations of a valid
file (truncation, byte flips, type swaps, deleted and duplicated keys, lines and list entries, huge
numbers) must end in a clean error (the ``ValueError`` family, one line naming the file) or a result
(for a mutant that parses to the same JSON as the original: the original's result), never another
exception.

Bounded by time: ``DSV4_FUZZ_SECONDS`` (default 20, shared by both readers), ``DSV4_FUZZ_SEED``
(default 0). A long run with figures::

    nice python tests/tools/test_reader_fuzz.py --seconds 900 --seed 1    # --max-memory-gb 8 (default)
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import pytest


SECONDS = float(os.environ.get("DSV4_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("DSV4_FUZZ_SEED", "0"))
SWAPS = [None, True, False, 0, -1, 1, 0.5, 3.0, "x", "", [], {}, [0], {"a": 1}, 2 ** 63, -2 ** 63 - 1]
HUGE = [2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 62, 2 ** 63, -2 ** 63 - 1, 10 ** 30, -10 ** 30, 10 ** 400, 2 ** 40]
BYTES = b'{}[]",:-.0123456789eE \n\\\x00\xff\xc3tfn'
PROGRESS = [0.0]    # NOTE: seconds between progress lines (0: none); set by the command line


def _progress(name, out, last):
    if PROGRESS[0] and time.monotonic() - last[0] > PROGRESS[0]:
        last[0] = time.monotonic()
        print(f"  {name}: {sum(out.values())} mutants so far, {dict(out)}", flush=True)


# ---------------------------------------------------------------------------------------------- files
def good_trace(path: Path) -> Path:
    from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, StepInput
    from dsv4_index.tools.trace import record_steps

    lay = DSV4Layout.from_config("tiny", max_model_len=64, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 4, 16, "cpu", 1, backend="reference")
    ids = [list(range(1 + 10 * g, 4 + 10 * g)) for g in range(len(lay.groups))]
    with record_steps(pipe, path, values_limit=64):
        pipe.update(StepInput([NewRequest("a", tuple(ids), 0)], [], {"a": 5}), pad_to=8)
        pipe.build()
        try:
            pipe.update(StepInput([], [RunningRequest("zz", tuple([] for _ in ids), 5)], {"zz": 1}))
        except ValueError:
            pass
        pipe.update(StepInput([NewRequest("b", tuple([i + 100 for i in x] for x in ids), 0)],
                              [RunningRequest("a", tuple([] for _ in ids), 5)], {"a": 1, "b": 3}), pad_to=6)
        pipe.build()
    return path


def good_config(path: Path) -> Path:
    from dsv4_index.config import shipped_config

    path.write_text(json.dumps(shipped_config("tiny"), indent=2))
    return path


# ---------------------------------------------------------------------------------------------- mutations
def _nodes(x, path=()):
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _nodes(v, path + (i,))


def _get(x, path):
    for k in path:
        x = x[k]
    return x


def _dump(x, dup=None, path=()):
    """JSON text of ``x``; the object at path ``dup[0]`` writes key ``dup[1]`` twice (``dup[2]`` first)."""
    if isinstance(x, dict):
        items = [f"{json.dumps(k)}:{_dump(v, dup, path + (k,))}" for k, v in x.items()]
        if dup is not None and dup[0] == path:
            items.insert(0, f"{json.dumps(dup[1])}:{_dump(dup[2])}")
        return "{" + ",".join(items) + "}"
    if isinstance(x, list):
        return "[" + ",".join(_dump(v, dup, path + (i,)) for i, v in enumerate(x)) + "]"
    return json.dumps(x)


def mutate_json(obj, rng: random.Random):
    """(text, description) of one structural mutation of a parsed JSON value."""
    nodes = list(_nodes(obj))
    path, val = rng.choice(nodes[1:] or nodes)
    kind = rng.choice(["swap", "huge", "delete", "dup_key", "dup_item", "nest"])
    obj = json.loads(json.dumps(obj))
    parent = _get(obj, path[:-1]) if path else None
    if kind == "swap" and path:
        parent[path[-1]] = rng.choice(SWAPS)
    elif kind == "huge":
        ints = [(p, v) for p, v in nodes if p and isinstance(v, int) and not isinstance(v, bool)]
        if ints:
            path, _ = rng.choice(ints)
            _get(obj, path[:-1])[path[-1]] = rng.choice(HUGE)
    elif kind == "delete" and path:
        del parent[path[-1]]
    elif kind == "dup_key":
        dicts = [(p, v) for p, v in nodes if isinstance(v, dict) and v]
        if dicts:
            p, d = rng.choice(dicts)
            k = rng.choice(list(d))
            return _dump(obj, (p, k, rng.choice([d[k]] + SWAPS))), f"dup_key {p}/{k}"
    elif kind == "dup_item":
        lists = [(p, v) for p, v in nodes if isinstance(v, list) and v]
        if lists:
            p, lst = rng.choice(lists)
            i = rng.randrange(len(lst))
            _get(obj, p).insert(i, lst[i])
            path = p
    elif kind == "nest" and path:
        parent[path[-1]] = [[[val]]] if rng.random() < 0.5 else {"x": val}
    return json.dumps(obj), f"{kind} {path}"


def mutate_bytes(raw: bytes, rng: random.Random, jsonl: bool = True):
    kinds = ["truncate", "flip", "bit", "delete_line", "dup_line", "swap_lines"]
    kind = rng.choice(kinds + ["json"] * 3 if jsonl else kinds)
    lines = raw.split(b"\n")
    if kind == "truncate":
        n = rng.randrange(len(raw))
        return raw[:n], f"truncate at {n}"
    if kind in ("flip", "bit"):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            b[i] = rng.choice(BYTES) if kind == "flip" else b[i] ^ (1 << rng.randrange(8))
        return bytes(b), kind
    if kind in ("delete_line", "dup_line", "swap_lines"):
        i = rng.randrange(len(lines))
        if kind == "delete_line":
            del lines[i]
        elif kind == "dup_line":
            lines.insert(i, lines[i])
        else:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        return b"\n".join(lines), f"{kind} {i}"
    docs = [i for i, x in enumerate(lines) if x.strip()]
    i = rng.choice(docs)
    text, what = mutate_json(json.loads(lines[i]), rng)
    lines[i] = text.encode()
    return b"\n".join(lines), f"line {i + 1}: {what}"


def _same_json(raw: bytes, original) -> bool:
    try:
        return [json.loads(x) for x in raw.decode().splitlines() if x.strip()] == original
    except (ValueError, RecursionError):
        return False


# ---------------------------------------------------------------------------------------------- oracles
def run_trace(path: Path, tmp: Path, seconds: float, seed: int) -> Counter:
    from dsv4_index.tools.replay import replay_trace

    good = good_trace(path)
    raw = good.read_bytes()
    ref = replay_trace(good, device="cpu", backend="reference", log=lambda s: None)
    assert ref.ok and ref.stats["steps matching the recording"] == 2, ref.report()
    original = [json.loads(x) for x in raw.decode().splitlines()]
    rng, out, stop = random.Random(seed), Counter(), time.monotonic() + seconds
    mutant, last = tmp / "mutant.jsonl", [time.monotonic()]
    while time.monotonic() < stop:
        _progress("traces", out, last)
        data, what = mutate_bytes(raw, rng)
        mutant.write_bytes(data)
        try:
            res = replay_trace(mutant, device="cpu", backend="reference", log=lambda s: None)
        except ValueError as e:
            msg = str(e)
            assert msg.startswith(str(mutant)) and "\n" not in msg, (what, msg)
            out["clean error"] += 1
            continue
        except Exception as e:   # noqa: BLE001 -- the property under test
            raise AssertionError(f"trace mutant ({what}, seed {seed}, #{sum(out.values())}): "
                                 f"{type(e).__name__}: {e}") from e
        if _same_json(data, original):
            assert res.ok and res.stats == ref.stats, (what, res.report())
            out["same JSON, same result"] += 1
        else:
            out["result: ok" if res.ok else f"result: {res.problem.kind}"] += 1
    return out


def run_config(path: Path, seconds: float, seed: int) -> Counter:
    from dsv4_index import DSV4Layout, MetadataPipeline

    good = good_config(path)
    raw = good.read_bytes()
    ref = DSV4Layout.from_config(good, max_model_len=128)
    original = [json.loads(raw)]
    rng, out, stop = random.Random(seed), Counter(), time.monotonic() + seconds
    last = [time.monotonic()]
    while time.monotonic() < stop:
        _progress("configs", out, last)
        kind = rng.random()
        if kind < 0.6:
            text, what = mutate_json(json.loads(raw), rng)
            data = text.encode()
        else:
            data, what = mutate_bytes(raw, rng, jsonl=False)
        path.write_bytes(data)
        try:
            lay = DSV4Layout.from_config(path, max_model_len=128)
            MetadataPipeline(lay, 2, 16, "cpu", backend="reference")
        except ValueError as e:
            # NOTE: errors about the file or one of its fields name the file; the layout's own checks
            # of values against from_config's arguments (e.g. block size vs ratio) name the argument
            assert "\n" not in str(e), (what, str(e))
            out["clean error" if str(path) in str(e) else "clean error (layout check)"] += 1
            continue
        except Exception as e:   # noqa: BLE001 -- the property under test
            raise AssertionError(f"config mutant ({what}, seed {seed}): {type(e).__name__}: {e}") from e
        if _same_json(data, original) or data.strip() == raw.strip():
            assert lay == ref, what
            out["same JSON, same layout"] += 1
        else:
            out["accepted (other layout)" if lay != ref else "accepted (same layout)"] += 1
    return out


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.slow  # ./dev quick skips it
def test_trace_reader_fuzz(tmp_path):
    out = run_trace(tmp_path / "good.jsonl", tmp_path, 0.65 * SECONDS, SEED)
    print(dict(out))
    assert out["clean error"] > 0 and sum(out.values()) > 10


@pytest.mark.slow  # ./dev quick skips it
def test_config_reader_fuzz(tmp_path):
    out = run_config(tmp_path / "config.json", 0.35 * SECONDS, SEED)
    print(dict(out))
    assert out["clean error"] > 0 and sum(out.values()) > 10


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=SECONDS, help="total, split 65/35 between traces and configs")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--max-memory-gb", type=float, default=8.0,
                    help="address-space limit: a runaway allocation becomes a MemoryError (a finding), "
                    "not the OOM killer")
    a = ap.parse_args()
    PROGRESS[0] = 60.0
    if a.max_memory_gb > 0:
        import resource
        lim = int(a.max_memory_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        tr = run_trace(Path(d) / "good.jsonl", Path(d), 0.65 * a.seconds, a.seed)
        cf = run_config(Path(d) / "config.json", 0.35 * a.seconds, a.seed)
        print(f"seed {a.seed}, {time.monotonic() - t0:.0f} s")
        print(f"traces : {sum(tr.values())} mutants, {dict(tr)}")
        print(f"configs: {sum(cf.values())} mutants, {dict(cf)}")
