"""The engine-bug shapes of tests/test_engine_bug_shapes.py through the REAL llama-server serving SmolLM2 (`make
engine`, `make real-model`): a proxy in front of it (tests/engine.py's CorruptingProxy) swaps the top-2 answer tokens
of the prompts a bug shape picks, and `phasekv audit --endpoint ... --protocol query` must give each shape the verdict
the query protocol promises (phasekv.evaluate.query_stats): a length-mod-4 bug is "phase sensitive: period 4" (at 64
prompts per phase and at the default); errors growing linearly with the prompt length are no query-phase effect, with
the length trend reported (at 16 prompts per phase and at the default); "everything from length L on is wrong" is no
phase effect either.  One server for every case, one answer cache in front of it shared by all proxies (the bug is
applied after the cache), so that each distinct prompt reaches the server once (the three shapes at the default size
share one prompt set), and a context's queries sent back to back on the server's cached prefix (--reuse-prefix)."""

import json
import zlib

import pytest

from tests.engine import LLAMA_SERVER, CorruptingProxy, engine_present
from tests.helpers import SMOL, SMOL_FILE, needs_real

needs_smol = needs_real(engine_present, "llama-server not built (make engine) or real model absent (make real-model)")
STRIDE = 4
FLAGS = ["--format", "records", "--records", "6", "--demos", "1", "--stride", str(STRIDE), "--protocol", "query",
         "--reuse-prefix", "--threads", "1", "--no-progress"]
PHASE_CLAIMS = ("phase sensitive", "a phase effect", "a small phase effect")


def prompt_lengths(tokenizer) -> tuple[int, int]:
    """The shortest and longest prompt (tokens) of the audit's query set at the default size: the widest range (the
    records' words tokenize to different lengths, and more clusters run through more length offsets: 93-99 tokens
    at 16 prompts per phase, 93-107 at 64 and at 192)."""
    from phasekv.config import AuditPlan, audit_config
    from phasekv.data.formats import FormatVocabulary, load_format
    from phasekv.evaluate.sources import audit_sets

    cfg = audit_config(records=6, demos=1, stride=STRIDE)
    (eval_set,) = audit_sets(FormatVocabulary(load_format("records", False), tokenizer), cfg, ("query",),
                             AuditPlan().prompts_per_phase).values()
    lengths = [len(p.ids) for p in eval_set.prompts()]
    return min(lengths), max(lengths)


def shapes(shortest: int, longest: int) -> dict:
    """Bug shape -> the predicate on a prompt's token ids that makes the engine answer wrong.  The length-keyed
    shapes leave the model able to do the task (about a quarter of the answers wrong at the default size), so the
    verdict judges the phase instead of stopping at the capability gate."""
    threshold = shortest + 3 * (longest - shortest) // 4
    return {
        "mod4": lambda ids: len(ids) % 4 == 3,
        "threshold": lambda ids: len(ids) >= threshold,  # everything from 3/4 of the way up on is wrong
        # the error rate rises linearly from 0 at the shortest prompt to 50% at the longest (a hash of the prompt
        # picks which ones), nothing periodic
        "linear": lambda ids: zlib.crc32(json.dumps(ids).encode()) % 1000
        < 500 * (len(ids) - shortest) / (longest - shortest),
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A function running one audit through a bug proxy -> its summary's query phase.  SmolLM2's tokenizer is read
    from the GGUF file once and saved as a transformers tokenizer for every audit's --tokenizer (reading it from the
    GGUF file took most of a minute per audit on the loaded test machine)."""
    from phasekv.adapters.hf import load_tokenizer
    from phasekv.cli import main
    from phasekv.engines.registry import launcher, started

    tokenizer = load_tokenizer(str(SMOL), SMOL_FILE, flag="--tokenizer")
    saved = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer.save_pretrained(saved)
    cache: dict = {}
    bugs = shapes(*prompt_lengths(tokenizer))
    with started(launcher("llama-server"), LLAMA_SERVER, SMOL / SMOL_FILE, {}, context=2048) as url:
        def audit(shape, out, per_phase=None):
            size = [] if per_phase is None else ["--prompts-per-phase", str(per_phase)]
            with CorruptingProxy(url, wrong=bugs[shape], cache=cache) as proxy:
                code = main(["audit", "--endpoint", proxy.url, "--tokenizer", str(saved), *FLAGS, *size, "--out",
                             str(out)])
            assert code == 0 and proxy.corrupted > 0
            summary = json.loads((out / "summary.json").read_text())
            query = summary["conditions"]["none"]["query"]["query_phase"]
            print(f"{shape} at {summary['settings']['prompts_per_phase']} per phase: {query['verdict']}")
            return query

        yield audit


@needs_smol
@pytest.mark.slow
@pytest.mark.parametrize("per_phase", [64, None])  # None: the audit's default prompts per phase
def test_a_length_mod_4_bug_is_phase_sensitive_with_period_4(served, per_phase, tmp_path):
    query = served("mod4", tmp_path / "mod4", per_phase)
    assert query["verdict"].startswith("phase sensitive: period 4"), query["verdict"]


@needs_smol
@pytest.mark.slow
@pytest.mark.parametrize("per_phase", [16, None])
def test_errors_growing_linearly_with_the_length_are_no_query_phase_effect(served, per_phase, tmp_path):
    query = served("linear", tmp_path / "linear", per_phase)
    assert not query["verdict"].startswith(PHASE_CLAIMS), query["verdict"]
    trend = query["length_trend"]  # reported beside the verdict, with its interval
    assert f"accuracy changes by {trend['pp_per_stride']:+.1f} pp per {STRIDE} tokens" in query["verdict"]
    if per_phase is None:  # the default size judges the phase (no effect) and resolves the trend below 0
        assert query["verdict"].startswith("no phase effect detected") and trend["ci_pp"][1] < 0, query["verdict"]
    # at 16 prompts per phase (8 clusters) the capability gate's bound is wide: measured "cannot do the task
    # (accuracy 67.2%, in-context chance 23.1%)" with the trend +7.5 pp per 4 tokens [-17.5, 30.0]: no phase claim


@needs_smol
@pytest.mark.slow
def test_everything_past_a_length_wrong_is_no_query_phase_effect(served, tmp_path):
    query = served("threshold", tmp_path / "threshold")
    assert not query["verdict"].startswith((*PHASE_CLAIMS, "cannot do the task")), query["verdict"]
    assert query["length_trend"]["ci_pp"][1] < 0, query["length_trend"]
