"""``DSV4Layout.from_config`` errors name the config they came from (issue 20): a bad ``groups=`` list,
another argument or the layout's own checks read ``from_config(<name | path | dict>): ...`` and are
``ConfigError`` s (``ValueError`` s) with ``source`` set; errors of the config file itself keep naming
the file (and line) as before."""

from __future__ import annotations

import json
import re

import pytest

from dsv4_index import DSV4Layout
from dsv4_index.config import ConfigError, shipped_config, shipped_config_path

BAD_LAYERS = [dict(role="mla"), dict(role="swa"), dict(role="c4_state", layers="0-3"), dict(role="c128_state")]


def _error(config, **kw) -> ConfigError:
    kw.setdefault("max_model_len", 4096)
    with pytest.raises(ValueError) as e:
        DSV4Layout.from_config(config, **kw)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value), repr(e.value)
    return e.value


def test_group_errors_name_the_shipped_config_the_file_or_the_dict(tmp_path):
    e = _error("flash", groups=BAD_LAYERS)
    assert str(e) == "from_config('flash'): groups[2].layers must be a list of layer indices, got '0-3'"
    assert (e.source, e.field) == ("flash", "groups[2].layers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shipped_config("flash")))
    for given in (path, str(path), tmp_path):  # NOTE: a folder is named as given
        e = _error(given, groups=[dict(role="mla"), dict(role="swa")])
        assert str(e) == f"from_config({str(given)!r}): groups: no group serves the 'c4_state' caches of layers " \
                         f"[2, 4, 6, 8, 10, 12, 14, 16]...", str(e)
        assert e.source == str(given)
    e = _error(shipped_config("flash"), groups="sglang")
    assert str(e) == "from_config(dict): groups must be None, 'vllm' or a list of group dicts, got 'sglang'"


def test_other_argument_and_layout_errors_name_the_config_too():
    e = _error("tiny", kernel_block_size={"swa_9": 4})
    assert re.fullmatch(r"from_config\('tiny'\): kernel_block_size names unknown group\(s\) \['swa_9'\]; .*", str(e))
    e = _error(shipped_config_path("tiny"), max_model_len=0)
    assert str(e) == f"from_config({str(shipped_config_path('tiny'))!r}): max_model_len must be an int >= 1, got 0"
    assert isinstance(e.__cause__, ValueError) and not isinstance(e.__cause__, ConfigError)


def test_errors_of_the_file_itself_keep_their_form(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**shipped_config("tiny"), "sliding_window": 0}))
    e = _error(path)
    assert str(e).startswith(f"config ({path}:") and "sliding_window" in str(e), str(e)
