"""The foundations the other features build on: the import layers, the compressor interface, the model
families, checkpoints of every family, old configs, and the `eval:` section."""

import ast
import json
from pathlib import Path

import pytest
import torch

import phasekv
from phasekv import ModelConfig, build_model, families
from phasekv.checkpoint import load_weights, save_checkpoint
from phasekv.compression import compressors_of
from phasekv.config import Experiment, TransformersModelConfig, model_config_from_dict
from phasekv.probes.gates import gate_statistics
from tests.helpers import tiny

SRC = Path(__file__).resolve().parents[1] / "src" / "phasekv"
CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


# ----------------------------------------------------------------------------- the import graph


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (type-only imports are no dependency)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """module -> phasekv modules it imports anywhere in its source (top level or inside functions)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("phasekv"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phasekv"):
                for alias in node.names:  # `from phasekv.x import y`: y may itself be a module
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t != name}
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return False


def test_import_graph_has_no_cycle():
    graph = import_graph()
    cycles = sorted(m for m in graph if _reaches(graph, m, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("lower, forbidden", [
    ("phasekv.config", ["phasekv"]),  # the bottom layer imports nothing of phasekv
    ("phasekv.layers", ["phasekv"]),
    ("phasekv.figures", ["phasekv.config", "phasekv.model", "phasekv.evaluate", "phasekv.probes", "phasekv.theory"]),
    ("phasekv.compression", ["phasekv.attention", "phasekv.model", "phasekv.train", "phasekv.evaluate",
                             "phasekv.families", "phasekv.checkpoint"]),
    ("phasekv.evaluate", ["phasekv.train", "phasekv.report", "phasekv.cli", "phasekv.probes"]),
    ("phasekv.probes", ["phasekv.train", "phasekv.report", "phasekv.cli"]),
    ("phasekv.report", ["phasekv.cli"]),
    ("phasekv.train", ["phasekv.evaluate", "phasekv.probes", "phasekv.report", "phasekv.cli"]),
])
def test_no_lower_layer_imports_a_higher_one(lower, forbidden):
    graph = import_graph()
    for module, targets in graph.items():
        if not _in(module, lower):
            continue
        for target in targets:
            if _in(target, lower) and lower != "phasekv.config":
                continue  # within its own package
            assert not any(_in(target, f) for f in forbidden), f"{module} imports {target}"


def test_only_cli_modules_define_argument_parsers():
    for path in SRC.rglob("*.py"):
        if _module_name(path).startswith("phasekv.cli"):
            continue
        source = path.read_text()
        assert "argparse" not in source and "add_parser" not in source, path


def test_no_parameter_name_matching_outside_the_compressors():
    """Roles of compressor parameters come from the compressor interface, never from name strings."""
    for path in SRC.rglob("*.py"):
        if _module_name(path).startswith("phasekv.compression"):
            continue
        source = path.read_text()
        # phasekv/indexer.py sets transformers' own indexers' `index_topk` (their attribute, found by class, for the
        # dense warm-up): not a phasekv compressor option
        topk = () if _module_name(path) == "phasekv.indexer" else ("index_topk",)
        for pattern in ('".compressor."', "'_gate'", '"_gate"', '"_gate_bias"', 'getattr(self.compressor', *topk):
            assert pattern not in source, f"{path} contains {pattern}"


def test_functions_are_short_or_say_why():
    """No function longer than 60 lines without a `# long: reason` comment on its first line."""
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            length = node.end_lineno - node.lineno + 1 if isinstance(node, ast.FunctionDef) else 0
            if length > 60:
                header = " ".join(lines[node.lineno - 1:node.body[0].lineno])
                assert "# long:" in header, f"{path}:{node.lineno} {node.name} has {length} lines"


# ----------------------------------------------------------------------------- compressor interface


def test_a_compressor_from_outside_the_package_brings_its_own_options():
    """tests/toy_compressor.py registers `toy_mean` with a knob (`scale`) config.py has never heard of."""
    assert "scale" not in (SRC / "config.py").read_text().split("class TransformersModelConfig")[0].split(
        "class ModelConfig")[1]
    config = tiny(compressor="toy_mean", span=4, scale=2.0)
    assert config.options("toy_mean").scale == 2.0 and config.phase_stride == 4
    with pytest.raises(ValueError, match="toy_mean.scale"):
        tiny(compressor="toy_mean", scale=-1.0)
    with pytest.raises(ValueError, match="toy_mean.span"):
        tiny(compressor="toy_mean", span="three")
    assert ModelConfig.from_dict(config.to_dict()) == config  # round trip through plain data


def test_old_flat_configs_load_and_round_trip():
    flat = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, local_window=4, compressor="gated", window=8, stride=4, gate="vector",
                csa_block=4, hca_block=128, index_topk=0, tied_kv=False)  # every compressor's keys, as old files
    config = ModelConfig.from_dict(flat)
    assert list(config.compressors) == ["gated"] and config.options("gated").geometry() == (8, 4)
    assert config.options("gated").gate == "vector"
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_every_bundled_checkpoint_loads_through_the_public_function():
    found = sorted(p for p in CHECKPOINTS.iterdir() if (p / "model.safetensors").is_file())
    assert len(found) >= 8
    for path in found:
        model, config = phasekv.load_checkpoint(path)
        assert isinstance(config, ModelConfig | TransformersModelConfig) and not model.training
        ids = torch.randint(0, config.vocab_size, (1, 40))
        with torch.no_grad():
            assert torch.isfinite(families.logits(model, ids)).all()


def test_staggered_layers_report_gates_on_their_real_windows():
    """Layer 1 of a staggered W = S = 4 model starts its windows at position 2.  A token X placed at every
    position = 3 mod 4 sits at offset 1 of layer 1's windows (and offset 3 of layer 0's); a gate that
    attends to X must show that, which it does only if statistics use the layer's true window starts."""
    config = tiny(compressor="gated", window=4, stride=4, stagger=True, num_key_value_heads=1)
    model = _gates_see_token(config, X=5)
    assert [c.offset for _, c in compressors_of(model)] == [0, 2]
    ids = torch.randint(6, config.vocab_size, (3, 42))
    ids[:, 3::4] = 5
    gates = {(g["layer"], g["branch"]): g for g in gate_statistics(model, ids, progress=False)}
    assert gates[(0, "k")]["profile"] == pytest.approx([0, 0, 0, 1], abs=1e-4)
    assert gates[(1, "k")]["profile"] == pytest.approx([0, 1, 0, 0], abs=1e-4)
    assert gates[(1, "k")]["first_window_start"] == 2
    assert gates[(1, "k")]["offset_phases"] == [2, 3, 0, 1]  # the profile's peak is at phase 3 in both layers


def test_staggered_heads_report_gates_on_their_own_windows():
    """With head stagger (W = S = 4, 2 KV heads), head 1 starts its windows at 2: X at every position = 3 mod 4
    sits at offset 3 of head 0's windows and offset 1 of head 1's, in each layer."""
    config = tiny(compressor="gated", window=4, stride=4, head_stagger=True)
    model = _gates_see_token(config, X=5)
    ids = torch.randint(6, config.vocab_size, (3, 42))
    ids[:, 3::4] = 5
    gates = {(g["layer"], g["kv_head"]): g for g in gate_statistics(model, ids, progress=False) if g["branch"] == "k"}
    for layer in (0, 1):
        assert gates[(layer, 0)]["profile"] == pytest.approx([0, 0, 0, 1], abs=1e-4)
        assert gates[(layer, 1)]["profile"] == pytest.approx([0, 1, 0, 0], abs=1e-4)
        assert gates[(layer, 1)]["first_window_start"] == 2
        assert gates[(layer, 1)]["offset_phases"] == [2, 3, 0, 1]


def _gates_see_token(config, X: int):
    """A model whose residual stream is the token embedding and whose key gates attend only to token X."""
    torch.manual_seed(0)
    model = build_model(config).eval()
    layers = compressors_of(model)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the token embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[X] = 0.0
        emb[X, 0] = 1.0  # only X has a component on hidden dim 0
        for _, c in layers:
            for name, p in c.gate_parameters().items():
                p.zero_()
                if name == "k_gate":
                    p[:, 0, :] = 50.0  # every offset's logit = 50 * (normalized h)[0]: large only for X
    return model


def test_cycling_excludes_each_layers_boundary_phase():
    from phasekv.probes.cycle import boundary_phases, cycle_stride

    assert boundary_phases(build_model(tiny(compressor="gated", window=4, stride=4))) == [3]
    assert boundary_phases(build_model(tiny(compressor="gated", window=4, stride=4, stagger=True))) == [1, 3]
    with pytest.raises(ValueError, match="staggers its KV heads"):
        cycle_stride(build_model(tiny(compressor="gated", window=4, stride=4, head_stagger=True)))


# ----------------------------------------------------------------------------- model families


QWEN3 = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": False,
         "use_sliding_window": False}


def test_transformers_model_sections_are_validated_by_name():
    assert isinstance(model_config_from_dict(QWEN3), TransformersModelConfig)
    with pytest.raises(ValueError, match="model.hiden_size: not a field of transformers' Qwen3Config"):
        model_config_from_dict({**QWEN3, "hiden_size": 3})
    with pytest.raises(ValueError, match="model.model_type: transformers has no model type 'qwen99'"):
        model_config_from_dict({**QWEN3, "model_type": "qwen99"})


@pytest.mark.slow
def test_qwen3_from_transformers_trains_and_evaluates_like_the_same_phasekv_model(tmp_path):
    """`phasekv train` trains transformers' Qwen3ForCausalLM; `phasekv eval --checkpoint` evaluates it;
    a phasekv full-attention model with the same weights is the same function and gets the same metrics."""
    from phasekv.cli import main
    from phasekv.train import train
    from tests.test_train import TINY

    tree = {**TINY, "model": QWEN3, "train": {**TINY["train"], "steps": 4, "checkpoint_every": 4}}
    train(Experiment.from_tree(tree), tmp_path / "run", progress=False)
    hf_model, hf_config = phasekv.load_checkpoint(tmp_path / "run")
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    same = build_model(ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, local_window=TINY["model"]["local_window"]))
    load_weights(same, {k: v for k, v in hf_model.state_dict().items()}, "hf")
    ids = torch.randint(0, 256, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(same(ids), hf_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    tree_json = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    save_checkpoint(tmp_path / "same", same, {**tree_json, "model": same.config.to_dict()})
    flags = ["--clusters", "2", "--records", "24", "--demos", "4", "--no-progress", "--seed", "3"]
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf_eval"), *flags]) == 0
    assert main(["eval", "--checkpoint", str(tmp_path / "same"), "--out", str(tmp_path / "pk_eval"), *flags]) == 0
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("hf_eval", "pk_eval"))
    assert a["per_residue"] == b["per_residue"] and a["n_prompts"] == b["n_prompts"] > 0
    preds = [(tmp_path / d / "predictions.jsonl").read_text() for d in ("hf_eval", "pk_eval")]
    assert preds[0] == preds[1]
