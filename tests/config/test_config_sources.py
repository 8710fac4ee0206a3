"""``DSV4Layout.from_config`` gives one layout from every config source (dsv4_index.config)."""

import json

import pytest

from dsv4_index.config import (CONFIG_DIR, SHIPPED, normalize_config, shipped_config,
                               shipped_config_path)
from dsv4_index.geometry import DSV4Layout
from models.deepseek_v4 import load_config

L = 131072
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def layout(src):
    return DSV4Layout.from_config(src, max_model_len=L)


def hf_fields(name):
    """The shipped config spelled the transformers 5.x way: ``layer_types`` for the
    ``num_hidden_layers`` main layers (none for MTP layers) and ``compress_rates``."""
    d = shipped_config(name)
    ratios = d.pop("compress_ratios")
    nz = sorted({r for r in ratios if r})
    rates = {CSA: nz[0], HCA: nz[-1]}
    kind = {0: SWA, nz[0]: CSA, nz[-1]: HCA}
    d["layer_types"] = [kind[r] for r in ratios[:d["num_hidden_layers"]]]
    d["compress_rates"] = rates
    for k in ("architectures", "model_type"):
        d.pop(k)
    return d


class FakePretrainedConfig:
    """Duck type of a transformers ``PretrainedConfig``: attributes plus ``to_dict()``."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def to_dict(self):
        return dict(self.__dict__)


V4 = ("flash", "pro", "tiny")  # NOTE: DeepSeek-V4 configs (the V4.1 ones: tests/v41/)


@pytest.fixture(scope="module", params=V4)
def shipped(request):
    name = request.param
    return name, layout(shipped_config(name))


def test_shipped_names_and_files():
    assert SHIPPED == V4 + ("v41_flash", "tiny_v41")
    for name in SHIPPED:
        assert shipped_config_path(name) == CONFIG_DIR / f"{name}.json"
        assert shipped_config(name)["model_type"] == ("deepseek_v4" if name in V4 else "deepseek_v41_text")
    a = shipped_config("tiny")
    a["num_hidden_layers"] = 99                              # a fresh copy each call
    assert shipped_config("tiny")["num_hidden_layers"] == 4
    with pytest.raises(ValueError, match="huge"):
        shipped_config("huge")


def test_file_dir_dict_name_and_dataclass(shipped, tmp_path):
    name, ref = shipped
    path = CONFIG_DIR / f"{name}.json"
    (tmp_path / "config.json").write_text(path.read_text())
    sources = {"name": name, "path": path, "str path": str(path), "model dir": tmp_path,
               "str model dir": str(tmp_path), "dict": shipped_config(name),
               "DSV4Config": load_config(name), "DSV4Config.to_dict": load_config(name).to_dict()}
    for what, src in sources.items():
        assert layout(src) == ref, what
    assert len(ref.compress_ratios) == shipped_config(name)["num_hidden_layers"] + 1


def test_layer_types_dicts(shipped):
    name, ref = shipped
    f = hf_fields(name)
    assert layout(f) == ref                                   # main layers only: MTP -> SWA
    full = dict(f, layer_types=f["layer_types"] + [SWA] * f["num_nextn_predict_layers"])
    assert layout(full) == ref                                # MTP layers spelled out
    both = dict(f, compress_ratios=shipped_config(name)["compress_ratios"])
    assert layout(both) == ref                                # consistent: fine
    assert layout(FakePretrainedConfig(**f)) == ref           # duck-typed PretrainedConfig


def test_normalize_keeps_original_keys():
    d = normalize_config(hf_fields("tiny"))
    assert d["hidden_size"] == 64 and d["layer_types"][:2] == [SWA, CSA]
    assert d["compress_ratios"] == shipped_config("tiny")["compress_ratios"]
    assert d["num_nextn_predict_layers"] == 1 and d["index_topk"] == 4 and d["sliding_window"] == 8
    no_mtp = normalize_config({"num_hidden_layers": 2, "compress_ratios": [0, 128], "sliding_window": 8})
    assert no_mtp["num_nextn_predict_layers"] == 0 and no_mtp["index_topk"] is None   # no c4 layer


def test_legacy_compress_rate_keys():
    f = hf_fields("tiny")
    rates = f.pop("compress_rates")
    f["compress_rate_csa"], f["compress_rate_hca"] = rates[CSA], rates[HCA]
    assert layout(f) == layout("tiny")


# --------------------------------------------------------------------------------------------------
# transformers' DeepseekV4Config (the class itself, built from fields; nothing from the hub)

def deepseek_v4_config_cls():
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "DeepseekV4Config", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4Config (needs >= 5.17)")
    return cls


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_transformers_deepseek_v4_config(shipped, tmp_path):
    cls = deepseek_v4_config_cls()
    name, ref = shipped
    cfg = cls(**hf_fields(name))
    n = cfg.num_hidden_layers
    assert len(cfg.layer_types) == n and cfg.num_nextn_predict_layers == 1
    assert "compress_ratios" not in cfg.to_dict()
    lay = layout(cfg)
    assert lay == ref
    assert lay.num_layers == n + 1 and lay.compress_ratios[-1] == 0   # the MTP layer: SWA-only
    cfg.save_pretrained(tmp_path)                             # a model directory as transformers writes it
    assert layout(tmp_path) == ref
    assert layout(cls.from_pretrained(tmp_path)) == ref


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_transformers_from_published_json(name):
    """transformers folds the published ``compress_ratios`` (0 / 4 / 128 only) into ``layer_types``."""
    cls = deepseek_v4_config_cls()
    cfg = cls(**{k: v for k, v in shipped_config(name).items() if k != "architectures"})
    assert layout(cfg) == layout(name)


# --------------------------------------------------------------------------------------------------
# errors name the problem and the file

def test_missing_file_and_dir(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ValueError, match="no such file.*nope"):
        layout(missing)
    with pytest.raises(ValueError, match=f"no such file.*{tmp_path.name}.*config.json"):
        layout(tmp_path)                                      # a directory without config.json
    with pytest.raises(ValueError, match="shipped names"):
        layout("huge")
    with pytest.raises(ValueError, match="config must be"):
        layout(42)


def test_broken_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"num_hidden_layers": 4,')
    with pytest.raises(ValueError, match=r"config: .*config\.json is not valid JSON: ") as e:
        layout(p)
    assert str(p) in str(e.value) and isinstance(e.value.__cause__, json.JSONDecodeError)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        layout(tmp_path)


@pytest.mark.parametrize("key", ["num_hidden_layers", "sliding_window", "compress_ratios", "index_topk"])
def test_missing_keys_name_the_file(tmp_path, key):
    d = shipped_config("tiny")
    d.pop(key)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"missing key.*{key}") as e:
        layout(p)
    assert str(p) in str(e.value)
    with pytest.raises(ValueError, match=f"missing key.*{key}"):
        layout(d)


def test_inconsistent_layer_types(tmp_path):
    f = hf_fields("tiny")
    f["compress_ratios"] = [0, 4, 16, 16, 0]                  # layer 3 is CSA in layer_types
    p = tmp_path / "config.json"
    p.write_text(json.dumps(f))
    with pytest.raises(ValueError, match=r"disagree.*layer 3") as e:
        layout(p)
    assert str(p) in str(e.value)


def test_unknown_layer_type(tmp_path):
    f = hf_fields("tiny")
    f["layer_types"][1] = "full_attention"
    p = tmp_path / "config.json"
    p.write_text(json.dumps(f))
    with pytest.raises(ValueError, match="unknown layer type.*full_attention") as e:
        layout(p)
    assert str(p) in str(e.value)
    with pytest.raises(ValueError, match="FakePretrainedConfig.*unknown layer type"):
        layout(FakePretrainedConfig(**f))


@pytest.mark.parametrize("mutate,match", [
    (lambda f: f["layer_types"].pop(), "layer_types has 3 entries"),
    (lambda f: f.__setitem__("layer_types", "sliding_attention"), "layer_types must be a list"),
    (lambda f: f.__setitem__("compress_rates", [4, 16]), "compress_rates must be a dict"),
    (lambda f: f["compress_rates"].__setitem__(CSA, 0), "compress_rates"),
    (lambda f: f.__setitem__("compress_ratios", [0, 4, 16, 4]), "num_nextn_predict_layers"),
    (lambda f: f.__setitem__("num_nextn_predict_layers", -1), "num_nextn_predict_layers"),
])
def test_malformed_layer_types(mutate, match):
    f = hf_fields("tiny")
    mutate(f)
    with pytest.raises(ValueError, match=match):
        layout(f)


def test_existing_path_wins_over_shipped_name(tmp_path, monkeypatch):
    d = shipped_config("tiny")
    d["sliding_window"] = 16
    (tmp_path / "flash").mkdir()
    (tmp_path / "flash" / "config.json").write_text(json.dumps(d))
    monkeypatch.chdir(tmp_path)
    assert layout("flash").sliding_window == 16
    assert layout("pro") == layout(shipped_config("pro"))
