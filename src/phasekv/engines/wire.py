"""The wire every engine is reached over: the HTTP connection, the records of an answer, and the strict parses of
token ids and log-probabilities that every engine API shares.

`Connection` retries connection errors (refused, reset, timed out, a body cut short) and 5xx answers with
exponential backoff; anything else is a one-line `EndpointError`.  Every read is bounded: an answer larger than
`MAX_ANSWER_BYTES` is refused as it streams in (an endless body never fills memory), each chunk must come within
the timeout and the whole answer within twice it; a redirect is refused (phasekv never follows one).  The parses read
token ids and log-probabilities strictly (an id is a JSON integer, a log-probability a JSON number);
`phasekv.engines.answers` then checks each answer against its request and the tokenizer.
"""


from __future__ import annotations

import json
import logging
import math
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger(__name__)

# the largest answer read from a server: a completion with its top-k is a few kB, llama.cpp's /props tens of kB
MAX_ANSWER_BYTES = 16 << 20


class EndpointError(ValueError):
    """An endpoint that cannot be reached or does not answer with a completion (one line)."""


@dataclass(frozen=True)
class Answer:
    token: int  # the engine's greedy next token
    top: list[tuple[int, float]]  # the top-k (token id, log-probability), most likely first
    cached: int | None = None  # prompt tokens the engine reused from its prefix cache (None: not reported)


@dataclass(frozen=True)
class ServerInfo:
    model: str  # the served model's name (the id the openai API must be sent)
    vocab_size: int | None = None  # None: the server does not say
    context: int | None = None


# ---------------------------------------------------------------------------------------------- the wire


class Connection:
    """httpx client with timeouts and bounded retries (exponential backoff) on connection errors and 5xx."""

    def __init__(self, url: str, *, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 concurrency: int = 1, transport: httpx.BaseTransport | None = None,
                 max_bytes: int = MAX_ANSWER_BYTES):
        check_url(url)
        check_timeout(timeout)
        self.url, self.retries, self.backoff, self.max_bytes = url.rstrip("/"), retries, backoff, max_bytes
        self.deadline_s = 2 * timeout  # the whole answer, however it trickles in
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                   limits=httpx.Limits(max_connections=concurrency + 1), transport=transport)

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        """The decoded JSON answer; EndpointError when unreachable after the retries, on a 3xx or 4xx, on an answer
        over `max_bytes`, or on non-JSON."""
        where = f"{self.url}{path}"
        for attempt in range(self.retries + 1):
            try:
                status, reason, headers, data = self.exchange(method, path, body)
            except httpx.TransportError as exc:  # refused, reset, timed out: the server may be (re)starting
                problem = f"cannot reach the server ({type(exc).__name__}: {_first_line(str(exc))})"
            else:
                if status < 500:
                    break
                problem = f"HTTP {status} ({_message(data, reason)})"
            if attempt == self.retries:
                raise EndpointError(f"{where}: {problem}, after {self.retries + 1} tries")
            log.info("%s: %s; retrying", where, problem)
            time.sleep(self.backoff * 2 ** attempt)
        if 300 <= status < 400:
            raise EndpointError(f"{where}: HTTP {status}, a redirect to {headers.get('location', '(nowhere)')!r}: "
                                "phasekv does not follow redirects; give the server's own URL as --endpoint")
        if status >= 400:
            raise EndpointError(f"{where}: HTTP {status} ({_message(data, reason)})")
        return _decode(data, where)

    def exchange(self, method: str, path: str, body: dict | None = None) -> tuple[int, str, Any, bytes]:
        """(status, reason, headers, body) of one request, not retried, the body read at most `max_bytes` and within
        `deadline_s` (a trickle past it reads as a timeout); EndpointError past the size."""
        where = f"{self.url}{path}"
        deadline = time.monotonic() + self.deadline_s
        with self.client.stream(method, path, json=body) as response:
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > self.max_bytes:
                    raise EndpointError(f"{where}: answered more than {self.max_bytes >> 20} MiB (HTTP "
                                        f"{response.status_code}); an engine's answer is a few kB: is this the "
                                        "engine's URL?")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"the answer took more than {self.deadline_s:g} s to arrive")
            return response.status_code, response.reason_phrase, response.headers, bytes(data)

    def get_optional(self, path: str) -> Any:
        """GET `path`, or None where the server has no such route (404)."""
        try:
            return self.request("GET", path)
        except EndpointError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise

    def close(self) -> None:
        self.client.close()


def check_url(url: Any) -> None:
    """Refuse, in one line, an --endpoint that is not an http(s) URL naming a host (and a port in 1-65535)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise EndpointError(f"--endpoint {url}: must be an http:// or https:// URL")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError past 65535
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise EndpointError(f"--endpoint {url}: not a valid URL ({_first_line(str(exc))})") from None
    if not parts.hostname:
        raise EndpointError(f"--endpoint {url}: names no host")
    if port == 0:
        raise EndpointError(f"--endpoint {url}: port 0 is no server's port (1-65535)")


MAX_TIMEOUT_S = 7 * 86400.0  # a week: longer is no request's timeout but a typo (and overflows the socket's)


def check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise EndpointError(f"--timeout: must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f} "
                            f"(a week), got {timeout}")


def _decode(data: bytes, where: str) -> Any:
    """The JSON of an answer's body (NaN and Infinity are read as numbers: the answer checks refuse them)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise EndpointError(f"{where}: answered JSON nested too deep to be a completion") from None
    except ValueError:  # UnicodeDecodeError included
        text = data[:400].decode("utf-8", errors="replace")
        raise EndpointError(f"{where}: answered non-JSON ({_first_line(text)[:120]!r})") from None


def _message(data: bytes, reason: str) -> str:
    """A server's error message: llama.cpp / OpenAI {"error": {"message"}}, FastAPI {"detail"}, else the text."""
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return _first_line(data[:400].decode("utf-8", errors="replace"))[:200] or reason
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return _first_line(str(error))[:200]
    return _first_line(json.dumps(payload))[:200]


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


# ---------------------------------------------------------------------------------------------- strict parses


def not_completion(api: str, payload: Any) -> EndpointError:
    """The one-line error of an answer that is not a completion of `api`."""
    return EndpointError(f"the server did not answer with a {api} completion: {json.dumps(payload)[:160]}")


def ranked(top: list[tuple[Any, Any]]) -> list[tuple[int, float]]:
    """(id, log-probability) pairs read strictly, most likely first."""
    return sorted(((strict_id(i), strict_logprob(lp)) for i, lp in top), key=lambda t: -t[1])


def strict_id(value: Any) -> int:
    """A token id as the answer gave it: a JSON integer (not a string, a float or a boolean)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"token id {value!r} is not an integer")
    return value


def strict_logprob(value: Any) -> float:
    """A log-probability as the answer gave it: a JSON number (its value is checked in `answers`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"log-probability {value!r} is not a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError(f"log-probability {value} is out of range") from None


# a continuation token whose probability is below float32's range (the engine says -inf, or JSON null): read as
# this log-probability, as vLLM itself clamps its prompt log-probabilities
LOGPROB_FLOOR = -9999.0


def scored_logprob(value: Any, token: int) -> float:
    """A continuation token's log-probability as the engine gave it: a number <= 0 (a rounding of 1e-4 above
    allowed), or null/-inf for a probability that underflowed (`LOGPROB_FLOOR`)."""
    if value is None or (isinstance(value, float) and value == float("-inf")):
        return LOGPROB_FLOOR
    lp = strict_logprob(value)
    if not (math.isfinite(lp) and lp <= 1e-4):
        raise ValueError(f"token {token}: log-probability {lp} is not a log-probability")
    return max(min(lp, 0.0), LOGPROB_FLOOR)


def served_models(conn: Connection) -> list[dict[str, Any]]:
    """The entries of an OpenAI-style /v1/models listing ([] where the server has none)."""
    listing = conn.get_optional("/v1/models")
    return listing.get("data", []) if isinstance(listing, dict) else []


def pick_model(served: list[dict[str, Any]], model: str | None, where: str) -> dict[str, Any]:
    """The entry of /v1/models for `model` (the only one served, when not given)."""
    ids = [m.get("id") for m in served]
    if model is None:
        if len(served) != 1:
            raise EndpointError(f"{where}: serves {len(served)} models {ids}: choose one with --model")
        return served[0]
    for entry in served:
        if entry.get("id") == model:
            return entry
    raise EndpointError(f"--model {model}: not served by {where} (it serves {ids})")
