"""`phasekv sweep`: the shift sweep of a flipping completion (docs/science.md section 3, "Shift sweep").

    phasekv sweep --checkpoint DIR --text "cat Alice dog" --a Alice --b Bob --out OUT
    phasekv sweep --hf PATH --filler " the" --text "T.Cast(FP" --a 8 --b 32 --max-filler 63 --out OUT

For every filler length n = 0..max_filler the prompt is

    prefix + n x filler + text            (every token real: no padding, see docs/architecture.md)

and the two candidate continuations a and b are scored after it by teacher forcing (the decision audit's
scoring, `phasekv.decisions.scoring.forward_logprobs`: `phasekv sweep` is `phasekv decide`'s special case of one
item, one continuation pair and a single growing filler, without a compression condition): P(a), P(b) are
the probabilities of their FIRST tokens at the prompt's last position, logp_a, logp_b the summed
log-probabilities of all their tokens (equal to log P(a), log P(b) for one-token candidates).  The
ranking of the two completions is the larger full log-probability; the signal whose period is
detected and plotted is diff = P(a) - P(b).  The paper: DeepSeek-V4-Flash-Base flips between `8` and
`32` completing `T.Cast(FP` with period 4 (its compression stride), 60 of 64 rankings.

Period rule (`detect_signal_period`): for each candidate period p = 1..min(max_period, N // 2) (N
signal values, so every class holds at least two), the signal is folded mod p, each class n mod p
is fit by its mean, and the residual sum of squares scores p with the Gaussian BIC

    BIC(p) = N log(RSS(p) / N) + p log N

(RSS floored at 1e-12 of the signal's sum of squares, so an exactly periodic or constant signal
has a finite score).  The period is the SMALLEST p whose BIC is within 6 of the minimum (6 is
"strong evidence" on the Kass-Raftery scale): a period-4 signal is also fit by p = 8, 12, ... but
they pay for their extra means, and a longer period must beat a shorter one clearly.  Why the
margin: with N = 65 and max_period 16, plain "smallest BIC wins" (margin 0) finds a period p > 1 in
7.3% of pure Gaussian noise signals, the margin in 0.4% (3000 draws); the price is power at low
signal-to-noise: a random period-4 shape with amplitude (SD over the period) equal to the noise SD
is found in 88% of draws (92.5% at margin 0), a +-1 square wave of period 4 in noise of SD 1 in
99.8% (99%), of SD 2 in 40% (74%).  A flipping completion with 60 of 64 consistent rankings is far
above that noise level.

Agreement with the periodic pattern: each class n mod p gets the majority ranking of its lengths
(an even split goes to the sign of the class's mean log-probability difference); a length agrees
when its ranking equals its class's.  With p = 1 this counts the overall majority.

Every length is its own forward pass (prompt lengths differ, and left padding would shift every
position); the inputs prompt + a[:-1] and prompt + b[:-1] share one pass when they have equal length
and one row when they are equal (one-token candidates).  Writes sweep.json and sweep.png.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.decisions.scoring import forward_logprobs
from phasekv.evaluate.sources import Source, open_checkpoint
from phasekv.figures.evaluation import plot_sweep
from phasekv.outputs import write_json

log = logging.getLogger(__name__)

BIC_MARGIN = 6.0  # a longer period must lower the BIC by more than this (module docstring)
PERIOD_CRITERION = ("smallest p with Gaussian BIC N log(RSS/N) + p log N within 6 of the minimum, "
                    "RSS of the signal folded mod p about its class means")


def detect_signal_period(signal: ArrayLike, max_period: int = 16) -> tuple[int, dict[int, float]]:
    """The period p of a real signal x[0..N-1] by the Gaussian BIC rule of the module docstring.

    Candidates p = 1..min(max_period, N // 2).  Returns the period and, per candidate, BIC(p) minus
    the smallest BIC (0 for the best fit, larger is worse; the period is the smallest p within
    BIC_MARGIN of 0).
    """
    x = np.asarray(signal, dtype=float)
    if x.ndim != 1 or len(x) < 2 or not np.all(np.isfinite(x)):
        raise ValueError(f"signal: needs a 1-D array of at least 2 finite values, got shape {x.shape}")
    if max_period < 1:
        raise ValueError(f"max_period: must be >= 1, got {max_period}")
    N = len(x)
    floor = 1e-12 * float(np.sum(x**2)) + 1e-300
    bic = {}
    for p in range(1, min(max_period, N // 2) + 1):
        rss = float(np.sum((x - _class_means(x, p)[np.arange(N) % p]) ** 2))
        bic[p] = N * np.log(max(rss, floor) / N) + p * np.log(N)
    best = min(bic.values())
    period = min(p for p, b in bic.items() if b <= best + BIC_MARGIN)
    return period, {p: float(b - best) for p, b in bic.items()}


def periodic_agreement(choices: Sequence[str], score: ArrayLike, period: int) -> tuple[list[str], int]:
    """(pattern, agreement): the majority ranking ("a"/"b") of each class n mod period, and how many
    lengths n rank as their class does.  An even split takes the sign of the class mean of `score`
    (logp_a - logp_b); a tie ("tie" choice) never agrees."""
    s = np.asarray(score, dtype=float)
    pattern = []
    for c in range(period):
        members = [choices[n] for n in range(c, len(choices), period)]
        n_a, n_b = members.count("a"), members.count("b")
        pattern.append("a" if n_a > n_b or (n_a == n_b and s[c::period].mean() >= 0) else "b")
    agreement = sum(choice == pattern[n % period] for n, choice in enumerate(choices))
    return pattern, agreement


def _check_sweep(adapter: Adapter, *, prefix_ids: list[int], filler_id: int, text_ids: list[int], a_ids: list[int],
                 b_ids: list[int], max_filler: int) -> None:
    prefix_ids, text_ids, a_ids, b_ids = (list(map(int, x)) for x in (prefix_ids, text_ids, a_ids, b_ids))
    for name, ids in (("text", text_ids), ("a", a_ids), ("b", b_ids)):
        if not ids:
            raise ValueError(f"{name}: encodes to no tokens")
    if a_ids == b_ids:
        raise ValueError(f"a and b: both encode to {a_ids}; give two different continuations")
    if isinstance(max_filler, bool) or not isinstance(max_filler, int) or max_filler < 1:
        raise ValueError(f"max_filler: must be an integer >= 1, got {max_filler!r}")
    V = adapter.info.vocab_size
    bad = [i for i in [*prefix_ids, filler_id, *text_ids, *a_ids, *b_ids] if not 0 <= i < V]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (size {V})")
    adapter.check_length(len(prefix_ids) + max_filler + len(text_ids) + max(len(a_ids), len(b_ids)) - 1)



def run_sweep(adapter: Adapter, decode: Callable[[Sequence[int]], str], *, prefix_ids: Sequence[int], filler_id: int,
              text_ids: Sequence[int], a_ids: Sequence[int], b_ids: Sequence[int], max_filler: int,
              out_dir: str | Path | None = None, progress: bool = True, max_period: int = 16) -> dict[str, Any]:
    """Score a against b after prefix + n fillers + text for n = 0..max_filler (module docstring).

    decode(ids) -> text labels the JSON and the figure.  Returns the sweep.json dict: settings,
    `detected_period`, `period_scores`, `pattern`, `agreement` of `n_rankings`, and `per_length`
    rows {filler, last_position, p_a, p_b, diff, logp_a, logp_b, choice}.  With `out_dir` writes
    sweep.json and sweep.png there.
    """
    prefix_ids, text_ids, a_ids, b_ids = (list(map(int, x)) for x in (prefix_ids, text_ids, a_ids, b_ids))
    _check_sweep(adapter, prefix_ids=prefix_ids, filler_id=filler_id, text_ids=text_ids, a_ids=a_ids, b_ids=b_ids,
                 max_filler=max_filler)
    rows = []
    for n in tqdm(range(max_filler + 1), desc="sweep", unit="length", disable=not progress, leave=False):
        prompt = prefix_ids + [filler_id] * n + text_ids
        lp_a, lp_b = forward_logprobs(adapter, prompt, [a_ids, b_ids])
        p_a, p_b = float(np.exp(lp_a[0])), float(np.exp(lp_b[0]))
        logp_a, logp_b = float(sum(lp_a)), float(sum(lp_b))
        choice = "a" if logp_a > logp_b else "b" if logp_b > logp_a else "tie"
        rows.append({"filler": n, "last_position": len(prompt) - 1, "p_a": p_a, "p_b": p_b, "diff": p_a - p_b,
                     "logp_a": logp_a, "logp_b": logp_b, "choice": choice})

    diff = np.array([r["diff"] for r in rows])
    period, scores = detect_signal_period(diff, max_period)
    choices = [r["choice"] for r in rows]
    pattern, agreement = periodic_agreement(choices, [r["logp_a"] - r["logp_b"] for r in rows], period)
    result = {
        "model": adapter.info.name,
        "model_stride": adapter.info.stride,
        "prefix": decode(prefix_ids), "filler": decode([filler_id]), "text": decode(text_ids),
        "a": decode(a_ids), "b": decode(b_ids),
        "prefix_ids": prefix_ids, "filler_id": int(filler_id), "text_ids": text_ids, "a_ids": a_ids, "b_ids": b_ids,
        "max_filler": max_filler,
        "max_period": max_period,
        "detected_period": period,
        "period_criterion": PERIOD_CRITERION,
        "period_scores": {str(p): s for p, s in scores.items()},
        "period_fit": _class_means(diff, period).tolist(),  # mean diff of each class n mod period
        "pattern": pattern,
        "agreement": agreement,
        "n_rankings": len(rows),
        "n_a": choices.count("a"),
        "n_flips": sum(x != y for x, y in zip(choices, choices[1:])),
        "per_length": rows,
    }
    log.info("sweep %s: period %d, %d of %d rankings agree", adapter.info.name, period, agreement, len(rows))
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "sweep.json", result, sort_keys=False)
        plot_sweep(result, out / "sweep.png")
        log.info("wrote %s", out)
    return result


def _class_means(x: np.ndarray, period: int) -> np.ndarray:
    """Mean of x[n] over each class n mod period, shape (period,)."""
    classes = np.arange(len(x)) % period
    return np.bincount(classes, weights=x, minlength=period) / np.bincount(classes, minlength=period)


# ----------------------------------------------------------------------------- from a model source


def sweep_source(source: Source, text: str, a: str, b: str, out: str | Path, *, filler: str | None = None,
                 prefix: str | None = None, max_filler: int = 64, max_period: int = 16, device: str = "auto",
                 dtype: str = "float32", progress: bool = True) -> dict[str, Any]:
    """`phasekv sweep` on a checkpoint (texts are words of its vocabulary) or an HF model (its tokenizer)."""
    if max_filler < 1 or max_period < 1:
        raise ValueError(f"--max-filler and --max-period: must be >= 1, got {max_filler}, {max_period}")
    if source.checkpoint:
        adapter, defaults = open_checkpoint(source.checkpoint, device)
        vocab = defaults["vocab"]
        encode, decode = vocab.encode, vocab.decode
        fillers = vocab.group("fillers")
        filler = filler if filler is not None else vocab.decode(fillers[:1])
        filler_ids = _encode(encode, "--filler", filler)
        if len(filler_ids) != 1 or filler_ids[0] not in fillers:
            raise ValueError(f"--filler: {filler!r} is not one word of the checkpoint's fillers group "
                             f"({vocab.decode(fillers[:6])} ...)")
        default_prefix = [vocab.bos]
    else:
        from phasekv.adapters.hf import load_hf

        adapter, tokenizer = load_hf(source.hf, device, dtype)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        decode = tokenizer.decode
        filler = filler if filler is not None else " the"
        filler_ids = encode(filler)
        if len(filler_ids) != 1:
            pieces = [tokenizer.decode([i]) for i in filler_ids]
            raise ValueError(f"--filler: {filler!r} is {len(filler_ids)} tokens of the tokenizer {pieces}; "
                             f"it must be exactly one token (try a common word with a leading space, e.g. ' the')")
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None and prefix is None:
            raise ValueError("--prefix: the tokenizer has neither a bos nor an eos token; give the prompt start")
        default_prefix = [bos]
    prefix_ids = _encode(encode, "--prefix", prefix) if prefix is not None else default_prefix
    text_ids, a_ids, b_ids = (_encode(encode, flag, value) for flag, value in
                              (("--text", text), ("--a", a), ("--b", b)))
    return run_sweep(adapter, decode, prefix_ids=prefix_ids, filler_id=filler_ids[0], text_ids=text_ids, a_ids=a_ids,
                     b_ids=b_ids, max_filler=max_filler, out_dir=out, progress=progress, max_period=max_period)


def _encode(encode: Callable[[str], list[int]], flag: str, text: str) -> list[int]:
    """Token ids of one flag's text; unknown words and empty encodings name the flag."""
    try:
        ids = list(encode(text))
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not ids:
        raise ValueError(f"{flag}: {text!r} encodes to no tokens")
    return ids
