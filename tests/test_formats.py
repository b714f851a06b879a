"""Prompt formats as data: token-exact framed prompts for real tokenizers, with matched positions."""

import pytest

from phasekv.data.formats import FORMATS, FormatVocabulary, load_format
from phasekv.data.protocols import build_eval_set
from tests.helpers import bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    return bpe_tokenizer()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_record_has_one_length_and_answers_are_not_a_giveaway(tokenizer, name):
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
