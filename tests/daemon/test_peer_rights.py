"""A root daemon acting on a non-root peer's word (issue 10, defects 2, 3 and 6):
segments a peer names must be its own, outputs work for any user and never
leak, weights files are opened with the peer's rights and errors quote
nothing from them. Clients run as uid 65534 (:mod:`tests.nonroot`); skipped
where the tests do not run as root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import tempfile

import numpy as np
import pytest
import torch

from client_lib import Client
from client_lib import protocol as p
from client_lib import tensors
from tests import safetensors_files as safetensors
from tests import serving_models
from tests.conftest import wait_for
from tests.nonroot import (NOBODY_UID, SOCKET_GID, popen_as_nobody, reachable_daemon, require_root,
                           run_as_nobody, share_with_socket_group)
from tests.rawpeer import RawPeer

pytestmark = pytest.mark.slow

SECRET = bytes(range(64))  # what a root-only segment holds
SHM_DIR = "/dev/shm"


@pytest.fixture(scope="module")
def served():
    """One root daemon with one warm worker, reachable by uid 65534, whose group may
    register models (ctxpool.register_group: registering is an operator's act); a long
    grace so that a training holder keeps inference requests queued while a test looks."""
    require_root()
    marker_dir = tempfile.mkdtemp(prefix="na-mark-")
    os.environ["NA_TEST_SLEEP_MARKER"] = os.path.join(marker_dir, "sleeping.pid")  # the workers inherit it
    try:
        with reachable_daemon("--ctxpool", "on", "--enforce", "revoke", "--grace-ms", "30000",
                              config=f"[ctxpool]\nworkers_per_device = 1\nregister_group = {SOCKET_GID}\n") as d:
            with Client("root-svc", workload="inference", endpoint=d.endpoint) as c:
                x = np.zeros((2, 16), dtype=np.float32)
                c.register_model("mlp", "tests.serving_models:small_mlp", example_input=x)
                c.register_model("flat", "torch.nn:Flatten", example_input=np.zeros((1, 16), dtype=np.float32))
                c.register_model("sleeps", "tests.serving_models:sleeps_for_input",
                                 example_input=np.zeros((1, 1), dtype=np.float32))
            d.marker = os.environ["NA_TEST_SLEEP_MARKER"]
            yield d
    finally:
        del os.environ["NA_TEST_SLEEP_MARKER"]
        shutil.rmtree(marker_dir, ignore_errors=True)


@pytest.fixture
def root_segment():
    """A root-owned 0600 segment holding SECRET; its name."""
    seg = tensors.create_segment(len(SECRET), prefix="na-test-root")
    seg.buf[:len(SECRET)] = SECRET
    seg.close()
    yield seg.name
    tensors.unlink_segment(seg.name)


def _shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _holds(name: str, data: bytes) -> bool:
    try:
        with open(_shm_path(name), "rb") as f:
            return f.read(len(data)) == data
    except FileNotFoundError:
        return False


def _workers_of(pid: int) -> list[int]:
    """Pids of the processes whose parent is ``pid`` (the daemon's workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def _left_by(client_pid: int, daemon_pid: int) -> list[str]:
    """Segments of this client (its inputs) or of the daemon's workers (outputs) still in /dev/shm."""
    prefixes = (f"na-in-{client_pid}-", *(f"na-out-{w}-" for w in _workers_of(daemon_pid)))
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)]


def _last_json(done) -> dict:
    assert done.returncode == 0, f"client as nobody failed ({done.returncode}):\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------- segments a peer names

_NAME_A_SEGMENT = """
import json, os, sys
from client_lib import Client, DaemonError, tensors
from client_lib import protocol as p
SHM_DIR = "/dev/shm"
endpoint, model, root_name = sys.argv[1:4]
link = tensors.segment_name("na-test-link")
os.symlink(os.path.join(SHM_DIR, root_name), os.path.join(SHM_DIR, link))
results = {}
try:
    with Client("nobody", workload="inference", endpoint=endpoint) as c:
        for label, name in (("root", root_name), ("symlink", link)):
            ref = p.TensorRef(dtype="float32", shape=[1, 16], shm=name, nbytes=64)
            try:
                reply = c._call(p.Infer(id=c._transport.take_id(), model=model, inputs=[ref]), 30.0)
                data = tensors.take(reply.outputs, like="numpy", unlink=False)[0].tobytes().hex()
                results[label] = {"data": data}
            except DaemonError as exc:
                results[label] = {"code": exc.code, "message": str(exc)}
        try:  # the example input of a registration is copied out of the segment it names
            c._call(p.RegisterModel(id=c._transport.take_id(), name="stolen-example", factory="torch.nn:Flatten",
                                    example_input=[p.TensorRef(dtype="float32", shape=[1, 16], shm=root_name,
                                                               nbytes=64)]), 60.0)
            results["example"] = {"registered": True}
        except DaemonError as exc:
            results["example"] = {"code": exc.code, "message": str(exc)}
finally:
    os.unlink(os.path.join(SHM_DIR, link))
print(json.dumps(results))
"""


def test_a_root_segment_named_by_a_nonroot_peer_is_refused_and_nothing_read(served, root_segment):
    """Before: a peer that registered torch.nn:Flatten read any root-only segment back."""
    results = _last_json(run_as_nobody(_NAME_A_SEGMENT, served.endpoint, "flat", root_segment))
    for label in ("root", "symlink", "example"):
        assert results[label].get("code") == p.ErrorCode.FORBIDDEN, results
        assert SECRET.hex() not in json.dumps(results[label])
    assert "does not belong to uid 65534" in results["root"]["message"]
    assert "does not belong to uid 65534" in results["example"]["message"]
    assert "symbolic link" in results["symlink"]["message"]
    assert _holds(root_segment, SECRET)  # and nothing unlinked it


_QUEUE_THEN_BYE = """
import json, sys
from client_lib import protocol as p, tensors
from tests.rawpeer import RawPeer
endpoint, model, root_name = sys.argv[1:4]
peer = RawPeer(endpoint)
peer.hello(name="nobody-queued", workload="inference")
own = tensors.create_segment(64, prefix="na-test-own")
own.close()
sent = {}
for label, name in (("root", root_name), ("own", own.name)):
    rid = peer.take_id()
    sent[rid] = label
    peer.send(p.Infer(id=rid, model=model, inputs=[p.TensorRef(dtype="float32", shape=[1, 16], shm=name, nbytes=64)]))
answered = {}
try:
    while True:  # a reply within a second: refused at once; none: queued behind the token holder
        reply = peer.recv(1.0)
        if reply.id in sent:
            answered[sent[reply.id]] = getattr(reply, "code", type(reply).__name__)
except TimeoutError:
    pass
tensors.unlink_segment(own.name)  # gone from under the queued request before the bye
print(json.dumps({"own": own.name, "answered": answered}), flush=True)
sys.stdin.readline()  # meanwhile another user's segment took that name
print(type(peer.call(p.Goodbye(id=peer.take_id()))).__name__, flush=True)
"""


def test_a_queued_request_naming_another_users_segment_does_not_make_bye_unlink_it(served, root_segment):
    """Before: a queued request's inputs were unlinked as root at bye, whoever owned them."""
    holder = RawPeer(served.endpoint)  # holds the device token: inference requests queue
    try:
        holder.hello(name="holder", workload="training")
        holder.send(p.Acquire(id=holder.take_id()))
        holder.next_notice(p.Grant)
        proc = popen_as_nobody(_QUEUE_THEN_BYE, served.endpoint, "flat", root_segment)
        try:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            state = json.loads(line)
            taken = tensors.create_segment(64, name=state["own"])  # another user takes the name
            taken.buf[:64] = SECRET
            taken.close()
            try:
                proc.stdin.write("go\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "Ok"
                proc.wait(30)
                served.status()  # a barrier: the daemon finished with the bye before answering this
                assert _holds(root_segment, SECRET), "the daemon unlinked root's segment at bye"
                assert _holds(state["own"], SECRET), "the daemon unlinked another user's segment at bye"
                # Root's segment was refused at once; its own was accepted and queued.
                assert state["answered"] == {"root": p.ErrorCode.FORBIDDEN}, state
            finally:
                tensors.unlink_segment(state["own"])
        finally:
            proc.kill()
            proc.wait()
    finally:
        holder.call(p.Goodbye(id=holder.take_id()))
        holder.close()


_IN_A_CONTAINER = """
import json, sys
import numpy as np
from client_lib import Client, DaemonError, tensors
from client_lib import protocol as p
endpoint, model, theirs = sys.argv[1:4]
own = tensors.create_segment(64, prefix="na-test-ns-own")  # uid 0's, made in here
own.buf[:64] = np.arange(16, dtype=np.float32).tobytes()
results = {}
try:
    with Client("container-root", workload="inference", endpoint=endpoint) as c:
        for label, name in (("theirs", theirs), ("own", own.name)):
            ref = p.TensorRef(dtype="float32", shape=[1, 16], shm=name, nbytes=64)
            try:
                reply = c._call(p.Infer(id=c._transport.take_id(), model=model, inputs=[ref]), 30.0)
                results[label] = {"data": tensors.take(reply.outputs, like="numpy")[0].tobytes().hex()}
            except DaemonError as exc:
                results[label] = {"code": exc.code, "message": str(exc)}
finally:
    own.close()
    own.unlink()
print(json.dumps(results))
"""


def test_a_containers_root_may_name_only_uid_0s_segments_and_host_root_any(served):
    """Issue 32 (left over from item 2): the segment-owner check let uid 0 name any segment, so
    a real uid-0 process in new pid and mount namespaces (unshare(1)), a container's root, read
    another tenant's segment back through a Flatten model. Only the ROOT role may: host root,
    asking the same, is answered; the container's root gets E_FORBIDDEN, and its own segment works."""
    import subprocess
    import sys

    from tests.conftest import REPO

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to make a process in new pid and mount namespaces")
    seg = tensors.create_segment(len(SECRET), prefix="na-test-tenant", owner=NOBODY_UID)  # another tenant's
    seg.buf[:len(SECRET)] = SECRET
    seg.close()
    try:
        run = subprocess.run(["unshare", "--pid", "--mount", "--fork", "--", sys.executable, "-c", _IN_A_CONTAINER,
                              served.endpoint, "flat", seg.name], cwd=REPO, capture_output=True, text=True,
                             timeout=90)
        if run.returncode != 0 and "unshare" in run.stderr and "Operation not permitted" in run.stderr:
            pytest.skip(f"this sandbox refuses new namespaces: {run.stderr.strip()}")
        results = _last_json(run)
        assert results["theirs"].get("code") == p.ErrorCode.FORBIDDEN, results
        assert "does not belong to uid 0" in results["theirs"]["message"], results
        assert SECRET.hex() not in json.dumps(results["theirs"])
        assert results["own"].get("data") == np.arange(16, dtype=np.float32).tobytes().hex(), results
        assert _holds(seg.name, SECRET)  # and nothing unlinked it
        with Client("host-root", workload="inference", endpoint=served.endpoint) as c:  # ROOT: any segment
            ref = p.TensorRef(dtype="float32", shape=[1, 16], shm=seg.name, nbytes=64)
            reply = c._call(p.Infer(id=c._transport.take_id(), model="flat", inputs=[ref]), 30.0)
            assert tensors.take(reply.outputs, like="numpy")[0].tobytes() == SECRET
    finally:
        tensors.unlink_segment(seg.name)


# ------------------------------------------------------------- outputs

_INFER = """
import json, os, sys
import numpy as np
from client_lib import Client
endpoint, model = sys.argv[1:3]
x = np.arange(32, dtype=np.float32).reshape(2, 16) / 10
with Client("nobody-svc", workload="inference", endpoint=endpoint) as c:
    out = c.infer(model, x)
    again = c.infer(model, x)
print(json.dumps({"pid": os.getpid(), "out": np.asarray(out).tolist(), "same": bool((out == again).all())}))
"""


def test_a_nonroot_clients_infer_succeeds_and_leaves_no_segment(served):
    """Before: the worker's root-owned output could not be unlinked by the client:
    PermissionError after the work was done, and one na-out segment leaked per call."""
    result = _last_json(run_as_nobody(_INFER, served.endpoint, "mlp"))
    x = torch.arange(32, dtype=torch.float32).reshape(2, 16) / 10
    assert torch.allclose(torch.tensor(result["out"]), serving_models.small_mlp()(x), atol=1e-6)
    assert result["same"]
    assert _left_by(result["pid"], served.proc.pid) == []


_INFER_SLOWLY = """
import sys
import numpy as np
from client_lib import Client
c = Client("doomed", workload="inference", endpoint=sys.argv[1])
print("ready", flush=True)
c.infer(sys.argv[2], np.full((1, 1), 1.5, dtype=np.float32), timeout=60)
"""


def test_a_nonroot_client_killed_mid_request_leaves_no_segment(served):
    if os.path.exists(served.marker):
        os.unlink(served.marker)
    proc = popen_as_nobody(_INFER_SLOWLY, served.endpoint, "sleeps")
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        wait_for(lambda: os.path.exists(served.marker), timeout=30)  # the worker runs it now
        assert any(n.startswith(f"na-in-{proc.pid}-") for n in os.listdir(SHM_DIR))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Once the request completes, the daemon unlinks the dead client's input
        # (its own user's) and the output it will never read.
        wait_for(lambda: not _left_by(proc.pid, served.proc.pid), timeout=30, interval=0.05)
    finally:
        proc.kill()
        proc.wait()
        if os.path.exists(served.marker):
            os.unlink(served.marker)


_NEVER_READ = """
import json, os, sys
from client_lib import protocol as p, tensors
from tests.rawpeer import RawPeer
endpoint, model = sys.argv[1:3]
peer = RawPeer(endpoint)
peer.hello(name="nobody-hoarder", workload="inference")
seg, refs = tensors.pack([__import__("numpy").zeros((2, 16), dtype="float32")], prefix="na-in")
outputs, refused = [], None
for _ in range(70):
    reply = peer.call(p.Infer(id=peer.take_id(), model=model, inputs=refs), 30.0)
    if isinstance(reply, p.Error):
        refused = [reply.code, reply.message]
        break
    outputs += [r.shm for r in reply.outputs if r.shm]
seg.close()
seg.unlink()
SHM_DIR = "/dev/shm"
owners = sorted({os.stat(os.path.join(SHM_DIR, n)).st_uid for n in outputs})
print(json.dumps({"outputs": outputs, "refused": refused, "owners": owners}), flush=True)
os._exit(0)  # no bye: the daemon learns of it from the process's exit
"""


def test_outputs_a_client_never_reads_are_bounded_and_unlinked_when_it_exits(served):
    """Before: no bound, and the outputs of a client that exits unread stayed in /dev/shm."""
    from nodeagent.daemon.output_segments import MAX_UNREAD

    result = _last_json(run_as_nobody(_NEVER_READ, served.endpoint, "mlp"))
    assert len(result["outputs"]) == MAX_UNREAD, result["refused"]
    assert result["refused"][0] == p.ErrorCode.INVALID and "unread" in result["refused"][1]
    assert result["owners"] == [NOBODY_UID]  # made for the client: it could unlink them
    wait_for(lambda: not any(os.path.exists(_shm_path(n)) for n in result["outputs"]), timeout=15, interval=0.05)


# ------------------------------------------------------------- weights files

_REGISTER_WEIGHTS = """
import json, sys
import numpy as np
from client_lib import Client, DaemonError
endpoint, *paths = sys.argv[1:]
out = {}
with Client("nobody-reg", workload="inference", endpoint=endpoint) as c:
    for i, path in enumerate(paths):
        try:
            c.register_model(f"w{i}", "tests.serving_models:small_mlp", weights=path,
                             example_input=np.zeros((2, 16), dtype=np.float32))
        except DaemonError as exc:
            out[path] = {"code": exc.code, "message": str(exc)}
            continue
        out[path] = {"registered": True}
        try:
            out[path]["y"] = np.asarray(c.infer(f"w{i}", np.ones((2, 16), dtype=np.float32))).tolist()
        except Exception as exc:
            out[path]["infer_error"] = repr(exc)
        c.unregister_model(f"w{i}")
print(json.dumps(out))
"""


def test_weights_are_opened_with_the_peers_rights_and_errors_quote_nothing(served):
    """Before: a symlink to a root-only file answered with the file's first 8 bytes (as a
    header length) and its size; a file in a root-only directory loaded, or said it was missing."""
    base = tempfile.mkdtemp(prefix="na-w-", dir=served.workdir)  # in the socket group's directory
    os.chmod(base, 0o755)
    trained = serving_models.small_mlp()
    with torch.no_grad():
        for t in trained.parameters():
            t.mul_(-2.0)
    state = {k: v.contiguous() for k, v in trained.state_dict().items()}
    readable = os.path.join(base, "readable.safetensors")
    safetensors.save(state, readable)
    os.chmod(readable, 0o644)
    private = os.path.join(base, "private")
    os.mkdir(private, 0o700)
    safetensors.save(state, os.path.join(private, "real.safetensors"))
    os.chmod(os.path.join(private, "real.safetensors"), 0o644)  # readable by mode, but behind a 0700 directory
    secret_file = os.path.join(base, "root-only.bin")
    with open(secret_file, "wb") as f:
        f.write(b"root:$6$secret-hash-material:19000:0:99999:7:::\n" * 13)
    os.chmod(secret_file, 0o600)
    link = os.path.join(base, "link.safetensors")
    os.symlink(secret_file, link)
    real, missing = os.path.join(private, "real.safetensors"), os.path.join(private, "missing.safetensors")

    result = _last_json(run_as_nobody(_REGISTER_WEIGHTS, served.endpoint, link, real, missing, readable))

    header_len = str(struct.unpack("<Q", open(secret_file, "rb").read(8))[0])
    size = str(os.path.getsize(secret_file))
    for path in (link, real, missing):
        assert result[path].get("code") == p.ErrorCode.MODEL, result
        assert "Permission denied" in result[path]["message"]
    text = result[link]["message"]
    assert header_len not in text and size not in text and "root:" not in text and "secret" not in text
    # Behind a directory it may not search, a file that is there and one that is not look alike.
    assert result[real]["message"].replace("real", "X") == result[missing]["message"].replace("missing", "X")
    # What the peer may read registers, and serves the weights from the file.
    assert result[readable].get("registered"), result[readable]
    expected = trained(torch.ones(2, 16))
    assert torch.allclose(torch.tensor(result[readable]["y"]), expected, atol=1e-6)


def test_the_socket_group_setup_is_what_a_client_needs():
    """The helper itself: nobody reaches a socket only through the supplementary group."""
    require_root()
    with tempfile.TemporaryDirectory(prefix="na-") as base:
        share_with_socket_group(base, 0o750)
        path = os.path.join(base, "f")
        with open(path, "w") as f:
            f.write("ok")
        share_with_socket_group(path, 0o640)
        done = run_as_nobody("import os, sys; print(os.getuid(), open(sys.argv[2]).read())", "ipc://unused", path)
        assert done.returncode == 0 and done.stdout.split() == [str(NOBODY_UID), "ok"], done.stderr
