"""The engines phasekv knows, found by name: every module of `phasekv.engines` that defines `API` (an `Api`) or
`LAUNCHER` (a `Launcher`) is one engine, so adding an engine is adding its file.

`api(name)` is the `--api` a served model is reached with, `launcher(name)` the `--launch` phasekv starts itself;
`started` runs a launcher's server for the length of a block, `running_settings` records what a server the user
started says about itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phasekv.engines.base import Api, Launcher
from phasekv.engines.process import free_port, launched
from phasekv.engines.wire import Connection, EndpointError

# the modules of the package that are plumbing shared by the engines, not engines
_PLUMBING = {"answers", "base", "client", "journal", "process", "registry", "wire"}


@functools.cache
def _engines() -> tuple[dict[str, Api], dict[str, Launcher]]:
    import phasekv.engines as package

    apis: dict[str, Api] = {}
    launchers: dict[str, Launcher] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name in _PLUMBING:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if isinstance(getattr(module, "API", None), Api):
            apis[module.API.name] = module.API
        if isinstance(getattr(module, "LAUNCHER", None), Launcher):
            launchers[module.LAUNCHER.name] = module.LAUNCHER
    return apis, launchers


def apis() -> dict[str, Api]:
    """Every engine API by its --api name."""
    return dict(_engines()[0])


def launchers() -> dict[str, Launcher]:
    """Every engine phasekv can start, by its --launch name."""
    return dict(_engines()[1])


def api(name: str) -> Api:
    known = _engines()[0]
    if name not in known:
        raise EndpointError(f"--api: must be one of {list(known)}, got {name!r}")
    return known[name]


def launcher(name: str) -> Launcher:
    known = _engines()[1]
    if name not in known:
        raise ValueError(f"--launch {name}: unknown engine; known: {', '.join(known)}")
    return known[name]


@contextlib.contextmanager
def started(engine: Launcher, binary: Path, model: Path, settings: dict[str, str], *, context: int = 4096,
            slots: int = 1, startup_s: float | None = None) -> Iterator[str]:
    """The URL of `engine` serving `model` with `settings` on a free loopback port, stopped when the block ends
    (on any exit: `phasekv.engines.process.launched`); `startup_s`: default the engine's own."""
    if not Path(binary).is_file():
        raise EndpointError(f"--engine-bin {binary}: no such file ({engine.install})")
    port = free_port()
    command = engine.command(Path(binary), Path(model), port, settings, context=context, slots=slots)
    with launched(command, f"http://127.0.0.1:{port}", name=engine.name, health=engine.health,
                  startup_s=engine.startup_s if startup_s is None else startup_s) as url:
        yield url


def default_binary(engine: Launcher) -> Path:
    """Where the engine's install step (`make engine`, `make vllm`) puts its binary (its environment variable
    overrides the directory: PHASEKV_ENGINE, PHASEKV_VLLM, PHASEKV_SGLANG)."""
    return engine.root() / engine.binary


def running_settings(api_name: str, conn: Connection) -> dict[str, Any] | None:
    """The settings a running server reports (its API's `report`), or None for an API that reports none; a server
    that fails to answer is recorded with its one-line error, not raised (the verdict does not depend on it)."""
    try:
        return api(api_name).report(conn)
    except EndpointError as exc:
        return {"error": str(exc)}
