"""`phasekv audit --launch vllm --engine-grid ...`: vLLM's registry entry (the command line of every grid point, its
refusals, its startup timeout, its settings read back from a captured /metrics and /server_info), the per-point
prompt-cache mode on a stand-in server, and one real 2-point grid through vLLM's own server (`make vllm`; the test
skips without it and fails under `make test-real`)."""

import dataclasses
import json
from pathlib import Path

import httpx
import pytest

from phasekv.auditing.engine_grid import EngineGrid, run_grid
from phasekv.config import audit_config
from phasekv.engines.base import parse_grid, point_name
from phasekv.engines.registry import default_binary, launcher
from phasekv.engines.vllm import vllm_report
from phasekv.engines.wire import Connection
from tests.engine import VLLM_MODEL, VLLM_PYTHON, vllm_present
from tests.helpers import bpe_tokenizer, needs_real
from tests.test_engine_grid import CFG, fake_engine
from tests.test_vllm import METRICS

VLLM = launcher("vllm")
needs_vllm = needs_real(vllm_present, "vLLM not installed (make vllm)")


def flags_after(command: list[str], flag: str) -> list[str]:
    return command[command.index(flag) + 1:]


def test_each_grid_point_is_its_own_vllm_command_line(monkeypatch):
    monkeypatch.setenv("PHASEKV_VLLM", "/opt/v")
    points = parse_grid(VLLM, ["max_num_batched_tokens=32,4096", "prefix_cache=off,on"])
    assert [point_name(p) for p in points] == [
        "max_num_batched_tokens=32,prefix_cache=off", "max_num_batched_tokens=32,prefix_cache=on",
        "max_num_batched_tokens=4096,prefix_cache=off", "max_num_batched_tokens=4096,prefix_cache=on"]
    python = default_binary(VLLM)
    assert python == Path("/opt/v/venv/bin/python")
    for point in points:
        command = VLLM.command(python, Path("/m"), 9, point, context=4096, slots=1)
        env = command[1:command.index(str(python))]
        assert command[0] == "env" and {"OMP_NUM_THREADS=1", "VLLM_CPU_OMP_THREADS_BIND=nobind",
                                        "VLLM_HOST_IP=127.0.0.1", "VLLM_SERVER_DEV_MODE=1",
                                        "VLLM_CACHE_ROOT=/opt/v/cache"} <= set(env)
        served = command[command.index(str(python)):]
        assert served[:4] == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
        assert served[served.index("--max-model-len") + 1] == "4096" and "--enforce-eager" in served
        tail = flags_after(served, "--no-enable-prefix-caching")  # the later flag wins: "on" must come after it
        on = ["--enable-prefix-caching"] if point["prefix_cache"] == "on" else []
        assert tail == ["--enable-prompt-tokens-details", "--max-num-seqs", "1", "--max-num-batched-tokens",
                        point["max_num_batched_tokens"], *on]
        assert VLLM.caches_prefix(point) == (point["prefix_cache"] == "on")
    # four slots of the batch check: four sequences, each with the per-slot context (llama.cpp splits -c)
    wide = VLLM.command(python, Path("/m"), 9, {"kv_cache_dtype": "fp8", "dtype": "bfloat16"}, context=4 * 1024,
                        slots=4)
    assert flags_after(wide, "--max-model-len")[0] == "1024" and flags_after(wide, "--max-num-seqs")[0] == "4"
    assert flags_after(wide, "--kv-cache-dtype")[0] == "fp8" and wide[-2:] == ["--dtype", "bfloat16"]  # after float32
    assert VLLM.startup_s >= 600 > launcher("llama-server").startup_s  # vLLM loads slowly on busy cores


@pytest.mark.parametrize("items, message", [
    (["flash_attn=on"], "not a vllm setting (vLLM's CPU backend has one attention kernel"),
    (["ubatch=16"], "not a vllm setting (vLLM's prefill chunk is max_num_batched_tokens)"),
    (["cache_type_k=q8_0"], "one KV cache dtype for K and V: kv_cache_dtype"),
    (["kv_cache_dtype=bfloat16"], "must be one of auto, fp8, fp8_e4m3, fp8_e5m2"),
    (["kv_cache_dtype=f16"], "must be one of auto, fp8"),
    (["prefix_cache=yes"], "must be one of off, on"), (["prefix_cache=off,off"], "repeated"),
    (["max_num_batched_tokens=0"], "integer >= 1"), (["dtype=float64"], "one of float32, bfloat16, float16"),
])
def test_settings_vllm_does_not_have_or_rejects_are_one_line_refusals(items, message):
    with pytest.raises(ValueError) as err:
        parse_grid(VLLM, items)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_vllm_key_given_to_llama_server_names_llama_cpps_own():
    with pytest.raises(ValueError, match=r"not a llama-server setting \(llama.cpp's batch sizes are ubatch"):
        parse_grid(launcher("llama-server"), ["max_num_batched_tokens=32"])


def _vllm_flags(tmp_path: Path) -> tuple[list[str], Path]:
    """The audit's --launch vllm flags with a stand-in Python and model folder (nothing is started: every refusal
    below comes before any server)."""
    tokenizer = bpe_tokenizer()
    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text("{}")
    python = tmp_path / "python"
    python.write_text("")
    return ["audit", "--launch", "vllm", "--engine-bin", str(python), "--tokenizer", str(folder), "--records", "16",
            "--demos", "2", "--stride", "4", "--local-window", "8", "--prompts-per-phase", "4", "--protocol",
            "prefix", "--no-progress"], folder


def test_the_audit_refuses_a_vllm_grid_it_cannot_start_in_one_line(tmp_path, capsys):
    from phasekv.cli import main

    base, folder = _vllm_flags(tmp_path)
    (tmp_path / "weights.gguf").write_text("")
    for flags, message in (
            (["--engine-grid", "flash_attn=on"], "not a vllm setting"),
            (["--engine-grid", "max_num_batched_tokens=2", "--engine-checks", "batch"],
             "max_num_batched_tokens=2: vLLM needs at least --max-num-seqs (4"),
            (["--engine-model", str(tmp_path / "weights.gguf")], "not a model folder (no config.json)"),
            (["--engine-bin", str(tmp_path / "none")], "no such file (make vllm installs"),
            (["--gguf-file", "w.gguf"], "serves a model folder (safetensors)")):
        assert main([*base, *flags, "--out", str(tmp_path / "p")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "p").exists()
    assert main([*base, "--engine-model", str(folder), "--out", str(folder / "out")]) == 2  # inside its input
    assert "never writes over what it reads" in capsys.readouterr().err


# what vLLM 0.32.0 answered on /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1, --max-num-batched-tokens 32
# --max-num-seqs 1 --enable-prefix-caching), trimmed to the parts the report reads plus one it does not
SERVER_INFO = {"vllm_config": {
    "model_config": {"model": "/root/.cache/phasekv/vllm/smollm2", "dtype": "torch.float32", "max_model_len": 4096,
                     "enforce_eager": True, "seed": 0},
    "cache_config": {"block_size": 128, "cache_dtype": "auto", "enable_prefix_caching": True, "swap_space": 4},
    "scheduler_config": {"max_num_batched_tokens": 32, "max_num_seqs": 1, "enable_chunked_prefill": True,
                         "policy": "fcfs"},
    "parallel_config": {"tensor_parallel_size": 1}},
    "vllm_env": {"VLLM_HOST_IP": "127.0.0.1"}, "system_env": {}}


def _server(routes: dict[str, httpx.Response]) -> Connection:
    def answer(request: httpx.Request) -> httpx.Response:
        return routes.get(request.url.path, httpx.Response(404, json={"detail": "Not Found"}))
    return Connection("http://vllm.test", transport=httpx.MockTransport(answer))


def test_vllms_settings_are_read_back_from_its_metrics_and_server_info():
    caching = METRICS.replace('enable_prefix_caching="False"', 'enable_prefix_caching="True"')
    metrics = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info "
               f"gauge\n{caching}\n" 'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')
    report = vllm_report(_server({"/metrics": httpx.Response(200, text=metrics),
                                  "/server_info": httpx.Response(200, json=SERVER_INFO)}))
    assert report["cache_config"]["enable_prefix_caching"] == "True" and report["cache_config"]["block_size"] == "128"
    assert report["server_info"] == {
        "scheduler_config": {"max_num_batched_tokens": 32, "max_num_seqs": 1, "enable_chunked_prefill": True},
        "cache_config": {"enable_prefix_caching": True, "cache_dtype": "auto", "block_size": 128},
        "model_config": {"dtype": "torch.float32", "max_model_len": 4096, "enforce_eager": True}}
    # a vLLM started without dev mode has no /server_info, a llama-server no /metrics gauge: None, not an error
    assert vllm_report(_server({})) == {"cache_config": None, "server_info": None}


def test_the_engines_own_startup_timeout_applies_unless_the_grid_sets_one(tmp_path, monkeypatch):
    import contextlib

    from phasekv.engines import registry

    asked = []

    @contextlib.contextmanager
    def launched(command, url, *, name, health, startup_s):
        asked.append((name, startup_s))
        yield url

    monkeypatch.setattr(registry, "launched", launched)
    python = tmp_path / "python"
    python.write_text("")
    for startup_s in (None, 5.0):
        with registry.started(VLLM, python, tmp_path, {}, startup_s=startup_s):
            pass
    assert asked == [("vllm", VLLM.startup_s), ("vllm", 5.0)]


def test_a_point_whose_server_caches_prefixes_is_audited_reusing_them_and_the_others_refuse_cached_tokens(tmp_path):
    """The stand-in llama-server with a launcher that, like vLLM's prefix_cache=on, says its flash_attn=on points
    cache prefixes: those points send a context's queries back to back and count the hits; the others ask for no
    cache and get none."""
    tokenizer = bpe_tokenizer()
    binary, model = fake_engine(tmp_path, len(tokenizer))
    engine = dataclasses.replace(launcher("llama-server"), caches_prefix=lambda s: s.get("flash_attn") == "on")
    grid = EngineGrid(engine, binary, model, tuple(parse_grid(engine, ["flash_attn=off,on"])), context=2048,
                      startup_s=60)
    summary = run_grid(grid, tokenizer, audit_config(**CFG), tmp_path / "out", protocols=("prefix",), per_phase=4,
                       progress=False)
    off, on = (p["protocols"]["prefix"]["prompt_cache"] for p in summary["points"])
    assert off["mode"] == "off" and off["cached_tokens"] == 0 and off["hits"] == 0 and off["reported"] == off["n"]
    assert on["mode"] == "reuse-prefix" and on["hits"] > 0 and on["cached_tokens"] > 0 and on["reported"] == on["n"]
    endpoint = json.loads((tmp_path / "out" / "points" / "flash_attn=on" / "endpoint.json").read_text())
    assert endpoint["prompt_cache"] == "reuse-prefix" and endpoint["cached_prompt_tokens"] == on["cached_tokens"]
    table = (tmp_path / "out" / "grid.md").read_text()
    assert "cached prompt tokens" in table and f"| {on['cached_tokens']:,} ({on['hits']}/{on['n']}, reuse-prefix) |" \
        in table and f"| 0 (0/{off['n']}) |" in table
    everywhere = dataclasses.replace(grid, points=({"flash_attn": "off"},), reuse_prefix=True)
    again = run_grid(everywhere, tokenizer, audit_config(**CFG), tmp_path / "all", protocols=("prefix",),
                     per_phase=4, progress=False)
    assert again["points"][0]["protocols"]["prefix"]["prompt_cache"]["mode"] == "reuse-prefix"  # --reuse-prefix


@needs_vllm
def test_a_two_point_vllm_grid_runs_end_to_end_with_the_settings_it_asked_for(tmp_path, capsys):
    """Two vLLM servers, one after the other (prefill chunks of 32 tokens, prefix cache off then on), 16 prompts
    each against transformers in float32: every point served, its settings as vLLM reports them, the cache hit only
    where it is on, and no server left listening."""
    from phasekv.cli import main

    out = tmp_path / "grid"
    assert main(["audit", "--launch", "vllm", "--engine-bin", str(VLLM_PYTHON), "--engine-grid",
                 "max_num_batched_tokens=32", "prefix_cache=off,on", "--tokenizer", str(VLLM_MODEL), "--reference-hf",
                 str(VLLM_MODEL), "--format", "records", "--stride", "4", "--prompts-per-phase", "2", "--protocol",
                 "prefix", "--threads", "1", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    off, on = summary["points"]
    for point, caching in ((off, False), (on, True)):
        assert "failed" not in point, point.get("failed")
        info = point["engine_report"]["server_info"]
        assert info["scheduler_config"]["max_num_batched_tokens"] == 32 and info["model_config"]["enforce_eager"]
        assert info["cache_config"]["enable_prefix_caching"] is caching
        assert point["engine_report"]["cache_config"]["enable_prefix_caching"] == str(caching)
        overall = point["comparison"]["prefix"]["overall"]
        assert overall["n"] == 16 and overall["agreement"] >= 0.9, overall  # float32: the same greedy tokens
        assert f"{overall['agree']}/16 greedy tokens agree" in printed
    assert off["protocols"]["prefix"]["prompt_cache"] == {"mode": "off", "cached_tokens": 0, "hits": 0,
                                                          "reported": 16, "n": 16}
    cache = on["protocols"]["prefix"]["prompt_cache"]
    assert cache["mode"] == "reuse-prefix" and cache["hits"] > 0 and cache["cached_tokens"] % 128 == 0  # whole blocks
    assert (out / "grid.md").read_text().count("\n") == 4 and (out / "figures" / "accuracy_prefix.png").is_file()
    for point in summary["points"]:
        url = json.loads((out / "points" / point["name"] / "endpoint.json").read_text())["endpoint"]
        with pytest.raises(httpx.TransportError):  # stopped after its point
            httpx.get(url + "/health", timeout=5)
