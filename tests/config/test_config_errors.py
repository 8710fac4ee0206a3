"""Every bad config file or field is one ConfigError (a ValueError) naming the file, the line and the
field; the CLI prints it on one stderr line and exits 2."""

import json

import pytest

from dsv4_index.config import BOUNDS, MAX_CONFIG_BYTES, ConfigError, normalize_config, shipped_config
from dsv4_index.geometry import DSV4Layout
from dsv4_index.tools.cli import main


def layout(src):
    return DSV4Layout.from_config(src, max_model_len=1024)


def write(tmp_path, text, name="config.json"):
    p = tmp_path / name
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def pretty(d):
    return json.dumps(d, indent=2)


def cli_fails(capsys, path):
    assert main(["layout", "--config", str(path)]) == 2
    cap = capsys.readouterr()
    assert cap.err.count("\n") == 1 and "Traceback" not in cap.err and str(path) in cap.err, cap.err
    return cap.err


def test_nested_100000_deep(tmp_path, capsys):
    p = write(tmp_path, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON: line 1: JSON nested 100001 deep "
                                          r"\(at most 32 allowed\)"):
        layout(p)
    cli_fails(capsys, p)


@pytest.mark.parametrize("key,value,match", [
    ("sliding_window", 2 ** 40, rf"sliding_window must be an int in \[1, {BOUNDS['sliding_window']}\] \(tokens\), "
                                r"got 1099511627776"),
    ("sliding_window", "128", r"sliding_window must be an int .*got '128'"),
    ("sliding_window", 128.0, r"sliding_window must be an int .*got 128.0"),
    ("num_hidden_layers", 10 ** 9, r"num_hidden_layers must be an int in \[1, 4096\]"),
    ("index_topk", 0, r"index_topk must be an int in \[1, 65536\], got 0"),
])
def test_bad_field_names_file_line_and_field(tmp_path, capsys, key, value, match):
    d = shipped_config("tiny")
    d[key] = value
    p = write(tmp_path, pretty(d))
    line = next(i for i, x in enumerate(pretty(d).splitlines(), 1) if f'"{key}"' in x)
    with pytest.raises(ConfigError, match=match) as e:
        layout(p)
    assert str(e.value).startswith(f"config ({p}:{line}): {key} must")
    assert (e.value.source, e.value.line, e.value.field) == (str(p), line, key)
    assert f"{p}:{line}" in cli_fails(capsys, p)


def test_index_topk_x_without_c4_layers(tmp_path):
    """A model with c128 layers only: index_topk is unused, but a string is still rejected (it
    used to reach the layout)."""
    d = shipped_config("tiny")
    d["compress_ratios"] = [0, 16, 16, 0, 0]
    d["index_topk"] = "x"
    with pytest.raises(ConfigError, match=r"config \(dict\): index_topk must be an int in \[1, 65536\], got 'x'"):
        layout(d)
    p = write(tmp_path, pretty(d))
    with pytest.raises(ConfigError, match=rf"config \({p}:\d+\): index_topk"):
        layout(p)
    d["index_topk"] = None
    assert layout(d).index_topk is None


def test_huge_compress_ratio(tmp_path):
    d = shipped_config("tiny")
    d["compress_ratios"] = [0, 4, 2 ** 40, 4, 0]
    with pytest.raises(ConfigError, match=r"compress_ratios must be a list of ints in \[0, 65536\]"):
        layout(d)


@pytest.mark.parametrize("content,match", [
    (b"", r"not valid JSON: line 1: not JSON \(truncated\?\): Expecting value"),
    (b"\x89PNG\r\n\x1a\n\x00\x00",
     r"not valid JSON: line 1: not UTF-8 text \(byte 0x89 at column 1; a binary file\?\)"),
    (b'{\n "a": 1,\n "b": "\xff"}', r"not valid JSON: line 3: not UTF-8 text \(byte 0xff"),
    (b'{"sliding_window": 8, "sliding_window": 9}', r"not valid JSON: line 1: unusable JSON: duplicate key "
                                                     r"'sliding_window'"),
    (b'{"sliding_window": NaN}', r"line 1: sliding_window: NaN is not a JSON number \(unusable JSON\)"),
    (b'{"num_hidden_layers": 4,\n "compress_ratios": [0, 4', r"line 2: not JSON \(truncated\?\)"),
    (b"[1, 2]", r"must hold a JSON object, got list"),
    (b'{"a": 1' + b"0" * 5000 + b"}", r"unusable JSON: .*digits"),
])
def test_bad_files(tmp_path, capsys, content, match):
    p = write(tmp_path, content)
    with pytest.raises(ConfigError, match=match) as e:
        normalize_config(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    cli_fails(capsys, p)


def test_missing_file_directory_and_size(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"config: no such file .*nope\.json"):
        layout(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=rf"config: no such file '{tmp_path}/config.json'"):
        layout(tmp_path)                                       # a model directory without config.json
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=r"config: is a directory '.*config\.json/config\.json'|no such file"):
        layout(tmp_path / "config.json")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)                       # sparse: no real 16 MiB written
    with pytest.raises(ConfigError, match=rf"is larger than {MAX_CONFIG_BYTES} bytes"):
        layout(big)
    cli_fails(capsys, big)


def test_a_good_file_still_reads_the_same(tmp_path):
    d = shipped_config("flash")
    assert normalize_config(write(tmp_path, pretty(d))) == normalize_config(d) == normalize_config("flash")
