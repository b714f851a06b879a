"""Engines that misbehave, bounded (phasekv.engines.process, wire, vllm; the grid's and the conditions' numbers):
an endless /health or /metrics body ends in bounded memory and time, a launched server that ignores SIGTERM does
not outlive a SIGKILLed phasekv, a grid whose every point failed is no passing run, and integers past their range
(20 digits, full-width digits, a 1e300 s timeout) are one-line refusals, never tracebacks."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from phasekv.engines.process import EngineDied, free_port, launched
from phasekv.engines.wire import Connection, EndpointError

ENDLESS = textwrap.dedent('''
    import os, signal, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server that ignores TERM
    open(sys.argv[2], "w").write(str(os.getpid()))
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
            try:
                while True:
                    self.wfile.write(b"x" * 65536)
            except OSError:
                pass
        def log_message(self, *a): pass
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def _endless(tmp_path):
    script = tmp_path / "endless.py"
    script.write_text(ENDLESS)
    port = free_port()
    return [sys.executable, str(script), str(port), str(tmp_path / "pid")], f"http://127.0.0.1:{port}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_an_endless_health_body_is_never_healthy_and_the_server_is_stopped_though_it_ignores_term(tmp_path,
                                                                                                  monkeypatch):
    from phasekv.engines import process

    monkeypatch.setattr(process, "STOP_GRACE_S", 1.0)
    command, url = _endless(tmp_path)
    start = time.monotonic()
    with pytest.raises(EngineDied, match="not healthy after 4 s"), launched(command, url, name="endless",
                                                                            startup_s=4):
        pass
    assert time.monotonic() - start < 30
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_an_endless_metrics_body_is_read_within_the_connections_bounds(tmp_path):
    from phasekv.engines.vllm import vllm_cache_config

    command, url = _endless(tmp_path)
    server = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        conn = Connection(url, timeout=5, max_bytes=1 << 20)
        start = time.monotonic()
        assert vllm_cache_config(conn) is None
        with pytest.raises(EndpointError, match="answered more than 1 MiB"):
            conn.request("GET", "/health")
        assert time.monotonic() - start < 20
    finally:
        server.kill()
        server.wait()


def test_a_sigkilled_phasekv_leaves_no_launched_server_behind_even_one_that_ignores_term(tmp_path):
    command, url = _endless(tmp_path)
    runner = tmp_path / "runner.py"
    runner.write_text(textwrap.dedent(f'''
        import time
        from phasekv.engines.process import launched
        try:
            with launched({command!r}, {url!r}, name="endless", startup_s=600):
                pass
        finally:
            time.sleep(600)
    '''))
    parent = subprocess.Popen([sys.executable, str(runner)])
    deadline = time.monotonic() + 30
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((tmp_path / "pid").read_text())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 8
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


@pytest.mark.parametrize("condition", [
    "kpool:pool=4,top=99999999999999999999", "kpool:pool=4,budget=0.5,sink=１２", "kpool:pool=4,budget=0.5,seed=-1",
    "slices:kind=contiguous,size=99999999999999999999", "jitter:select:3+keep-first:99999999999999999999",
    "select:3+keep-first:１", "select:９",
])
def test_huge_or_non_ascii_integers_in_a_condition_are_one_line_refusals(condition):
    from phasekv.conditions.grammar import Geometry, check_conditions

    with pytest.raises(ValueError) as err:
        check_conditions((condition,), Geometry(8, 8, 16))
    assert "\n" not in str(err.value) and type(err.value) is ValueError


@pytest.mark.parametrize("value", ["１６", "99999999999999999999", "-1", "1e3"])
def test_grid_values_past_their_range_are_one_line_refusals(value):
    from phasekv.engines.base import parse_grid
    from phasekv.engines.registry import launcher

    with pytest.raises(ValueError, match="must be an integer >= 1"):
        parse_grid(launcher("llama-server"), [f"ubatch={value}"])


@pytest.mark.parametrize("timeout", [1e300, float("inf"), 0, -1])
def test_a_timeout_past_a_week_or_not_positive_is_refused(timeout):
    from phasekv.engines.wire import check_timeout

    with pytest.raises(EndpointError, match="--timeout: must be a finite number of seconds"):
        check_timeout(timeout)
    check_timeout(600.0)


def test_a_grid_whose_every_point_failed_exits_non_zero(tmp_path, capsys):
    from phasekv.cli import main
    from tests.helpers import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    dead = tmp_path / "llama-server"
    dead.write_text("#!/bin/sh\nexit 3\n")
    dead.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_text("{}")
    code = main(["audit", "--launch", "llama-server", "--engine-bin", str(dead), "--engine-model", str(model),
                 "--tokenizer", str(tmp_path / "tok"), "--records", "16", "--demos", "2", "--stride", "4",
                 "--local-window", "8", "--prompts-per-phase", "2", "--protocol", "prefix", "--no-progress",
                 "--engine-grid", "ubatch=8,16", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "every grid point failed" in err[0] and "exited with status 3" in err[0]
