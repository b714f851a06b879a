"""vLLM: how phasekv starts its OpenAI server, its settings, and what it says about its own cache and scheduler.
vLLM speaks the shared /v1/completions protocol (`phasekv.engines.openai`).

`LAUNCHER` (`--launch vllm`) runs `vllm_server_command` (vLLM's OpenAI server, eager, one thread, no prefix cache,
cached prompt tokens reported) on the safetensors FOLDER with --max-model-len CONTEXT / SLOTS and --max-num-seqs
SLOTS, then: max_num_batched_tokens --max-num-batched-tokens (below the prompt length: chunked prefill),
kv_cache_dtype --kv-cache-dtype, dtype --dtype, prefix_cache on --enable-prefix-caching (a bare switch; "on" points
are audited with --reuse-prefix, so that a context's queries hit the cache, and "off" points refuse any cached
token).  Its `report` is /metrics' cache gauge and /server_info.  `vllm_server` and `smoke_vllm` start a server for
the tests and for `make vllm`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from phasekv.engines.base import Launcher, Setting
from phasekv.engines.process import EngineDied, free_port, launched
from phasekv.engines.wire import Connection, EndpointError


def vllm_cache_config(conn: Connection) -> dict[str, str] | None:
    """vLLM's own account of its KV cache: the labels of the `vllm:cache_config_info` gauge in its Prometheus
    /metrics (enable_prefix_caching, cache_dtype, block_size, ...), read with the connection's bounds (size and
    time); None for a server without it (llama.cpp) or that cannot say."""
    try:
        status, _, _, data = conn.exchange("GET", "/metrics")
    except (httpx.TransportError, EndpointError):
        return None
    if status != 200:
        return None
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.startswith("vllm:cache_config_info{") and "}" in line:
            return dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
    return None


def vllm_server_command(python: Path, model: Path, port: int, *, context: int = 4096, dtype: str = "float32",
                        cache_root: Path | None = None, kv_cache_gib: int = 1, threads: int = 1,
                        env: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`; `vllm serve` crashes on the CPU build),
    eager (its compiled graphs take 300-400 s and are never reused), on 127.0.0.1:`port`, without a prefix cache and
    reporting cached prompt tokens, so that an audit that asks for no prompt cache gets none and can check it.
    Run through `env`: VLLM_HOST_IP keeps its internal sockets on loopback, VLLM_CACHE_ROOT its caches in
    `cache_root`, VLLM_CPU_KVCACHE_SPACE (GiB) and OMP_NUM_THREADS its memory and cores modest (`env`: more
    NAME=VALUE)."""
    env = [*env, "VLLM_HOST_IP=127.0.0.1", f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib}", f"OMP_NUM_THREADS={threads}",
           "VLLM_CPU_OMP_THREADS_BIND=nobind",  # the kernel places the threads: the cores are shared
           *([f"VLLM_CACHE_ROOT={cache_root}"] if cache_root is not None else [])]
    return ["env", *env, str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(context), "--dtype", dtype,
            "--enforce-eager", "--no-enable-prefix-caching", "--enable-prompt-tokens-details", *extra]


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, *, context: int = 4096, dtype: str = "float32",
                cache_root: Path | None = None, startup_s: float = 600.0, extra: Sequence[str] = ()) -> Iterator[str]:
    """The URL of a vLLM server (run by `python`, the Python of vLLM's own environment) serving the safetensors
    folder `model` on a free loopback port while the block runs (`extra`: more flags, e.g.
    --enable-prefix-caching, which the later flag wins)."""
    port = free_port()
    command = vllm_server_command(python, model, port, context=context, dtype=dtype, cache_root=cache_root,
                                  extra=extra)
    with launched(command, f"http://127.0.0.1:{port}", name="vllm", startup_s=startup_s) as url:
        yield url


def smoke_vllm(python: Path, model: Path, cache_root: Path | None = None, startup_s: float = 900.0) -> int:
    """Start vLLM on `model` and ask /v1/completions for one token of a token-id prompt; the token id it answered.
    Raises `EngineDied` when the server does not come up or does not answer with a token id."""
    with vllm_server(python, model, context=256, cache_root=cache_root, startup_s=startup_s) as url:
        try:
            served = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            answer = httpx.post(f"{url}/v1/completions", json={
                "model": served, "prompt": [504, 3458, 314], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "return_tokens_as_token_ids": True}, timeout=startup_s)
            answer.raise_for_status()
            token = answer.json()["choices"][0]["logprobs"]["tokens"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise EngineDied(f"vllm did not answer a one-token request: {e}") from None
        if not (isinstance(token, str) and token.startswith("token_id:")):
            raise EngineDied(f"vllm answered {token!r} to a one-token request, not a token id")
        return int(token[len("token_id:"):])


def _build(python: Path, model: Path, port: int, *, context: int, slots: int, flags: list[str]) -> list[str]:
    # context is the grid's total (llama.cpp splits it over its slots): vLLM's --max-model-len is per sequence
    return vllm_server_command(python, model, port, context=context // slots,
                               cache_root=LAUNCHER.root() / "cache",
                               env=("VLLM_SERVER_DEV_MODE=1",),  # its /server_info: the settings it runs with
                               extra=("--max-num-seqs", str(slots), *flags))


def _vllm_prefix_cache(settings: dict[str, str]) -> bool:
    return settings.get("prefix_cache") == "on"


def _vllm_limits(settings: dict[str, str], *, context: int, slots: int) -> None:
    batched = settings.get("max_num_batched_tokens")
    if batched is not None and int(batched) < slots:  # vLLM's SchedulerConfig refuses it at startup
        raise ValueError(f"--engine-grid max_num_batched_tokens={batched}: vLLM needs at least --max-num-seqs "
                         f"({slots}, the --batch-width of --engine-checks batch)")


# the SchedulerConfig, CacheConfig and ModelConfig fields of /server_info that the grid's settings set
_SERVER_INFO = {"scheduler_config": ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill"),
                "cache_config": ("enable_prefix_caching", "cache_dtype", "block_size"),
                "model_config": ("dtype", "max_model_len", "enforce_eager")}


def vllm_report(conn: Connection) -> dict[str, Any]:
    """vLLM's own account of its settings: the labels of /metrics' `vllm:cache_config_info` gauge (None without
    it), and the fields of /server_info (answered with VLLM_SERVER_DEV_MODE=1, as phasekv starts it; None
    otherwise) that a grid can set."""
    report: dict[str, Any] = {"cache_config": vllm_cache_config(conn)}
    info = conn.get_optional("/server_info?config_format=json")
    config = info.get("vllm_config") if isinstance(info, dict) else None
    report["server_info"] = None if not isinstance(config, dict) else {
        part: {k: config[part].get(k) for k in keys} for part, keys in _SERVER_INFO.items()
        if isinstance(config.get(part), dict)}
    return report


LAUNCHER = Launcher(
    name="vllm", binary="venv/bin/python", api="openai", build=_build, report=vllm_report,
    settings={"max_num_batched_tokens": Setting(("--max-num-batched-tokens",), low=1),
              # the CPU attention backend's cache dtypes (no float16/bfloat16 cache: `auto` is the model's)
              "kv_cache_dtype": Setting(("--kv-cache-dtype",), ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
              "dtype": Setting(("--dtype",), ("float32", "bfloat16", "float16")),
              "prefix_cache": Setting(switch={"off": (), "on": ("--enable-prefix-caching",)})},
    home=("PHASEKV_VLLM", "vllm"), install="make vllm installs vLLM's environment",
    startup_s=900.0,  # eager startup is 1-2 min on an idle machine, 10-15 min when the cores are busy
    serves="folder", caches_prefix=_vllm_prefix_cache, limits=_vllm_limits,
    hints={"ubatch": "vLLM's prefill chunk is max_num_batched_tokens", "batch": "use max_num_batched_tokens",
           "flash_attn": "vLLM's CPU backend has one attention kernel and no flash-attention switch",
           "cache_type": "vLLM has one KV cache dtype for K and V: kv_cache_dtype",
           "cache_type_k": "vLLM has one KV cache dtype for K and V: kv_cache_dtype",
           "cache_type_v": "vLLM has one KV cache dtype for K and V: kv_cache_dtype",
           "threads": "phasekv runs vLLM on one thread (OMP_NUM_THREADS=1)"})
