"""The rejection table (state/messages.py): every code words its template with its fields, the position
fields a message carries are the positions its text names, in the same order, and the checks raise by
code (no ValueError built from text in the step checks)."""

import pathlib
import re

import pytest

from dsv4_index.state import messages
from dsv4_index.state.messages import MESSAGES, Rejection, reject

_POS = re.compile(r"write_ids\[(\d+)\]|write run (\d+)|\bslot (\d+)")
_ROOT = pathlib.Path(messages.__file__).parent


def _sample(code):
    vals = {}
    for k, name in enumerate(MESSAGES[code].fields):
        vals[name] = 100 + k if name in messages.POSITIONS else f"<{name}>"
    if code == "null_block":
        vals["src"], vals["src_j"], vals["row"] = "from write_ids[7]", 7, " (batch row 2)"
    return vals


@pytest.mark.parametrize("code", sorted(MESSAGES))
def test_positions_are_what_the_text_names(code):
    e = reject(code, **_sample(code))
    assert isinstance(e, ValueError) and e.code == code
    want = [(m.group(0), k, int(v)) for m in _POS.finditer(str(e))
            for k, v in zip(("j", "r", "slot"), m.groups()) if v is not None]
    assert e.positions() == want


def test_level_is_known_and_templates_distinct():
    assert {m.level for m in MESSAGES.values()} <= {"safe", "full"}
    assert len({m.template for m in MESSAGES.values()}) == len(MESSAGES)


def test_a_wording_is_exact():
    e = reject("hole", i=3, value=5, g=1, slot=7, have=2)
    assert str(e) == "write_starts[3] = 5 leaves a hole: gid 1 of slot 7 holds 2 blocks"
    assert e.fields == dict(i=3, value=5, g=1, slot=7, have=2)
    assert isinstance(Rejection("hole", {}, "x"), ValueError)


@pytest.mark.parametrize("name", ["checks/naive.py", "checks/__init__.py", "checks/kernel.py"])
def test_step_checks_raise_by_code(name):
    assert "raise ValueError(" not in (_ROOT / name).read_text()
