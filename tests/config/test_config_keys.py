"""Every config error names the key, with its path: explicit ``groups=`` lists (wrong types, unknown and
ignored keys: explicit groups accept only the keys they use), ``NaN`` / ``Infinity`` in a config.json,
list entries of ``compress_ratios`` / ``layer_types``."""

from __future__ import annotations

import json

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.config import ConfigError, shipped_config

MLA, SWA, C4, C128 = dict(role="mla"), dict(role="swa"), dict(role="c4_state"), dict(role="c128_state")


def groups_error(groups, field, match):
    with pytest.raises(ConfigError) as e:
        DSV4Layout.from_config("flash", max_model_len=4096, groups=groups)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("from_config('flash'): "), msg
    assert e.value.field == field, (e.value.field, msg)
    assert match in msg, msg
    return e.value


@pytest.mark.parametrize("g,field,match", [
    (dict(layer_names=[5]), "groups[2].layer_names[0]", "groups[2].layer_names[0] must be a layer name (a string), "
     "got int 5"),
    (dict(layer_names=5), "groups[2].layer_names", "groups[2].layer_names must be a list of layer names, got 5"),
    (dict(layer_names=["model.layers.2.attn.state_cache", None]), "groups[2].layer_names[1]",
     "groups[2].layer_names[1] must be a layer name (a string), got NoneType None"),
    (dict(layer_names=["model.attn"]), "groups[2].layer_names[0]",
     "groups[2].layer_names[0]: layer name 'model.attn' has no 'layers.<i>.' part"),
    (dict(role="c4_state", layers=5), "groups[2].layers", "groups[2].layers must be a list of layer indices, got 5"),
    (dict(role="c4_state", layers=[2, "4"]), "groups[2].layers[1]",
     "groups[2].layers[1] must be a layer index (an int), got str '4'"),
    (dict(role="c4_state", layers=[2, True]), "groups[2].layers[1]", "must be a layer index (an int), got bool"),
    (dict(role="c4_state", name=["mla"]), "groups[2].name", "groups[2].name must be a string, got list ['mla']"),
    (dict(role="c4_state", name=5), "groups[2].name", "groups[2].name must be a string, got int 5"),
    (dict(role="c4_state", name="a\nb"), "groups[2].name", "groups[2].name must be a string"),
    (dict(role=["mla"]), "groups[2].role", "groups[2].role must be a string, got list"),
    (dict(role="c4_state", window=3), "groups[2].window", "groups[2].window: unknown key (a group's window is the "
     "config's sliding_window; explicit groups take role, layers, layer_names, block_size, name)"),
    (dict(role="c4_state", blocksize=4), "groups[2].blocksize", "groups[2].blocksize: unknown key"),
    (dict(role="c4_state", block_size=float("nan")), "groups[2].block_size", "groups[2].block_size must be an int"),
    (dict(role="c4_state", block_size=float("inf")), "groups[2].block_size", "groups[2].block_size must be an int"),
])
def test_group_errors_name_the_key_path(g, field, match):
    groups_error([MLA, SWA, g, C128], field, match)


def test_not_a_dict_and_not_a_list():
    groups_error([MLA, SWA, 5, C128], "groups[2]", "groups[2] must be a dict")
    groups_error(5, "groups", "groups must be None, 'vllm' or a list of group dicts, got int")


def test_explicit_groups_that_use_every_key_still_work():
    lay = DSV4Layout.from_config("flash", max_model_len=4096, groups=[
        dict(role="mla", name="full", block_size=256), dict(layer_names=["model.layers.0.attn.swa_cache"] + [
            f"model.layers.{i}.attn.swa_cache" for i in range(1, 44)], name="sw"), C4, C128])
    assert [g.name for g in lay.groups] == ["full", "sw", "c4_state", "c128_state"]
    MetadataPipeline(lay, 2, 16, "cpu")


@pytest.mark.parametrize("key", ["sliding_window", "index_topk"])
@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_a_file_name_the_key(tmp_path, key, const):
    d = shipped_config("flash")
    text = json.dumps(d, indent=1).replace(f'"{key}": {d[key]}', f'"{key}": {const}')
    assert const in text
    p = tmp_path / "config.json"
    p.write_text(text)
    line = text[:text.index(f'"{key}"')].count("\n") + 1
    with pytest.raises(ConfigError) as e:
        DSV4Layout.from_config(p, max_model_len=4096)
    assert str(e.value) == f"config: {p} is not valid JSON: line {line}: {key}: {const} is not a JSON number " \
                           "(unusable JSON)", str(e.value)
    assert (e.value.line, e.value.field) == (line, key)


def test_nan_in_a_dict_names_the_key():
    for key in ("sliding_window", "index_topk", "num_hidden_layers"):
        d = dict(shipped_config("flash"), **{key: float("nan")})
        with pytest.raises(ConfigError, match=rf"config \(dict\): {key} must be an int .*got nan") as e:
            DSV4Layout.from_config(d, max_model_len=4096)
        assert e.value.field == key


def test_list_entries_are_named():
    d = dict(shipped_config("tiny"), compress_ratios=[0, 4, "4", 4, 0])
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\] is '4'"):
        DSV4Layout.from_config(d, max_model_len=4096)
    d = dict(shipped_config("tiny"), compress_ratios=[0, 4, float("inf"), 4, 0])
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\] is inf"):
        DSV4Layout.from_config(d, max_model_len=4096)
    d = dict(shipped_config("tiny"), layer_types=["sliding_attention", 4])
    d.pop("compress_ratios")
    with pytest.raises(ConfigError, match=r"layer_types\[1\] is 4"):
        DSV4Layout.from_config(d, max_model_len=4096)
