"""Engines phasekv can start itself, by name: how to build the command, how an engine setting maps to a flag, where
its health route is, and what the running server reports about its own settings.

`phasekv audit --launch NAME --engine-grid key=v1,v2 ...` starts the engine once per grid point
(`phasekv.evaluate.engine_grid`).  A `Launcher` is one registry entry; a new engine (vLLM's OpenAI server, SGLang)
is one more `Launcher` in `LAUNCHERS`:

    llama-server   -m MODEL --host 127.0.0.1 --port P -c CONTEXT -np SLOTS --no-webui, then one flag per setting:
                   ubatch -ub, batch -b, cache_type_k -ctk, cache_type_v -ctv, cache_type -ctk and -ctv,
                   flash_attn -fa, threads -t
                   (and -t 1 when threads is not a grid key: phasekv's runs share the CPU cores)

A setting's values are checked before any server starts (`check_settings`: the allowed values or an integer range),
so a typo in a grid is one line, not a server that dies at its fifth point.  `running_settings` reads what a server
says about itself (llama.cpp: /props and /slots), recorded beside the verdict whether phasekv started the server
or the user did.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasekv.adapters.engines import Connection, EndpointError
from phasekv.adapters.launch import free_port, launched


@dataclass(frozen=True)
class Setting:
    """One engine setting of a grid: its flags (each gets the value) and what it may be (`choices`, or an integer of
    at least `low`)."""

    flags: tuple[str, ...]
    choices: tuple[str, ...] = ()
    low: int | None = None

    def check(self, key: str, value: str) -> str:
        if self.choices and value not in self.choices:
            raise ValueError(f"--engine-grid {key}={value}: must be one of {', '.join(self.choices)}")
        if self.low is not None and not (value.isdigit() and int(value) >= self.low):
            raise ValueError(f"--engine-grid {key}={value}: must be an integer >= {self.low}")
        return value


@dataclass(frozen=True)
class Launcher:
    """How to start one engine: `command(binary, model, port, settings, context, slots)` is its command line,
    `settings` the grid keys it knows, `health` the route that answers 200 once the model is loaded, `api` the
    `--api` phasekv talks to it with, `report` what the running server says about its settings."""

    name: str
    binary: str  # the default binary's file name (`--engine-bin` overrides)
    api: str
    settings: dict[str, Setting]
    build: Callable[..., list[str]]
    report: Callable[[Connection], dict[str, Any]]
    health: str = "/health"
    defaults: dict[str, str] = field(default_factory=dict)  # settings given when the grid does not vary them

    def command(self, binary: Path, model: Path, port: int, settings: dict[str, str], *, context: int,
                slots: int) -> list[str]:
        flags = [part for key, value in {**self.defaults, **settings}.items()
                 for flag in self.settings[key].flags for part in (flag, value)]
        return self.build(binary, model, port, context=context, slots=slots, flags=flags)


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


LAUNCHERS: dict[str, Launcher] = {
    "llama-server": Launcher(
        name="llama-server", binary="llama-server", api="llamacpp", build=_llama_server, report=llama_cpp_report,
        settings={"ubatch": Setting(("-ub",), low=1), "batch": Setting(("-b",), low=1),
                  "cache_type_k": Setting(("-ctk",), _CACHE_TYPES), "cache_type_v": Setting(("-ctv",), _CACHE_TYPES),
                  # both caches at once: DeepSeek-V4 in llama.cpp b11434 refuses different K and V cache types
                  "cache_type": Setting(("-ctk", "-ctv"), _CACHE_TYPES),
                  "flash_attn": Setting(("-fa",), ("on", "off", "auto")), "threads": Setting(("-t",), low=1)},
        defaults={"threads": "1"}),
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
            raise ValueError(f"--engine-grid {key}: not a {engine.name} setting; known: {', '.join(engine.settings)}")
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
            slots: int = 1, startup_s: float = 180.0) -> Iterator[str]:
    """The URL of `engine` serving `model` with `settings` on a free loopback port, stopped when the block ends
    (on any exit: `phasekv.adapters.launch.launched`)."""
    if not Path(binary).is_file():
        raise EndpointError(f"--engine-bin {binary}: no such file (make engine builds llama-server)")
    port = free_port()
    command = engine.command(Path(binary), Path(model), port, settings, context=context, slots=slots)
    with launched(command, f"http://127.0.0.1:{port}", name=Path(binary).name, health=engine.health,
                  startup_s=startup_s) as url:
        yield url


def default_binary(engine: Launcher) -> Path:
    """Where `make engine` installs the engine's binary (PHASEKV_ENGINE overrides the directory)."""
    root = Path(os.environ.get("PHASEKV_ENGINE", Path.home() / ".cache" / "phasekv" / "llama.cpp"))
    return root / "bin" / engine.binary


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
