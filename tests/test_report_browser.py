"""report.html in headless Chromium: no console message, no broken image, every section in place; and the same
for a long-context audit's report.html, whose depth x phase heatmap must decode.

The report is written from a small synthetic summary (oracle evaluations of models with strides 4, 6
and 8, so the heatmap has grey cells).  Chromium opens a copy with a probe script injected at the top
of <head>: it records console errors and error events, and after load writes into the DOM which
images decoded to nothing (naturalWidth 0) and which section ids exist; `--dump-dom` returns that DOM.
The page itself has no script, so any console line Chromium logs counts as a failure too.  The test
checks itself on a copy with one image's bytes corrupted, and leaves a screenshot at
runs/browser/report.png for CI.  Skipped where the Debian package `chromium` is absent (.ci/run
installs it).
"""

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from phasekv.adapters.base import Adapter, ModelInfo
from phasekv.evaluate.metrics import summarize
from phasekv.evaluate.verdict import task_verdict
from phasekv.report.html import SECTIONS, write_report
from tests.helpers import needs_real
from tests.test_metrics import phase_curve, shifted_records

CHROMIUM = shutil.which("chromium")
SCREENSHOT = Path(__file__).resolve().parents[1] / "runs" / "browser" / "report.png"
FLAGS = ["--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000"]
PROBE = """<script>
const seen = [];
const keep = (kind, text) => seen.push(kind + ": " + text);
const error = console.error.bind(console);
console.error = (...a) => { keep("console.error", a.join(" ")); error(...a); };
addEventListener("error", e => keep("error event", e.message || (e.target && e.target.tagName)), true);
addEventListener("load", () => {
  const result = {errors: seen,
    broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.alt),
    no_alt: [...document.images].filter(i => !(i.alt || "").trim()).length,
    images: document.images.length,
    alts: [...document.images].map(i => i.alt),
    sections: [...document.querySelectorAll("h2[id]")].map(h => h.id),
    first_image: document.images.length ? document.images[0].getBoundingClientRect().bottom + scrollY : null};
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(result);
  document.body.append(out);
});
</script>"""

needs_chromium = needs_real(CHROMIUM is not None, "chromium not installed (apt-get install -y chromium; .ci/run "
                                                   "installs it)")


def _model(stride: int, fail: tuple[int, ...], seed: int) -> dict:
    curve = phase_curve(stride, fail=fail)
    metrics = {}
    for protocol in ("prefix", "insequence"):
        m = summarize(shifted_records(curve, 20, seed=seed), stride=stride, n_boot=50, n_perm=50)
        metrics[protocol] = {**m, **task_verdict(m, chance=1 / 64, in_context_chance=0.04)}
    return {**metrics, "val_loss": 1.234}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    models = {"w4s4": _model(4, (2, 3), 0), "w8s6": _model(6, (0, 4, 5), 1), "w8s8": _model(8, (3,), 2)}
    findings = [{"claim": "w8s8: phase sensitive with period S = 8", "paper": "period S", "rule": "period = 8",
                 "measured": "period 8", "status": "holds", "holds": True},
                {"claim": "w8s6: phase gap >= 90 points", "paper": "90", "rule": "gap >= 90", "measured": "gap 80 pp",
                 "status": "fails", "holds": False},
                {"claim": "w4s4: worst phase below 20%", "paper": "5.7%", "rule": "interval below 20%",
                 "measured": "worst 19% [12, 26]", "status": "inconclusive", "holds": None,
                 "why": "inconclusive: interval spans the bar"},
                {"claim": "cycling on shared payloads", "measured": "no shared-payload model", "status": "not measured",
                 "holds": None}]
    summary = {"models": models, "findings": findings, "settings": {"quick": True}, "elapsed_s": 1.0}
    return write_report(summary, tmp_path_factory.mktemp("report"))


def probe(page: Path) -> dict:
    """Open a probed copy of `page` in Chromium; the probe's findings plus Chromium's console lines."""
    text = page.read_text()
    probed = page.with_name(f"probed_{page.name}")
    probed.write_text(text.replace("<head>", f"<head>{PROBE}", 1))
    run = subprocess.run([CHROMIUM, *FLAGS, "--window-size=1280,800", "--dump-dom", probed.as_uri()],
                         capture_output=True, text=True,
                         timeout=60)
    found = re.search(r'<pre id="probe">(.*?)</pre>', run.stdout, re.S)
    assert found, f"the probe did not report (chromium exit {run.returncode}): {run.stderr[-2000:]}"
    result = json.loads(html.unescape(found.group(1)))
    result["console"] = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    return result


@needs_chromium
def test_report_renders_cleanly_in_chromium(report):
    result = probe(report)
    assert result["errors"] == [] and result["console"] == [], result
    assert result["broken"] == [] and result["no_alt"] == 0, result
    assert result["images"] >= 3, result  # heatmap and one residue grid per protocol
    assert result["sections"][:2] == ["phase-heatmap", "findings"], "the headline figure first, then the findings"
    assert result["first_image"] <= 800, "the headline figure fits the first screen (1280 x 800)"
    assert set(SECTIONS) <= set(result["sections"]), f"missing sections: {set(SECTIONS) - set(result['sections'])}"
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    subprocess.run([CHROMIUM, *FLAGS, "--window-size=1280,800", f"--screenshot={SCREENSHOT}", report.as_uri()],
                   capture_output=True, timeout=60, check=True)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_chromium
def test_the_headline_figure_of_as_many_models_as_make_demo_fits_the_first_screen(tmp_path):
    """make demo reports 22 models: their heatmap is taller than a screen at its natural size, so the page scales
    it down to end above 800 px (at 3 models it is left as drawn)."""
    strides = [4, 6, 8, 12]  # divisors of the residue modulus 24
    models = {f"m{i:02d}": _model(strides[i % 4], (i % strides[i % 4],), i) for i in range(22)}
    page = write_report({"models": models, "findings": [], "settings": {"quick": True}, "elapsed_s": 1.0}, tmp_path)
    result = probe(page)
    assert result["broken"] == [] and result["sections"][0] == "phase-heatmap", result
    assert 600 < result["first_image"] <= 800, "the headline figure fits the first screen (1280 x 800)"


@needs_chromium
def test_an_audits_report_opens_on_the_conditions_curves(tmp_path):
    """`phasekv audit`'s report.html: the conditions' per-phase curves end on the first screen (the settings note and
    the layers table come after them; before, the curves of a model that cannot do the task ended at 927 px)."""
    import phasekv
    from tests.helpers import bpe_tokenizer, tiny_causal_lm

    tokenizer = bpe_tokenizer()
    model = tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa")
    phasekv.audit(model, tokenizer, records=24, demos=2, prompts_per_phase=1, out=tmp_path / "audit")
    page = tmp_path / "audit" / "report.html"
    result = probe(page)
    assert result["errors"] == [] and result["broken"] == [] and result["images"] == 2, result
    assert result["first_image"] <= 800, "the per-phase curves fit the first screen (1280 x 800)"
    text = page.read_text()
    assert text.index("<img ") < text.index("<table>") < text.index("format chance = 1 / possible answer tokens")


@needs_chromium
def test_probe_catches_a_corrupted_image(report):
    text = report.read_text()
    first_alt = html.unescape(re.search(r'<img alt="(.*?)"', text).group(1))
    start = text.index("base64,") + len("base64,")
    broken = report.with_name("broken.html")
    broken.write_text(text[:start] + "A" * 64 + text[start + 64:])  # the first PNG's signature and header zeroed
    result = probe(broken)
    assert result["broken"] == [first_alt], result


def test_report_reads_top_down(report):
    """The headline figure, then the findings, one summary line per model, not-measured findings kept, alt text on
    every image."""
    page = report.read_text()
    order = [page.index(mark) for mark in ("id='phase-heatmap'", "id='findings'", "<p class='note'>", "id='models'",
                                           "id='prefix'", "id='insequence'")]
    assert order == sorted(order)
    assert page.count("<li><b>") == 3 and "not measured" in page and "1 hold, 1 fail, 1 inconclusive of 3" in page
    assert page.count("<img ") == page.count('<img alt="') == 3
    w8s8 = re.search(r"<li><b>w8s8</b>: (.*?)</li>", page).group(1)
    assert w8s8.startswith("mean ") and "in-context chance 4.0%" in w8s8 and "period 8" in w8s8
    assert "phase sensitive" in w8s8


# ---------------------------------------------------------------------------------------------- a long-context audit


class NeedleReader(Adapter):
    """Answers a long-context prompt by finding its query's key code earlier in the prompt and copying the token after
    it, except where the target key starts at phase 3 (mod 4) in the first half of the prompt: a depth x phase map
    with a failing cell at one depth only."""

    def __init__(self, vocab: int, query: int):
        self.info = ModelInfo(name="needle-reader", vocab_size=vocab, num_layers=0, num_heads=0, num_kv_heads=0,
                              head_dim=0, max_length=1 << 20, stride=None, local_window=None)
        self.query = query

    module, device = None, torch.device("cpu")

    def read(self, prompt: list[int]) -> int:
        code = prompt[-self.query:]
        start = next(i for i in range(len(prompt) - self.query - 1, -1, -1) if prompt[i:i + self.query] == code)
        wrong = start % 4 == 3 and start < len(prompt) // 2
        return (prompt[start + self.query] + 1) % self.info.vocab_size if wrong else prompt[start + self.query]

    def logits(self, ids):
        out = torch.zeros(ids.shape[0], ids.shape[1], self.info.vocab_size)  # (B, T, V)
        for b, row in enumerate(ids.tolist()):
            out[b, -1, self.read(row)] = 1.0
        return out

    def prefill(self, ids):  # the "cache" is the context's ids (no `answer` method: an adapter with one is served)
        return ids

    def continue_from(self, cache, ids, repeats):
        return self.logits(torch.cat([cache.repeat_interleave(repeats, 0), ids], dim=1))


@pytest.fixture(scope="module")
def long_report(tmp_path_factory) -> Path:
    """A long-context audit's report.html (`auditing.pipeline`, two target depths, stride 4) of `NeedleReader`."""
    import transformers

    from phasekv.auditing.pipeline import run_audit
    from phasekv.config import AuditPlan, audit_config
    from phasekv.data.keyspace import train_bpe
    from phasekv.data.longcontext import LongContextSpec

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=train_bpe("byte-level"), bos_token="<s>",
                                                     eos_token="<s>")
    spec = LongContextSpec(family="needle", context=1024, stride=4, depths=(0.25, 0.75), per_group=16,
                           local_window=8)
    out = tmp_path_factory.mktemp("long") / "audit"
    summary = run_audit(NeedleReader(len(tokenizer), spec.key_tokens + 1), tokenizer,
                        audit_config(stride=4, local_window=8), out,
                        plan=AuditPlan(("none",), protocols=("prefix",), prompts_per_phase=16), progress=False,
                        long_context=spec)
    by_depth = summary["conditions"]["none"]["prefix"]["by_depth"]
    assert by_depth["0.75"]["mean_accuracy"] == 1.0 and by_depth["0.25"]["per_phase"][3]["accuracy"] == 0.0
    return out / "report.html"


@needs_chromium
def test_a_long_context_report_renders_its_depth_phase_heatmap_in_chromium(long_report):
    result = probe(long_report)
    assert result["errors"] == [] and result["console"] == [], result
    assert result["broken"] == [] and result["no_alt"] == 0, result
    assert result["images"] == 2, result  # the per-phase curves and the depth x phase heatmap
    assert result["alts"][1].startswith("Top-1 accuracy by target depth"), result
    assert (long_report.parent / "figures" / "depth_phase_prefix.png").is_file()


@needs_chromium
def test_the_probe_catches_a_broken_depth_phase_heatmap(long_report):
    """The heatmap's PNG bytes corrupted: the probe names it (so the test above can fail)."""
    text = long_report.read_text()
    at = text.index('<img alt="Top-1 accuracy by target depth')
    start = text.index("base64,", at) + len("base64,")
    broken = long_report.with_name("broken.html")
    broken.write_text(text[:start] + "A" * 64 + text[start + 64:])
    result = probe(broken)
    assert [alt[:30] for alt in result["broken"]] == ["Top-1 accuracy by target depth"], result
