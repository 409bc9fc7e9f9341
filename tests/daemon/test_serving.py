"""Server-side inference through a real daemon: registration, infer, errors,
worker death, eviction and re-swap, restart. Workers are real spawned
processes running torch on the cpu backend."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from client_lib import Client, DaemonError, InferenceError, ModelError, NoModelError, WorkerDeadError
from client_lib import protocol as p
from client_lib import serving
from tests import serving_models
from tests.conftest import REPO, Daemon, wait_for
from tests.private_shm import run_with_private_dev_shm

pytestmark = pytest.mark.slow


def _infer_reply(c: Client, d: Daemon, name: str, x: torch.Tensor) -> p.InferResult:
    """The whole reply (swap, queue_ms), not only the outputs ``Client.infer`` returns."""
    with serving.Packed([x], d.endpoint) as packed:
        return c._call(p.Infer(id=c._transport.take_id(), model=name, inputs=packed.refs), 30.0)


def _shm_names(*pids: int) -> set[str]:
    """The na- segments in /dev/shm; given pids, only those these processes made (a name carries its
    maker's pid): under pytest-xdist another worker's daemons make and unlink theirs beside."""
    names = {n for n in os.listdir("/dev/shm") if n.startswith("na-")}
    if not pids:
        return names
    return {n for n in names if (m := re.match(r"na-[a-z]+-(\d+)-", n)) and int(m.group(1)) in pids}


def _made_by(d: Daemon, *others: int) -> tuple[int, ...]:
    """Daemon ``d``, its workers, this process and ``others``: who may make a test's segments."""
    return (os.getpid(), d.proc.pid, *_workers_of(d.proc.pid), *others)


def _one_worker(workdir: str) -> None:
    """Config for a daemon whose test needs no standby: each worker is a torch import (seconds of CPU)."""
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[ctxpool]\nworkers_per_device = 1\n")


@pytest.fixture(scope="module")
def served():
    """One daemon with a warm worker for the tests that leave it as they found it."""
    workdir = tempfile.mkdtemp(prefix="na-")
    _one_worker(workdir)
    d = Daemon(workdir, ["--ctxpool", "on"]).start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_infer_equals_the_module_run_plainly(served):
    x = torch.randn(4, 3, 12, 12)
    with Client("svc", workload="inference", endpoint=served.endpoint) as c:
        info = c.register_model("cnn", "tests.serving_models:small_cnn", example_input=x)
        assert info.name == "cnn" and info.layers > 0 and info.groups >= 1 and info.model_bytes > 0
        out = c.infer("cnn", x)
        expected = serving_models.small_cnn()(x)
        assert isinstance(out, torch.Tensor) and torch.equal(out, expected)
        # again: resident now; numpy in, numpy out
        out_np = c.infer("cnn", x.numpy())
        assert torch.equal(torch.from_numpy(out_np[0] if isinstance(out_np, list) else out_np), expected)
        assert [m.name for m in c.models()] == ["cnn"]
        c.unregister_model("cnn")
        assert c.models() == []


def test_registration_errors_register_nothing(served, tmp_path):
    x = torch.randn(2, 16)
    before = _shm_names(*_made_by(served))
    with Client("svc", workload="inference", endpoint=served.endpoint) as c:
        with pytest.raises(ModelError, match="package.module:callable"):
            c.register_model("m", "no-colon-here", example_input=x)
        with pytest.raises(ModelError, match="tests.no_such_module"):
            c.register_model("m", "tests.no_such_module:f", example_input=x)
        with pytest.raises(ModelError, match="missing_file.pt"):
            c.register_model("m", "tests.serving_models:small_mlp", weights=tmp_path / "missing_file.pt",
                             example_input=x)
        wrong = tmp_path / "wrong.pt"
        torch.save({k: torch.zeros(3, 3) for k in serving_models.small_mlp().state_dict()}, wrong)
        with pytest.raises(ModelError, match="shape"):
            c.register_model("m", "tests.serving_models:small_mlp", weights=wrong, example_input=x)
        with pytest.raises(ModelError):
            c.register_model("m", "tests.serving_models:not_a_module", example_input=x)
        with pytest.raises(ModelError):  # the example does not fit the model
            c.register_model("m", "tests.serving_models:small_mlp", example_input=torch.randn(2, 5))
        assert c.models() == []
        with pytest.raises(NoModelError):
            c.infer("m", x)
    assert _shm_names(*_made_by(served)) <= before  # nothing left in /dev/shm


def test_weights_file_is_used(served, tmp_path):
    x = torch.randn(2, 16)
    trained = serving_models.small_mlp()
    with torch.no_grad():
        for p_ in trained.parameters():
            p_.mul_(-3.0)
    path = tmp_path / "mlp.pt"
    torch.save(trained.state_dict(), path)
    with Client("svc", workload="inference", endpoint=served.endpoint) as c:
        c.register_model("mlp-w", "tests.serving_models:small_mlp", weights=path, example_input=x)
        assert torch.equal(c.infer("mlp-w", x), trained(x))
        c.unregister_model("mlp-w")


def test_model_exception_is_typed_and_the_worker_survives(served):
    x = torch.ones(2, 16)
    with Client("svc", workload="inference", endpoint=served.endpoint) as c:
        c.register_model("fails", "tests.serving_models:fails_on_negative", example_input=x)
        with pytest.raises(InferenceError, match="negative input refused"):
            c.infer("fails", -x)
        out = c.infer("fails", x)  # the worker lives on and serves the next request
        assert torch.equal(out, serving_models.fails_on_negative()(x))
        c.unregister_model("fails")


def test_infer_waits_for_the_device_token(start_daemon, spawn, workdir):
    """A training holder that ignores yields keeps the device until revoked:
    the inference request waits in the token queue, not beside it."""
    _one_worker(workdir)
    d = start_daemon("--ctxpool", "on", "--enforce", "revoke", "--grace-ms", "400")
    x = torch.randn(2, 16)
    with Client("svc", workload="inference", endpoint=d.endpoint) as c:
        c.register_model("mlp", "tests.serving_models:small_mlp", example_input=x)
        hog = spawn(d.endpoint, "stubborn", "--seconds", "30")
        hog.expect("GRANT")
        reply = _infer_reply(c, d, "mlp", x)
        assert torch.equal(serving.take_outputs(reply, "torch", reply.single), serving_models.small_mlp()(x))
        assert reply.queue_ms >= 350.0, reply  # it waited out the holder's grace period
        assert reply.swap in ("ready", "pipelined")


def test_worker_killed_mid_request_then_replacement_serves(start_daemon, workdir):
    marker = os.path.join(workdir, "busy.pid")
    os.environ["NA_TEST_BUSY_MARKER"] = marker  # inherited by the daemon and its workers
    _one_worker(workdir)  # no standby: the next request must wait for the replacement
    try:
        d = start_daemon("--ctxpool", "on")
    finally:
        del os.environ["NA_TEST_BUSY_MARKER"]
    x = torch.ones(1, 256)
    with Client("svc", workload="inference", endpoint=d.endpoint) as c:
        c.register_model("busy", "tests.serving_models:busy", example_input=-x)  # the example skips the busy loop
        import threading
        result = {}

        def call():
            try:
                result["out"] = c.infer("busy", x, timeout=60)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                result["exc"] = exc

        t = threading.Thread(target=call)
        t.start()
        pid = int(wait_for(lambda: os.path.exists(marker) and open(marker).read(), timeout=30))
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        assert isinstance(result.get("exc"), WorkerDeadError), result
        assert str(pid) in str(result["exc"])
        os.unlink(marker)
        # The next request is served by the replacement, with the right output.
        out = c.infer("busy", -x, timeout=60)
        assert torch.equal(out, serving_models.busy()(-x))
    assert "[ctxpool] worker replaced" in d.log()


def test_eviction_and_reswap_under_a_residency_budget(start_daemon, workdir):
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[ctxpool]\nworkers_per_device = 1\nresident_mb = 6\n")
    d = start_daemon("--ctxpool", "on")
    x = torch.randn(2, 16)
    a = serving_models.wide_mlp()
    with Client("svc", workload="inference", endpoint=d.endpoint) as c:
        c.register_model("wide1", "tests.serving_models:wide_mlp", example_input=x)
        c.register_model("wide2", "tests.serving_models:wide_mlp", example_input=x)
        swaps = []
        for name in ["wide1", "wide1", "wide2", "wide1"]:
            reply = _infer_reply(c, d, name, x)
            assert torch.equal(serving.take_outputs(reply, "torch", reply.single), a(x))
            swaps.append(reply.swap)
        # wide2 evicted wide1 (the budget holds one), so wide1 was swapped in again.
        assert swaps == ["pipelined", "ready", "pipelined", "pipelined"], swaps


def test_restart_keeps_registrations(start_daemon, workdir):
    _one_worker(workdir)  # both daemons
    d = start_daemon("--ctxpool", "on")
    x = torch.randn(2, 16)
    with Client("svc", workload="inference", endpoint=d.endpoint, reconnect=False) as c:
        c.register_model("mlp", "tests.serving_models:small_mlp", example_input=x)
    d.stop(signal.SIGKILL)
    left = {n for n in _shm_names() if n.startswith(f"na-example-{d.proc.pid}-")}
    assert left  # what a SIGKILLed daemon could not unlink ...
    d2 = start_daemon("--ctxpool", "on")
    with Client("svc2", workload="inference", endpoint=d2.endpoint) as c:
        wait_for(lambda: [m.name for m in c.models()] == ["mlp"], timeout=60, interval=0.1)
        assert torch.equal(c.infer("mlp", x), serving_models.small_mlp()(x))
    assert not left & _shm_names()  # ... its successor swept


_INFER_THEN_DIE = """
import sys, torch
from client_lib import Client
c = Client("doomed", workload="inference", endpoint=sys.argv[1])
print("ready", flush=True)
c.infer("busy", torch.ones(1, 256), timeout=60)
"""


def test_client_killed_mid_infer_leaves_nothing_and_others_are_served(start_daemon, workdir):
    marker = os.path.join(workdir, "busy.pid")
    release = os.path.join(workdir, "busy.release")
    os.environ["NA_TEST_BUSY_MARKER"] = marker
    os.environ["NA_TEST_BUSY_RELEASE"] = release
    try:
        d = start_daemon("--ctxpool", "on")
    finally:
        del os.environ["NA_TEST_BUSY_MARKER"]
        del os.environ["NA_TEST_BUSY_RELEASE"]
    x = torch.ones(1, 256)
    with Client("svc", workload="inference", endpoint=d.endpoint) as c:
        c.register_model("busy", "tests.serving_models:busy", example_input=-x)
        before = _shm_names()
        doomed = subprocess.Popen([sys.executable, "-c", _INFER_THEN_DIE, d.endpoint], cwd=str(REPO),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert doomed.stdout.readline().strip() == "ready"
            wait_for(lambda: os.path.exists(marker) and open(marker).read(), timeout=30)
            inputs = {n for n in _shm_names() - before if n.startswith(f"na-in-{doomed.pid}-")}
            assert inputs  # the dying client's input segment, owned by it
            doomed.kill()
        finally:
            doomed.kill()
            doomed.wait()
        os.unlink(marker)
        # Served: the dead client's serving session loses the token at its yield
        # deadline, and the standby worker runs this request meanwhile.
        assert torch.equal(c.infer("busy", -x, timeout=60), serving_models.busy()(-x))
        open(release, "w").close()  # the dead client's request may finish now (a cue, not a timer)
        # Once the dead client's request completes, the daemon unlinks what that
        # client owned: its inputs, and the outputs it will never read.
        wait_for(lambda: not (_shm_names(*_made_by(d, doomed.pid)) - before), timeout=60, interval=0.05)
        status = d.status()
        assert all("doomed" not in s.name for dev in status.devices for s in dev.sessions)


def test_unverifiable_peer_may_not_register_a_model(start_daemon, workdir):
    """Over tcp the daemon cannot read the peer's credentials: registering would run
    its factory in the daemon's workers, so it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _one_worker(workdir)
    d = start_daemon("--ctxpool", "on", endpoint=f"tcp://127.0.0.1:{port}")
    with Client("remote", workload="inference", endpoint=d.endpoint) as c:
        with pytest.raises(DaemonError) as err:
            c.register_model("m", "tests.serving_models:small_mlp", example_input=torch.randn(2, 16))
        assert err.value.code == p.ErrorCode.FORBIDDEN
        assert c.models() == []


def test_outputs_a_session_leaves_unread_are_bounded_and_unlinked_at_bye(served):
    """Outputs are made for the client, which unlinks them once read; what it never
    reads goes when its session ends, and a session may leave only so many unread."""
    from nodeagent.daemon.output_segments import MAX_UNREAD
    from tests.rawpeer import RawPeer

    x = torch.randn(2, 16)
    with Client("svc", workload="inference", endpoint=served.endpoint) as c:
        c.register_model("hoard", "tests.serving_models:small_mlp", example_input=x)
        peer = RawPeer(served.endpoint)
        try:
            peer.hello(name="hoarder", workload="inference")
            with serving.Packed([x], served.endpoint) as packed:
                unread = []
                for _ in range(MAX_UNREAD):
                    reply = peer.call(p.Infer(id=peer.take_id(), model="hoard", inputs=packed.refs), 30.0)
                    assert isinstance(reply, p.InferResult), reply
                    unread.append(reply)
                owner = os.stat(f"/dev/shm/{unread[0].outputs[0].shm}").st_uid
                assert owner == os.geteuid()  # the client's own: it may unlink it
                refused = peer.call(p.Infer(id=peer.take_id(), model="hoard", inputs=packed.refs), 30.0)
                assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.INVALID, refused
                assert "unread" in refused.message
                first = unread.pop(0)  # read (and so unlink) one: room for one more
                assert torch.equal(serving.take_outputs(first, "torch", first.single), serving_models.small_mlp()(x))
                unread.append(peer.call(p.Infer(id=peer.take_id(), model="hoard", inputs=packed.refs), 30.0))
                assert isinstance(unread[-1], p.InferResult), unread[-1]
                names = [r.outputs[0].shm for r in unread]
                assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
                assert isinstance(peer.call(p.Goodbye(id=peer.take_id())), p.Ok)
            served.status()  # a barrier: the bye was handled before this is answered
            assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
        finally:
            peer.close()
        c.unregister_model("hoard")


def _workers_of(pid: int) -> list[int]:
    """The ctxpool workers of daemon ``pid``: its children started by multiprocessing's spawn."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid and b"spawn_main" in cmdline:
            out.append(int(entry))
    return out


def test_outputs_a_dead_worker_made_but_never_reported_are_unlinked(start_daemon, workdir):
    """A worker killed between making an output segment and reporting it leaves a
    segment nobody was handed: the daemon unlinks it when it learns of the death."""
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[ctxpool]\nworkers_per_device = 1\n")
    d = start_daemon("--ctxpool", "on")
    with Client("svc", workload="inference", endpoint=d.endpoint) as c:
        c.register_model("mlp", "tests.serving_models:small_mlp", example_input=torch.randn(2, 16))
        [worker] = _workers_of(d.proc.pid)
        from client_lib import tensors

        orphan = tensors.create_segment(64, name=f"na-out-{worker}-999-{os.urandom(4).hex()}")
        orphan.close()
        kept = c.infer("mlp", torch.randn(2, 16))  # a handed-out output is the client's business
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: "[ctxpool] worker replaced" in d.log(), timeout=30)
        wait_for(lambda: not os.path.exists(f"/dev/shm/{orphan.name}"), timeout=10)
        assert kept.shape == (2, 4)


def test_an_output_made_while_the_daemon_stops_is_not_left_behind(start_daemon, workdir):
    """A request answered E_SHUTTING_DOWN whose worker still finishes it during the
    polite part of shutdown: the output it made is nobody's, and the daemon unlinks it."""
    import threading

    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write("[ctxpool]\nworkers_per_device = 1\n")
    marker = os.path.join(workdir, "sleeping.pid")
    os.environ["NA_TEST_SLEEP_MARKER"] = marker
    try:
        d = start_daemon("--ctxpool", "on")
    finally:
        del os.environ["NA_TEST_SLEEP_MARKER"]
    errors = []
    with Client("svc", workload="inference", endpoint=d.endpoint, reconnect=False) as c:
        c.register_model("sleeps", "tests.serving_models:sleeps_for_input", example_input=torch.zeros(1, 1))
        [worker] = _workers_of(d.proc.pid)

        def call():
            try:
                c.infer("sleeps", torch.full((1, 1), 1.0), timeout=30)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        t = threading.Thread(target=call)
        t.start()
        wait_for(lambda: os.path.exists(marker), timeout=30)
        assert d.stop() == 0
        t.join(30)
    assert errors and getattr(errors[0], "code", None) == p.ErrorCode.SHUTTING_DOWN, errors
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"na-out-{worker}-")]


# ----------------------------------------------- restored models, and a full /dev/shm

_REGISTER_AS_NOBODY = """
import sys
import numpy as np
from client_lib import Client
with Client("nobody-reg", workload="inference", endpoint=sys.argv[1]) as c:
    c.register_model("mine", "tests.serving_models:small_mlp", weights=sys.argv[2],
                     example_input=np.zeros((2, 16), dtype=np.float32))
print("registered")
"""


def test_a_restarted_daemon_reads_a_models_weights_with_its_registrants_rights(tmp_path):
    """Before: the journal did not say who registered a model, and a restarted daemon read
    its weights as root: a registrant who repointed the path at a root-only file before a
    restart got that file loaded. Now the restore opens it as the registrant (refused), and
    a row from before registrants were journalled is not restored if it names a file."""
    import dataclasses

    from tests import safetensors_files as safetensors
    from nodeagent.journal import Journal
    from tests.nonroot import (NOBODY_GID, NOBODY_UID, SOCKET_GID, require_root, run_as_nobody,
                               share_with_socket_group)

    require_root()
    workdir = tempfile.mkdtemp(prefix="na-")  # short: ipc paths must stay under 107 bytes
    weights_dir = tempfile.mkdtemp(prefix="na-w-")
    secret_dir = tempfile.mkdtemp(prefix="na-s-")
    try:
        share_with_socket_group(workdir, 0o2750)
        with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
            f.write(f"[ctxpool]\nworkers_per_device = 1\nregister_group = {SOCKET_GID}\n")
        os.chmod(weights_dir, 0o755)
        os.chown(weights_dir, NOBODY_UID, NOBODY_GID)  # the registrant's own directory
        own = serving_models.small_mlp()
        safetensors.save({k: v.contiguous() for k, v in own.state_dict().items()}, f"{weights_dir}/own.safetensors")
        os.chmod(f"{weights_dir}/own.safetensors", 0o644)
        secret = f"{secret_dir}/secret.safetensors"  # root's: 0600, of the same shapes
        safetensors.save({k: (v * 5).contiguous() for k, v in own.state_dict().items()}, secret)
        os.chmod(secret, 0o600)
        link = f"{weights_dir}/model.safetensors"
        os.symlink("own.safetensors", link)
        os.lchown(link, NOBODY_UID, NOBODY_GID)

        def start() -> Daemon:
            d = Daemon(workdir, ["--ctxpool", "on"]).start()
            share_with_socket_group(d.socket_path, 0o660)
            return d

        d = start()
        try:
            done = run_as_nobody(_REGISTER_AS_NOBODY, d.endpoint, link)
            assert done.returncode == 0 and done.stdout.strip() == "registered", done.stderr
        finally:
            assert d.stop() == 0, d.log()
        with Journal(os.path.join(workdir, "state", "state.db")) as j:
            [mine] = j.models()
            assert (mine.registrant.uid, mine.registrant.gid) == (NOBODY_UID, NOBODY_GID)
            assert SOCKET_GID in mine.registrant.groups
            # Rows as a journal from before schema 4 holds them: nobody knows who registered them.
            j.put_model(dataclasses.replace(mine, name="legacy-file", weights=secret, registrant=None))
            j.put_model(dataclasses.replace(mine, name="legacy-none", weights=None, registrant=None))
        os.unlink(link)  # the registrant repoints its path while the daemon is down
        os.symlink(secret, link)
        os.lchown(link, NOBODY_UID, NOBODY_GID)

        d = start()
        try:
            with Client("svc", workload="inference", endpoint=d.endpoint) as c:
                wait_for(lambda: "legacy-none" in [m.name for m in c.models()], timeout=60, interval=0.1)
                wait_for(lambda: "registration failed name=mine" in d.log(), timeout=60, interval=0.1)
                assert [m.name for m in c.models()] == ["legacy-none"]
            log = d.log()
            failed = next(line for line in log.splitlines() if "registration failed name=mine" in line)
            assert "Permission denied" in failed and f"uid {NOBODY_UID}" in failed
            assert "not restoring model name=legacy-file" in log and "register it again" in log
        finally:
            assert d.stop() == 0, d.log()
    finally:
        for path in (workdir, weights_dir, secret_dir):
            shutil.rmtree(path, ignore_errors=True)


_SHM_FULL_SCENARIO = r"""
import json, os, shutil, sys, tempfile
import torch
from client_lib import Client, DaemonError
from tests.conftest import Daemon

workdir = tempfile.mkdtemp(prefix="na-")
with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
    f.write("[ctxpool]\nworkers_per_device = 1\n")
d = Daemon(workdir, ["--ctxpool", "on"]).start(timeout=60)
out = {}
try:
    with Client("svc", workload="inference", endpoint=d.endpoint) as c:
        try:  # 3 MiB: the client's segment fits the 4 MiB /dev/shm, the daemon's copy does not
            c.register_model("big", "tests.serving_models:sleeps_for_input", example_input=torch.zeros(1, 3 << 18))
            out["example"] = {"registered": True}
        except DaemonError as exc:
            out["example"] = {"code": exc.code, "message": str(exc)}
        c.register_model("sleeps", "tests.serving_models:sleeps_for_input", example_input=torch.zeros(1, 1))
        try:  # 2.5 MiB in, 2.5 MiB out (x * 2): the worker's output segment does not fit
            c.infer("sleeps", torch.zeros(1, 5 << 17))
            out["output"] = {"served": True}
        except DaemonError as exc:
            out["output"] = {"code": exc.code, "message": str(exc)}
        out["after"] = c.infer("sleeps", torch.ones(1, 4)).tolist()  # daemon and worker live on
        out["models"] = [m.name for m in c.models()]
finally:
    out["exit"] = d.stop()
    out["worker_deaths"] = d.log().count("[ctxpool] worker replaced")
    shutil.rmtree(workdir, ignore_errors=True)
out["left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("na-"))
print(json.dumps(out))
"""


def test_a_full_dev_shm_is_an_error_naming_the_size_not_a_sigbus_of_the_daemon_or_its_worker():
    """Before: the daemon's copy of an example input and a worker's output segment were
    sparse; the first write past a full /dev/shm killed the daemon (SIGBUS), or the worker.
    The daemon, its worker and this client run in a mount namespace with a 4 MiB /dev/shm."""
    import json

    run = run_with_private_dev_shm("4m", _SHM_FULL_SCENARIO, timeout=240)
    assert run.returncode == 0, f"status {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    example, output = out["example"], out["output"]
    assert example.get("code") == p.ErrorCode.MODEL, out
    assert f"needs {3 << 20} bytes" in example["message"] and "/dev/shm has" in example["message"], out
    assert output.get("code") == p.ErrorCode.INFERENCE, out
    assert f"needs {5 << 19} bytes" in output["message"] and "/dev/shm has" in output["message"], out
    assert out["after"] == [[2.0, 2.0, 2.0, 2.0]] and out["models"] == ["sleeps"], out
    assert out["exit"] == 0 and out["worker_deaths"] == 0, out
    assert out["left"] == [], out
