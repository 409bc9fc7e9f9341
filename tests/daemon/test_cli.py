"""The nodeagent command line: help, flag validation, backend choice, metrics."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client_lib import Client
from tests.conftest import REPO, wait_for
from tests.rawpeer import RawPeer
from tests.conftest import free_port as _free_port
from tests.conftest import nodeagent



@pytest.mark.parametrize("args, fragments", [
    ([], ["serve", "status", "demo", "bench", "NODEAGENT_ENDPOINT"]),
    (["serve"], ["--backend", "--cpu-devices", "--endpoint", "--state-dir", "--metrics-port", "--quantum-ms",
                 "--grace-ms"]),
    (["status"], ["--json", "--endpoint"]),
    (["demo"], ["--seconds"]),
])
def test_help_explains_each_command(args, fragments):
    out = nodeagent(*args, "--help")
    assert out.returncode == 0
    for fragment in fragments:
        assert fragment in out.stdout


@pytest.mark.parametrize("flags, fragment", [
    (["--quantum-ms", "training=-5"], "--quantum-ms must be a positive number of ms, got training=-5"),
    (["--quantum-ms", "gaming=5"], "--quantum-ms has unknown workload class 'gaming'"),
    (["--cpu-devices", "0"], "--cpu-devices must be >= 1"),
    (["--grace-ms", "0"], "--grace-ms must be"),
    (["--endpoint", "udp://x"], "--endpoint must be ipc://PATH or tcp://HOST:PORT"),
])
def test_bad_settings_are_refused_at_start_naming_the_flag(flags, fragment, workdir):
    out = nodeagent("serve", "--backend", "cpu", "--config", "/dev/null", "--state-dir", workdir, *flags)
    assert out.returncode == 2, out.stderr
    assert f"nodeagent: error: {fragment}" in out.stderr


def test_explicit_cuda_backend_without_a_driver_fails_clearly(workdir):
    pytest.importorskip("pynvml")
    from nodeagent.nvml import Nvml, NvmlUnavailable
    try:
        Nvml().init()
        pytest.skip("NVML works here: this test is for machines without a GPU")
    except NvmlUnavailable:
        pass
    out = nodeagent("serve", "--backend", "cuda", "--endpoint", f"ipc://{workdir}/a.sock", "--state-dir", workdir)
    assert out.returncode == 1
    assert "NVML" in out.stderr and "--backend cpu" in out.stderr


def test_auto_backend_says_what_it_picked_and_why(start_daemon):
    d = start_daemon("--backend", "auto")
    assert "backend=cpu" in d.log() and "auto:" in d.log()



def test_metrics_endpoint_serves_parseable_prometheus_text(start_daemon):
    port = _free_port()
    d = start_daemon("--metrics-port", str(port))
    bad = RawPeer(d.endpoint)
    bad.send(b"\xc1")
    bad.recv()
    with Client("m", workload="inference", endpoint=d.endpoint) as client:
        with client.slice():
            pass
        # The release is quiet (no reply): scrape once the daemon has handled it.
        wait_for(lambda: d.status().devices[0].holder is None)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["nodeagent_bad_requests"].samples[0].value == 1
    sessions = families["nodeagent_sessions"].samples
    assert [(s.labels["workload"], s.labels["state"], s.value) for s in sessions if s.value] == [
        ("inference", "idle", 1)]
    waits = [s for s in families["nodeagent_token_wait_seconds"].samples if s.name.endswith("_count")]
    assert waits and waits[0].value == 1 and waits[0].labels == {"device": "0", "workload": "inference"}
    bad.close()


def test_metrics_cover_the_documented_names_and_count_slices_by_workload(start_daemon):
    port = _free_port()
    d = start_daemon("--metrics-port", str(port), "--quantum-ms", "training=20")
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape():
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    with Client("a", endpoint=d.endpoint) as a, Client("b", endpoint=d.endpoint) as b:
        a.acquire()
        t = threading.Thread(target=lambda: (b.acquire(timeout=5), b.release()))
        t.start()
        deadline = time.monotonic() + 5
        while not a.yield_point():  # a quantum ask, a handoff, and back
            assert time.monotonic() < deadline
        t.join()
        a.release()
        families = scrape()
        for name in ("nodeagent_token_wait_seconds", "nodeagent_token_handoff_seconds", "nodeagent_slice_seconds",
                     "nodeagent_yield_requests", "nodeagent_enforcements", "nodeagent_sessions",
                     "nodeagent_device_memory_bytes", "nodeagent_bad_requests"):
            assert name in families, name
        sliced = {s.labels["workload"] for s in families["nodeagent_slice_seconds"].samples
                  if s.name.endswith("_total") and s.value > 0}
        assert sliced == {"training"}
        yields = [s for s in families["nodeagent_yield_requests"].samples if s.name.endswith("_total") and s.value]
        assert yields and yields[0].labels == {"device": "0", "reason": "quantum"} and yields[0].value >= 1


def test_under_journald_log_lines_carry_syslog_priorities(workdir):
    import os
    import signal
    env = dict(os.environ, JOURNAL_STREAM="8:12345")
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--backend", "cpu", "--config", "/dev/null",
                             "--endpoint", f"ipc://{workdir}/j.sock", "--state-dir", workdir],
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    wait_for(lambda: _answers(f"ipc://{workdir}/j.sock"), timeout=15)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert "<6>nodeagent.server [serve] listening" in err


def test_serve_starts_no_warm_workers_unless_asked(workdir):
    """Warm workers hold contexts, pools and up to half of each device for server-side models;
    a daemon whose users never register one must not start them unasked (issue 24), root or not.
    The log says they are off and how to turn them on."""
    import os
    import signal
    endpoint = f"ipc://{workdir}/w.sock"
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--backend", "cpu", "--config", "/dev/null",
                             "--endpoint", endpoint, "--state-dir", workdir],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(lambda: _answers(endpoint), timeout=30)
        spawned = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if _parent(pid) == proc.pid]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not spawned, f"the daemon started {len(spawned)} processes unasked:\n{err}"
    assert "[ctxpool] off: ctxpool.enabled = off (the default; --ctxpool on starts them)" in err, err


def _answers(endpoint: str) -> bool:
    from client_lib import query_status
    try:
        query_status(endpoint, timeout=0.2)
        return True
    except Exception:
        return False


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def test_status_prints_no_control_characters_from_a_peers_name():
    """Defence in depth (the daemon refuses such names at hello): a name from an older
    journal or another daemon must not drive the terminal of whoever runs status."""
    from client_lib import protocol as p
    from nodeagent.cli import format_status
    row = p.SessionInfo(id="s-1", name="x\x1b]0;owned\x07\x1b[2J", pid=5, pid_verified=True, workload="training",
                        weight=1.0, state="holding", gpu_time_s=1.0, grants=1, memory_mb=0)
    status = p.StatusReply(id=1, protocol=(2, 1), daemon_pid=1, backend="cpu", uptime_s=3.0, devices=[
        p.DeviceInfo(index=0, backend="cpu", uuid="CPU-0", name="cpu:0", memory_total_bytes=1 << 30,
                     memory_used_bytes=None, utilization_percent=None, holder="s-1", queue=[], sessions=[row])])
    text = format_status(status)
    assert "\x1b" not in text and "\x07" not in text and "x?]0;owned??[2J" in text


def test_status_wait_tries_again_until_its_time_is_up_then_says_why(tmp_path, capsys):
    from nodeagent.cli import main
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    start = time.monotonic()
    assert main(["status", "--endpoint", endpoint, "--wait", "0.4"]) == 1
    assert time.monotonic() - start >= 0.4  # it kept trying, where without --wait it answers at once
    err = capsys.readouterr().err
    assert "nothing listens there" in err and "Traceback" not in err
    start = time.monotonic()
    assert main(["status", "--endpoint", endpoint]) == 1
    assert time.monotonic() - start < 0.4


def test_status_says_a_garbled_reply_in_one_line(tmp_path, capsys):
    """A peer at the endpoint that answers with bytes that are not MessagePack: one line, exit 1."""
    from nodeagent.cli import main
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "garbled.sock"))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(len(b"\xc1").to_bytes(4, "big") + b"\xc1")  # 0xc1: never valid MessagePack
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert main(["status", "--endpoint", f"ipc://{tmp_path}/garbled.sock"]) == 1
    finally:
        listener.close()
    err = capsys.readouterr().err
    assert err.startswith("nodeagent: error: bad status reply from ipc://") and err.count("\n") == 1, err


# --- the first hour: what a newcomer types, answered in one line -----------------------------

def test_version_names_the_package_and_the_protocol():
    from client_lib.protocol import PROTOCOL_VERSION
    out = nodeagent("--version")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(rf"nodeagent \S+ \(protocol {PROTOCOL_VERSION[0]}\.{PROTOCOL_VERSION[1]}\)\n", out.stdout)


@pytest.mark.parametrize("args, usage, meant", [
    (["serve", "--quantum", "training=100"], "nodeagent serve", "--quantum-ms"),
    (["serve", "--grace=50"], "nodeagent serve", "--grace-ms"),
    (["keys", "generate", "--forc"], "nodeagent keys generate", "--force"),
    (["status", "--jsn"], "nodeagent status", "--json"),
])
def test_an_unknown_flag_is_refused_by_its_command_naming_the_flag_meant(args, usage, meant):
    out = nodeagent(*args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"usage: {usage} "), out.stderr  # that command's usage, not the top level's
    assert f"{usage}: error: unrecognized arguments: " in out.stderr
    assert f"(did you mean {meant}?)" in out.stderr


def test_serve_help_shows_the_default_endpoint_and_state_dir():
    from client_lib.endpoint import daemon_endpoint
    from nodeagent.config import default_state_dir
    out = nodeagent("serve", "--help", env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0
    assert f"(default here: {daemon_endpoint()};" in out.stdout
    assert f"(default here: {default_state_dir()})" in out.stdout


def documented_benchmarks() -> set[str]:
    """Every benchmark the docs tell a user to run: `python -m bench.NAME` or `nodeagent bench NAME`."""
    docs = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(path.read_text() for path in docs)
    named = set(re.findall(r"python -m bench\.([a-z_]+)", text)) | set(re.findall(r"nodeagent bench ([a-z_]+)", text))
    return named - {"models"}  # `python -m bench.models cold` is bench.switch's cold-start child, not a benchmark


def test_bench_offers_every_benchmark_the_docs_name():
    from nodeagent.cli import BENCHMARKS
    documented = documented_benchmarks()
    assert {"colocate", "llm_wake", "handoff"} <= documented  # the scan finds them
    assert documented <= set(BENCHMARKS), f"documented but not offered by `nodeagent bench`: " \
                                           f"{sorted(documented - set(BENCHMARKS))}"
    for name in BENCHMARKS:  # each is a module that runs
        assert 'if __name__ == "__main__":' in (REPO / "bench" / f"{name}.py").read_text(), name
    out = nodeagent("bench", "--help", env={**os.environ, "COLUMNS": "400"})
    assert all(name in out.stdout for name in BENCHMARKS), out.stdout


def test_a_config_file_that_is_not_utf8_is_one_line_and_exit_2(workdir):
    path = os.path.join(workdir, "latin1.toml")
    with open(path, "wb") as f:
        f.write(b'log_level = "info"\n# caf\xe9\n')
    out = nodeagent("serve", "--backend", "cpu", "--config", path, "--state-dir", workdir)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"nodeagent: error: {path}: not UTF-8 text (line 2, byte 24: 0xe9); " \
                         "TOML files are UTF-8: save it as UTF-8\n"


def run_into_a_closed_pipe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``nodeagent ARGS`` with stdout a pipe whose reader has already gone (`| head -1` that
    has exited): every write it makes fails with EPIPE, every time, not in 7 of 10 tries."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "nodeagent", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=30, cwd=REPO, env=env)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["serve", "--help"], ["config-example"],
                                  ["status"], ["status", "--json"], ["top", "--once"]])
def test_a_reader_that_stops_reading_ends_a_command_quietly(args, daemon):
    env = {**os.environ, "NODEAGENT_ENDPOINT": daemon.endpoint}
    out = run_into_a_closed_pipe(*args, env=env)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.stderr == "", out.stderr
    # 141 as a shell reports a command SIGPIPE ended; argparse's --help and --version drop what
    # cannot be written and exit 0.
    assert out.returncode in (0, 141), out.stderr


def test_keys_generate_into_a_closed_pipe_still_writes_its_keys(tmp_path):
    out = run_into_a_closed_pipe("keys", "generate", "--dir", str(tmp_path / "keys"))
    assert "Traceback" not in out.stderr and out.returncode == 141, out.stderr
    assert (tmp_path / "keys" / "server.key_secret").exists()


def test_a_fresh_start_says_what_matters_in_a_few_lines(workdir):
    """A first start at the default level (issue 29: 17 lines, six of them a brand-new
    journal's migrations): what it serves, on which backend, where, and anything wrong."""
    import signal
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--backend", "cpu", "--config", "/dev/null",
                             "--state-dir", os.path.join(workdir, "state"), "--endpoint", f"ipc://{workdir}/a.sock"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        before = []
        for line in proc.stderr:
            if line.startswith("nodeagent: ready "):
                break
            before.append(line)
        else:
            pytest.fail("serve ended before it was ready:\n" + "".join(before))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert "journal=" in line and os.path.join(workdir, "state", "state.db") in line  # where its state is
    assert not any("migrated" in l for l in before), before
    assert len(before) <= 6, "".join(before)
    assert any("[journal] created" in l for l in before) and any("[serve] listening" in l for l in before)


def test_a_state_dir_it_cannot_use_ends_the_start_with_one_line_and_status_74(workdir):
    blocked = os.path.join(workdir, "a-file")
    open(blocked, "w").close()
    out = nodeagent("serve", "--backend", "cpu", "--config", "/dev/null", "--endpoint", f"ipc://{workdir}/a.sock",
                    "--state-dir", os.path.join(blocked, "state"))
    assert out.returncode == 74, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"nodeagent: error: state dir {blocked}/state cannot be used: Not a directory; free space or fix "
        "permissions there, or point --state-dir elsewhere")


def test_a_state_dir_another_daemon_holds_ends_the_start_with_status_1(workdir):
    from nodeagent.runtime import InstanceLock
    lock = InstanceLock(os.path.join(workdir, "nodeagent.lock"), "state dir")
    lock.acquire()
    try:
        out = nodeagent("serve", "--backend", "cpu", "--config", "/dev/null", "--endpoint", f"ipc://{workdir}/a.sock",
                        "--state-dir", workdir)
    finally:
        lock.release()
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"nodeagent: error: another nodeagent (pid {os.getpid()}) holds the state dir lock {workdir}/nodeagent.lock; "
        "stop it first, or give this one its own --endpoint and --state-dir")


def test_a_setting_the_daemon_refuses_as_it_starts_names_the_file(workdir):
    config = os.path.join(workdir, "nodeagent.toml")
    with open(config, "w") as f:
        f.write("[mps]\ndevices = [5]\n")
    out = nodeagent("serve", "--backend", "cpu", "--config", config, "--endpoint", f"ipc://{workdir}/a.sock",
                    "--state-dir", workdir)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"nodeagent: error: {config}: mps.devices names [5], but this node has devices 0..0")
    assert not os.path.exists(os.path.join(workdir, "a.sock"))
