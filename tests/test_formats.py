"""Prompt formats as data: token-exact framed prompts for real tokenizers, with matched positions."""

import dataclasses

import pytest
import torch

from phasekv.config import EvalConfig
from phasekv.data.formats import FORMATS, FormatVocabulary, load_format
from phasekv.data.protocols import build_eval_set
from tests.helpers import SMOL, SMOL_FILE, bpe_tokenizer, needs_real_model


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    return bpe_tokenizer()


# records-lmeval's filler " ." is one token in real byte-level BPE vocabularies (SmolLM2's: tests/test_lmeval.py), not
# in the small test tokenizer
@pytest.mark.parametrize("name", sorted(set(FORMATS) - {"records-lmeval"}))
def test_every_record_has_one_length_and_answers_are_not_a_giveaway(request, name):
    tokenizer = request.getfixturevalue("prose_tokenizer" if FORMATS[name].haystack_tokens else "tokenizer")
    vocab = FormatVocabulary(FORMATS[name], tokenizer)
    kt, vt = vocab.record_shape
    assert all(len(k) == kt for k in vocab.key_pieces) and all(len(v) == vt for v in vocab.value_pieces)
    assert len(vocab.answers) >= 2 and len(set(vocab.key_pieces)) == len(vocab.key_pieces)
    assert vocab.group("values") == vocab.answers  # chance = 1 / answers


@pytest.mark.parametrize("protocol", ["prefix", "insequence"])
def test_framed_prompts_put_every_piece_at_its_recorded_position(tokenizer, protocol):
    vocab = FormatVocabulary(FORMATS["records"], tokenizer)
    kt, vt = vocab.record_shape
    eval_set = build_eval_set(vocab, protocol, n_records=64, n_demos=4, stride=8, n_clusters=None,
                              key_tokens=kt, value_tokens=vt, local_window=16, seed=1)
    stats = eval_set.matching_stats()
    assert stats["max_mean_gap"] == 0
    H = len(vocab.header)
    for prompt in eval_set.prompts()[::37]:
        ids, q = prompt.ids, prompt.query
        assert ids[1:1 + H] == vocab.header
        assert tuple(ids[q.target_position:q.target_position + kt]) == q.key  # the target record's key ...
        assert ids[q.target_position + kt] == q.answer  # ... followed by its value's first token
        assert tuple(ids[-kt:]) == q.key and len(ids) - 1 == eval_set.query_position
        assert q.phase == q.target_position % 8
        assert q.answer in vocab.answers
    assert 0.5 < vocab.retokenization_agreement(eval_set.prompts()[0].ids) <= 1.0
    assert eval_set.chance == 1 / len(vocab.answers)


def test_formats_load_from_yaml_and_bad_ones_name_the_field(tmp_path, tokenizer):
    path = tmp_path / "mine.yaml"
    path.write_text("header: 'Records follow.\\n'\nkey_text: '{key}='\nvalue_text: ' {value}\\n'\n"
                    "values: 'digits:2'\n")
    fmt = load_format(str(path))
    assert fmt.name == "mine" and fmt.values == "digits:2"
    assert FormatVocabulary(fmt, tokenizer).record_shape[1] >= 2
    with pytest.raises(ValueError, match="neither a shipped format"):
        load_format("nope")
    path.write_text("values: 'digits:9'\n")
    with pytest.raises(ValueError, match="values"):
        load_format(str(path))
    path.write_text("colour: red\n")
    with pytest.raises(ValueError, match="colour: unknown key"):
        load_format(str(path))


@pytest.fixture(scope="module")
def prose_tokenizer():
    pytest.importorskip("transformers")
    return bpe_tokenizer(prose=True)


def _needle(tokenizer, chat=False, haystack_tokens=40):
    return FormatVocabulary(dataclasses.replace(load_format("needle", chat=chat), haystack_tokens=haystack_tokens),
                            tokenizer)


def _needle_set(vocab, protocol, seed=1, n_records=16):
    kt, vt = vocab.record_shape
    return build_eval_set(vocab, protocol, n_records=n_records, n_demos=2, stride=8, residue_modulus=8,
                          key_tokens=kt, value_tokens=vt, local_window=16, seed=seed)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("protocol", ["prefix", "insequence"])
def test_needles_sit_in_whole_prose_sentences_at_their_recorded_positions(prose_tokenizer, protocol, chat):
    vocab = _needle(prose_tokenizer, chat)
    kt, vt = vocab.record_shape
    eval_set = _needle_set(vocab, protocol)
    stats = eval_set.matching_stats()
    assert stats["max_mean_gap"] == 0 and stats["max_variance_rel_gap"] == 0
    sentences = {prose_tokenizer.decode(s) for s in vocab.sentences}
    for i, prompt in enumerate(eval_set.prompts()[::5]):
        ids, q = prompt.ids, prompt.query
        assert vocab.retokenization_agreement(ids) == 1.0  # re-tokenizing the text gives the same ids
        assert tuple(ids[q.target_position:q.target_position + kt]) == q.key and ids[q.target_position + kt] == q.answer
        assert q.phase == q.target_position % 8 and len(ids) - 1 == eval_set.query_position
        context = eval_set.contexts[prompt.context]
        # the 40 tokens before a needle are whole sentences of the built-in prose
        rest = prose_tokenizer.decode(ids[context.record_positions[i % 16] - 40:context.record_positions[i % 16]])
        while rest:
            sentence = [s for s in sentences if rest.startswith(s)]
            assert sentence, rest
            rest = rest[len(sentence[0]):]
    text = prose_tokenizer.decode(eval_set.prompts()[0].ids)
    assert ("[user]" in text and "[assistant]" in text) == chat
    assert text.count("The special magic number for") == 16 + 2 + 1  # needles, demonstrations, query


def test_needle_prompts_are_deterministic_per_seed_and_shift_the_whole_haystack(prose_tokenizer):
    vocab = _needle(prose_tokenizer)
    a, b, c = (_needle_set(vocab, "prefix", seed) for seed in (3, 3, 4))
    assert [x.ids for x in a.contexts] == [x.ids for x in b.contexts]
    assert [x.ids for x in a.contexts] != [x.ids for x in c.contexts]
    # prefix padding: the contexts of one cluster hold the same haystack, moved one filler at a time
    first, second = (x for x in a.contexts if x.cluster == 0 and x.shift in (0, 1))
    start, end = first.record_positions[0] - 40, first.record_positions[-1] + sum(vocab.record_shape) + 40
    assert first.ids[start:end] == second.ids[start + 1:end + 1]
    assert second.ids[start] == vocab.fillers[0]


def test_needle_runs_record_the_phase_of_the_key_and_of_the_answer(prose_tokenizer):
    from phasekv.evaluate.runner import predict

    class Oracle:  # predicts the answer from the prompt itself: the token after the last copy of the key
        shares_cache = False

        def check_length(self, n):
            pass

        def logits(self, ids):
            out = torch.zeros(len(ids), 1, len(prose_tokenizer))
            for row, seq in enumerate(ids.tolist()):
                key = seq[-kt:]
                at = next(p for p in range(len(seq) - kt) if seq[p:p + kt] == key)
                out[row, 0, seq[at + kt]] = 1.0
            return out

    vocab = _needle(prose_tokenizer)
    kt = vocab.record_shape[0]
    eval_set = _needle_set(vocab, "insequence", n_records=12)
    records = predict(Oracle(), eval_set, batch_size=64, multi_query=False, progress=False)
    assert all(r["correct"] for r in records)
    assert {r["answer_phase"] for r in records} == set(range(8)) == {r["phase"] for r in records}
    assert all(r["answer_phase"] == (r["phase"] + kt) % 8 for r in records)


def test_chat_and_haystack_errors_are_one_clear_line(tmp_path, tokenizer, prose_tokenizer):
    with pytest.raises(ValueError, match="records.chat: the tokenizer has no chat template"):
        FormatVocabulary(load_format("records", chat=True), tokenizer)
    with pytest.raises(ValueError, match="haystack_tokens: no set of haystack sentences is exactly 3 tokens"):
        _needle(prose_tokenizer, haystack_tokens=3)
    path = tmp_path / "bad.yaml"
    for text, message in [("haystack_tokens: -1\n", "haystack_tokens: must be >= 0"),
                          ("chat: maybe\n", "chat: must be true or false"),
                          ("keys: 'animals-fancy'\n", "keys: must be a word kind"),
                          ("- a list\n", "section must be a mapping"),
                          ("header: [unclosed\n", "not valid YAML")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as info:
            load_format(str(path))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="eval.chat: needs a prompt format"):
        EvalConfig(chat=True)


@needs_real_model
@pytest.mark.parametrize("chat", [False, True])
def test_needle_prompts_are_token_exact_with_the_real_smollm2_tokenizer(chat):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    vocab = FormatVocabulary(load_format("needle", chat=chat), tokenizer)
    assert vocab.record_shape == (8, 4) and len(vocab.answers) == 9  # " The special ... tiger is " + "4", "8", "2", "."
    assert vocab.header[0] != vocab.bos  # the template's own <|im_start|> is the prompt's <bos>
    for protocol in ("prefix", "insequence"):
        eval_set = build_eval_set(vocab, protocol, n_records=16, n_demos=2, stride=8, residue_modulus=8,
                                  key_tokens=8, value_tokens=4, local_window=16, n_clusters=4, seed=0)
        assert all(vocab.retokenization_agreement(p.ids) == 1.0 for p in eval_set.prompts()[::9])


def test_a_word_level_tokenizer_without_an_unknown_token_is_one_line():
    """A phasekv checkpoint's word-level tokenizer cannot render prose formats: one ValueError naming the format and
    the word (tokenizers raises a bare Exception); the same tokenizer with an unknown token renders it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    def word_level(unk: bool):
        vocab = {"[UNK]": 0, "a": 1, "b": 2} if unk else {"a": 1, "b": 2}
        inner = Tokenizer(WordLevel(vocab, unk_token="[UNK]" if unk else None))
        inner.pre_tokenizer = WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=inner)

    with pytest.raises(ValueError, match=r"format records: the tokenizer cannot encode .*phasekv eval"):
        FormatVocabulary(FORMATS["records"], word_level(unk=False))
    with pytest.raises(ValueError) as caught:  # with [UNK] it encodes, then fails later for another reason
        FormatVocabulary(FORMATS["records"], word_level(unk=True))
    assert "cannot encode" not in str(caught.value)
