"""vLLM for real (`make vllm`): the OpenAI adapter against vLLM's own server serving SmolLM2 in float32 (the ids
read and echoed as sent, its token ids parsed, its top-k log-probabilities against transformers in process, the
model's name, its errors as one line, its prefix cache caught), and an audit through it against the reference.
The server starts once for the module (1-3 minutes eager on 2 busy cores); without `make vllm` the tests skip, and
fail under `make test-real`."""

import json

import httpx
import pytest
import torch

from phasekv.engines.client import EndpointAdapter
from phasekv.engines.registry import api as api_named
from phasekv.engines.wire import EndpointError
from tests.engine import VLLM_MODEL, vllm_present, vllm_server
from tests.helpers import needs_real

needs_vllm = needs_real(vllm_present, "vLLM not installed (make vllm)")

# an answer of vLLM 0.32.0 (make vllm, SmolLM2 float32, --enable-prompt-tokens-details) to
# {"prompt": [504, 3458, 314, 3365], "max_tokens": 1, "logprobs": 3, "return_tokens_as_token_ids": true}, trimmed
RECORDED = {
    "id": "cmpl-8d45fde6c48bafd7", "object": "text_completion", "created": 1796186509,
    "model": "/root/.cache/phasekv/vllm/smollm2",
    "choices": [{"index": 0, "text": " after", "logprobs": {
        "text_offset": [0], "token_logprobs": [-0.4514174163341522], "tokens": ["token_id:990"],
        "top_logprobs": [{"token_id:990": -0.4514174163341522, "token_id:327": -2.6189303398132324,
                          "token_id:281": -3.487924098968506}]},
        "finish_reason": "length", "stop_reason": None, "token_ids": None, "prompt_logprobs": None}],
    "system_fingerprint": "vllm-0.32.0-55f54fd9",
    "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1,
              "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None},
              "completion_tokens_details": None}}


def test_vllms_recorded_answer_parses_to_its_token_ids_and_cached_count():
    answer, read = api_named("openai").parse(RECORDED)
    assert answer.token == 990 and read == 4 and answer.cached == 0
    assert answer.top == [(990, -0.4514174163341522), (327, -2.6189303398132324), (281, -3.487924098968506)]


@pytest.fixture(scope="module")
def server():
    with vllm_server() as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    from phasekv.adapters.hf import load_tokenizer

    return load_tokenizer(str(VLLM_MODEL))


def prompts(tokenizer) -> list[list[int]]:
    """Token-id prompts of a few lengths, none starting with the tokenizer's BOS (a server adding one would show)."""
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] != tokenizer.bos_token_id
    return [ids[:n] for n in (5, 11, len(ids))]


@needs_vllm
def test_vllm_reads_and_echoes_exactly_the_ids_sent(server, tokenizer):
    ids = prompts(tokenizer)[-1]
    answer = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": str(VLLM_MODEL), "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
        "return_tokens_as_token_ids": True}).json()
    echoed = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    assert echoed[:-1] == ids and len(echoed) == len(ids) + 1  # no BOS added, nothing re-tokenized
    assert answer["usage"]["prompt_tokens"] == len(ids)


@needs_vllm
def test_the_openai_adapter_gives_vllms_greedy_token_and_the_top_k_of_transformers(server, tokenizer):
    from phasekv.adapters.hf import load_hf

    adapter = EndpointAdapter(server, "openai", len(tokenizer), top_k=5)
    assert adapter.model == str(VLLM_MODEL)
    assert adapter.info.max_length == 4095  # --max-model-len 4096, less the one token answered
    assert adapter.cache_config["enable_prefix_caching"] == "False"  # its /metrics read
    reference, _ = load_hf(str(VLLM_MODEL))
    for ids in prompts(tokenizer):
        row = torch.tensor([ids])
        served = adapter.logits(row)[0, -1]
        [[answer]] = adapter.answer([[ids]])
        expected = torch.log_softmax(reference.logits(row)[0, -1].double(), -1)
        assert answer.token == int(expected.argmax()) == int(served.argmax())
        top = torch.tensor([i for i, _ in answer.top])
        assert top.tolist() == expected.topk(5).indices.tolist()
        gap = (torch.tensor([lp for _, lp in answer.top], dtype=torch.double) - expected[top]).abs().max()
        assert gap < 1e-3, f"float32 vLLM vs transformers: log-probability gap {gap:.2e}"
        assert answer.cached == 0  # reported (--enable-prompt-tokens-details) and nothing cached
    [[again]] = adapter.answer([[prompts(tokenizer)[-1] + [1]]])  # a prompt sharing 22 tokens with the last
    assert again.cached == 0 and adapter.sent == 4


@needs_vllm
def test_vllms_refusals_are_one_line_each(server, tokenizer):
    with pytest.raises(EndpointError, match="--model nope: not served") as unknown:
        EndpointAdapter(server, "openai", len(tokenizer), model="nope")
    adapter = EndpointAdapter(server, "openai", len(tokenizer), top_k=5)
    adapter.model = "nope"  # as if the server had been restarted with another model: the server's own refusal
    with pytest.raises(EndpointError, match="HTTP 404.*nope") as wrong_model:
        adapter.logits(torch.tensor([prompts(tokenizer)[0]]))
    too_long = EndpointAdapter(server, "openai", len(tokenizer))
    with pytest.raises(EndpointError, match="HTTP 400.*4096") as context:
        too_long.logits(torch.full((1, 5000), 504))
    greedy = EndpointAdapter(server, "openai", len(tokenizer), top_k=21)
    with pytest.raises(EndpointError, match="HTTP 400.*20") as logprobs:
        greedy.logits(torch.tensor([prompts(tokenizer)[0]]))
    for err in (unknown, wrong_model, context, logprobs):
        print(err.value)
        assert "\n" not in str(err.value)


def test_a_run_without_prompt_cache_refuses_an_answer_from_the_prefix_cache():
    def engine(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(200, json=RECORDED_CACHED)

    adapter = EndpointAdapter("http://engine.test", "openai", 49152, transport=httpx.MockTransport(engine), top_k=3)
    with pytest.raises(EndpointError, match="reused 3 cached prompt tokens.*--no-enable-prefix-caching") as err:
        adapter.logits(torch.tensor([[504, 3458, 314, 3365]]))
    assert "\n" not in str(err.value)
    reuse = EndpointAdapter("http://engine.test", "openai", 49152, transport=httpx.MockTransport(engine), top_k=3,
                            reuse_prefix=True)
    assert reuse.answer([[[504, 3458, 314, 3365]]])[0][0].cached == 3  # asked for: counted, not refused


RECORDED_CACHED = {**RECORDED, "usage": {**RECORDED["usage"], "prompt_tokens_details": {"cached_tokens": 3}}}


def test_a_run_whose_server_does_not_report_cached_tokens_says_the_cache_was_not_checked(tmp_path, caplog):
    from phasekv.engines.journal import keep_journal

    silent = {**RECORDED, "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}}

    def engine(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(200, json=silent)

    adapter = EndpointAdapter("http://engine.test", "openai", 49152, transport=httpx.MockTransport(engine), top_k=3)
    adapter.logits(torch.tensor([[504, 3458, 314, 3365]]))
    keep_journal(adapter, tmp_path)
    record = json.loads((tmp_path / "endpoint.json").read_text())
    assert record["prompt_cache"] == "off" and record["cached_prompt_tokens"] is None and record["cache_reported"] == 0
    assert "not checked" in caplog.text


# the cache line of /metrics, recorded from vLLM 0.32.0 started by `launch.vllm_server` (--no-enable-prefix-caching)
METRICS = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="128",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="False",engine="0",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="5.6875",'
    'kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="23296",kv_offloading_backend="native",'
    'kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",'
    'mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",'
    'mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="182",'
    'num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0'
)


def metrics_engine(cache_line: str):
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                                            f"# TYPE vllm:cache_config_info gauge\n{cache_line}\n")
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(200, json=RECORDED)
    return httpx.MockTransport(engine)


def test_a_vllm_server_with_its_prefix_cache_on_is_refused_before_any_request_of_a_run_without_cache(tmp_path):
    from phasekv.engines.journal import keep_journal

    off = EndpointAdapter("http://engine.test", "openai", 49152, transport=metrics_engine(METRICS))
    assert off.cache_config["enable_prefix_caching"] == "False" and off.cache_config["block_size"] == "128"
    caching = METRICS.replace('enable_prefix_caching="False"', 'enable_prefix_caching="True"')
    with pytest.raises(EndpointError, match="prefix cache on.*--no-enable-prefix-caching") as err:
        EndpointAdapter("http://engine.test", "openai", 49152, transport=metrics_engine(caching))
    assert "\n" not in str(err.value)
    reuse = EndpointAdapter("http://engine.test", "openai", 49152, transport=metrics_engine(caching), top_k=3,
                            reuse_prefix=True)
    reuse.logits(torch.tensor([[504, 3458, 314, 3365]]))
    keep_journal(reuse, tmp_path)
    assert json.loads((tmp_path / "endpoint.json").read_text())["server_cache"] == {
        "block_size": "128", "cache_dtype": "auto", "enable_prefix_caching": "True"}
