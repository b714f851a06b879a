"""Bad input, every subcommand: exit status 2 (130 on Ctrl-C), exactly one line on stderr, no traceback,
nothing written outside --out, and an existing finished --out left byte-identical.

Most cases run `phasekv.cli.main` in-process (fast); a few run as real processes where only a process
shows the behaviour (a signal, what reaches the real stderr).  The workspace (a tiny trained run, a
copy of the bundled w8s8 checkpoint, a tiny transformers model, a finished eval) is built once.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import phasekv.evaluate.runner as runner_mod
import phasekv.outputs as outputs_mod
from phasekv import families
from phasekv.cli import main
from phasekv.config import MAX_CONFIG_BYTES, Experiment
from phasekv.training.loop import train
from tests.engine import LoopbackServer
from tests.test_endpoint import FakeEngine
from tests.test_evaluate import VOCAB, _tiny_hf
from tests.test_train import TINY

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
EXPERIMENT = {**TINY, "train": {**TINY["train"], "steps": 2, "eval_every": 2, "checkpoint_every": 2,
                                 "eval_sequences": 8},
              "eval": {"stride": 4, "clusters": 2, "records": 32, "demos": 2}}


# ----------------------------------------------------------------------------- workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(REPO / "checkpoints" / "w8s8", root / "w8s8", ignore=shutil.ignore_patterns("gates"))
    (root / "tiny.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    train(Experiment.from_file(root / "tiny.yaml"), root / "run", progress=False)
    assert main(["eval", "--checkpoint", str(root / "run"), "--out", str(root / "done"), "--no-progress"]) == 0
    _tiny_hf(root, VOCAB.words)
    (root / "cases").mkdir()
    (root / "cwd").mkdir()
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` -> a digest of its content ('dir' for directories)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_dir():
            out[rel] = "dir"
        else:  # a FIFO or a symlink loop is named, never read (reading a FIFO blocks)
            out[rel] = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest() if path.is_file() else "other"
    return out


# ----------------------------------------------------------------------------- corruptions (setup steps)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors copied out of the memory-mapped file (which the caller may then overwrite)."""
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def copy_ck(ws: Path, c: Path, source: str = "run/final") -> Path:
    return Path(shutil.copytree(ws / source, c / "ck"))


def edit_config(edit: Callable[[dict], None], source: str = "run/final") -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        ck = copy_ck(ws, c, source)
        tree = json.loads((ck / "config.json").read_text())
        edit(tree)
        (ck / "config.json").write_text(json.dumps(tree))
    return setup


def set_model(**values) -> Callable[[Path, Path], None]:
    return edit_config(lambda tree: tree["model"].update(values))


def config_text(text: str | bytes) -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        ck = copy_ck(ws, c)
        (ck / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def edit_weights(edit: Callable[[dict[str, torch.Tensor]], None], source: str = "run/final"
                 ) -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        ck = copy_ck(ws, c, source)
        state = read_weights(ck / "model.safetensors")
        edit(state)
        save_file(state, str(ck / "model.safetensors"))
    return setup


def poison(value: float, name: str = "model.norm.weight") -> Callable[[dict], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name].clone()
        state[name].view(-1)[0] = value
    return edit


def wrong_shape(state: dict[str, torch.Tensor]) -> None:
    state["model.embed_tokens.weight"] = torch.zeros(3, 5)


def weights_bytes(transform: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        ck = copy_ck(ws, c)
        (ck / "model.safetensors").write_bytes(transform((ck / "model.safetensors").read_bytes()))
    return setup


def pickled_weights(ws: Path, c: Path) -> None:
    ck = copy_ck(ws, c)
    torch.save(read_weights(ck / "model.safetensors"), ck / "model.safetensors")


def zero_norm_eps(ws: Path, c: Path) -> None:
    """rms_norm_eps = 0 with all-zero embeddings: 0 / sqrt(0) gives NaN logits, caught at evaluation."""
    edit_weights(lambda s: s["model.embed_tokens.weight"].zero_())(ws, c)
    tree = json.loads((c / "ck" / "config.json").read_text())
    tree["model"]["rms_norm_eps"] = 0.0
    (c / "ck" / "config.json").write_text(json.dumps(tree))


def hf_copy(edit: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        edit(Path(shutil.copytree(ws / "hf", c / "hf")))
    return setup


def hf_pickled(hf: Path) -> None:
    state = read_weights(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    torch.save(state, hf / "pytorch_model.bin")


def hf_config(**values) -> Callable[[Path], None]:
    def edit(hf: Path) -> None:
        tree = json.loads((hf / "config.json").read_text())
        tree.update(values)
        (hf / "config.json").write_text(json.dumps(tree))
    return edit


def run_copy(edit: Callable[[Path], None] = lambda run: None) -> Callable[[Path, Path], None]:
    """A copy of the finished tiny run at c/out (the --out of resume cases), then `edit(run)`."""
    def setup(ws: Path, c: Path) -> None:
        edit(Path(shutil.copytree(ws / "run", c / "out")))
    return setup


def trainer_state(**values) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        path = run / "checkpoints" / "step_000002" / "trainer_state.json"
        state = json.loads(path.read_text())
        state.update(values)
        for key, value in values.items():
            if value is None:
                del state[key]
        path.write_text(json.dumps(state))
    return edit


def yaml_file(text: str) -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        (c / "config.yaml").write_text(text)
    return setup


def file_at(name: str, content: bytes = b"x") -> Callable[[Path, Path], None]:
    def setup(ws: Path, c: Path) -> None:
        (c / name).write_bytes(content)
    return setup


def format_file(text: str | bytes) -> Callable[[Path, Path], None]:
    """A --format YAML file at c/f.yaml."""
    return file_at("f.yaml", text if isinstance(text, bytes) else text.encode())


def vit_config(hf: Path) -> None:
    """A vision model's config.json (ViT) beside a working tokenizer."""
    import transformers

    (hf / "config.json").unlink()
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(hf)


def bigger_tokenizer(hf: Path) -> None:
    """The tokenizer gains 300 words: its ids run past the model's embedding."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    tokenizer.add_tokens([f"extra{i}" for i in range(300)])
    tokenizer.save_pretrained(hf)


def int32_weights(state: dict[str, torch.Tensor]) -> None:
    for name, tensor in state.items():
        state[name] = tensor.round().to(torch.int32)


def fifo(name: str) -> Callable[[Path, Path], None]:
    """A named pipe at c/name: what `<(...)` (process substitution) hands a command."""
    return lambda ws, c: os.mkfifo(c / name)


def symlink_loop(ws: Path, c: Path) -> None:
    os.symlink("loop", c / "loop")


def deep_json(n: int) -> str:
    return '{"model": ' + '{"a": ' * n + "1" + "}" * n + "}"


TINY_YAML = yaml.safe_dump(EXPERIMENT)
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9)) + "model: {}\n"


# ----------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """argv uses {ws} (the shared workspace), {c} (this case's own directory), {cuda} (a GPU device
    this machine lacks) and {empty} (an empty argument); `setup(ws, c)` prepares corrupted inputs; `match` must
    appear in the error."""

    id: str
    argv: str
    match: str = ""
    setup: Callable[[Path, Path], None] | None = None
    code: int = 2


TRAIN = "train {ws}/tiny.yaml --out {c}/out --no-progress"
EVAL = "eval --checkpoint {ws}/run --out {c}/out --no-progress"
EVAL_CK = "eval --checkpoint {c}/ck --out {c}/out --no-progress"
EVAL_HF = "eval --hf {c}/hf --out {c}/out --no-progress --records 32 --clusters 2"
EVAL_HF_FMT = "eval --hf {ws}/hf --out {c}/out --no-progress --format {c}/f.yaml"
AUDIT_HF = "audit --hf {ws}/hf --out {c}/out --no-progress"
AUDIT_SERVED = "audit --endpoint {url} --tokenizer {{ws}}/hf --out {{c}}/out --no-progress"

CASES = [
    # train: overrides and config files
    Case("train-lr-abc", TRAIN + " --set train.lr=abc", "train.lr: must be a finite number"),
    Case("train-warmup-abc", TRAIN + " --set train.warmup_steps=abc", "train.warmup_steps: must be an integer"),
    Case("train-threads-neg", TRAIN + " --set train.threads=-1", "train.threads: must be >= 0"),
    Case("train-device-cuda", TRAIN + " --set train.device={cuda}", "device:"),
    Case("train-device-tpu9", TRAIN + " --set train.device=tpu9", "unknown device 'tpu9'"),
    Case("train-window-huge", TRAIN + " --set model.window=1000000000",
         "model.compressors.gated.window: must be <="),
    Case("train-layers-huge", TRAIN + " --set model.num_hidden_layers=1000000", "num_hidden_layers: must be <="),
    Case("train-hidden-float", TRAIN + " --set model.hidden_size=1e9", "model.hidden_size: must be an integer"),
    Case("train-too-big-for-memory", TRAIN + " --set model.vocab_size=4194304 --set model.hidden_size=65536",
         "GiB of memory is available"),
    Case("train-rope-nan", TRAIN + " --set model.rope_theta=.nan", "model.rope_theta: must be a finite number"),
    Case("train-rope-inf", TRAIN + " --set model.rope_theta=.inf", "model.rope_theta: must be a finite number"),
    Case("train-eps-negative", TRAIN + " --set model.rms_norm_eps=-1", "model.rms_norm_eps: must be >= 0"),
    Case("train-gate-bias-string", TRAIN + " --set model.gate_bias=maybe",
         "model.compressors.gated.gate_bias: must"),
    Case("train-yaml-gate-bias-no", "train {c}/config.yaml --out {c}/out", "model.compressors.gated.gate_bias: must",
         yaml_file(TINY_YAML.replace("model:\n", 'model:\n  gate_bias: "no"\n'))),
    Case("train-set-no-equals", TRAIN + " --set train.lr", "expected KEY.PATH=VALUE"),
    Case("train-set-unknown-section", TRAIN + " --set bogus.x=1", "bogus"),
    Case("train-set-unknown-key", TRAIN + " --set train.stepz=1", "train.stepz: unknown key"),
    Case("train-set-empty-component", TRAIN + " --set train..lr=1", "empty key component"),
    Case("train-records-zero", TRAIN + " --set data.n_records=0", "data.n_records: must be >= 1"),
    Case("train-batch-indivisible", TRAIN + " --set train.batch_size=7 --set train.grad_accum=2",
         "not divisible"),
    Case("train-eval-section-bad", TRAIN + " --set eval.stride=0", "eval.stride: must be >= 1"),
    Case("train-missing-config", "train {c}/nope.yaml --out {c}/out", "no such file"),
    Case("train-config-is-dir", "train {c} --out {c}/out", "is not a regular file"),
    Case("train-empty-config", "train {c}/config.yaml --out {c}/out", "'model' section", yaml_file("")),
    Case("train-config-list", "train {c}/config.yaml --out {c}/out", "'model' section", yaml_file("- 1\n- 2\n")),
    Case("train-yaml-alias-bomb", "train {c}/config.yaml --out {c}/out", "aliases", yaml_file(ALIAS_BOMB)),
    Case("train-yaml-duplicate-train", "train {c}/config.yaml --out {c}/out", "duplicate key 'train'",
         yaml_file(TINY_YAML + "train: {steps: 5}\n")),
    Case("train-yaml-deep", "train {c}/config.yaml --out {c}/out", "nested more than",
         yaml_file("model: " + "[" * 100_000 + "]" * 100_000 + "\n")),
    Case("train-yaml-invalid", "train {c}/config.yaml --out {c}/out", "not valid YAML",
         yaml_file("model: {a: [1, 2}\n")),
    Case("train-yaml-binary", "train {c}/config.yaml --out {c}/out", "unreadable",
         file_at("config.yaml", b"\xff\xfe\x00model")),
    Case("train-out-is-file", "train {ws}/tiny.yaml --out {c}/f --no-progress", "", file_at("f")),
    Case("train-out-under-file", "train {ws}/tiny.yaml --out {c}/f/run --no-progress", "", file_at("f")),
    Case("train-existing-run", "train {ws}/tiny.yaml --out {c}/out --no-progress", "--resume", run_copy()),
    Case("train-resume-window", "train {ws}/tiny.yaml --out {c}/out --resume --set model.window=16 --no-progress",
         "window", run_copy()),
    Case("train-resume-lr", "train {ws}/tiny.yaml --out {c}/out --resume --set train.lr=0.5 --no-progress",
         "train.lr", run_copy()),
    Case("train-resume-step-abc", "train {ws}/tiny.yaml --out {c}/out --resume --set train.steps=4 --no-progress",
         "no readable checkpoint", run_copy(trainer_state(step="abc"))),
    Case("train-resume-no-optimizer",
         "train {ws}/tiny.yaml --out {c}/out --resume --set train.steps=4 --no-progress",
         "no readable checkpoint", run_copy(trainer_state(optimizer=None))),
    Case("train-resume-latest-escapes", "train {ws}/tiny.yaml --out {c}/out --resume --no-progress",
         "not a checkpoint", run_copy(lambda run: (run / "latest").write_text("../../../etc\n"))),
    # eval: flags
    Case("eval-device-cuda", EVAL + " --device {cuda}", "device:"),
    Case("eval-device-tpu9", EVAL + " --device tpu9", "unknown device 'tpu9'"),
    Case("eval-stride-zero", EVAL + " --stride 0", "eval.stride: must be >= 1"),
    Case("eval-records-zero", EVAL + " --records 0", "eval.records: must be >= 1"),
    Case("eval-key-tokens-zero", EVAL + " --key-tokens 0", "eval.key_tokens: must be >= 1"),
    Case("eval-residue-zero", EVAL + " --residue-modulus 0", "eval.residue_modulus: must be >= 1"),
    Case("eval-batch-negative", EVAL + " --batch-size -1", "eval.batch_size: must be >= 1"),
    Case("eval-stride-not-int", EVAL + " --stride 4.5", "invalid int value"),
    Case("eval-protocol-bogus", EVAL + " --protocol bogus", "invalid choice"),
    Case("eval-dtype-checkpoint", EVAL + " --dtype nn", "eval.dtype: must be one of"),
    Case("eval-missing-out", "eval --checkpoint {ws}/run", "--out"),
    Case("eval-no-source", "eval --out {c}/out", "--checkpoint"),
    Case("eval-two-sources", "eval --checkpoint {ws}/run --hf {ws}/hf --out {c}/out", "not allowed with"),
    Case("eval-no-checkpoint", "eval --checkpoint {c}/nowhere --out {c}/out", "no such file"),
    Case("eval-checkpoint-is-file", "eval --checkpoint {c}/f --out {c}/out", "expected config.json", file_at("f")),
    Case("eval-out-is-file", "eval --checkpoint {ws}/run --out {c}/f --no-progress", "not a directory",
         file_at("f")),
    Case("eval-out-under-file", "eval --checkpoint {ws}/run --out {c}/f/out --no-progress", "not a directory",
         file_at("f")),
    Case("eval-out-finished", "eval --checkpoint {ws}/run --out {ws}/done --no-progress", "--force"),
    # eval: corrupted checkpoints
    Case("ck-rope-theta-abc", EVAL_CK, "model.rope_theta: must be a finite number", set_model(rope_theta="abc")),
    Case("ck-index-topk-string", EVAL_CK, "model.compressors.deepseek_csa.index_topk: must be an integer",
         set_model(compressor="deepseek_csa", layer_types=None, compressors={"deepseek_csa": {"index_topk": "3"}})),
    Case("ck-gate-bias-no", EVAL_CK, "model.compressors.gated.gate_bias: must be true or false",
         edit_config(lambda t: t["model"]["compressors"]["gated"].update(gate_bias="no"))),
    Case("ck-flat-gate-bias-no", EVAL_CK, "model.gate_bias: 'no' conflicts", set_model(gate_bias="no")),
    Case("ck-flat-window-conflict", EVAL_CK, "model.window: 16 conflicts with model.compressors.gated.window=4",
         set_model(window=16)),
    Case("ck-rope-nan", EVAL_CK, "model.rope_theta: must be a finite number", set_model(rope_theta=float("nan"))),
    Case("ck-eps-negative", EVAL_CK, "model.rms_norm_eps: must be >= 0", set_model(rms_norm_eps=-1e-6)),
    Case("ck-hidden-1e9", EVAL_CK, "model.hidden_size: must be an integer", set_model(hidden_size=1e9)),
    Case("ck-hidden-int-huge", EVAL_CK, "model.hidden_size: must be <=", set_model(hidden_size=10 ** 9)),
    Case("ck-too-big-for-memory", EVAL_CK, "GiB of memory is available",
         set_model(vocab_size=1 << 22, hidden_size=1 << 16)),
    Case("ck-qwen3-too-big-for-memory", EVAL_CK, "GiB of memory is available",
         edit_config(lambda t: t.update(model={"model_type": "qwen3", "vocab_size": 256, "hidden_size": 1 << 16,
                                               "intermediate_size": 1 << 22, "num_hidden_layers": 8}))),
    Case("ck-qwen3-hidden-abc", EVAL_CK, "expected int, got str",
         edit_config(lambda t: t.update(model={"model_type": "qwen3", "vocab_size": 256, "hidden_size": "abc"}))),
    Case("ck-qwen3-unknown-field", EVAL_CK, "model.windw: not a field",
         edit_config(lambda t: t.update(model={"model_type": "qwen3", "windw": 3}))),
    Case("ck-unknown-model-key", EVAL_CK, "model.windw: unknown key", set_model(windw=8)),
    Case("ck-model-type-unknown", EVAL_CK, "no model type", set_model(model_type="nonesuch")),
    Case("ck-eval-section-bad", EVAL_CK, "eval.stride: must be >= 1",
         edit_config(lambda t: t.update(eval={"stride": 0}))),
    Case("ck-eval-section-list", EVAL_CK, "eval section must be a mapping", edit_config(lambda t: t.update(eval=[4]))),
    Case("ck-eval-section-typo", EVAL_CK, "eval.strde: unknown key", edit_config(lambda t: t["eval"].update(strde=4))),
    Case("ck-vocab-string", EVAL_CK, "vocab", edit_config(lambda t: t.update(vocab="abc"))),
    Case("ck-vocab-groups-int", EVAL_CK, "vocab", edit_config(lambda t: t.update(vocab={"groups": 5}))),
    Case("ck-vocab-groups-empty", EVAL_CK, "vocab", edit_config(lambda t: t.update(vocab={"groups": {}}))),
    Case("ck-vocab-word-int", EVAL_CK, "vocab is malformed",
         edit_config(lambda t: t["vocab"]["groups"].update(keys=[1, 2, 3]))),
    Case("ck-data-string", EVAL_CK, "data: section must be a mapping", edit_config(lambda t: t.update(data="abc"))),
    Case("ck-data-records-string", EVAL_CK, "data.n_records: must be an integer",
         edit_config(lambda t: t["data"].update(n_records="x"))),
    Case("ck-layer-types-string", EVAL_CK, "model.layer_types", set_model(layer_types="gated")),
    Case("ck-layer-types-ints", EVAL_CK, "model.layer_types", set_model(layer_types=[1, 2])),
    Case("ck-compressors-int", EVAL_CK, "model.compressors", set_model(compressors={"gated": 5})),
    Case("ck-compressors-list", EVAL_CK, "model.compressors", set_model(compressors=[])),
    Case("ck-model-string", EVAL_CK, "model", edit_config(lambda t: t.update(model="abc"))),
    Case("ck-max-positions-tiny", EVAL_CK, "exceeds the model's context (8 tokens)",
         set_model(max_position_embeddings=8)),
    Case("ck-vocab-size-tiny", EVAL_CK, "lm_head.weight has shape (256, 32)", set_model(vocab_size=8)),
    Case("ck-vocab-too-many-words", EVAL_CK, "only 256 token ids",
         edit_config(lambda t: t["vocab"]["groups"]["background"].extend(f"w{i}" for i in range(300)))),
    Case("ck-no-vocab", EVAL_CK, "no 'vocab'", edit_config(lambda t: t.pop("vocab"))),
    Case("ck-config-empty", EVAL_CK, "not valid JSON", config_text("")),
    Case("ck-config-list", EVAL_CK, "no 'model' section", config_text("[1, 2]")),
    Case("ck-config-deep-json", EVAL_CK, "nested more than", config_text(deep_json(100_000))),
    Case("ck-config-deep-list", EVAL_CK, "nested more than", config_text("[" * 100_000 + "]" * 100_000)),
    Case("ck-config-binary", EVAL_CK, "", config_text(b"\xff\xfe\x00{")),
    Case("ck-weights-wrong-shape", EVAL_CK, "has shape (3, 5)", edit_weights(wrong_shape)),
    Case("ck-weights-missing-one", EVAL_CK, "missing ['model.norm.weight']",
         edit_weights(lambda s: s.pop("model.norm.weight"))),
    Case("ck-weights-nan", EVAL_CK, "weight model.norm.weight holds non-finite", edit_weights(poison(float("nan")))),
    Case("ck-weights-inf", EVAL_CK, "non-finite", edit_weights(poison(float("inf"), "lm_head.weight"))),
    Case("ck-weights-truncated", EVAL_CK, "truncated or corrupted", weights_bytes(lambda b: b[: len(b) // 2])),
    Case("ck-weights-empty", EVAL_CK, "truncated or corrupted", weights_bytes(lambda b: b"")),
    Case("ck-weights-pickle", EVAL_CK, "truncated or corrupted", pickled_weights),
    Case("ck-nan-logits", EVAL_CK, "non-finite logits", zero_norm_eps),
    Case("ck-bundled-nan", "eval --checkpoint {c}/ck --out {c}/out --no-progress", "non-finite",
         edit_weights(poison(float("nan"), "model.embed_tokens.weight"), source="w8s8")),
    # eval: transformers models
    Case("hf-dtype-nn", EVAL_HF + " --dtype nn", "eval.dtype: must be one of", hf_copy(lambda hf: None)),
    Case("hf-pickled-bin", EVAL_HF, "pickled .bin", hf_copy(hf_pickled)),
    Case("hf-missing-dir", "eval --hf {c}/nowhere --out {c}/out --no-progress", "no such directory"),
    Case("hf-config-broken", EVAL_HF, "cannot load",
         hf_copy(lambda hf: (hf / "config.json").write_text("{"))),
    Case("hf-config-huge", EVAL_HF, "GiB of memory is available", hf_copy(hf_config(hidden_size=1 << 20,
                                                                                    intermediate_size=1 << 22))),
    Case("hf-stride-zero", EVAL_HF + " --stride 0", "eval.stride: must be >= 1", hf_copy(lambda hf: None)),
    # probes, sweep
    Case("knockout-calib-zero", "knockout --checkpoint {ws}/run --out {c}/out --calib-prompts 0", "--calib-prompts"),
    Case("knockout-nan-weights", "knockout --checkpoint {c}/ck --out {c}/out --no-progress", "non-finite",
         edit_weights(poison(float("nan")))),
    Case("knockout-hf-dtype", "knockout --hf {c}/hf --out {c}/out --dtype nn", "eval.dtype",
         hf_copy(lambda hf: None)),
    Case("gates-prompts-zero", "gates --checkpoint {ws}/run --out {c}/out --prompts 0", "--prompts"),
    Case("gates-top-zero", "gates --checkpoint {ws}/run --out {c}/out --top 0", "--top"),
    Case("gates-no-checkpoint", "gates --checkpoint {c}/nowhere --out {c}/out", "no such file"),
    Case("gates-hf-flag", "gates --hf {ws}/hf --out {c}/out", "required: --checkpoint"),
    Case("cycle-deltas-abc", "cycle --checkpoint {ws}/run --out {c}/out --deltas abc", "invalid int value"),
    Case("cycle-out-finished", "cycle --checkpoint {ws}/run --out {ws}/done", "--force"),
    Case("sweep-max-filler-neg", "sweep --checkpoint {ws}/run --text a --a b --b c --out {c}/out --max-filler -1",
         "max"),
    Case("sweep-max-period-zero", "sweep --checkpoint {ws}/run --text a --a b --b c --out {c}/out --max-period 0",
         "max"),
    Case("sweep-unknown-word", "sweep --checkpoint {ws}/run --text zzzz --a qqqq --b c --out {c}/out", ""),
    Case("sweep-device-tpu9", "sweep --checkpoint {ws}/run --text a --a b --b c --out {c}/out --device tpu9",
         "unknown device"),
    Case("sweep-missing-text", "sweep --checkpoint {ws}/run --a b --b c --out {c}/out", "--text"),
    # theory, reproduce, demo, the command itself
    Case("theory-out-is-file", "theory --out {c}/f --quick", "not a directory", file_at("f")),
    Case("theory-out-finished", "theory --out {ws}/done --quick", "--force"),
    Case("theory-seed-abc", "theory --out {c}/out --seed abc", "invalid int value"),
    Case("reproduce-jobs-zero", "reproduce --out {c}/out --jobs 0", "--jobs"),
    Case("reproduce-no-checkpoints", "reproduce --out {c}/out --checkpoints {c}/nowhere --quick", ""),
    Case("reproduce-unknown-model", "reproduce --out {c}/out --checkpoints {ws} --models nosuch --quick", ""),
    Case("reproduce-out-finished", "reproduce --out {ws}/done --quick", "--force"),
    Case("demo-tokens-huge", "demo --tokens 100000000", "--tokens: must be in"),
    Case("demo-tokens-zero", "demo --tokens 0", "--tokens: must be in"),
    Case("demo-tokens-abc", "demo --tokens abc", "invalid int value"),
    Case("unknown-subcommand", "frobnicate", "invalid choice"),
    Case("no-subcommand", "", "required"),
    Case("unknown-flag", "eval --checkpoint {ws}/run --out {c}/out --bogus", "unrecognized arguments"),
    # round 3: --out equal to, above or inside an input is refused, --force replaces only phasekv's own outputs
    Case("eval-out-is-checkpoint", "eval --checkpoint {ws}/run --out {ws}/run --force", "is the input --checkpoint"),
    Case("eval-out-holds-checkpoint", "eval --checkpoint {ws}/run/final --out {ws}/run --force",
         "holds the input --checkpoint"),
    Case("eval-out-inside-checkpoint", "eval --checkpoint {ws}/run --out {ws}/run/sub", "lies inside the input"),
    Case("eval-hf-out-is-model", "eval --hf {ws}/hf --out {ws}/hf --force", "is the input --hf"),
    # decide: every flag refused before the model loads; an endpoint refused in one line (no continuation scoring)
    Case("decide-endpoint", "decide --endpoint http://127.0.0.1:9 --out {c}/out", "need --tokenizer DIR"),
    Case("decide-no-model", "decide --out {c}/out", "--hf, --endpoint or --launch: give the model"),
    Case("decide-set-missing", "decide --hf {ws}/hf --set {c}/nope.yaml --out {c}/out", "neither a shipped set"),
    Case("decide-shifts-not-multiple", "decide --hf {ws}/hf --shifts 5 --out {c}/out", "--shifts 5: must be a"),
    Case("decide-bad-condition", "decide --hf {ws}/hf --compress select:99 --out {c}/out", "select needs an offset"),
    Case("decide-items-zero", "decide --hf {ws}/hf --items 0 --out {c}/out", "--items: must be >= 1"),
    Case("decide-set-bad-item", "decide --hf {ws}/hf --set {c}/s.yaml --out {c}/out", "item 'a': context",
         lambda ws, c: (c / "s.yaml").write_text("name: s\nitems:\n- {id: a, context: no slot}\n")),
    Case("audit-hf-out-is-model", "audit --hf {ws}/hf --out {ws}/hf --force", "is the input --hf"),
    Case("knockout-out-is-checkpoint", "knockout --checkpoint {ws}/run --out {ws}/run --force", "is the input"),
    Case("reproduce-out-holds-checkpoints", "reproduce --checkpoints {ws}/run --out {ws} --force", "holds the input"),
    Case("export-out-is-tokenizer", "export lm-eval --tokenizer {ws}/hf --out {ws}/hf --force",
         "is the input --tokenizer"),
    Case("export-out-is-hf", "export lm-eval --hf {ws}/hf --out {ws}/hf --force", "is the input --hf"),
    Case("export-hf-and-tokenizer", "export lm-eval --hf {ws}/hf --tokenizer {ws}/hf --out {c}/out",
         "not allowed with argument"),
    Case("eval-results-is-out", "eval --checkpoint {ws}/run --out {c}/out --eval-results {c}/out",
         "is the output --eval-results"),
    Case("train-out-holds-config", "train {ws}/tiny.yaml --out {ws} --resume", "holds the input config"),
    Case("force-over-a-users-directory", "eval --checkpoint {ws}/run --out {c}/mine --force", "is not a phasekv output",
         setup=lambda ws, c: ((c / "mine").mkdir(), (c / "mine" / "notes.txt").write_text("mine"))),
    # round 3: bounded work, refused before anything is allocated (the budget is stated)
    Case("train-batch-a-million", TRAIN + " --set train.batch_size=1000000", "needs at least"),
    Case("eval-prompt-set-huge", EVAL + " --clusters 65536 --residue-modulus 4096 --stride 4",
         "prompts or more: needs at least"),
    Case("eval-hf-prompt-set-huge", EVAL_HF + " --targets-per-context 65536 --residue-modulus 4096",
         "prompts or more: needs at least", hf_copy(lambda hf: None)),
    Case("audit-prompts-per-phase-huge", AUDIT_HF + " --prompts-per-phase 1000000000", "prompts or more"),
    Case("export-prompt-set-huge", "export lm-eval --tokenizer {ws}/hf --out {c}/out --clusters 65536 "
         "--residue-modulus 4096 --stride 4", "prompts or more"),
    # round 3: prompt-format files, one line naming the file (audit: before the model loads)
    Case("format-empty", EVAL_HF_FMT, "f.yaml: is empty", format_file("")),
    Case("format-extra-placeholder", EVAL_HF_FMT, "has the placeholder {other}",
         format_file("key_text: '{key} {other}:'\n")),
    Case("format-positional-placeholder", EVAL_HF_FMT, "has the placeholder {}",
         format_file("value_text: ' {value} {}'\n")),
    Case("format-unmatched-brace", EVAL_HF_FMT, "is not a valid template", format_file("key_text: '{key:'\n")),
    Case("format-no-key", EVAL_HF_FMT, "lacks {key}", format_file("key_text: 'key:'\n")),
    Case("format-binary", EVAL_HF_FMT, "f.yaml: not a text file", format_file(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")),
    Case("format-too-big", EVAL_HF_FMT, "a format file may hold at most",
         format_file("#\n" * (MAX_CONFIG_BYTES // 2 + 1))),
    Case("format-is-fifo", "eval --hf {ws}/hf --out {c}/out --no-progress --format {c}/f.yaml",
         "(not a regular file)", fifo("f.yaml")),
    Case("audit-format-empty", AUDIT_HF + " --format {c}/f.yaml", "f.yaml: is empty", format_file("")),
    Case("audit-records-below-demos", AUDIT_HF + " --records 4 --demos 4", "cannot hold a target"),
    Case("audit-local-window-zero", AUDIT_HF + " --local-window 0", "--local-window: must be >= 1"),
    Case("audit-device-tpu9", AUDIT_HF + " --device tpu9", "unknown device 'tpu9'"),
    # round 3: models that are not what they claim
    Case("hf-vision-model", EVAL_HF, "not a causal language model", hf_copy(vit_config)),
    Case("hf-tokenizer-past-embedding", EVAL_HF, "have no embedding", hf_copy(bigger_tokenizer)),
    Case("ck-weights-int32", EVAL_CK, "is stored as torch.int32", edit_weights(int32_weights)),
    # round 3: flags that would be ignored, paths that are not what they seem
    Case("eval-checkpoint-format", EVAL + " --format records", "--format: applies to --hf models only"),
    Case("eval-checkpoint-gguf-file", EVAL + " --gguf-file m.gguf", "--gguf-file: applies to --hf models only"),
    Case("eval-checkpoint-dtype", EVAL + " --dtype bfloat16", "--dtype: applies to --hf models only"),
    Case("eval-checkpoint-section-format", EVAL_CK, "eval.format (the checkpoint's config.json): applies to --hf",
         edit_config(lambda t: t["eval"].update(format="records"))),
    Case("eval-out-empty", "eval --checkpoint {ws}/run --no-progress --out {empty}", "--out: is empty"),
    Case("train-config-process-substitution", "train {c}/fifo.yaml --out {c}/out", "process substitution",
         fifo("fifo.yaml")),
    Case("eval-out-under-symlink-loop", "eval --checkpoint {ws}/run --out {c}/loop/out --no-progress",
         "loop is a symbolic link loop", symlink_loop),
    Case("eval-out-is-symlink-loop", "eval --checkpoint {ws}/run --out {c}/loop --no-progress",
         "loop is a symbolic link loop", symlink_loop),
    # round 4: flags of another source refused, every --endpoint flag checked before anything is loaded or asked
    Case("audit-hf-concurrency-zero", AUDIT_HF + " --concurrency 0",
         "--concurrency: applies to --endpoint only, not to --hf"),
    Case("audit-hf-resume", AUDIT_HF + " --resume", "--resume: applies to --endpoint only"),
    Case("eval-checkpoint-api", EVAL + " --api openai", "--api: applies to --endpoint only, not to --checkpoint"),
    Case("eval-hf-timeout", EVAL_HF + " --timeout 5", "--timeout: applies to --endpoint only",
         hf_copy(lambda hf: None)),
    Case("audit-endpoint-ipv6-unclosed", AUDIT_SERVED.format(url="http://[::1"), "not a valid URL (Invalid IPv6 URL)"),
    Case("audit-endpoint-port-99999", AUDIT_SERVED.format(url="http://127.0.0.1:99999"),
         "not a valid URL (Port out of range 0-65535)"),
    Case("audit-endpoint-no-host", AUDIT_SERVED.format(url="http://:8080"), "names no host"),
    Case("audit-endpoint-timeout-zero", AUDIT_SERVED.format(url="http://127.0.0.1:9") + " --timeout 0",
         "--timeout: must be a finite number of seconds > 0 and at most 604800 (a week), got 0.0"),
    Case("audit-endpoint-timeout-nan", AUDIT_SERVED.format(url="http://127.0.0.1:9") + " --timeout nan",
         "--timeout: must be a finite number of seconds > 0 and at most 604800 (a week), got nan"),
    Case("audit-endpoint-sglang-reuse-prefix", AUDIT_SERVED.format(url="http://127.0.0.1:9") +
         " --api sglang --reuse-prefix", "--reuse-prefix: the sglang API has no per-request prompt-cache switch"),
    Case("audit-endpoint-dtype", AUDIT_SERVED.format(url="http://127.0.0.1:9") + " --dtype bfloat16",
         "--dtype: applies to an in-process model"),
    Case("eval-endpoint-timeout-zero", "eval --endpoint http://127.0.0.1:9 --tokenizer {ws}/hf --timeout 0 "
         "--out {c}/out --no-progress", "--timeout: must be a finite number of seconds > 0"),
    Case("eval-endpoint-device-map", "eval --endpoint http://127.0.0.1:9 --tokenizer {ws}/hf --device-map auto "
         "--out {c}/out --no-progress", "--device-map: applies to an in-process model"),
]


def argv_of(case: Case, ws: Path, c: Path) -> list[str]:
    cuda = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    return [part.format(ws=ws, c=c, cuda=cuda, empty="") for part in case.argv.split()]


def out_of(argv: list[str]) -> Path | None:
    return Path(argv[argv.index("--out") + 1]) if "--out" in argv[:-1] else None


def check_one_line(code: int, err: str, out: str, expected_code: int = 2) -> str:
    """The one line stderr shows on a terminal (an erased progress bar leaves only '\r' behind)."""
    assert code == expected_code, err
    assert "Traceback" not in err + out
    lines = [line.split("\r")[-1] for line in err.split("\n")]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("phasekv"), err
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, ws: Path, capsys, monkeypatch):
    c = ws / "cases" / case.id
    c.mkdir()
    if case.setup:
        case.setup(ws, c)
    argv = argv_of(case, ws, c)
    out = out_of(argv)
    out_was_empty = out is None or not out.exists() or (out.is_dir() and not any(out.iterdir()))
    monkeypatch.chdir(ws / "cwd")
    before = snapshot(ws)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exits
        code = exc.code
    captured = capsys.readouterr()
    line = check_one_line(code, captured.err, captured.out, case.code)
    assert case.match in line
    after = snapshot(ws)
    inside = f"{out.relative_to(ws)}/" if out is not None and out.is_relative_to(ws) else None
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    if out_was_empty and inside:
        changed = {p for p in changed if not (p + "/").startswith(inside)}
    assert not changed, f"written outside --out (or a finished --out changed): {sorted(changed)[:5]}"


def test_enough_cases():
    assert len(CASES) >= 60


def test_eval_checks_out_before_computing(ws: Path, capsys, monkeypatch):
    """A bad --out is refused before the model is even opened (no minutes of compute lost)."""
    def never(*args, **kwargs):
        raise AssertionError("evaluation started before --out was checked")

    monkeypatch.setattr(runner_mod, "open_source", never)
    (ws / "cases" / "blocker").write_text("x")
    for out in (ws / "done", ws / "cases" / "blocker", ws / "cases" / "blocker" / "sub"):
        code = main(["eval", "--checkpoint", str(ws / "run"), "--out", str(out), "--no-progress"])
        check_one_line(code, capsys.readouterr().err, "")


# the cases whose flags must be refused before any model or tokenizer is opened
EARLY = [c for c in CASES if c.id.startswith(("audit-", "decide-", "format-", "eval-checkpoint-", "eval-prompt-set",
                                              "eval-hf-prompt-set", "train-batch-a-million", "eval-endpoint-",
                                              "eval-hf-timeout"))]


@pytest.mark.parametrize("case", EARLY, ids=[c.id for c in EARLY])
def test_flags_are_checked_before_anything_loads(case: Case, ws: Path, capsys, monkeypatch):
    """Each of these is refused with its own line although loading a model (or training) would fail the test: the
    flags, the format file and the work's size are checked first (a GGUF model takes most of a minute to load)."""
    import phasekv.adapters.hf as hf_mod
    import phasekv.training.loop as train_mod

    def never(*args, **kwargs):
        raise AssertionError(f"{case.id}: a model was loaded before the flags were checked")

    for module, name in ((hf_mod, "load_hf"), (runner_mod, "open_source"), (train_mod, "train")):
        monkeypatch.setattr(module, name, never)
    c = ws / "cases" / f"early-{case.id}"
    c.mkdir()
    if case.setup:
        case.setup(ws, c)
    code = main(argv_of(case, ws, c))
    assert case.match in check_one_line(code, capsys.readouterr().err, "")


def test_eval_out_in_read_only_dir(ws: Path, capsys, monkeypatch):
    locked = ws / "cases" / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: make the permission check see what a user would
        monkeypatch.setattr(outputs_mod.os, "access", lambda path, mode: Path(path) != locked)
    try:
        code = main(["eval", "--checkpoint", str(ws / "run"), "--out", str(locked / "out"), "--no-progress"])
        assert "is not writable" in check_one_line(code, capsys.readouterr().err, "")
    finally:
        locked.chmod(0o700)
    assert not (locked / "out").exists()


def test_check_fits_counts_without_allocating(ws: Path):
    config = Experiment.from_file(ws / "tiny.yaml").model
    n = sum(p.numel() for p in families.build(config).parameters())
    assert families.weight_bytes(config) >= 4 * n
    families.check_fits(config, available=4 * n * 2)
    with pytest.raises(ValueError, match="GiB of memory is available"):
        families.check_fits(config, available=4 * n // 2)


# ----------------------------------------------------------------------------- the eval section


def test_eval_honours_the_checkpoint_eval_section_and_flags_override(ws: Path):
    done = json.loads((ws / "done" / "metrics.json").read_text())
    assert done["stride"] == 4 and done["settings"]["n_clusters"] == 2
    out = ws / "cases" / "override"
    assert main(["eval", "--checkpoint", str(ws / "run"), "--stride", "2", "--out", str(out), "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stride"] == 2 and metrics["settings"]["n_clusters"] == 2


# ----------------------------------------------------------------------------- real processes


def _run(argv: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + str(REPO), "OMP_NUM_THREADS": "1"}
    # SIGINT at its default in the child: a harness that runs the suite as a background job of a non-interactive
    # shell ignores SIGINT, and an ignored signal stays ignored across exec (the Ctrl-C test then hung)
    return subprocess.Popen([sys.executable, "-m", "phasekv.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kwargs)


def _communicate(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """(stdout, stderr) as written: bytes decoded without turning '\r' into a line break."""
    out, err = proc.communicate(timeout=timeout)
    return out.decode(errors="replace"), err.decode(errors="replace")


@pytest.mark.parametrize("case_id", ["train-lr-abc", "hf-pickled-bin", "ck-weights-nan", "ck-nan-logits",
                                     "train-yaml-deep"])
def test_bad_input_in_a_real_process(case_id: str, ws: Path):
    """What reaches the real stderr (logging, warnings, progress bars) is still one line; progress
    bars are on, as for a user who does not pass --no-progress."""
    case = next(c for c in CASES if c.id == case_id)
    c = ws / "cases" / f"process-{case_id}"
    c.mkdir()
    if case.setup:
        case.setup(ws, c)
    argv = [a for a in argv_of(case, ws, c) if a != "--no-progress"]
    before = snapshot(ws)
    proc = _run(argv, cwd=ws / "cwd")
    out, err = _communicate(proc)
    assert case.match in check_one_line(proc.returncode, err, out)
    assert snapshot(ws) == before


def test_ctrl_c_exits_130_with_one_line(ws: Path):
    run = ws / "cases" / "sigint"
    proc = _run(["train", str(ws / "tiny.yaml"), "--out", str(run), "--set", "train.steps=100000",
                 "--set", "train.log_every=1", "--set", "train.checkpoint_every=100000", "--no-progress"])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size > 0:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = _communicate(proc, timeout=60)
    assert "interrupted" in check_one_line(proc.returncode, err, out, expected_code=130)


def test_pickle_is_never_loaded(ws: Path, capsys):
    """A pickle that would run code when loaded is refused without being unpickled."""
    c = ws / "cases" / "evil"
    hf = Path(shutil.copytree(ws / "hf", c / "hf"))
    (hf / "model.safetensors").unlink()
    marker = c / "pwned"
    (hf / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(str(marker))))
    code = main(["eval", "--hf", str(hf), "--out", str(c / "out"), "--no-progress"])
    check_one_line(code, capsys.readouterr().err, "")
    assert not marker.exists()


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


# ----------------------------------------------------------------------------- known gaps (training/loop.py)


def test_resume_without_readable_checkpoint_in_a_real_process(ws: Path):
    c = ws / "cases" / "process-resume"
    c.mkdir()
    run_copy(trainer_state(step="abc"))(ws, c)
    proc = _run(["train", str(ws / "tiny.yaml"), "--out", str(c / "out"), "--resume", "--set", "train.steps=4"])
    out, err = _communicate(proc)
    assert "no readable checkpoint" in check_one_line(proc.returncode, err, out)


def test_resume_names_the_nested_field(ws: Path, capsys):
    c = ws / "cases" / "resume-nested"
    c.mkdir()
    run_copy()(ws, c)
    code = main(["train", str(ws / "tiny.yaml"), "--out", str(c / "out"), "--resume", "--set", "model.window=16"])
    assert "model.compressors.gated.window" in check_one_line(code, capsys.readouterr().err, "")


# ----------------------------------------------------------------------------- round 4: served models
#
# The endpoint adapter against answers no working engine gives: a generator of broken (and harmless) variants of
# each API's answer, run through the adapter's own HTTP path in process (httpx.MockTransport), and small loopback
# servers for what only a socket shows (an endless body, a redirect) and for the command line end to end.

V4 = 256  # the fake engines' vocabulary
TOP_K = 8  # what EndpointAdapter asks by default


def top_entries(t: int) -> list[tuple[int, float]]:
    """The fake engine's top-k for greedy token t: t first, then 7 other ids, log-probabilities decreasing."""
    return [((t + 13 * j) % V4, -0.25 - j) for j in range(TOP_K)]


def valid_answer(flavour: str, ids: list[int]) -> tuple[dict, int]:
    """(an answer to `ids` in the format of `flavour`, its greedy token): the formats recorded in test_endpoint."""
    t = (sum(ids) * 7 + len(ids)) % V4
    top, n = top_entries(t), len(ids)
    if flavour == "llamacpp":
        return {"content": "x", "model": "/models/fake.gguf", "tokens_evaluated": n, "stop": True,
                "timings": {"cache_n": 0, "prompt_n": n},
                "completion_probabilities": [{"id": t, "token": "x", "bytes": [120], "logprob": -0.25, "top_logprobs": [
                    {"id": i, "token": "x", "bytes": [120], "logprob": lp} for i, lp in top]}]}, t
    if flavour == "openai-llamacpp":
        step = {"id": t, "token": "x", "bytes": [120], "logprob": -0.25,
                "top_logprobs": [{"id": i, "token": "x", "bytes": [120], "logprob": lp} for i, lp in top]}
        return {"choices": [{"text": "x", "index": 0, "logprobs": {"content": [step]}, "finish_reason": "length"}],
                "model": "fake", "object": "text_completion",
                "usage": {"prompt_tokens": n, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}, t
    if flavour == "openai-vllm":
        return {"choices": [{"text": "x", "index": 0, "logprobs": {
            "tokens": [f"token_id:{t}"], "token_logprobs": [-0.25], "text_offset": [0],
            "top_logprobs": [{f"token_id:{i}": lp for i, lp in top}]}}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}}, t
    return {"text": "x", "output_ids": [t], "meta_info": {
        "id": "x", "prompt_tokens": n, "completion_tokens": 1, "cached_tokens": 0,
        "finish_reason": {"type": "length", "length": 1}, "output_token_logprobs": [[-0.25, t, None]],
        "output_top_logprobs": [[[lp, i, None] for i, lp in top]]}}, t


# per flavour: the fields an answer cannot do without (ids and log-probabilities; "*": any index or key), the
# fields read when present (prompt-token counts, cache counts), and the dicts whose keys are data (vLLM's top-k)
REQUIRED = {
    "llamacpp": ["completion_probabilities.0.id", "completion_probabilities.0.top_logprobs.*.id",
                 "completion_probabilities.0.top_logprobs.*.logprob"],
    "openai-llamacpp": ["choices.0.logprobs.content.0.id", "choices.0.logprobs.content.0.top_logprobs.*.id",
                        "choices.0.logprobs.content.0.top_logprobs.*.logprob"],
    "openai-vllm": ["choices.0.logprobs.tokens.0", "choices.0.logprobs.top_logprobs.0.*"],
    "sglang": ["meta_info.output_token_logprobs.0.1", "meta_info.output_top_logprobs.0.*.0",
               "meta_info.output_top_logprobs.0.*.1"],
}
CHECKED = {
    "llamacpp": ["tokens_evaluated", "timings.cache_n"],
    "openai-llamacpp": ["usage.prompt_tokens", "usage.prompt_tokens_details.cached_tokens"],
    "openai-vllm": ["usage.prompt_tokens"],
    "sglang": ["meta_info.prompt_tokens", "meta_info.cached_tokens"],
}
TOP_LISTS = {"llamacpp": "completion_probabilities.0.top_logprobs",
             "openai-llamacpp": "choices.0.logprobs.content.0.top_logprobs",
             "openai-vllm": "choices.0.logprobs.top_logprobs.0", "sglang": "meta_info.output_top_logprobs.0"}
WRONG_TYPES = [None, "x", "12", True, False, [], {}, [1], {"a": 1}, 1.5]


def _matches(pattern: str, path: tuple) -> bool:
    parts = pattern.split(".")
    return len(parts) == len(path) and all(p == "*" or p == str(q) for p, q in zip(parts, path))


def _is_prefix(path: tuple, pattern: str) -> bool:
    """`path` is (an ancestor of) a field `pattern` names."""
    parts = pattern.split(".")
    return len(path) <= len(parts) and all(p == "*" or p == str(q) for p, q in zip(parts, path))


def role(flavour: str, path: tuple) -> str:
    """required: the answer cannot do without it (or it holds such a field); checked: read when present; ignored."""
    if any(_is_prefix(path, p) for p in REQUIRED[flavour]):
        return "required"
    if any(_matches(p, path) for p in CHECKED[flavour]):
        return "checked"
    if any(_is_prefix(path, p) for p in CHECKED[flavour]):
        return "holds-checked"
    return "ignored"


def nodes(tree, path=()):
    """(path, value) of every node of a JSON tree, the root included."""
    yield path, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield from nodes(value, (*path, key))


def replaced(tree, path: tuple, value):
    """A copy of `tree` with the node at `path` replaced by `value` (deleted when value is DROP)."""
    import copy

    if not path:
        return value
    tree = copy.deepcopy(tree)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    if value is DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return tree


DROP = object()


def pick(rng, options: list):
    """One of `options` (numpy's choice would turn a list of mixed values into an array)."""
    return options[int(rng.integers(len(options)))]


def mutations(flavour: str, ids: list[int], rng) -> tuple[str | bytes, str, str]:
    """(answer body, expected outcome, what was done): outcome "raise" (a broken answer: EndpointError), "accept"
    (the answer's greedy token stands) or "either" (a container of fields read only when present, retyped)."""
    import math

    payload, _ = valid_answer(flavour, ids)
    text = json.dumps(payload)
    everything = list(nodes(payload))
    kind = rng.choice(["truncate", "drop", "retype", "number", "extra", "fewer", "rename", "deep", "big"],
                      p=[.12, .16, .24, .2, .1, .06, .04, .04, .04])
    if kind == "truncate":
        cut = int(rng.integers(0, len(text)))
        return text[:cut], "raise", f"truncated at {cut}"
    if kind == "deep":
        return text[:-1] + ', "zz": ' + "[" * 100_000 + "]" * 100_000 + "}", "raise", "nested 100000 deep"
    if kind == "big":
        return text[:-1] + ', "zz": "' + "y" * (1 << 20) + '"}', "accept", "a 1 MiB extra field"
    if kind == "fewer":
        top_path = tuple(int(p) if p.isdigit() else p for p in TOP_LISTS[flavour].split("."))
        top = dict(nodes(payload))[top_path]
        keep = int(rng.integers(0, TOP_K))
        short = dict(list(top.items())[:keep]) if isinstance(top, dict) else top[:keep]
        return json.dumps(replaced(payload, top_path, short)), "raise", f"top-k cut to {keep}"
    if kind == "rename":  # a data key of vLLM's top-k, or an extra key in any dict
        dicts = [p for p, v in everything if isinstance(v, dict)]
        path = dicts[int(rng.integers(len(dicts)))]
        node = dict(nodes(payload))[path]
        data_keys = flavour == "openai-vllm" and _matches(TOP_LISTS[flavour], path)
        new = dict(node)
        if data_keys:
            old = list(new)[int(rng.integers(len(new)))]
            new[pick(rng, ["token_id:-1", "token_id: 5", "token_id:9999", " 5", "token_id:0x1f", "token_id:"])] = \
                new.pop(old)
            return json.dumps(replaced(payload, path, new)), "raise", f"{path}: key {old} renamed"
        new["zz_extra"] = pick(rng, ["x", 1, None, [1, 2], {"a": {"b": 1}}])
        return json.dumps(replaced(payload, path, new)), "accept", f"{path}: extra key"
    if kind == "extra":
        dicts = [p for p, v in everything if isinstance(v, dict)
                 and not (flavour == "openai-vllm" and _matches(TOP_LISTS[flavour], p))]
        path = dicts[int(rng.integers(len(dicts)))]
        value = pick(rng, ["x", 10 ** 30, -1, None, float("nan"), [1, 2], {"id": -1}])
        new = {**dict(nodes(payload))[path], f"extra_{int(rng.integers(1000))}": value}
        return json.dumps(replaced(payload, path, new)), "accept", f"{path}: extra field"
    if kind == "drop":
        keyed = [p for p, _ in everything if p and isinstance(dict(nodes(payload))[p[:-1]], dict)]
        path = keyed[int(rng.integers(len(keyed)))]
        r = role(flavour, path)
        return json.dumps(replaced(payload, path, DROP)), "raise" if r == "required" else "accept", f"drop {path}"
    if kind == "retype":
        path = everything[int(rng.integers(len(everything)))][0]
        old = dict(nodes(payload))[path]
        choices = [w for w in WRONG_TYPES if type(w) is not type(old)]
        if isinstance(old, int | float) and not isinstance(old, bool):
            choices = [w for w in choices if isinstance(w, bool) or not isinstance(w, int | float)]
        value = choices[int(rng.integers(len(choices)))]
        r = role(flavour, path)
        expected = {"required": "raise", "checked": "raise", "holds-checked": "either", "ignored": "accept"}[r]
        if r == "checked" and value in ([], {}, None, False):  # read as "not reported" is as good as absent
            expected = "either"
        return json.dumps(replaced(payload, path, value)), expected, f"{path} -> {value!r}"
    # number: a numeric field set to a value no answer has, or to one that is still valid
    numeric = [p for p, v in everything if isinstance(v, int | float) and not isinstance(v, bool)
               and role(flavour, p) in ("required", "checked")]
    path = numeric[int(rng.integers(len(numeric)))]
    is_logprob = isinstance(dict(nodes(payload))[path], float)
    count = role(flavour, path) == "checked"  # a prompt-token or cached count: len(ids) + 1 is one too many
    value = pick(rng, [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 10 ** 30, -1, 0.5, 2 ** 63, -5.0,
                       *([len(ids) + 1] if count else [])])
    if is_logprob:
        ok = isinstance(value, int | float) and math.isfinite(value) and value <= 0
    elif count:  # every value in the pool is outside 0..len(ids) or not an integer
        ok = False
    else:
        ok = False  # an id: every value in the pool is outside 0..255 or not an integer
    return json.dumps(replaced(payload, path, value)), "accept" if ok else "raise", f"{path} -> {value!r}"


class ScriptedEngine(FakeEngine):
    """test_endpoint's fake engine describing its model on GET, answering `body` (set per request) on POST."""

    def __init__(self, vocab: int = V4):
        super().__init__(vocab=vocab)
        self.body: str | bytes = b""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return super().__call__(request)
        body = self.body.encode() if isinstance(self.body, str) else self.body
        return httpx.Response(200, content=body, headers={"Content-Type": "application/json"})


def scripted_adapter(flavour: str, engine: ScriptedEngine):
    from phasekv.engines.client import EndpointAdapter

    return EndpointAdapter("http://engine.test", flavour.split("-")[0], V4, retries=0, backoff=0.0,
                           transport=httpx.MockTransport(engine))


FUZZ_PER_FLAVOUR = 600
FLAVOURS = ["llamacpp", "openai-llamacpp", "openai-vllm", "sglang"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fuzzed_engine_answers_are_refused_in_one_line_or_read_right(flavour):
    """Each generated answer (truncated, retyped, NaN, huge, missing or extra fields, fewer top-k, a wrong prompt
    count) either raises EndpointError in one line, nothing stored, or, when harmless, gives the engine's greedy
    token; never another exception.  The valid answer itself is accepted (the generator's baseline)."""
    import numpy as np

    from phasekv.engines.journal import prompt_key
    from phasekv.engines.wire import EndpointError

    rng = np.random.default_rng(FLAVOURS.index(flavour))
    engine = ScriptedEngine()
    adapter = scripted_adapter(flavour, engine)
    outcomes = collections.Counter()
    for n in range(FUZZ_PER_FLAVOUR + 1):
        ids = [1 + n % 200, 1 + n // 200, 3]
        if n == 0:
            payload, greedy = valid_answer(flavour, ids)
            body, expected, what = json.dumps(payload), "accept", "the valid answer"
        else:
            body, expected, what = mutations(flavour, ids, rng)
            greedy = valid_answer(flavour, ids)[1]
        engine.body = body
        adapter.answered_by = {}  # each answer judged alone (a renamed "model" would carry over)
        try:
            logits = adapter.logits(torch.tensor([ids]))
        except EndpointError as exc:
            assert expected in ("raise", "either"), f"{flavour} {what}: refused a good answer: {exc}"
            assert "\n" not in str(exc) and prompt_key(ids) not in adapter.answers, what
            outcomes["refused"] += 1
            continue
        assert expected in ("accept", "either"), f"{flavour} {what}: a broken answer was accepted"
        assert int(logits[0, -1].argmax()) == greedy, what
        outcomes["accepted"] += 1
    assert sum(outcomes.values()) == FUZZ_PER_FLAVOUR + 1
    assert outcomes["refused"] > FUZZ_PER_FLAVOUR // 2 and outcomes["accepted"] > 50, outcomes


@pytest.mark.parametrize("api", ["llamacpp", "openai", "sglang"])
def test_fuzzed_model_descriptions_are_one_line_or_a_working_adapter(api):
    """The server's description of its model (/props, /v1/models, /get_model_info), fuzzed the same way: a working
    adapter or one EndpointError line, never a traceback."""
    import numpy as np

    from phasekv.engines.client import EndpointAdapter
    from phasekv.engines.wire import EndpointError

    described = {"/props": {"model_path": "/models/fake.gguf", "default_generation_settings": {"n_ctx": 4096}},
                 "/v1/models": {"data": [{"id": "fake", "max_model_len": 4096, "meta": {"n_vocab": V4}}]},
                 "/get_model_info": {"model_path": "org/fake"}}
    rng = np.random.default_rng(7)
    refused = 0
    for _ in range(200):
        route = pick(rng, list(described))
        everything = list(nodes(described[route]))
        path = everything[int(rng.integers(len(everything)))][0]
        value = pick(rng, [*WRONG_TYPES, DROP, float("nan"), -1, 0, 10 ** 30]) if path else pick(rng, WRONG_TYPES)
        mutated = {**described, route: replaced(described[route], path, value if path else value)}
        if value is DROP and not path:
            continue

        def handler(request, mutated=mutated):
            if request.url.path in mutated:
                return httpx.Response(200, json=mutated[request.url.path])
            return httpx.Response(404, json={"detail": "Not Found"})

        try:
            EndpointAdapter("http://engine.test", api, V4, retries=0, transport=httpx.MockTransport(handler))
        except EndpointError as exc:
            assert "\n" not in str(exc)
            refused += 1
    assert refused > 20


@pytest.mark.parametrize("case, match", [
    ("id-minus-one", "token id -1, outside the tokenizer's 256"),
    ("id-past-vocab", "token id 300, outside the tokenizer's 256: wrong --tokenizer?"),
    ("nan-logprob", "the log-probability nan"),
    ("positive-logprob", "the log-probability 0.5"),
    ("fewer-top-k", "3 top-k log-probabilities where 8 were asked"),
    ("prompt-count", "read 4 prompt tokens where 3 ids were sent"),
    ("greedy-not-in-top", "the greedy token 200, which is not among its own top-8"),
    ("cached-negative", "-2 prompt tokens served from its cache"),
])
def test_each_broken_answer_of_the_issue_is_named(case, match):
    """The issue's broken answers, one line each (llama.cpp's format; the fuzz covers every API)."""
    from phasekv.engines.wire import EndpointError

    ids = [5, 6, 7]
    payload, t = valid_answer("llamacpp", ids)
    step = payload["completion_probabilities"][0]
    if case == "id-minus-one":  # the issue's engine: token -1, top-k ids -1..-8
        step["id"] = -1
        for j, entry in enumerate(step["top_logprobs"]):
            entry["id"] = -1 - j
    elif case == "id-past-vocab":
        step["id"] = step["top_logprobs"][0]["id"] = 300
    elif case == "nan-logprob":
        step["top_logprobs"][2]["logprob"] = float("nan")
    elif case == "positive-logprob":
        step["top_logprobs"][0]["logprob"] = 0.5
    elif case == "fewer-top-k":
        del step["top_logprobs"][3:]
    elif case == "prompt-count":
        payload["tokens_evaluated"] = 4
    elif case == "greedy-not-in-top":
        step["id"] = 200
    else:
        payload["timings"]["cache_n"] = -2
    engine = ScriptedEngine()
    engine.body = json.dumps(payload)
    with pytest.raises(EndpointError, match=re.escape(match)) as caught:
        scripted_adapter("llamacpp", engine).logits(torch.tensor([ids]))
    assert "\n" not in str(caught.value) and t != 200


class HTTPEngine(LoopbackServer):
    """A fake llama.cpp server on a loopback port: /props, /v1/models and /completion answered as llama-server
    answers (the greedy token a hash of the ids, as many top-k entries as asked, within `vocab`).  `answer(n, ids,
    k, good)` may replace the n-th /completion answer (1-based) with (status, body); `props` streams /props' body
    from an iterable of chunks until the client hangs up; `redirect` answers 302 to everything.  `sent`: body bytes
    written."""

    def __init__(self, vocab: int, context: int = 4096, answer=None, props=None, redirect: str | None = None):
        self.posts, self.sent = 0, 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if redirect is not None:
                    return self._send(302, b"", {"Location": redirect})
                if self.path == "/props" and props is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()  # HTTP/1.0: the body runs until the connection closes
                    try:
                        for chunk in props:
                            self.wfile.write(chunk)
                            engine.sent += len(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return None
                routes = {"/props": {"model_path": "/models/fake.gguf", "default_generation_settings": {"n_ctx":
                                                                                                         context}},
                          "/v1/models": {"data": [{"id": "fake.gguf", "meta": {"n_vocab": vocab}}]}}
                if self.path in routes:
                    return self._send(200, json.dumps(routes[self.path]).encode())
                return self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                engine.posts += 1
                if redirect is not None:
                    return self._send(302, b"", {"Location": redirect})
                ids, k = body["prompt"], body["n_probs"]
                t = (sum((i + 1) * x for i, x in enumerate(ids)) * 7 + len(ids)) % vocab
                step = {"id": t, "logprob": -0.25, "top_logprobs": [
                    {"id": (t + j) % vocab, "token": "x", "logprob": -0.25 - j} for j in range(k)]}
                good = {"completion_probabilities": [step], "tokens_evaluated": len(ids), "model": "fake.gguf"}
                status, data = answer(engine.posts, ids, k, good) if answer else (200, good)
                return self._send(status, data if isinstance(data, bytes) else json.dumps(data).encode())

            def _send(self, status, data, headers=None):
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)
                    engine.sent += len(data)

            def log_message(self, *args):  # quiet
                pass

        self._serve(Handler)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small BPE tokenizer saved as files: what --tokenizer reads for the fake engines."""
    from tests.helpers import bpe_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    bpe_tokenizer().save_pretrained(path)
    return path


def vocab_of(tokenizer: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer))


# 8 prompts of about 75 tokens (stride 2, both protocols), as tests/test_endpoint_faults.py sends
SMALL_AUDIT = "--format records --stride 2 --records 4 --demos 1 --local-window 4 --prompts-per-phase 1 --no-progress"


def served_audit(url: str, tokenizer: Path, out: Path, capsys, extra: str = "") -> tuple[int, str]:
    """(exit status, the one stderr line or '') of `phasekv audit --endpoint URL` on the small prompt set."""
    capsys.readouterr()
    code = main(["audit", "--endpoint", url, "--tokenizer", str(tokenizer), *SMALL_AUDIT.split(), *extra.split(),
                 "--out", str(out)])
    captured = capsys.readouterr()
    if code == 0:
        return 0, ""
    return code, check_one_line(code, captured.err, captured.out)


def test_an_endless_body_is_cut_at_the_cap(tmp_path, tokenizer_dir, capsys):
    """/props streaming without end (256 MiB here) is read only up to the cap: the read stops, memory stays
    bounded (the server could write at most the cap plus the socket buffers), the audit is one line."""
    from phasekv.engines.wire import Connection, EndpointError

    def endless():
        yield b'{"model_path": "'
        for _ in range(4096):
            yield b"a" * 65536

    with HTTPEngine(256, props=endless()) as engine:
        conn = Connection(engine.url, timeout=30, retries=0, max_bytes=1 << 20)
        with pytest.raises(EndpointError, match=r"/props: answered more than 1 MiB"):
            conn.request("GET", "/props")
        conn.close()
        time.sleep(0.5)
        assert engine.sent < 32 << 20
    with HTTPEngine(256, props=endless()) as engine:
        start = time.perf_counter()
        code, line = served_audit(engine.url, tokenizer_dir, tmp_path / "out", capsys)
        time.sleep(0.5)
        assert code == 2 and "answered more than 16 MiB" in line, line
        assert engine.sent < 64 << 20 and time.perf_counter() - start < 60
    assert not any(tmp_path.iterdir())


def test_a_broken_engine_answer_stops_the_audit_before_anything_is_scored(tmp_path, tokenizer_dir, capsys):
    """The issue's engine: token -1 and top-k ids -1..-8.  Exit 2 naming it, no OUT, no journal left behind."""
    def broken(n, ids, k, good):
        step = good["completion_probabilities"][0]
        step["id"] = -1
        step["top_logprobs"] = [{"id": -1 - j, "token": "x", "logprob": -0.25 - j} for j in range(k)]
        return 200, good

    with HTTPEngine(vocab_of(tokenizer_dir), answer=broken) as engine:
        code, line = served_audit(engine.url, tokenizer_dir, tmp_path / "out", capsys)
    assert code == 2 and "token id -1, outside the tokenizer's" in line, line
    assert not any(tmp_path.iterdir())


def test_a_redirect_is_refused_in_one_line(tmp_path, tokenizer_dir, capsys):
    with HTTPEngine(256, redirect="http://127.0.0.1:9/elsewhere") as engine:
        code, line = served_audit(engine.url, tokenizer_dir, tmp_path / "out", capsys)
    assert code == 2 and "HTTP 302, a redirect to 'http://127.0.0.1:9/elsewhere'" in line, line
    assert not any(tmp_path.iterdir())


def test_the_journal_lives_inside_the_output_and_a_bad_line_is_named(tmp_path, tokenizer_dir, capsys):
    """A refused run leaves nothing; a failed run keeps its journal only inside OUT (OUT/.partial, never a file
    beside OUT); a journal line without an answer's fields is named with its line; --resume publishes the
    journal inside OUT and nothing else remains."""
    from phasekv.engines.journal import journal_path

    vocab, out = vocab_of(tokenizer_dir), tmp_path / "out"
    with HTTPEngine(vocab, context=16) as engine:  # every prompt is longer than the server's context
        code, line = served_audit(engine.url, tokenizer_dir, out, capsys)
    assert code == 2 and "serves a context of 16 tokens" in line and "+ 1 answer token" in line, line
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())

    def three_then_gone(n, ids, k, good):
        return (200, good) if n <= 3 else (400, {"error": {"message": "slot unavailable"}})

    with HTTPEngine(vocab, answer=three_then_gone) as engine:
        code, line = served_audit(engine.url, tokenizer_dir, out, capsys)
    assert code == 2 and "slot unavailable" in line, line
    journal = journal_path(out)
    assert journal.is_file() and len(journal.read_text().splitlines()) == 5  # header, prompt set, 3 answers
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the journal inside OUT, nothing beside it
    assert {p.name for p in out.iterdir()} == {outputs_mod.MARKER, outputs_mod.PARTIAL}

    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([*lines, '{"key": "abc"}']) + "\n")  # complete JSON, no answer
    with HTTPEngine(vocab) as engine:
        code, line = served_audit(engine.url, tokenizer_dir, out, capsys, "--resume")
    assert code == 2 and f"{journal}: line 6 is not a journaled answer (it lacks token, top, cached)" in line, line
    journal.write_text("\n".join(lines) + "\n")
    with HTTPEngine(vocab) as engine:
        assert served_audit(engine.url, tokenizer_dir, out, capsys, "--resume") == (0, "")
        asked = engine.posts
    assert asked == 8 - 3  # the three journaled prompts were not asked again
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert len((out / "endpoint_journal.jsonl").read_text().splitlines()) == 10
    assert json.loads((out / "endpoint.json").read_text())["answers_from_journal"] == 3


def _full_disk(command: str, size: str, tmp_path: Path) -> tuple[int, str, list[str]]:
    """(exit status, stderr, what is left on the disk) of `python COMMAND` run with {disk} a tmpfs of `size` in a
    private mount namespace: a real full file system without touching this machine's."""
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + str(REPO), "OMP_NUM_THREADS": "1"}
    script = (f"mount -t tmpfs -o size={size} none {disk} && {sys.executable} {command.format(disk=disk)}; "
              f"code=$?; echo LEFT: $(ls -A {disk}); exit $code")
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    left = proc.stdout.rsplit("LEFT:", 1)[-1].split()
    return proc.returncode, proc.stderr, left


def _can_mount() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=4k none /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs unshare --mount and tmpfs (root)")


@needs_mount
def test_a_full_disk_during_gguf_export_is_one_line_and_leaves_no_file(tmp_path):
    """The issue's case: a tmpfs too small for the GGUF.  Exit 2, "no space left on DISK writing FILE", the disk
    left empty (no partial file, no temporary)."""
    pytest.importorskip("gguf")
    code, err, left = _full_disk(f"-m phasekv.cli export gguf --checkpoint {REPO}/checkpoints/dsv4-csa --out "
                                 "{disk}/m.gguf", "256k", tmp_path)
    disk = tmp_path / "disk"
    assert f"no space left on {disk} writing {disk}/m.gguf" in check_one_line(code, err, "")
    assert left == [], left


# an output directory written on a full disk, through the outputs module as every command writes its --out
FILL_OUT = """-c "
import sys
from phasekv.outputs import OutputError, output_dir, write_json
try:
    with output_dir(sys.argv[1]) as tmp:
        write_json(tmp / 'summary.json', {{'x': 'y' * 100000}})
except OutputError as exc:
    print(exc, file=sys.stderr)
    sys.exit(2)
" {disk}/out"""


@needs_mount
def test_a_full_disk_under_an_output_directory_names_the_file_and_leaves_nothing(tmp_path):
    code, err, left = _full_disk(FILL_OUT, "16k", tmp_path)
    disk = tmp_path / "disk"
    assert code == 2 and f"no space left on {disk} writing {disk}/.out.tmp-" in err and "summary.json" in err, err
    assert len(err.strip().splitlines()) == 1 and left == [], (err, left)
