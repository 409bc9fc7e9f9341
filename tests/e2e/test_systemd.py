"""The systemd unit: its settings, `systemd-analyze verify`, and the daemon's
readiness protocol (READY=1 once the socket answers, STOPPING=1 on SIGTERM)."""

from __future__ import annotations

import ctypes.util
import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from client_lib import Client, DaemonUnavailableError, query_status, resume_session, suspend_session
from client_lib.endpoint import SYSTEM_SOCKET
from nodeagent import runtime
from nodeagent.cli import build_parser
from nodeagent.mps import MpsControl, MpsStartError
from tests.conftest import REPO, wait_for
from tests.systemd_unit import UNIT, parse_unit

SYSUSERS = REPO / "systemd" / "nodeagent.sysusers"
DEFAULTS = REPO / "systemd" / "nodeagent.default"


# ------------------------------------------------------------------ the unit file


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
    ("SystemCallFilter", "@system-service"),
    ("SystemCallErrorNumber", "EPERM"),  # a call left out fails like a missing privilege, never SIGSYS
    ("ProtectHostname", "yes"),
    ("PrivateMounts", "yes"),
    ("UMask", "0077"),
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
    # A device allow-list (DeviceAllow=, or ProtectClock=yes, which implies one) must take
    # every character device: nvidia-uvm's major is dynamic and may appear after the start.
    if "DeviceAllow" in service or service.get("ProtectClock", ["no"])[-1] == "yes":
        assert "char-* rw" in service.get("DeviceAllow", [])
    assert service.get("DevicePolicy", ["auto"])[-1] in ("auto", "closed")
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
    # A non-root client's input segments are 0600 and its own: the daemon maps them.
    assert "CAP_DAC_OVERRIDE" in caps
    assert not caps & {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_MODULE", "CAP_NET_ADMIN", "CAP_SYS_TIME"}
    assert int(one(unit, "Service", "LimitNOFILE")) >= 65536


def test_address_families_are_the_ones_the_daemon_uses(unit):
    # AF_NETLINK: ZeroMQ's tcp bind resolves addresses with getifaddrs() and aborts without it.
    families = set(one(unit, "Service", "RestrictAddressFamilies").split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}


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


SECURITY_CEILING = 3.0  # `systemd-analyze security` exposure; 5.1 before issue 14


def test_systemd_analyze_security_scores_the_unit_at_most_3(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu: package systemd)")
    copy = tmp_path / "nodeagent.service"
    copy.write_text(UNIT.read_text())
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(copy)],
                         capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    if "offline" in text and ("unrecognized option" in text or "Unknown option" in text):
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    found = re.search(r"Overall exposure level for nodeagent\.service: (\d+\.\d)", text)
    assert found, text
    exposure = float(found.group(1))
    # What the unit leaves open, if the ceiling is ever crossed:
    open_items = "\n".join(line for line in text.splitlines() if line.startswith("\u2717"))
    assert exposure <= SECURITY_CEILING, f"exposure {exposure} > {SECURITY_CEILING}:\n{open_items}"


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
        # READY=1 was tried and failed (the daemon says so), and the daemon serves on.
        wait_for(lambda: proc.poll() is not None or "cannot notify systemd" in daemon_log(workdir),
                 timeout=20, interval=0.02)
        assert proc.poll() is None, f"daemon exited {proc.returncode}:\n{daemon_log(workdir)}"
        assert query_status(endpoint, timeout=5).daemon_pid == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, daemon_log(workdir)
    finally:
        stop(proc)


# ------------------------------------------------------------------ the daemon's work inside the unit's sandbox
#
# Without systemd as pid 1, the settings that could break the daemon are applied by
# hand, read from the unit: SystemCallFilter= (groups resolved by `systemd-analyze
# syscall-filter`) with SystemCallErrorNumber=, RestrictAddressFamilies= (both through
# libseccomp, as systemd installs them), UMask= and CapabilityBoundingSet=. Namespaces,
# read-only paths and the device list are not: they hide paths, which this test's
# temporary directories would trip over, and they were there before.

_CAPABILITIES = {f"CAP_{name}": number for number, name in enumerate((
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE"))}

# Runs as: python -c _SANDBOX SPEC PROGRAM ARGS...; applies SPEC, then execs PROGRAM.
_SANDBOX = r"""
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
lib = ctypes.CDLL(spec["libseccomp"], use_errno=True)
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_load.argtypes = [ctypes.c_void_p]

class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                       ctypes.POINTER(Cmp)]
ALLOW, LT, EQ, GT = 0x7FFF0000, 2, 4, 6

def fail_with(code):
    return 0x00050000 | code

def rule(ctx, action, nr, *cmps):
    if lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), (Cmp * len(cmps))(*cmps) if cmps else None):
        sys.exit(f"sandbox: libseccomp refused a rule for syscall {nr}")

def load(ctx, what):
    if lib.seccomp_load(ctx):
        sys.exit(f"sandbox: cannot load the {what} filter")

# Address families first: the syscall filter refuses seccomp(2) itself.
families = sorted(spec["families"])
ctx, nr = lib.seccomp_init(ALLOW), lib.seccomp_syscall_resolve_name(b"socket")
refuse = fail_with(spec["eafnosupport"])
rule(ctx, refuse, nr, Cmp(0, LT, families[0], 0))
rule(ctx, refuse, nr, Cmp(0, GT, families[-1], 0))
for family in range(families[0] + 1, families[-1]):
    if family not in families:
        rule(ctx, refuse, nr, Cmp(0, EQ, family, 0))
load(ctx, "address family")
libc = ctypes.CDLL(None, use_errno=True)
for cap in range(spec["last_cap"] + 1):
    if cap not in spec["keep_caps"] and libc.prctl(24, cap, 0, 0, 0):  # PR_CAPBSET_DROP
        sys.exit(f"sandbox: cannot drop capability {cap}")
os.umask(spec["umask"])
allow_list = spec["mode"] == "allow"
ctx = lib.seccomp_init(fail_with(spec["errno"]) if allow_list else ALLOW)
for name in spec["syscalls"]:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0:  # negative: not a system call of this architecture
        rule(ctx, ALLOW if allow_list else fail_with(spec["errno"]), nr)
load(ctx, "system call")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _syscalls(name: str) -> set[str]:
    """A system call, or a @group resolved by systemd itself."""
    if not name.startswith("@"):
        return {name}
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    names: set[str] = set()
    for line in out.stdout.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            names |= _syscalls(item)
    return names


def _sandbox_spec(unit, libseccomp: str) -> dict:
    """The unit's filter, families, umask and capabilities, in the terms _SANDBOX applies."""
    service = unit["Service"]
    mode, syscalls = None, set()
    for value in service["SystemCallFilter"]:  # systemd's order: the first line sets allow or deny
        deny = value.startswith("~")
        names = set().union(*(_syscalls(n) for n in value.lstrip("~").split()))
        if mode is None:
            mode, syscalls = ("deny", names) if deny else ("allow", names)
        elif (mode == "allow") != deny:
            syscalls |= names
        else:
            syscalls -= names
    return {
        "libseccomp": libseccomp, "mode": mode, "syscalls": sorted(syscalls),
        "errno": getattr(errno, one(unit, "Service", "SystemCallErrorNumber")), "eafnosupport": errno.EAFNOSUPPORT,
        "families": [int(getattr(socket, f)) for f in one(unit, "Service", "RestrictAddressFamilies").split()],
        "umask": int(one(unit, "Service", "UMask"), 8),
        "keep_caps": [_CAPABILITIES[c] for c in one(unit, "Service", "CapabilityBoundingSet").split()],
        "last_cap": int(Path("/proc/sys/kernel/cap_last_cap").read_text()),
    }


_NOBODY_SERVED = """
import json, sys
import numpy as np
from client_lib import Client
endpoint, weights = sys.argv[1:3]
with Client("nobody-svc", workload="inference", endpoint=endpoint) as c:
    plain = c.infer("mlp", np.ones((2, 16), dtype=np.float32))  # its input segment: 0600, nobody's
    c.register_model("mine", "tests.serving_models:small_mlp", weights=weights,  # opened as nobody
                     example_input=np.zeros((2, 16), dtype=np.float32))
    mine = c.infer("mine", np.ones((2, 16), dtype=np.float32))
print(json.dumps({"plain": np.asarray(plain).tolist(), "mine": np.asarray(mine).tolist()}))
"""

_NOBODY_HOG = """
import sys, time
from client_lib import Client
c = Client("hog", workload="training", endpoint=sys.argv[1])
c.acquire()
print(c.session_id, flush=True)
while True:  # never yields: stopped at the suspend's deadline
    time.sleep(0.02)
"""


def _proc_state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_text()
    return data[data.rfind(")") + 2]


@pytest.mark.slow
def test_inside_the_units_sandbox_a_root_daemon_serves_signals_and_opens_files_for_a_nonroot_client(unit):
    """Before: the unit's capabilities left out CAP_DAC_OVERRIDE, so a root daemon could
    not map a non-root client's 0600 input segment: every such infer was E_FORBIDDEN."""
    import numpy as np
    import torch

    from tests import safetensors_files as safetensors
    from tests import serving_models
    from tests.nonroot import SOCKET_GID, popen_as_nobody, require_root, run_as_nobody, share_with_socket_group

    require_root()
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (it resolves the unit's system call groups)")
    libseccomp = ctypes.util.find_library("seccomp")
    if libseccomp is None:
        pytest.skip("libseccomp is not installed (Debian/Ubuntu: libseccomp2)")
    spec = _sandbox_spec(unit, libseccomp)
    workdir = tempfile.mkdtemp(prefix="na-")
    share_with_socket_group(workdir, 0o2750)  # nobody reaches the socket through SOCKET_GID
    config = os.path.join(workdir, "nodeagent.toml")
    Path(config).write_text(f"[ctxpool]\nworkers_per_device = 1\nregister_group = {SOCKET_GID}\n")
    weights_dir = os.path.join(workdir, "w")
    os.mkdir(weights_dir)
    os.chmod(weights_dir, 0o755)
    weights = os.path.join(weights_dir, "mine.safetensors")
    trained = serving_models.small_mlp()
    with torch.no_grad():
        for t in trained.parameters():
            t.mul_(-2.0)
    safetensors.save({k: v.contiguous() for k, v in trained.state_dict().items()}, weights)
    os.chown(weights, 65534, 65534)
    os.chmod(weights, 0o600)  # nobody's own: opened by a child that has become nobody
    endpoint = f"ipc://{workdir}/agent.sock"
    log_path = os.path.join(workdir, "daemon.log")
    with open(log_path, "ab") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-c", _SANDBOX, json.dumps(spec),
             sys.executable, "-m", "nodeagent", "serve", "--config", config, "--backend", "cpu",
             "--endpoint", endpoint, "--state-dir", os.path.join(workdir, "state"), "--ctxpool", "on",
             "--metrics-port", "0", "--log-level", "debug"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    hog = None
    try:
        def up():
            if daemon.poll() is not None:
                pytest.fail(f"daemon exited {daemon.returncode}:\n{Path(log_path).read_text()}")
            try:
                return query_status(endpoint, timeout=0.2)
            except DaemonUnavailableError:
                return None
        wait_for(up, timeout=60, interval=0.05)
        status = Path(f"/proc/{daemon.pid}/status").read_text()
        assert re.search(r"^Seccomp:\s+2$", status, re.M), status  # filtered, not merely started
        bounding = int(re.search(r"^CapBnd:\s+([0-9a-f]+)$", status, re.M).group(1), 16)
        assert bounding == sum(1 << c for c in spec["keep_caps"])

        with Client("root-svc", workload="inference", endpoint=endpoint) as c:
            c.register_model("mlp", "tests.serving_models:small_mlp", example_input=np.zeros((2, 16), np.float32))
        done = run_as_nobody(_NOBODY_SERVED, endpoint, weights, timeout=120)
        assert done.returncode == 0, f"{done.stderr}\n{Path(log_path).read_text()[-3000:]}"
        result = json.loads(done.stdout.strip().splitlines()[-1])
        x = torch.ones(2, 16)
        assert torch.allclose(torch.tensor(result["plain"]), serving_models.small_mlp()(x), atol=1e-6)
        assert torch.allclose(torch.tensor(result["mine"]), trained(x), atol=1e-6)

        # SIGSTOP and SIGCONT to another user's process, through its pidfd.
        hog = popen_as_nobody(_NOBODY_HOG, endpoint)
        session = hog.stdout.readline().strip()
        assert session.startswith("s-"), hog.stderr.read()
        assert suspend_session(session, deadline_ms=200, endpoint=endpoint).outcome == "stopped"
        wait_for(lambda: _proc_state(hog.pid) == "T", timeout=2)  # SIGSTOP lands when it next runs
        resume_session(session, endpoint=endpoint)
        wait_for(lambda: _proc_state(hog.pid) != "T")
        hog.kill()
        hog.wait()

        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, Path(log_path).read_text()[-3000:]
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        stop(daemon)
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_mps_control_daemon_keeps_umask_022_under_the_units_umask(workdir):
    """UMask=0077 must not reach nvidia-cuda-mps-control: its pipes are for other users' servers."""
    control = Path(workdir, "mps-control")
    control.write_text('#!/bin/sh\numask > "$0.umask"\nexit 1\n')
    control.chmod(0o755)
    old = os.umask(int(parse_unit(UNIT.read_text())["Service"]["UMask"][-1], 8))
    try:
        with pytest.raises(MpsStartError):
            MpsControl(0, "GPU-test", os.path.join(workdir, "run"), control_binary=str(control)).start(timeout_s=10)
    finally:
        os.umask(old)
    assert Path(workdir, "mps-control.umask").read_text().strip() == "0022"
