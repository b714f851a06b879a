"""Engines phasekv can start itself, by name: how to build the command, how an engine setting maps to a flag, where
its health route is, and what the running server reports about its own settings.

`phasekv audit --launch NAME --engine-grid key=v1,v2 ...` starts the engine once per grid point
(`phasekv.evaluate.engine_grid`).  A `Launcher` is one registry entry; a new engine (vLLM's OpenAI server, SGLang)
is one more `Launcher` in `LAUNCHERS`:

    llama-server   -m MODEL --host 127.0.0.1 --port P -c CONTEXT -np SLOTS --no-webui, then one flag per setting:
                   ubatch -ub, batch -b, cache_type_k -ctk, cache_type_v -ctv, cache_type -ctk and -ctv,
                   flash_attn -fa, threads -t
                   (and -t 1 when threads is not a grid key: phasekv's runs share the CPU cores)
    vllm           `launch.vllm_server_command` (vLLM's OpenAI server, eager, one thread, no prefix cache, cached
                   prompt tokens reported) on the safetensors FOLDER with --max-model-len CONTEXT / SLOTS and
                   --max-num-seqs SLOTS, then: max_num_batched_tokens --max-num-batched-tokens (below the prompt
                   length: chunked prefill), kv_cache_dtype --kv-cache-dtype, dtype --dtype, prefix_cache on
                   --enable-prefix-caching (a bare switch; "on" points are audited with --reuse-prefix, so that a
                   context's queries hit the cache, and "off" points refuse any cached token)

A setting's values are checked before any server starts (`Setting.check`: the allowed values or an integer range),
so a typo in a grid is one line, not a server that dies at its fifth point (a key of another engine says which key
this one has instead: `Launcher.hints`).  `Launcher.report` reads what a server says about itself (llama.cpp: /props
and /slots; vLLM: /metrics' cache gauge and /server_info); `running_settings` does so for a server the user
started, recorded beside the verdict.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasekv.adapters.engines import Connection, EndpointError, vllm_cache_config
from phasekv.adapters.launch import free_port, launched, vllm_server_command


@dataclass(frozen=True)
class Setting:
    """One engine setting of a grid: its flags (each gets the value) and what it may be (`choices`, or an integer of
    at least `low`); or a bare switch: `switch` maps each value to the flags it adds, without a value after them."""

    flags: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    low: int | None = None
    switch: dict[str, tuple[str, ...]] | None = None

    def check(self, key: str, value: str) -> str:
        allowed = self.choices or tuple(self.switch or ())
        if allowed and value not in allowed:
            raise ValueError(f"--engine-grid {key}={value}: must be one of {', '.join(allowed)}")
        if self.low is not None and not (value.isdigit() and int(value) >= self.low):
            raise ValueError(f"--engine-grid {key}={value}: must be an integer >= {self.low}")
        return value

    def args(self, value: str) -> list[str]:
        """The command-line words of this setting at `value`."""
        if self.switch is not None:
            return list(self.switch[value])
        return [part for flag in self.flags for part in (flag, value)]


def _no_prefix_cache(settings: dict[str, str]) -> bool:
    return False


def _no_limits(settings: dict[str, str], *, context: int, slots: int) -> None:
    return None


@dataclass(frozen=True)
class Launcher:
    """How to start one engine: `command(binary, model, port, settings, context, slots)` is its command line,
    `settings` the grid keys it knows, `health` the route that answers 200 once the model is loaded, `api` the
    `--api` phasekv talks to it with, `report` what the running server says about its settings, `startup_s` how
    long it may take to load, `serves` whether the model is a file or a folder, `caches_prefix` whether a point's
    server keeps a prefix cache that requests cannot switch off (its audit then reuses prefixes on purpose),
    `limits` the refusals that need several settings at once, `hints` a word for keys of other engines."""

    name: str
    binary: str  # the default binary, inside the install directory (`--engine-bin` overrides)
    api: str
    settings: dict[str, Setting]
    build: Callable[..., list[str]]
    report: Callable[[Connection], dict[str, Any]]
    health: str = "/health"
    defaults: dict[str, str] = field(default_factory=dict)  # settings given when the grid does not vary them
    home: tuple[str, str] = ("PHASEKV_ENGINE", "llama.cpp")  # (environment variable, default under ~/.cache/phasekv)
    install: str = "make engine builds llama-server"
    startup_s: float = 180.0
    serves: str = "file"
    caches_prefix: Callable[[dict[str, str]], bool] = _no_prefix_cache
    limits: Callable[..., None] = _no_limits
    hints: dict[str, str] = field(default_factory=dict)

    def command(self, binary: Path, model: Path, port: int, settings: dict[str, str], *, context: int,
                slots: int) -> list[str]:
        chosen = {**self.defaults, **settings}
        flags = [part for key, value in chosen.items() for part in self.settings[key].args(value)]
        return self.build(binary, model, port, context=context, slots=slots, flags=flags)

    def root(self) -> Path:
        """The engine's install directory (its environment variable, else under ~/.cache/phasekv)."""
        variable, default = self.home
        return Path(os.environ.get(variable, Path.home() / ".cache" / "phasekv" / default))


def _llama_server(binary: Path, model: Path, port: int, *, context: int, slots: int, flags: list[str]) -> list[str]:
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(context),
            "-np", str(slots), "--no-webui", *flags]


_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# /props fields that describe the server (the chat template is long text and says nothing about the numbers)
_PROPS_DROP = ("chat_template", "chat_template_tool_use", "chat_template_caps")


def llama_cpp_report(conn: Connection) -> dict[str, Any]:
    """llama.cpp's own account of its settings: /props (without the chat template) and, per slot, /slots' context
    and sampling parameters (None where the server has the route off)."""
    props = conn.get_optional("/props")
    slots = conn.get_optional("/slots")
    report: dict[str, Any] = {"props": {k: v for k, v in props.items() if k not in _PROPS_DROP}
                              if isinstance(props, dict) else None}
    report["slots"] = [{k: s.get(k) for k in ("id", "n_ctx", "speculative", "params") if k in s}
                       for s in slots if isinstance(s, dict)] if isinstance(slots, list) else None
    return report


def _vllm_server(python: Path, model: Path, port: int, *, context: int, slots: int, flags: list[str]) -> list[str]:
    # context is the grid's total (llama.cpp splits it over its slots): vLLM's --max-model-len is per sequence
    return vllm_server_command(python, model, port, context=context // slots,
                               cache_root=LAUNCHERS["vllm"].root() / "cache",
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


LAUNCHERS: dict[str, Launcher] = {
    "llama-server": Launcher(
        name="llama-server", binary="bin/llama-server", api="llamacpp", build=_llama_server, report=llama_cpp_report,
        settings={"ubatch": Setting(("-ub",), low=1), "batch": Setting(("-b",), low=1),
                  "cache_type_k": Setting(("-ctk",), _CACHE_TYPES), "cache_type_v": Setting(("-ctv",), _CACHE_TYPES),
                  # both caches at once: DeepSeek-V4 in llama.cpp b11434 refuses different K and V cache types
                  "cache_type": Setting(("-ctk", "-ctv"), _CACHE_TYPES),
                  "flash_attn": Setting(("-fa",), ("on", "off", "auto")), "threads": Setting(("-t",), low=1)},
        defaults={"threads": "1"},
        hints={"max_num_batched_tokens": "llama.cpp's batch sizes are ubatch and batch",
               "kv_cache_dtype": "llama.cpp's are cache_type_k, cache_type_v and cache_type (both)",
               "prefix_cache": "llama.cpp's prompt cache is per request: --reuse-prefix, --engine-checks prefix"}),
    "vllm": Launcher(
        name="vllm", binary="venv/bin/python", api="openai", build=_vllm_server, report=vllm_report,
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
               "threads": "phasekv runs vLLM on one thread (OMP_NUM_THREADS=1)"}),
}


def launcher(name: str) -> Launcher:
    if name not in LAUNCHERS:
        raise ValueError(f"--launch {name}: unknown engine; known: {', '.join(LAUNCHERS)}")
    return LAUNCHERS[name]


def parse_grid(engine: Launcher, items: Sequence[str]) -> list[dict[str, str]]:
    """`key=v1,v2 key2=w1` -> every combination, in the order given (the last key varies fastest); each value
    checked against the engine's settings.  No items: one point with the engine's defaults."""
    axes: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--engine-grid {item!r}: must be KEY=V1,V2,... (keys: {', '.join(engine.settings)})")
        if key not in engine.settings:
            hint = f" ({engine.hints[key]})" if key in engine.hints else ""
            raise ValueError(f"--engine-grid {key}: not a {engine.name} setting{hint}; known: "
                             f"{', '.join(engine.settings)}")
        if key in axes:
            raise ValueError(f"--engine-grid {key}: given twice")
        parts = values.split(",")
        if len(set(parts)) != len(parts):
            raise ValueError(f"--engine-grid {item}: a value is repeated")
        axes[key] = [engine.settings[key].check(key, v) for v in parts]
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def point_name(settings: dict[str, str]) -> str:
    """A grid point's directory name: `ubatch=16,flash_attn=on` (`default` for no settings)."""
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "default"


@contextlib.contextmanager
def started(engine: Launcher, binary: Path, model: Path, settings: dict[str, str], *, context: int = 4096,
            slots: int = 1, startup_s: float | None = None) -> Iterator[str]:
    """The URL of `engine` serving `model` with `settings` on a free loopback port, stopped when the block ends
    (on any exit: `phasekv.adapters.launch.launched`); `startup_s`: default the engine's own."""
    if not Path(binary).is_file():
        raise EndpointError(f"--engine-bin {binary}: no such file ({engine.install})")
    port = free_port()
    command = engine.command(Path(binary), Path(model), port, settings, context=context, slots=slots)
    with launched(command, f"http://127.0.0.1:{port}", name=engine.name, health=engine.health,
                  startup_s=engine.startup_s if startup_s is None else startup_s) as url:
        yield url


def default_binary(engine: Launcher) -> Path:
    """Where `make engine` (`make vllm`) installs the engine's binary (its environment variable overrides the
    directory: PHASEKV_ENGINE, PHASEKV_VLLM)."""
    return engine.root() / engine.binary


# what a server the user started says about its settings, by --api (vLLM has no /props: its routes answer 404)
REPORTS: dict[str, Callable[[Connection], dict[str, Any]]] = {"llamacpp": llama_cpp_report,
                                                              "openai": llama_cpp_report}


def running_settings(api: str, conn: Connection) -> dict[str, Any] | None:
    """The settings a running server reports (`REPORTS`), or None for an API that reports none; a server that
    fails to answer is recorded with its one-line error, not raised (the verdict does not depend on it)."""
    if api not in REPORTS:
        return None
    try:
        return REPORTS[api](conn)
    except EndpointError as exc:
        return {"error": str(exc)}
