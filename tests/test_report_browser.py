"""report.html in headless Chromium: no console message, no broken image, every section in place.

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
