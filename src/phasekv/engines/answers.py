"""What a working engine's answer satisfies, checked before the answer is journaled or used.

An engine that answers token id -1, a NaN log-probability or fewer top-k entries than asked is broken; scoring such
an answer would blame the model for the engine ("cannot do the task").  `check_answer` refuses it in one line that
says what is wrong, against the request (the ids sent, the top-k asked) and the tokenizer (its vocabulary);
`check_server` does the same for the server's description of its model.  A journal's answers are checked with
`check_answer` too when a run resumes from it (the request is then unknown: only the answer itself is checked).
"""

from __future__ import annotations

import math
from typing import Any

from phasekv.engines.wire import Answer, EndpointError, ServerInfo

# log-probabilities are <= 0; an engine's rounding may leave the top one a hair above
LOGPROB_SLACK = 1e-4


def answer_problem(answer: Answer, read: Any, *, vocab_size: int, top_k: int, sent: int | None) -> str | None:
    """What is wrong with `answer` (and its prompt-token count `read`) for a request of `sent` ids and `top_k`
    log-probabilities, or None."""
    ids = [answer.token, *(i for i, _ in answer.top)]
    outside = next((i for i in ids if not 0 <= i < vocab_size), None)
    if outside is not None:
        hint = "wrong --tokenizer?" if outside >= vocab_size else "no tokenizer has negative ids"
        return f"token id {outside}, outside the tokenizer's {vocab_size}: {hint}"
    if len(answer.top) < min(top_k, vocab_size):
        return f"{len(answer.top)} top-k log-probabilities where {top_k} were asked"
    if len({i for i, _ in answer.top}) < len(answer.top):
        return "the same token twice in its top-k"
    bad = next((lp for _, lp in answer.top if not (math.isfinite(lp) and lp <= LOGPROB_SLACK)), None)
    if bad is not None:
        return f"the log-probability {bad} (a log-probability is finite and <= 0)"
    if answer.token not in {i for i, _ in answer.top}:
        return f"the greedy token {answer.token}, which is not among its own top-{len(answer.top)}"
    if read is not None and (isinstance(read, bool) or not isinstance(read, int) or sent is not None and read != sent):
        return (f"that it read {read!r} prompt tokens where {sent} ids were sent (did it add a BOS or tokenize the "
                "prompt as text?)")
    cached = answer.cached
    if cached is not None and (isinstance(cached, bool) or not isinstance(cached, int) or cached < 0
                               or sent is not None and cached > sent):
        return f"{cached!r} prompt tokens served from its cache (of {sent} sent)"
    return None


def check_answer(answer: Answer, read: Any, *, vocab_size: int, top_k: int, sent: int) -> None:
    """Raise EndpointError (one line) when `answer` is not what a working engine answers to the request."""
    problem = answer_problem(answer, read, vocab_size=vocab_size, top_k=top_k, sent=sent)
    if problem is not None:
        raise EndpointError(f"the server answered {problem}: not a working engine's answer, so not scored as the "
                            "model's (the run stops here)")


def check_server(server: Any, where: str) -> ServerInfo:
    """`server` (what an Api's `identify` read) when its fields have their types: the model's name a non-empty
    string, the vocabulary and the context positive integers or unknown."""
    if not isinstance(server.model, str) or not server.model:
        raise EndpointError(f"{where}: names its model {server.model!r}, not a name")
    for field in ("vocab_size", "context"):
        value = getattr(server, field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EndpointError(f"{where}: reports {field} {value!r}, not a positive integer")
    return server
