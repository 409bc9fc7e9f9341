"""The README's walkthrough ("From zero: a trainer and an inference service on one
GPU") run as written: a newcomer's first commands must work after set-up.

The block is read from README.md, so a walkthrough edited into something that does
not run fails here. What the test adds: `serve` gets a private state directory and
the cpu backend (it must not touch /var/lib or a GPU), its log file and metrics port
are private (a free port for 9400), the service runs 3 s, the service starts once the
trainer has joined (as for a reader typing line by line), and NODEAGENT_ENDPOINT
points at a private socket. What it checks besides: the metrics line answers, and
none of the daemon's log lands among the examples' output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent.parent
HEADING = "### From zero: a trainer and an inference service on one GPU"


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    assert HEADING in text, "README.md lost its walkthrough"
    block = re.search(r"```sh\n(.*?)```", text[text.index(HEADING):], re.S)
    assert block, "the walkthrough has no ```sh block"
    return block.group(1)


@pytest.mark.timeout(300)  # three processes import torch on two cores: 2.5 min seen on a loaded VM
def test_the_readme_walkthrough_runs_as_written(tmp_path):
    script = walkthrough()
    assert "nodeagent serve" in script and "examples/inference_service.py" in script
    # Shorter than a reader's run: the service's --seconds is what makes the block take time.
    script = re.sub(r"inference_service\.py --seconds \d+", "inference_service.py --seconds 3", script)
    # serve gets a private state directory and the cpu backend (later flags win); the trainer is
    # given time to join before the service starts, as a reader typing the lines one by one does.
    # serve's flags go before its redirection: `serve ... 2> nodeagent.log &`
    script = re.sub(r"^(nodeagent serve [^&#>]*?)(\s*2> ?nodeagent\.log)?\s*&",
                    rf"\1 --backend cpu --state-dir {tmp_path}/state 2> {tmp_path}/nodeagent.log &", script,
                    flags=re.M)
    assert "127.0.0.1:9400/metrics" in script and "--metrics-port 9400" in script, script
    script = script.replace("9400", str(free_port()))
    script = re.sub(r"^(python examples/train_loop\.py[^\n]*)$",
                    r"\1\nuntil nodeagent status | grep examples/train_loop >/dev/null; do sleep 0.2; done", script, flags=re.M)
    assert "--state-dir" in script and "until nodeagent status" in script, script
    env = dict(os.environ)
    env["NODEAGENT_ENDPOINT"] = f"ipc://{tmp_path}/agent.sock"
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, whatever the venv's editable install points at
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # where .venv/ is elsewhere (a second clone)
    # Its own session, so that a failure or a timeout cannot leave its daemon or trainer running.
    proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=280)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    out = stdout + stderr
    log = (tmp_path / "nodeagent.log").read_text() if (tmp_path / "nodeagent.log").exists() else ""
    assert proc.returncode == 0, out[-3000:] + "\n--- nodeagent.log ---\n" + log[-2000:]
    # The daemon's log is in its file, at its default level, and none of it among the examples' lines.
    assert "nodeagent: ready endpoint=" in log and "[session] open" in log, log[-3000:]
    daemon_line = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING|ERROR) |^nodeagent: ready", re.M)
    assert not daemon_line.search(out), out[-3000:]
    # The metrics line: the service's waits were counted.
    assert re.search(r'^nodeagent_token_wait_seconds_count\{device="0",workload="inference"\} [1-9]', out, re.M), \
        out[-3000:]
    assert re.search(r"^done: [1-9]\d* requests +latency p50", out, re.M), out[-3000:]
    assert re.search(r"session \S+ on device 0", out), out[-3000:]  # the trainer joined
    # The last status: the trainer still on the device, with GPU time, after the service's run.
    last_status = out[out.rindex("nodeagent pid"):]
    assert re.search(r"examples/train_loop +training .* [1-9]\d*\s+\d+$", last_status, re.M), last_status


# ------------------------------------------------------------- a first line at once

def first_line(argv: list[str], env: dict, timeout_s: float = 60.0) -> str:
    """The first line ``argv`` prints (stdout and stderr in one pipe); then it is killed with
    everything it started (its own session: the demo's daemon too)."""
    import selectors
    import signal
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout_s), f"{argv}: nothing printed in {timeout_s:g} s"
        return proc.stdout.readline().decode()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("script", ["examples/train_loop.py", "examples/inference_service.py"])
def test_an_example_says_it_is_starting_before_torch_loads(script, tmp_path):
    """torch's first import takes seconds (5-7 s before the examples' first line, issue 29):
    the first line comes before it. Here torch is a package whose import never ends."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("import select\nselect.select([], [], [])  # an import that never ends\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}", NODEAGENT_ENDPOINT=f"ipc://{tmp_path}/none.sock")
    line = first_line([sys.executable, script], env)
    assert re.fullmatch(r"(train_loop|inference_service): loading torch \.\.\.\n", line), line


def test_the_demo_says_what_it_does_before_its_daemon_is_up(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))  # the demo's socket dir: removed with tmp_path
    env.pop("NODEAGENT_ENDPOINT", None)
    line = first_line([sys.executable, "-m", "nodeagent", "demo", "--seconds", "1"], env)
    # before the daemon it starts prints "nodeagent: ready" on the same pipe
    assert line.startswith("nodeagent demo: an inference and a training client sharing device 0"), line


def test_a_demo_whose_clients_never_connect_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """The clients' first torch import after a set-up can take minutes on a busy VM; past the
    demo's wait it says so in one line, ends its clients, and leaves no daemon (it once raised
    BrokenBarrierError with three tracebacks). Here torch is a package whose import never ends."""
    from nodeagent import demo
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("import select\nselect.select([], [], [])  # an import that never ends\n")
    # The clients are spawned, and a spawned child takes the parent's sys.path, not PYTHONPATH's:
    # without this they import the real torch, and the test passes only where that takes over 3 s.
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    monkeypatch.delenv("NODEAGENT_ENDPOINT", raising=False)
    monkeypatch.setattr(demo, "CONNECT_S", 3.0)
    started = time.monotonic()
    assert demo.run_demo(1.0) == 1
    err = capsys.readouterr().err
    assert "nodeagent demo: the two clients did not connect within 3 s" in err and "Traceback" not in err, err
    assert time.monotonic() - started < 60
