"""An endpoint audit at fleet scale (phasekv.engines.client, phasekv.auditing.cost): a dry run that prints the run's
requests, prompt tokens and time estimate from the servers' metadata alone, several replicas of one model sharing
the requests, a refusal before any prompt when the server's context cannot hold prompt + answer, and a journal
bound to its prompt set. Against stand-in llama-servers (tests/fake_llama_server.py) started the way the real one
is."""

import contextlib
import json

import httpx
import pytest

from phasekv.auditing.cost import cost_lines, run_cost
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.journal import Journal
from phasekv.engines.registry import launcher, started
from phasekv.engines.wire import EndpointError
from tests.helpers import bpe_tokenizer
from tests.test_endpoint import FakeEngine, V
from tests.test_engine_grid import fake_engine

LLAMA = launcher("llama-server")
BASE = ["--records", "16", "--demos", "2", "--stride", "4", "--local-window", "8", "--prompts-per-phase", "4",
        "--no-progress"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("tok")
    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(where)
    return where, len(tokenizer)


@contextlib.contextmanager
def servers(tmp_path, vocab: int, n: int = 1, context: int = 2048):
    binary, model = fake_engine(tmp_path, vocab)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(started(LLAMA, binary, model, {}, context=context)) for _ in range(n)]


def test_a_dry_run_prints_the_cost_from_metadata_alone_and_writes_nothing(tmp_path, tokenizer_dir, capsys):
    from phasekv.cli import main

    tok, vocab = tokenizer_dir
    with servers(tmp_path, vocab, 2) as urls:
        code = main(["audit", "--endpoint", *urls, "--tokenizer", str(tok), *BASE, "--protocol", "prefix", "query",
                     "--dry-run", "--tokens-per-s", "1000", "--out", str(tmp_path / "o")])
        slots = [httpx.get(f"{u}/slots").json() for u in urls]
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "o").exists()
    assert "prefix: " in out and "query: " in out and "over 2 endpoints" in out and "1,000 prompt tokens/s" in out
    requests = int(out.split("in all: ")[1].split(" requests")[0].replace(",", ""))
    assert requests > 0
    assert [s[0]["requests"] for s in slots] == [0, 0]  # metadata only: no prompt was sent


def test_run_cost_counts_prompts_tokens_and_time():
    class Set:
        prompt_length = 10

        def size(self):
            return 4, 36

    cost = run_cost({"prefix": Set(), "query": Set()}, conditions=3, endpoints=2, tokens_per_s=9.0)
    assert (cost["requests"], cost["prompt_tokens"], cost["seconds"]) == (24, 216, 12.0)
    assert run_cost({"prefix": Set()})["seconds"] is None
    assert "time: about 12 s at 9 prompt tokens/s" in "\n".join(cost_lines(cost))


def test_replicas_share_the_requests_and_give_the_same_answers(tmp_path, tokenizer_dir):
    from phasekv.auditing.pipeline import run_audit
    from phasekv.config import AuditPlan, audit_config

    tok, vocab = tokenizer_dir
    tokenizer = bpe_tokenizer()
    plan = AuditPlan(("none",), protocols=("prefix",), prompts_per_phase=2)
    cfg = audit_config(records=16, demos=2, stride=4, local_window=8)
    with servers(tmp_path, vocab, 2) as urls:
        one = EndpointAdapter(urls[0], "llamacpp", vocab)
        single = run_audit(one, tokenizer, cfg, tmp_path / "one", plan=plan, progress=False)
        one.close()
        before = [httpx.get(f"{u}/slots").json()[0]["requests"] for u in urls]
        both = EndpointAdapter(urls[0], "llamacpp", vocab, replicas=(urls[1],), concurrency=2)
        spread = run_audit(both, tokenizer, cfg, tmp_path / "two", plan=plan, progress=False)
        both.close()
        served = [httpx.get(f"{u}/slots").json()[0]["requests"] - b for u, b in zip(urls, before, strict=True)]
    assert spread["conditions"]["none"]["prefix"] == single["conditions"]["none"]["prefix"]
    assert "2 endpoints" in spread["model"]
    record = json.loads((tmp_path / "two" / "endpoint.json").read_text())
    assert record["endpoint_urls"] == urls and record["endpoints"] == 2
    assert all(n > 0 for n in served)  # both replicas answered, each prompt once
    assert sum(served) == sum(g["n"] for g in single["conditions"]["none"]["prefix"]["per_phase"]) == before[0]


def test_replicas_of_different_models_and_a_repeated_url_are_refused(tmp_path):
    engines = {"a.test": FakeEngine(vocab=V), "b.test": FakeEngine(vocab=V - 1)}
    transport = httpx.MockTransport(lambda r: engines[r.url.host](r))
    with pytest.raises(EndpointError, match="must be replicas of one model"):
        EndpointAdapter("http://a.test", "llamacpp", V, transport=transport, replicas=("http://b.test",))
    from phasekv.engines.client import EndpointOptions, check_endpoint_options

    with pytest.raises(EndpointError, match="given twice"):
        check_endpoint_options(EndpointOptions("http://a.test", replicas=("http://a.test",)))


def test_a_server_whose_context_cannot_hold_prompt_and_answer_is_refused_before_any_prompt(tmp_path, tokenizer_dir,
                                                                                          capsys):
    from phasekv.cli import main

    tok, vocab = tokenizer_dir
    with servers(tmp_path, vocab, 1, context=64) as urls:
        code = main(["audit", "--endpoint", *urls, "--tokenizer", str(tok), *BASE, "--protocol", "prefix",
                     "--out", str(tmp_path / "o")])
        slot = httpx.get(f"{urls[0]}/slots").json()[0]
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "serves a context of 64 tokens" in err[0] and "+ 1 answer token" in err[0]
    assert slot["requests"] == 0 and not (tmp_path / "o").exists()


def test_a_journal_bound_to_one_prompt_set_refuses_another(tmp_path):
    path, settings = tmp_path / "j.jsonl", {"api": "llamacpp"}
    journal = Journal(path, settings)
    journal.bind("prompt_set", "abc")
    journal.bind("prompt_set", "abc")  # the same set again: fine
    again = Journal(path, settings, resume=True)
    assert again.bound == {"prompt_set": "abc"}
    with pytest.raises(EndpointError, match="belong to another prompt set"):
        again.bind("prompt_set", "xyz")


def test_sharded_and_merged_equals_unsharded_and_a_missing_or_foreign_shard_is_refused(tmp_path, tokenizer_dir,
                                                                                        capsys):
    from phasekv.cli import main

    tok, vocab = tokenizer_dir
    flags = ["--tokenizer", str(tok), *BASE, "--protocol", "prefix", "query"]
    with servers(tmp_path, vocab, 2) as urls:
        assert main(["audit", "--endpoint", urls[0], *flags, "--out", str(tmp_path / "whole")]) == 0
        for i in range(3):  # shards on either server: replicas of one model
            assert main(["audit", "--endpoint", urls[i % 2], *flags, "--shard", f"{i}/3",
                         "--out", str(tmp_path / f"s{i}")]) == 0
        assert main(["audit", "--endpoint", urls[0], *flags, "--seed", "1", "--shard", "2/3",
                     "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    shards = [str(tmp_path / f"s{i}") for i in range(3)]
    assert main(["audit", "merge", *shards, "--out", str(tmp_path / "merged"), "--no-progress"]) == 0
    whole, merged = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "merged"))
    for field in ("model", "format", "conditions", "can_do_task", "settings"):
        assert merged[field] == whole[field], field
    answered = [json.loads((tmp_path / f"s{i}" / "shard.json").read_text())["prompts"] for i in range(3)]
    lines = (tmp_path / "whole" / "endpoint_journal.jsonl").read_text().splitlines()[1:]
    assert sum(answered) == len(lines) - 1  # the whole run's journal: its answers and one prompt-set line
    for given, message in (([shards[0], shards[1]], "needs each of 0..2 once"),
                           ([shards[0], shards[1], str(tmp_path / "other")], "differ in prompt_set"),
                           ([shards[0], str(tmp_path / "whole")], "holds no shard.json")):
        assert main(["audit", "merge", *given, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and not (tmp_path / "bad").exists()
    bad = ["audit", "--endpoint", "http://127.0.0.1:9", *flags, "--shard", "3/3", "--out", str(tmp_path / "x")]
    assert main(bad) == 2
    assert "needs 0 <= I < N" in capsys.readouterr().err


def test_sigterm_leaves_a_partial_summary_and_resume_completes_the_same_audit(tmp_path, tokenizer_dir):
    import os
    import signal
    import subprocess
    import sys
    import time

    from phasekv.cli import main
    from phasekv.engines.journal import journal_dir

    tok, vocab = tokenizer_dir
    flags = ["--tokenizer", str(tok), *BASE, "--protocol", "prefix"]
    out = tmp_path / "cut"
    with servers(tmp_path, vocab, 1) as urls:
        assert main(["audit", "--endpoint", urls[0], *flags, "--out", str(tmp_path / "whole")]) == 0
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "phasekv", "audit", "--endpoint", urls[0], *flags,
                                 "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True)
        journal = journal_dir(out) / "endpoint_journal.jsonl"
        deadline = time.monotonic() + 120
        while not (journal.exists() and len(journal.read_text().splitlines()) > 6) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 130 and "interrupted" in err  # the answers so far inside OUT, nothing beside it
        assert {p.name for p in out.iterdir()} == {".phasekv-output", ".partial"}
        assert sorted(p.name for p in tmp_path.iterdir() if "cut" in p.name) == ["cut"]
        partial = json.loads((journal_dir(out) / "partial_summary.json").read_text())
        assert partial["partial"] is True and 0 < partial["answered"] < partial["prompts"]
        assert main(["audit", "--endpoint", urls[0], *flags, "--resume", "--out", str(out)]) == 0
    whole, resumed = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "cut"))
    assert resumed["conditions"] == whole["conditions"]
    record = json.loads((out / "endpoint.json").read_text())
    assert record["answers_from_journal"] >= partial["answered"] and not journal_dir(out).exists()
