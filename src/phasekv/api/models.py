"""What the Python API accepts as a model, turned into an adapter: a model object (a transformers causal LM, a
phasekv model), a path (a local transformers directory or hub name, loaded as `phasekv audit --hf` loads it) or an
endpoint URL (a served model, as `--endpoint`), with its tokenizer (an object or a path)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

ENDPOINT_SCHEMES = ("http://", "https://")


@contextlib.contextmanager
def restored(model: Any) -> Iterator[None]:
    """A model object's training mode as it was (adapters put their model in eval mode), whatever happens; anything
    else (a path, a URL) as it is."""
    training = getattr(model, "training", None)
    try:
        yield
    finally:
        if isinstance(training, bool):
            model.train(training)


def model_name(model: nn.Module) -> str:
    """A transformers model's `name_or_path` (its last part), else its class name."""
    path = str(getattr(getattr(model, "config", None), "name_or_path", "") or "")
    return Path(path).name or type(model).__name__


def load_tokenizer_of(tokenizer: Any, gguf_file: str | None = None):
    """A tokenizer object as it is; a path loaded (one-line ValueError if it cannot be)."""
    if isinstance(tokenizer, (str, Path)):
        from phasekv.adapters.hf import load_tokenizer

        return load_tokenizer(str(tokenizer), gguf_file, flag="tokenizer")
    return tokenizer


def open_model(model: Any, tokenizer: Any, *, name: str | None = None, device: str = "auto",
               dtype: str = "float32", gguf_file: str | None = None, api: str = "llamacpp"):
    """(adapter, tokenizer or None) of what the caller gave: an nn.Module (left on its device, in its dtype), a
    path, or an http(s) URL (then `tokenizer` is required: a path or a tokenizer object; `api` the server's)."""
    if isinstance(model, nn.Module):
        from phasekv.adapters.phasekv import adapter_for

        return adapter_for(model, name or model_name(model)), load_tokenizer_of(tokenizer, gguf_file)
    if not isinstance(model, (str, Path)):
        raise ValueError(f"model: expected a torch nn.Module, a path or an http(s) URL, got {type(model).__name__}")
    text = str(model)
    if text.startswith(ENDPOINT_SCHEMES):
        return open_url(text, tokenizer, api=api, gguf_file=gguf_file)
    from phasekv.adapters.hf import load_hf

    adapter, own = load_hf(text, device, dtype, gguf_file=gguf_file)
    if name:
        adapter.info.name = name
    return adapter, own if tokenizer is None else load_tokenizer_of(tokenizer, gguf_file)


def open_url(url: str, tokenizer: Any, *, api: str, gguf_file: str | None):
    """An endpoint's adapter and the served model's tokenizer (no journal: the API writes nothing)."""
    from phasekv.engines.client import EndpointAdapter, EndpointOptions, check_endpoint_options, open_endpoint

    if tokenizer is None:
        raise ValueError(f"model {url}: an endpoint needs the served model's tokenizer (a path or a tokenizer object)")
    if isinstance(tokenizer, (str, Path)):
        return open_endpoint(EndpointOptions(url, tokenizer=str(tokenizer), api=api, gguf_file=gguf_file))
    check_endpoint_options(EndpointOptions(url, api=api))
    return EndpointAdapter(url, api, len(tokenizer)), tokenizer
