"""The long-context prompt sets (`phasekv.data.longcontext`, `phasekv.data.keyspace`): a key space of >= 16,000
constant-length keys that survive round-trip tokenization, exactly matched phase groups (integer arithmetic) at
32K and 128K tokens, a fixed query position, every prompt of the requested length, for a byte-level BPE and a
metaspace BPE trained here and for SmolLM2's tokenizer when it is present."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from phasekv.data.keyspace import build_key_space, train_bpe
from phasekv.data.longcontext import MIN_KEYS, PAPER_NIAH, PRESETS, LongContextSet, LongContextSpec
from tests.helpers import SMOL, SMOL_FILE, needs_real_model

KINDS = ("byte-level", "metaspace", "byte-level-transformers")


@pytest.fixture(scope="module", params=KINDS)
def tokenizer(request):
    """A GPT-2-style and a Llama-style BPE (`tokenizers` objects), and the first wrapped as a transformers one."""
    if request.param.endswith("-transformers"):
        import transformers

        return transformers.PreTrainedTokenizerFast(tokenizer_object=train_bpe("byte-level"),
                                                    bos_token="<|endoftext|>")
    return train_bpe(request.param)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)


def _encode(tokenizer, text):
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_key_space(tokenizer):
    keys = build_key_space(tokenizer)
    assert keys.size(PAPER_NIAH.key_tokens) >= MIN_KEYS and len(set(keys.pieces.tolist())) == len(keys.pieces)
    assert not set(keys.pieces.tolist()) & set(keys.values.tolist())
    codes = keys.codes(np.random.default_rng(0).choice(keys.size(2), 400, replace=False), 2)
    assert len({tuple(c) for c in codes.tolist()}) == 400
    lead = _encode(tokenizer, " the")
    for code in codes.tolist():  # a code's text, after running text, tokenizes back to exactly its pieces and ":"
        ids = lead + code + [keys.terminator]
        assert _encode(tokenizer, tokenizer.decode(ids)) == ids
    return keys


def _check_set(spec, tokenizer, keys=None, clusters=None):
    prompts = LongContextSet(spec, tokenizer, keys=keys)
    R, S = spec.modulus, spec.stride
    for modulus in sorted({R, S}):
        stats = prompts.matching_stats(modulus, coordinate="query" if spec.protocol == "query" else "target")
        assert stats["exact"] and stats["max_mean_gap"] == 0 == stats["max_variance_gap"], stats
        assert {g["n"] for g in stats["per_group"]} == {prompts.n_prompts // modulus}
    target = prompts.matching_stats()
    assert target["max_mean_gap"] == 0  # the query protocol's target groups: equal means (docstring)
    if spec.protocol != "query":
        assert target["query_positions"] == [spec.context - 1]
    for prompt in prompts.prompts(clusters):
        n = len(prompt.ids)
        assert n == spec.context if spec.protocol != "query" else spec.context - R < n <= spec.context
        assert prompt.query_position == n - 1 and prompt.phase == prompt.target_position % S
        at = prompt.target_position
        key = prompt.ids[n - 1 - spec.key_tokens:n - 1]
        assert (prompt.ids[at:at + spec.key_tokens] == key).all()  # the query repeats the target's key
        assert prompt.ids[at + spec.key_tokens + 1] == prompt.answer
        # the key occurs once in the context: it is the target, no other record shares it
        windows = np.lib.stride_tricks.sliding_window_view(prompt.ids[:n - 1 - spec.key_tokens], spec.key_tokens)
        assert int((windows == key).all(1).sum()) == 1
    return prompts


@pytest.mark.parametrize("protocol", ["prefix", "insequence", "query"])
@pytest.mark.parametrize("family", ["records", "needle"])
def test_groups_match_exactly_at_32k_tokens_for_two_tokenizer_families(tokenizer, family, protocol):
    spec = LongContextSpec(family=family, context=32768, protocol=protocol, stride=8, residue_modulus=16,
                           per_group=256, depths=(0.1, 0.25, 0.5, 0.75, 0.9), seed=3)
    keys = _check_key_space(tokenizer)
    prompts = _check_set(spec, tokenizer, keys=keys, clusters=range(0, 1280, 97))
    for depth in spec.depths:
        stats = prompts.matching_stats(depth=depth)
        assert stats["max_variance_gap"] == 0 or protocol == "query"
        mean = stats["per_group"][0]["mean"]
        assert abs(mean / spec.context - depth) < 0.02  # the target sits at its depth bin


@pytest.mark.parametrize("protocol", ["prefix", "insequence", "query"])
def test_the_paper_design_at_128k_tokens(tokenizer, protocol):
    spec = dataclasses.replace(PAPER_NIAH, protocol=protocol)
    prompts = _check_set(spec, tokenizer, clusters=range(0, 256, 51))
    assert PRESETS["paper-niah"] is PAPER_NIAH
    assert (prompts.n, prompts.n_prompts, prompts.n_clusters, prompts.record_tokens) == (16000, 2048, 256, 4)
    first = prompts.base0(0) / spec.context
    last = prompts.base0(prompts.n - 1) / spec.context
    assert first < 0.01 and last > 0.98  # records over the whole context, not a preamble then records


def test_every_prompt_of_a_32k_set_streams_with_little_memory(tokenizer):
    spec = LongContextSpec(family="needle", context=32768, protocol="insequence", per_group=64)
    prompts = LongContextSet(spec, tokenizer)
    tracemalloc.start()
    total = sum(len(p.ids) for p in prompts.prompts())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert total == prompts.n_prompts * spec.context == 512 * 32768
    assert peak < prompts.held_bytes()  # streaming holds a few contexts, never the set (64 MiB here)
    again = prompts.prompt(5, 3)  # a pure function of (seed, cluster, shift, target)
    assert np.array_equal(again.ids, LongContextSet(spec, tokenizer).prompt(5, 3).ids)


@needs_real_model
@pytest.mark.parametrize("protocol", ["prefix", "insequence", "query"])
def test_smollm2s_tokenizer_at_32k_and_128k_tokens(smollm2, protocol):
    keys = _check_key_space(smollm2)
    for spec in (LongContextSpec(context=32768, protocol=protocol, depths=(0.1, 0.5, 0.9), per_group=64),
                 dataclasses.replace(PAPER_NIAH, protocol=protocol)):
        _check_set(spec, smollm2, keys=keys, clusters=range(0, spec.per_group, 37))
    if protocol != "insequence":  # fillers between records join the newlines in text (" ...\n" is one token)
        records = LongContextSet(LongContextSpec(context=8192, protocol=protocol), keys=keys).prompt(1, 2)
        text = smollm2.decode(records.ids[1:].tolist())  # the records family re-tokenizes to the same ids
        assert _encode(smollm2, text) == records.ids[1:].tolist()


@pytest.mark.parametrize(("changes", "message"), [
    ({"context": 40}, "context: 40 tokens cannot hold"),
    ({"context": 100}, "per_group: 64 prompts per group need 8 target records per depth, the context holds"),
    ({"context": 4096, "n_records": 4000}, "context: 4096 tokens cannot hold 4000 records"),
    ({"depths": (0.5, 1.5)}, r"depths: need one or more target depths in \[0, 1\]"),
    ({"depths": ()}, "depths: need one"),
    ({"per_group": 100}, "per_group: must be a multiple of R\\^2 = 64"),
    ({"residue_modulus": 12}, "residue_modulus: 12 is not a multiple of stride 8"),
    ({"key_tokens": 1}, "key_tokens: .* at least 16000 are needed"),
    ({"family": "prose"}, "family: must be one of"),
    ({"protocol": "middle"}, "protocol: must be one of"),
    ({"context": 2048, "per_group": 64 * 64}, "per_group: 4096 prompts per group need 512 target records"),
    ({"context": "8k"}, "context: must be an integer"),
])
def test_impossible_requests_are_one_line(changes, message):
    keys = build_key_space(train_bpe("byte-level"))
    with pytest.raises(ValueError, match=message) as info:
        LongContextSet(dataclasses.replace(LongContextSpec(), **changes), keys=keys)
    assert "\n" not in str(info.value)
    prompts = LongContextSet(LongContextSpec(), keys=keys)
    for bad in ((prompts.n_clusters, 0), (0, 8), (0, 0, 1)):
        with pytest.raises(ValueError, match="must be an integer in"):
            prompts.prompt(*bad)


def test_a_tokenizer_that_cannot_render_the_set_is_one_line():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1}))  # no unknown token: tokenizers raises a bare Exception
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    for make, message in ((lambda: build_key_space(words), "tokenizer: cannot encode the long-context set's text"),
                          (lambda: train_bpe("unigram"), "kind: must be 'byte-level' or 'metaspace'")):
        with pytest.raises(ValueError, match=message) as info:
            make()
        assert "\n" not in str(info.value)


def test_depths_from_a_list_and_the_settings_a_run_records():
    keys = build_key_space(train_bpe("byte-level"))
    prompts = LongContextSet(LongContextSpec(depths=[0.25, 0.75], per_group=64), keys=keys)
    assert prompts.spec.depths == (0.25, 0.75) and prompts.n_prompts == 2 * 64 * 8
    settings = prompts.settings
    assert settings["n_records"] == prompts.n and settings["key_space"] >= MIN_KEYS
    assert settings["context"] == 8192 and settings["depths"] == [0.25, 0.75]
    deep = [p.target_position for p in prompts.prompts(range(64, 128))]
    shallow = [p.target_position for p in prompts.prompts(range(64))]
    assert max(shallow) < min(deep)  # the clusters of the first depth come first
