"""phasekv.config: the one field validator, compressor-key routing, experiment files, overrides and the
learning-rate schedule.  (Bad values reaching the CLI are covered in test_fuzz.py; model-config rules in
test_model.py.)"""

import json
import math

import pytest

from phasekv.config import (
    MAX_CONFIG_BYTES,
    DataConfig,
    EvalConfig,
    Experiment,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    load_yaml,
    parse_override,
    parse_yaml,
)

MODEL = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "local_window": 16, "compressor": "gated", "window": 8, "stride": 8}


def test_old_flat_configs_load_and_round_trip():
    flat = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, local_window=4, compressor="gated", window=8, stride=4, gate="vector",
                csa_block=4, hca_block=128, index_topk=0, tied_kv=False)  # every compressor's keys, as old files
    config = ModelConfig.from_dict(flat)
    assert list(config.compressors) == ["gated"] and config.options("gated").geometry() == (8, 4)
    assert config.options("gated").gate == "vector"
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", True, "model.hidden_size: must be an integer, got True"),  # a bool is no integer
    ("hidden_size", 8.0, "model.hidden_size: must be an integer, got 8.0"),
    ("rope_theta", float("inf"), "model.rope_theta: must be a finite number"),
    ("rope_part", "middle", "model.rope_part: must be one of ['first', 'last'], got 'middle'"),
    ("rope_theta", 0.0, "model.rope_theta: must be > 0, got 0.0"),
    ("num_hidden_layers", 513, "model.num_hidden_layers: must be <= 512, got 513"),
])
def test_the_validator_names_the_field_and_what_is_allowed(field, value, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig(**{**MODEL, field: value})


def test_integers_are_accepted_for_float_fields_and_become_floats():
    config = ModelConfig(**{**MODEL, "rope_theta": 500})
    assert config.rope_theta == 500.0 and isinstance(config.rope_theta, float)


def test_flat_compressor_keys_are_routed_to_the_compressor_options():
    config = ModelConfig(**MODEL)
    assert config.compressors["gated"].geometry() == (8, 8) and "window" not in config.to_dict()
    assert config.to_dict()["compressors"]["gated"]["window"] == 8
    with pytest.raises(ValueError, match="model.compressors.gated.window: must be >= 1"):
        ModelConfig(**{**MODEL, "window": 0})
    # a key no compressor knows is an error; the options of an unused compressor are dropped
    with pytest.raises(ValueError, match="model.windw: unknown key"):
        ModelConfig(**{**MODEL, "windw": 8})
    assert list(ModelConfig(**{**MODEL, "csa_block": 4}).compressors) == ["gated"]


def test_yaml_refuses_duplicate_keys_aliases_and_deep_nesting():
    with pytest.raises(ValueError, match="duplicate key 'lr'"):
        parse_yaml("train:\n  lr: 1\n  lr: 2\n", "x.yaml")
    with pytest.raises(ValueError, match=r"aliases \(\*a\) are not allowed"):
        parse_yaml("a: &a [1, 2]\nb: *a\n", "x.yaml")
    with pytest.raises(ValueError, match="nested more than 32 levels"):
        parse_yaml("[" * 40 + "]" * 40, "x.yaml")
    assert parse_yaml("a: [1, 2.5, x]", "x.yaml") == {"a": [1, 2.5, "x"]}


def test_overrides_set_one_leaf_parsed_as_yaml_and_leave_the_tree_alone():
    tree = {"model": dict(MODEL), "train": {"lr": 0.1}}
    out = apply_overrides(tree, ["train.lr=3.0e-3", "model.layer_types=[full, gated]", "eval.stride=4"])
    assert out["train"]["lr"] == 0.003 and out["model"]["layer_types"] == ["full", "gated"]
    assert out["eval"] == {"stride": 4}  # a known section that was missing is created
    assert tree == {"model": dict(MODEL), "train": {"lr": 0.1}}  # a copy was changed
    assert parse_override("a.b=c=d") == (["a", "b"], "c=d")
    with pytest.raises(ValueError, match="no section 'bogus'"):
        apply_overrides(tree, ["bogus.x=1"])
    with pytest.raises(ValueError, match="expected KEY.PATH=VALUE"):
        apply_overrides(tree, ["train.lr"])
    with pytest.raises(ValueError, match="empty key component"):
        apply_overrides(tree, ["train..lr=1"])


def test_experiment_resolves_every_section_and_round_trips(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("model:\n" + "".join(f"  {k}: {v}\n" for k, v in MODEL.items()) + "train:\n  steps: 7\n"
                    "notes: why this run\n")
    exp = Experiment.from_file(path, ["train.warmup_steps=2"])
    assert exp.train.steps == 7 and exp.train.warmup_steps == 2 and exp.data == DataConfig()
    assert exp.eval == EvalConfig() and exp.tree["notes"] == "why this run"
    assert set(exp.tree) == {"model", "data", "train", "eval", "notes"}
    assert exp.tree["train"]["lr"] == TrainConfig().lr  # defaults are written out: the tree is the whole config
    assert Experiment.from_tree(json.loads(json.dumps(exp.tree))).tree == exp.tree
    with pytest.raises(ValueError, match="traning: unknown section"):
        Experiment.from_tree({**exp.tree, "traning": {}})
    with pytest.raises(ValueError, match="data.local_window: 8 differs from model.local_window=16"):
        Experiment.from_tree({**exp.tree, "data": {"local_window": 8}})
    with pytest.raises(ValueError, match="expected a mapping with a 'model' section"):
        (tmp_path / "bad.yaml").write_text("- 1\n")
        load_yaml(tmp_path / "bad.yaml")


def test_learning_rate_warms_up_linearly_then_decays_by_cosine():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert [cfg.lr_at(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert cfg.lr_at(10) == pytest.approx(1.0)  # the top of the cosine
    assert cfg.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down
    assert cfg.lr_at(110) == pytest.approx(0.1)  # the floor: lr * min_lr_ratio
    assert cfg.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    restart = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, lr_horizons=[60])
    assert restart.lr_at(59) < 0.11 and restart.lr_at(60) > 0.5  # a warm restart at the horizon
    with pytest.raises(ValueError, match="train.lr_horizons: must be increasing integers"):
        TrainConfig(steps=110, warmup_steps=10, lr_horizons=[60, 50])


def test_sequence_length_counts_every_token_of_an_example():
    data = DataConfig(n_records=4, n_queries=3, key_tokens=2, value_tokens=1, prefix_max=5, outer_max=6,
                      gap_fillers=2, local_window=4)
    assert data.record_length == 3
    assert data.seq_len == 1 + 5 + 6 + 2 + (4 + 3) * 3  # <bos>, both filler budgets, scattered fillers, records
    with pytest.raises(ValueError, match="data.n_records: 5 distinct keys needed, only 4 exist"):
        DataConfig(n_records=5, n_keys=2, key_tokens=2, local_window=4)


@pytest.mark.parametrize("text, match", [
    ("model: {}\nnotes: 2024-05-01\n", "value at notes is a date"),
    ("model: {}\nwhen: 2024-05-01 10:00:00\n", "value at when is a timestamp"),
    ("model: {}\nblob: !!binary aGVsbG8=\n", "value at blob is binary data"),
    ("model: {}\ntags: !!set {a, b}\n", "value at tags is a set"),
    ("model: {}\n? [a, b]\n: 1\n", "mapping key must be a plain value"),
    ("model: {}\n1: x\n", "mapping key 1 at top level is a int"),
    ("model: {}\nbad: !!timestamp 2024-13-45\n", "not valid YAML"),
])
def test_yaml_values_json_cannot_hold_are_refused_in_one_line(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_yaml(path)


def test_override_values_and_config_size(tmp_path):
    assert parse_override("train.lr=3e-3") == (["train", "lr"], 0.003)  # YAML 1.1 alone reads a string
    assert parse_override("notes=hello") == (["notes"], "hello")
    with pytest.raises(ValueError, match="is a date"):
        parse_override("notes=2024-05-01")
    big = tmp_path / "big.yaml"
    big.write_text("model: {}\n" + "# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(ValueError, match="a config may hold at most"):
        load_yaml(big)
    with pytest.raises(ValueError, match="is not a regular file"):
        load_yaml(tmp_path)


# every kind of node PyYAML's safe loader builds, as YAML text
_SCALARS = ["1", "-3", "0x1f", "0o17", "1_000", "3.5", "3e-3", "1.0e+5", ".inf", "-.inf", ".nan", "true", "no", "~",
            "null", "''", "hello", "'2024-05-01'", "2024-05-01", "2001-12-14t21:59:43.10-05:00", "2024-13-45",
            "!!binary aGVsbG8=", "!!binary '@@@'", "!!int 7", "!!float 1", "!!str 5", "!!bool yes", "!!null ''",
            "!!timestamp 2024-01-01", "!!set {a, b}", "!!omap [a: 1]", "!!pairs [a: 1]", "12:30:00", "1:20",
            "&a 1", "*a", "!!python/object:os.system x", "'\\u00e9'", "\"\\x00\"", "[1, [2, [3]]]", "{a: {b: 1}}",
            "{? [a]: 1}", "{[1]: 2}", "{1: 2}", "{null: 2}", "=", "<<: {a: 1}", "!custom 1", "%", "@x", "`x"]


def _random_document(rng) -> str:
    lines = ["model: {}"] if rng.random() < 0.8 else []
    for i in range(rng.randrange(1, 4)):
        key = rng.choice([f"k{i}", f"k{i}", f"k{i}", f"'k{i}'", f"? [k{i}]", f"{i}", f"2024-01-0{i + 1}"])
        value = rng.choice(_SCALARS)
        lines.append(f"{key}: {value}" if not key.startswith("?") else f"{key}\n: {value}")
    return "\n".join(lines) + "\n"


def test_no_yaml_document_gives_a_traceback(tmp_path):
    """Generated documents over every node type of the safe loader: each is accepted as plain JSON-writable data
    (written back unchanged) or refused with a one-line ValueError; nothing else escapes."""
    import random

    rng = random.Random(0)
    path = tmp_path / "c.yaml"
    accepted = refused = 0
    for _ in range(600):
        path.write_text(_random_document(rng))
        try:
            tree = load_yaml(path)
        except ValueError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(f"config {path}")
            refused += 1
            continue
        assert json.loads(json.dumps(tree, allow_nan=True)).keys() == tree.keys()
        accepted += 1
    assert accepted > 30 and refused > 30


def test_model_config_init_is_the_class_own_and_keyword_only():
    """ModelConfig writes its own __init__ (no patch at import time): keyword-only, flat compressor keys routed, every
    field not given at its default (a fresh list or dict each time)."""
    assert ModelConfig.__init__.__qualname__ == "ModelConfig.__init__"
    with pytest.raises(TypeError):
        ModelConfig(256)
    a, b = ModelConfig(), ModelConfig(compressor="gated", window=8, stride=4)
    assert a.layer_types == ["full", "full"] and a.compressors == {} and a.hidden_size == 128
    assert b.options("gated").geometry() == (8, 4) and b.layer_types == ["gated", "gated"]
    a.layer_types.append("full")
    assert ModelConfig().layer_types == ["full", "full"]
    with pytest.raises(ValueError, match="model.windw: unknown key"):
        ModelConfig(windw=8)
