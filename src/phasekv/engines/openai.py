"""The OpenAI-style /v1/completions protocol with a token-id prompt, spoken by llama.cpp and vLLM.

    POST /v1/completions   {"prompt": ids, "max_tokens": 1, "logprobs": k, "model": ...}
                           (llama.cpp's own top-logprob ids, or vLLM's "token_id:N" tokens)

vLLM ignores the request's `cache_prompt` and caches prefixes unless started with --no-enable-prefix-caching, so
`server_cache` reads its own account (/metrics) before any request; a server the user started reports its settings
as llama.cpp's /props does (vLLM has none: its routes answer 404).
"""

from __future__ import annotations

from phasekv.engines.base import Api
from phasekv.engines.llama_cpp import llama_cpp_report, llama_step
from phasekv.engines.vllm import vllm_cache_config
from phasekv.engines.wire import (
    Answer,
    EndpointError,
    ServerInfo,
    not_completion,
    pick_model,
    ranked,
    scored_logprob,
    served_models,
)


class OpenAIApi(Api):
    """OpenAI-style /v1/completions with a token-id prompt (llama.cpp, vLLM)."""

    name, path = "openai", "/v1/completions"

    def body(self, ids, top_k, model, cache_prompt):
        # cache_prompt is llama.cpp's switch, return_tokens_as_token_ids vLLM's "token_id:N" tokens; each
        # engine ignores the other's field
        return {"model": model, "prompt": ids, "max_tokens": 1, "logprobs": top_k, "temperature": 0,
                "cache_prompt": cache_prompt, "return_tokens_as_token_ids": True}

    def parse(self, payload):
        try:
            logprobs = payload["choices"][0]["logprobs"]
            usage = payload.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            read = usage.get("prompt_tokens")
            if "content" in logprobs:  # llama.cpp: ids alongside the text
                return llama_step(logprobs["content"][0], cached), read
            token = vllm_token_id(logprobs["tokens"][0])  # OpenAI/vLLM: tokens as strings
            top = [(vllm_token_id(t), lp) for t, lp in logprobs["top_logprobs"][0].items()]
            return Answer(token, ranked(top), cached), read
        except EndpointError:
            raise
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise not_completion(self.name, payload) from None

    scoring = ("vLLM: one request per continuation, prompt + continuation with prompt_logprobs; the log-probability "
               "of each continuation token is the engine's own, from its raw logits (exact)")

    def continuation_logprobs(self, conn, prompt, continuation, model, cache_prompt):
        """One request: prompt + continuation as the prompt, `prompt_logprobs` 0 (vLLM: each prompt position's own
        token's log-probability, the actual token always included), read at the continuation's positions.  A server
        without prompt log-probabilities (llama.cpp's /v1/completions) is refused in one line."""
        ids = [*prompt, *continuation]
        payload = conn.request("POST", self.path, {**self.body(ids, 1, model, cache_prompt), "prompt_logprobs": 0})
        try:
            choice = payload["choices"][0]
            usage = payload.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            read = usage.get("prompt_tokens")
            positions = choice.get("prompt_logprobs")
            if positions is None:
                raise EndpointError(f"{conn.url}: answers without prompt_logprobs, so it cannot score a continuation "
                                    "through /v1/completions (llama.cpp: use --api llamacpp)")
            out = [scored_logprob(positions[len(prompt) + j][str(token)]["logprob"], token)
                   for j, token in enumerate(continuation)]
        except EndpointError:
            raise
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise not_completion(self.name, payload) from None
        if read is not None and read != len(ids):
            raise EndpointError(f"{conn.url}: read {read} prompt tokens of the {len(ids)} sent (a BOS added, or a "
                                "prompt cut?)")
        return out, cached

    def identify(self, conn, model):
        served = served_models(conn)
        if not served:
            raise EndpointError(f"{conn.url}/v1/models: lists no model; is --api right?")
        entry = pick_model(served, model, conn.url)
        meta = entry.get("meta") or {}  # llama.cpp
        return ServerInfo(entry["id"], meta.get("n_vocab"), entry.get("max_model_len") or meta.get("n_ctx_train"))

    def generate_body(self, ids, steps, top_k, model):
        # ignore_eos: llama.cpp's and vLLM's extension (each ignores what it does not know)
        return {**self.body(ids, top_k, model, False), "max_tokens": steps, "ignore_eos": True}

    def parse_steps(self, payload):
        try:
            logprobs = payload["choices"][0]["logprobs"]
            if "content" in logprobs:  # llama.cpp
                return [llama_step(step, strict=False) for step in logprobs["content"]]
            return [Answer(vllm_token_id(token), ranked([(vllm_token_id(t), lp) for t, lp in top.items()]))
                    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise not_completion(self.name, payload) from None

    def server_cache(self, conn):
        config = vllm_cache_config(conn)
        return config, (config or {}).get("enable_prefix_caching") == "True"

    def report(self, conn):
        return llama_cpp_report(conn)


def vllm_token_id(token: str) -> int:
    """vLLM's "token_id:N" (return_tokens_as_token_ids); a plain text token cannot be mapped back exactly."""
    if not (isinstance(token, str) and token.startswith("token_id:")):
        raise EndpointError(f"the server answered the token as text ({token!r}), not as an id: phasekv needs ids "
                            "(vLLM: return_tokens_as_token_ids; llama.cpp: --api llamacpp)")
    digits = token[len("token_id:"):]
    if not (digits.isascii() and digits.isdigit()):  # no sign, space or underscore that int() would accept
        raise ValueError(f"token {token!r} is not token_id:N")
    return int(digits)


API = OpenAIApi()
