"""`import phasekv` registers phasekv's transformers classes with AutoConfig and AutoModelForCausalLM, lazily.

Importing transformers' modeling code costs seconds (`transformers.modeling_utils`, about 2.5 s on one idle
core), and most uses of phasekv never touch it; `import phasekv` stays as light as before.  A finder on
`sys.meta_path` waits until transformers' own auto modules are imported (whoever imports them: the user,
lm-eval, phasekv's HF adapter) and registers right after each has run: `PhaseKVConfig` once
`configuration_auto` exists, `HFPhaseKVForCausalLM` once `modeling_auto` exists.  If they are imported
already, registration happens at once.  The finder only wraps those two modules' loaders; every other
import passes through untouched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

_REGISTER = {"transformers.models.auto.configuration_auto": ("phasekv.hf.config", "register"),
             "transformers.models.auto.modeling_auto": ("phasekv.hf.model", "register")}


def _register(name: str) -> None:
    module, function = _REGISTER[name]
    getattr(importlib.import_module(module), function)()


class _RegisterAfter(importlib.abc.Loader):
    """Runs the real loader, then phasekv's registration for that module."""

    def __init__(self, loader: importlib.abc.Loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register(self.name)


class _AutoModulesFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _REGISTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader, name)
        return spec


def install() -> None:
    """Register now for the auto modules already imported; hook the others (idempotent)."""
    for name in _REGISTER:
        if name in sys.modules:
            _register(name)
    if not any(isinstance(f, _AutoModulesFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AutoModulesFinder())
