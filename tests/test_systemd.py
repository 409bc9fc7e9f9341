"""The systemd unit: its settings, `systemd-analyze verify`, and the daemon's
readiness protocol (READY=1 once the socket answers, STOPPING=1 on SIGTERM)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from client_lib import DaemonUnavailableError, query_status
from client_lib.endpoint import SYSTEM_SOCKET
from nodeagent import runtime
from nodeagent.cli import build_parser
from tests.conftest import REPO

UNIT = REPO / "systemd" / "nodeagent.service"
SYSUSERS = REPO / "systemd" / "nodeagent.sysusers"
DEFAULTS = REPO / "systemd" / "nodeagent.default"


# ------------------------------------------------------------------ the unit file

def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}``; systemd allows a key more than once."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if not sep or current is None:
            raise ValueError(f"not a unit file line: {raw!r}")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= is not set"
    return values[-1]  # the last assignment wins


@pytest.mark.parametrize("key, value", [
    ("Type", "notify"),
    ("NotifyAccess", "main"),
    ("Restart", "on-failure"),
    ("RuntimeDirectory", "nodeagent"),
    ("StateDirectory", "nodeagent"),
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("PrivateTmp", "yes"),
    ("KillMode", "mixed"),
    ("KillSignal", "SIGTERM"),
])
def test_unit_sets(unit, key, value):
    assert one(unit, "Service", key) == value


def test_unit_execs_nodeagent_serve_with_operator_args(unit):
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    assert os.path.basename(argv[0]) == "nodeagent" and os.path.isabs(argv[0])
    assert argv[1] == "serve"
    assert "$NODEAGENT_ARGS" in argv[2:]
    assert "-/etc/default/nodeagent" in unit["Service"]["EnvironmentFile"]


def test_runtime_and_state_directories_are_where_the_daemon_looks(unit):
    assert os.path.dirname(SYSTEM_SOCKET) == "/run/" + one(unit, "Service", "RuntimeDirectory")
    assert "/var/lib/" + one(unit, "Service", "StateDirectory") == "/var/lib/nodeagent"


def test_sandbox_keeps_gpu_devices_and_other_processes_visible(unit):
    service = unit["Service"]
    assert one(unit, "Service", "ProtectHome") in ("yes", "read-only", "tmpfs")
    # /dev/nvidia* must stay reachable: no private /dev, no device allow-list
    # (ProtectClock=yes implies DeviceAllow=char-rtc, which makes one).
    assert service.get("PrivateDevices", ["no"])[-1] != "yes"
    assert service.get("ProtectClock", ["no"])[-1] != "yes"
    assert "DeviceAllow" not in service
    assert service.get("DevicePolicy", ["auto"])[-1] == "auto"
    # Other users' /proc/PID must stay visible (peer verification, pidfds).
    assert service.get("ProtectProc", ["default"])[-1] == "default"
    assert "ProcSubset" not in service
    assert service.get("MemoryDenyWriteExecute", ["no"])[-1] != "yes"  # ctypes closures, CUDA/torch JIT


def test_daemon_stays_root_and_keeps_the_capabilities_it_uses(unit):
    assert unit["Service"].get("User", ["root"])[-1] == "root"
    assert "Group" not in unit["Service"]  # the socket's group is set by the daemon, not the process's
    caps = set(one(unit, "Service", "CapabilityBoundingSet").split())
    assert {"CAP_KILL", "CAP_CHOWN"} <= caps  # signal clients; chown the socket to group nodeagent
    # Weights files are opened by a child that has become the registering user (ctxpool/peer_open.py).
    assert {"CAP_SETUID", "CAP_SETGID"} <= caps
    assert int(one(unit, "Service", "LimitNOFILE")) >= 65536


def test_the_unit_has_a_memory_ceiling(unit):
    assert one(unit, "Service", "MemoryMax").endswith("%") or one(unit, "Service", "MemoryMax")[-1] in "KMGT"
    assert "MemoryHigh" in unit["Service"]


def test_exit_statuses_a_restart_cannot_fix_are_not_restarted(unit):
    from nodeagent.cli import EXIT_STATE_UNUSABLE
    prevent = one(unit, "Service", "RestartPreventExitStatus").split()
    assert "2" in prevent  # a bad setting
    assert str(EXIT_STATE_UNUSABLE) in prevent  # a state dir or journal it cannot use (disk full, read-only)


def test_sysusers_declares_the_socket_group():
    entries = [line.split() for line in SYSUSERS.read_text().splitlines()
               if line.strip() and not line.lstrip().startswith("#")]
    assert ["g", runtime.SOCKET_GROUP, "-"] in [e[:3] for e in entries]


def test_default_file_examples_are_valid_serve_flags():
    examples = [line.lstrip("#").strip() for line in DEFAULTS.read_text().splitlines()
                if line.lstrip("#").strip().startswith("NODEAGENT_ARGS=")]
    assert examples
    for example in examples:
        value = example.partition("=")[2].strip('"')  # EnvironmentFile= drops the quotes
        build_parser().parse_args(["serve", *value.split()])  # $NODEAGENT_ARGS splits at whitespace;
        # argparse exits 2 on an unknown or bad flag


# ------------------------------------------------------------------ systemd's own checks

def _analyze_verify(path: Path) -> tuple[int, list[str]]:
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                         capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and unparsable values and only prints them.
    lines = [line for line in (out.stdout + out.stderr).splitlines() if path.name in line]
    return out.returncode, lines


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu: package systemd)")
    # verify fails when ExecStart's binary is missing: point it at this checkout's script.
    script = Path(sys.executable).parent / "nodeagent"
    if not os.access(script, os.X_OK):
        pytest.skip(f"no nodeagent console script next to {sys.executable} (pip install -e .)")
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/nodeagent " in text
    text = text.replace("ExecStart=/usr/local/bin/nodeagent ", f"ExecStart={script} ")

    # A copy with a deliberate mistake shows that this systemd reports one here.
    broken = tmp_path / "broken" / "nodeagent.service"
    broken.parent.mkdir()
    broken.write_text(text.replace("[Service]\n", "[Service]\nNoSuchSetting=1\n", 1))
    _, complaints = _analyze_verify(broken)
    if not any("NoSuchSetting" in line for line in complaints):
        pytest.skip(f"systemd-analyze verify does not report unit errors here: {complaints}")

    good = tmp_path / "good" / "nodeagent.service"
    good.parent.mkdir()
    good.write_text(text)
    code, complaints = _analyze_verify(good)
    assert code == 0 and not complaints, "\n".join(complaints)


def test_systemd_sysusers_accepts_the_sysusers_file(tmp_path):
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers is not installed (Debian/Ubuntu: package systemd)")
    (tmp_path / "etc").mkdir()
    out = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "--dry-run", str(SYSUSERS)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"group '{runtime.SOCKET_GROUP}'" in out.stdout + out.stderr


# ------------------------------------------------------------------ sd_notify readiness

class NotifyListener:
    """What systemd does for Type=notify: a datagram socket named by $NOTIFY_SOCKET."""

    def __init__(self, address: str) -> None:
        self.env_value = address  # "@name" is the abstract namespace, as systemd may use
        bind_to = "\0" + address[1:] if address.startswith("@") else address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)

    def next_message(self, timeout: float) -> dict[str, str]:
        """The next datagram as ``{VAR: value}``; raises TimeoutError if none comes."""
        self.sock.settimeout(timeout)
        data = self.sock.recv(4096)
        return dict(line.partition("=")[::2] for line in data.decode().splitlines() if line)

    def pending(self) -> list[dict[str, str]]:
        messages = []
        while True:
            try:
                messages.append(self.next_message(0.05))
            except TimeoutError:
                return messages

    def close(self) -> None:
        self.sock.close()


def serve(workdir: str, notify_socket: str, endpoint: str | None = None) -> tuple[subprocess.Popen, str]:
    endpoint = endpoint or f"ipc://{workdir}/a.sock"
    config = os.path.join(workdir, "nodeagent.toml")
    if not os.path.exists(config):
        open(config, "w").close()  # hermetic: never the host's /etc/nodeagent/nodeagent.toml
    env = {k: v for k, v in os.environ.items() if k != "NODEAGENT_ENDPOINT"}
    env["NOTIFY_SOCKET"] = notify_socket
    log = open(os.path.join(workdir, "daemon.log"), "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend", "cpu",
         "--endpoint", endpoint, "--state-dir", os.path.join(workdir, "s")],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    log.close()
    return proc, endpoint


def daemon_log(workdir: str) -> str:
    return Path(workdir, "daemon.log").read_text(errors="replace")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_once_the_socket_answers_and_stopping_on_sigterm(workdir, abstract):
    address = f"@na-notify-{uuid.uuid4().hex[:12]}" if abstract else os.path.join(workdir, "n.sock")
    listener = NotifyListener(address)
    proc, endpoint = serve(workdir, listener.env_value)
    try:
        try:
            message = listener.next_message(timeout=20)
        except TimeoutError:
            pytest.fail(f"no sd_notify message within 20 s:\n{daemon_log(workdir)}")
        assert message.get("READY") == "1", message
        # At READY the socket is bound and secured, not merely about to be:
        # a plain connect() succeeds only on a listening socket.
        path = endpoint[len("ipc://"):]
        assert stat.S_IMODE(os.stat(path).st_mode) == runtime.SOCKET_MODE
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)
        assert query_status(endpoint, timeout=1).daemon_pid == proc.pid

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, daemon_log(workdir)
        later = listener.pending()
        assert [m for m in later if m.get("STOPPING") == "1"], later
        assert not [m for m in later if "READY" in m], later  # READY exactly once
    finally:
        stop(proc)
        listener.close()


def test_a_daemon_that_cannot_bind_never_reports_ready(workdir, start_daemon):
    first = start_daemon()  # holds the endpoint's lock
    listener = NotifyListener(os.path.join(workdir, "n2.sock"))
    second_dir = os.path.join(workdir, "second")
    os.mkdir(second_dir)
    proc, _ = serve(second_dir, listener.env_value, endpoint=first.endpoint)
    try:
        assert proc.wait(timeout=20) == 1, daemon_log(second_dir)
        assert "another nodeagent" in daemon_log(second_dir)
        assert listener.pending() == []
    finally:
        stop(proc)
        listener.close()


def test_an_unreachable_notify_socket_does_not_stop_the_daemon(workdir):
    proc, endpoint = serve(workdir, os.path.join(workdir, "nobody-listens.sock"))
    try:
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                query_status(endpoint, timeout=0.1)
                break
            except DaemonUnavailableError:
                continue
        time.sleep(0.5)  # READY=1 is sent just after the socket starts answering
        assert proc.poll() is None, f"daemon exited {proc.returncode}:\n{daemon_log(workdir)}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, daemon_log(workdir)
    finally:
        stop(proc)
