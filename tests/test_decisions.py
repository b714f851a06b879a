"""phasekv decide: decision sets as data, token-exact shifted prompts, continuation scoring, the item-clustered
verdict (where it must say yes and where it must say no), the padding-only baseline, resume and atomic outputs."""

import json
import re

import numpy as np
import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.decisions import stats
from phasekv.decisions.pipeline import adapter_scorer, run_decide
from phasekv.decisions.prompts import build_prompts, encode, item_prompts, render
from phasekv.decisions.scoring import forward_logprobs, score_prompts
from phasekv.decisions.sets import SHIPPED, load_set, parse_set
from tests.helpers import SMOL, SMOL_FILE, needs_real_model, tiny_causal_lm


class WordTokenizer:
    """A deterministic stand-in tokenizer: words, runs of punctuation and runs of whitespace are tokens (so
    repeated spaces or newlines merge, as in BPE), ids handed out on first sight; optional chat template."""

    bos_token_id = 0

    def __init__(self, chat: bool = False):
        self.vocab: dict[str, int] = {"<s>": 0}
        self.chat_template = "[user] {text} [assistant]" if chat else None

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.setdefault(t, len(self.vocab)) for t in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text)]

    def decode(self, ids):
        back = {v: k for k, v in self.vocab.items()}
        return "".join(back[i] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return self.chat_template.format(text=messages[0]["content"])


def tiny_set(n=12, unit=" -", chat=False, **item):
    items = [{"id": f"q{i}", "context": f"Question {i}.[[pad]]\nIs it so", **item} for i in range(n)]
    return parse_set({"name": "tiny", "chat": chat, "padding": {"kind": "divider", "unit": unit},
                      "continuations": {"yes": " yes", "no": " no"}, "answer": "yes", "items": items}, "tiny")


# ----------------------------------------------------------------------------- sets and prompts


def test_shipped_sets_load_with_50_items_each():
    for name in SHIPPED:
        s = load_set(name)
        assert s.name == name and len(s.items) >= 50 and len({i.id for i in s.items}) == len(s.items)
        assert all(i.answer in i.continuations for i in s.items)


@pytest.mark.parametrize("tree, match", [
    ({"name": "x", "items": []}, "items: must be a non-empty list"),
    ({"name": "x", "items": [{"id": "a", "context": "no slot"}]}, "item 'a': context: must hold the padding slot"),
    ({"name": "x", "items": [{"context": "[[pad]]"}]}, "item 1: id: missing"),
    ({"name": "x", "padding": {"kind": "k", "unit": " -"}, "items": [{"id": "a", "context": "[[pad]]"}]},
     "item 'a': continuations: needs a mapping of two or more"),
    ({"name": "x", "padding": {"kind": "k", "unit": " -"}, "continuations": {"a": "A", "b": "B"}, "answer": "c",
      "items": [{"id": "a", "context": "[[pad]]"}]}, "item 'a': answer: 'c' is not one of"),
    ({"name": "x", "continuations": {"a": "A", "b": "B"}, "answer": "a",
      "items": [{"id": "a", "context": "[[pad]]"}]}, "item 'a': padding: needs a mapping"),
    ({"name": "x", "items": [{"id": "a", "context": "[[pad]]", "colour": 1}]}, "unknown field 'colour'"),
    ({"name": "x", "padding": {"kind": "k", "unit": " -"}, "continuations": {"a": "A", "b": "B"}, "answer": "a",
      "items": [{"id": "a", "context": "[[pad]]"}, {"id": "a", "context": "[[pad]]"}]}, "item 'a': id given twice"),
])
def test_bad_sets_are_one_line_errors_naming_the_item_or_field(tree, match):
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        parse_set(tree, "--set f.yaml")
    assert "\n" not in str(info.value)


def test_bad_yaml_and_missing_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_set(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="neither a shipped set"):
        load_set(str(tmp_path / "none.yaml"))


@pytest.mark.parametrize("chat", [False, True])
def test_every_shifted_prompt_is_token_exact(chat):
    """Rebuilt from its text, every prompt has the same ids; shift s inserts s padding tokens at one index and
    changes nothing else; each phase group holds every item exactly once (R = S)."""
    tok, s = WordTokenizer(chat), tiny_set(chat=chat)
    prompts = build_prompts(tok, s, shifts=8, stride=8)
    for item in s.items:
        rows = [p for p in prompts if p.item == item.id]
        base = list(rows[0].ids)
        for p in rows:
            assert list(p.ids) == encode(tok, render(tok, item, p.shift, chat), chat)  # the ids rebuilt
            k = next(j for j, (a, b) in enumerate(zip(base, rows[1].ids)) if a != b)
            assert list(p.ids[:k]) + list(p.ids[k + p.shift:]) == base
            assert tok.decode(list(p.ids[k:k + p.shift])) == " -" * p.shift
        assert sorted(p.phase for p in rows) == list(range(8))
    assert (tok.decode(list(prompts[0].ids)).startswith("[user]")) == chat


def test_padding_that_merges_and_continuations_that_merge_are_refused():
    with pytest.raises(ValueError, match=r"item 'q0': shift 1: the padding ' ' x 1 is not 1 tokens"):
        build_prompts(WordTokenizer(), tiny_set(unit=" "), shifts=4, stride=4)
    merging = tiny_set(continuations={"yes": "!", "no": "?"}, context="Is it so?[[pad]] Really?")
    with pytest.raises(ValueError, match=r"item 'q0': continuation 'yes' \('!'\) merges with the end of the prompt"):
        build_prompts(WordTokenizer(), merging, shifts=4, stride=4)
    with pytest.raises(ValueError, match="--shifts 6: must be a positive multiple of the stride S=4"):
        build_prompts(WordTokenizer(), tiny_set(), shifts=6, stride=4)


@needs_real_model
def test_shipped_sets_are_token_exact_for_smollm2():
    from phasekv.adapters.hf import load_tokenizer

    tok = load_tokenizer(str(SMOL), SMOL_FILE)
    for name in SHIPPED:
        s = load_set(name)
        prompts = build_prompts(tok, s, shifts=8, stride=8)
        assert len(prompts) == 8 * len(s.items)
        for item in s.items[:5]:
            for p in item_prompts(tok, item, shifts=8, stride=8, chat=s.chat):
                assert list(p.ids) == encode(tok, render(tok, item, p.shift, s.chat), s.chat)


# ----------------------------------------------------------------------------- scoring


def test_cached_scoring_equals_one_forward_teacher_forcing():
    model = tiny_causal_lm("llama", 64, 256, "sdpa")
    adapter = HFAdapter(model, "tiny")
    tok = WordTokenizer()
    s = tiny_set(n=3, continuations={"yes": " yes it is", "no": " no"})
    prompts = build_prompts(tok, s, shifts=4, stride=4)
    assert max(max(p.ids) for p in prompts) < 64
    scores = score_prompts(adapter, prompts, batch_size=4, progress=False)
    for p, got in zip(prompts, scores):
        labels = list(p.continuations)
        want = forward_logprobs(adapter, p.ids, [p.continuations[label] for label in labels])
        for label, values in zip(labels, want):
            assert got[label] == pytest.approx(values, abs=1e-4)


def test_a_posthoc_condition_scores_through_the_compressed_cache():
    from phasekv.conditions.grammar import Geometry

    adapter = HFAdapter(tiny_causal_lm("llama", 64, 256, "sdpa"), "tiny")
    tok = WordTokenizer()
    s = tiny_set(n=2, context="One two three four five six seven eight nine ten eleven twelve.[[pad]]\nIs it so")
    prompts = build_prompts(tok, s, shifts=4, stride=4)
    score = adapter_scorer(adapter, Geometry(4, 4, 2), progress=False)
    full, small = score("none", prompts), score("select:1", prompts)
    assert all(set(f) == {"yes", "no"} for f in small)
    assert any(abs(f["yes"][0] - c["yes"][0]) > 1e-5 for f, c in zip(full, small))
    with pytest.raises(ValueError, match="would not be compressed at all"):
        adapter_scorer(adapter, Geometry(4, 4, 64), progress=False)("select:1", prompts)


# ----------------------------------------------------------------------------- the verdict


def scripted(decide, n=48, stride=8, shifts=8):
    """Prompts of n items and a scorer whose decision is `decide(condition, item_index, shift, phase)` (True: the
    answer), margin 1 either way."""
    prompts = build_prompts(WordTokenizer(), tiny_set(n=n), shifts=shifts, stride=stride)

    def score(condition, group):
        out = []
        for p in group:
            right = decide(condition, int(p.item[1:]), p.shift, p.phase)
            out.append({"yes": [0.0 if right else -1.0], "no": [-1.0 if right else 0.0]})
        return out

    return prompts, score


def run(tmp_path, decide, **kwargs):
    prompts, score = scripted(decide, **kwargs)
    return run_decide(score, prompts, tmp_path / "out", conditions=["none", "select:3"],
                      settings={"model": "scripted", "stride": 8, "n_perm": 500, "n_boot": 300}, progress=False)


def test_verdict_says_yes_when_the_decision_flips_at_one_phase(tmp_path):
    summary = run(tmp_path, lambda c, i, s, ph: c == "none" or ph != 3)
    none, comp = summary["conditions"]["none"], summary["conditions"]["select:3"]
    assert summary["can_decide"] and not none["effect"]["phase_dependent"]
    e = comp["effect"]
    assert e["phase_dependent"] and e["material"] and e["per_phase"][3]["rate"] == 0.0
    assert e["phase_p"] < 0.01 and e["contrast_lower_pp"] > 50
    assert comp["against_padding"]["flips_more"] and comp["against_padding"]["periodic"]
    assert comp["verdict"].startswith("decisions phase sensitive")


def test_verdict_says_no_when_flips_fall_at_random_shifts(tmp_path):
    rng = np.random.default_rng(1)
    flipped = rng.random((48, 8)) < 0.25
    summary = run(tmp_path, lambda c, i, s, ph: c == "none" or not flipped[i, s])
    comp = summary["conditions"]["select:3"]
    assert not comp["effect"]["phase_dependent"] and not comp["effect"]["material"]
    assert comp["against_padding"]["flips_more"] and not comp["against_padding"]["periodic"]
    assert comp["verdict"].startswith("no phase effect detected")


def test_verdict_says_no_when_flips_are_equal_at_every_phase(tmp_path):
    summary = run(tmp_path, lambda c, i, s, ph: c == "none" or ph != i % 8)  # each item flips at its own phase
    comp = summary["conditions"]["select:3"]
    assert [r["rate"] for r in comp["effect"]["per_phase"]] == [0.875] * 8
    assert comp["effect"]["phase_p"] == 1.0 and not comp["effect"]["material"]
    assert comp["against_padding"]["flips_more"] and not comp["against_padding"]["periodic"]


def test_padding_baseline_says_no_when_compression_flips_no_more_than_padding(tmp_path):
    """The uncompressed model already flips at random shifts; the compressed one flips as often (other shifts):
    no more flips than the padding alone, and no phase effect."""
    rng = np.random.default_rng(2)
    flips = {c: rng.random((48, 8)) < 0.1 for c in ("none", "select:3")}
    summary = run(tmp_path, lambda c, i, s, ph: not flips[c][i, s])
    comp = summary["conditions"]["select:3"]
    assert not comp["against_padding"]["flips_more"] and comp["against_padding"]["more_flips_p"] > 0.05
    same = run(tmp_path / "same", lambda c, i, s, ph: not flips["none"][i, s])
    assert same["conditions"]["select:3"]["against_padding"]["more_flips_p"] == 1.0


def test_no_phase_verdict_when_the_uncompressed_model_cannot_decide(tmp_path):
    summary = run(tmp_path, lambda c, i, s, ph: i % 2 == 0)  # half the items wrong: at chance
    assert not summary["can_decide"]
    assert summary["conditions"]["none"]["verdict"].startswith("cannot decide")
    assert summary["conditions"]["select:3"]["verdict"].startswith("no phase verdict")


def test_statistics_never_split_an_item():
    """Permuting within items: an item-level effect (some items always wrong) is no phase effect."""
    values = np.repeat((np.arange(40) % 3 == 0)[:, None], 8, 1).astype(float)
    phases = np.tile(np.arange(8), (40, 1))
    effect = stats.phase_effect(values, phases, 8, n_perm=300, n_boot=200)
    assert effect["phase_p"] == 1.0 and effect["contrast_pp"] == 0.0 and not effect["material"]


# ----------------------------------------------------------------------------- outputs and resume


def test_outputs_resume_and_atomicity(tmp_path):
    prompts, score = scripted(lambda c, i, s, ph: c == "none" or ph != 3, n=12)
    settings = {"model": "scripted", "stride": 8, "n_perm": 100, "n_boot": 100}
    calls = []

    def dying(condition, group):
        calls.append((condition, len({p.item for p in group})))
        if calls == [("none", 8), ("none", 4)]:  # dies on the uncompressed model's second chunk of items
            raise KeyboardInterrupt
        return score(condition, group)

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_decide(dying, prompts, out, conditions=["select:3"], settings=settings, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".partial", ".phasekv-output"]  # the work inside OUT only
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    journal = out / ".partial" / "decide_journal.jsonl"
    kept = journal.read_bytes()
    with pytest.raises(ValueError, match="pass --resume"):
        run_decide(score, prompts, out, conditions=["select:3"], settings=settings, progress=False)
    with pytest.raises(ValueError, match="another model, prompt set or settings"):
        run_decide(score, prompts, out, conditions=["select:3"], settings={**settings, "model": "other"},
                   resume=True, progress=False)
    assert journal.read_bytes() == kept  # a refused journal is left as it was
    calls.clear()
    resumed = run_decide(dying, prompts, out, conditions=["select:3"], settings=settings, resume=True,
                         progress=False)
    assert calls == [("none", 4), ("select:3", 8), ("select:3", 4)] and resumed["resumed_pairs"] == 8
    fresh = run_decide(score, prompts, tmp_path / "fresh", conditions=["select:3"], settings=settings,
                       progress=False)
    assert {k: v for k, v in resumed["conditions"].items()} == fresh["conditions"]
    assert sorted(p.name for p in out.iterdir()) == [".phasekv-output", "decisions.jsonl", "figures", "items.jsonl",
                                                     "report.html", "summary.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]
    page = (out / "report.html").read_text()
    assert page.count("<img") == 1 and "decisions phase sensitive" in page and "padding alone" in page
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    row = next(r for r in items if r["condition"] == "select:3")
    assert row["flips"] == 1 and len(row["decisions"]) == 8 and row["changes"] in (1, 2)
    assert json.loads((out / "summary.json").read_text())["conditions"]["select:3"]["verdict"] == \
        resumed["conditions"]["select:3"]["verdict"]


def test_decision_row_margins():
    from phasekv.decisions.pipeline import decision_row

    prompt = build_prompts(WordTokenizer(), tiny_set(n=1), shifts=1, stride=1)[0]
    row = decision_row(prompt, {"yes": [np.log(0.2)], "no": [np.log(0.6)]})
    assert row["decision"] == "no" and not row["correct"]
    assert row["margin"] == pytest.approx(np.log(0.2 / 0.6)) and row["p_margin"] == pytest.approx(-0.5)
    assert torch.tensor(0).item() == 0
