"""The output segments handed to one session (nodeagent/daemon/output_segments.py), on real files in
/dev/shm: what counts as unread, what the daemon unlinks when the session ends (only what it handed
out, only while the uid it made them for still owns them), and a dead worker's orphans."""

from __future__ import annotations

import os

import pytest

from client_lib import protocol as p
from client_lib import tensors
from nodeagent.daemon.output_segments import OutputSegments, orphans_of

pytestmark = pytest.mark.skipif(not os.path.isdir(tensors.SHM_DIR), reason="needs /dev/shm")

PREFIX = f"na-test-out-{os.getpid()}"
STRANGER_UID = 54321


@pytest.fixture
def shm():
    """make(name, uid=None) creates a 0600 segment in /dev/shm; every one made is removed at the end."""
    made: list[str] = []

    def make(name: str, uid: int | None = None) -> str:
        path = os.path.join(tensors.SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, b"\0" * 16)
        os.close(fd)
        if uid is not None:
            os.chown(path, uid, -1)
        made.append(name)
        return name

    yield make
    for name in made:
        try:
            os.unlink(os.path.join(tensors.SHM_DIR, name))
        except FileNotFoundError:
            pass


def _ref(name: str) -> p.TensorRef:
    return p.TensorRef(dtype="float32", shape=[4], shm=name, nbytes=16)


def _exists(name: str) -> bool:
    return os.path.lexists(os.path.join(tensors.SHM_DIR, name))


def test_unread_counts_each_handed_name_once_and_forgets_what_the_client_unlinked(shm):
    a, b = shm(f"{PREFIX}-a"), shm(f"{PREFIX}-b")
    outputs = OutputSegments(os.geteuid())
    outputs.handed([_ref(a), _ref(a), p.TensorRef(dtype="float32", shape=[4])])  # a repeat; no segment
    outputs.handed([_ref(b)])
    assert outputs.unread() == 2 and a in outputs and b in outputs
    os.unlink(os.path.join(tensors.SHM_DIR, a))  # the client read it, then unlinked it
    assert outputs.unread() == 1 and a not in outputs and b in outputs


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a segment to another uid: needs root")
def test_release_unlinks_only_what_the_sessions_uid_still_owns(shm):
    mine, reused, unhanded = shm(f"{PREFIX}-mine"), shm(f"{PREFIX}-reused"), shm(f"{PREFIX}-unhanded")
    outputs = OutputSegments(None)  # made owned by the daemon's own user (root here)
    outputs.handed([_ref(mine), _ref(reused)])
    os.chown(os.path.join(tensors.SHM_DIR, reused), STRANGER_UID, -1)  # unlinked and made again by another
    assert outputs.release() == 1
    assert not _exists(mine) and _exists(reused) and _exists(unhanded)  # never a name it did not hand out
    assert outputs.unread() == 0 and outputs.release() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="makes segments owned by another uid: needs root")
def test_a_root_daemon_releases_a_peers_outputs_as_that_peer(shm):
    theirs, roots = shm(f"{PREFIX}-theirs", uid=STRANGER_UID), shm(f"{PREFIX}-roots")
    outputs = OutputSegments(STRANGER_UID)
    outputs.handed([_ref(theirs), _ref(roots)])
    assert outputs.release() == 1 and not _exists(theirs) and _exists(roots)  # root's is not the peer's


def test_a_dead_workers_orphans_are_what_it_made_and_nobody_was_handed(shm):
    handed = shm(f"{PREFIX}-77-1")
    orphan = shm(f"{PREFIX}-77-2")
    shm(f"{PREFIX}-770-1")  # another worker's (pid 770): not a prefix match
    shm(f"{PREFIX}-78-1")
    outputs = OutputSegments(os.geteuid())
    outputs.handed([_ref(handed)])
    assert orphans_of(77, PREFIX, [outputs]) == [orphan]
    assert sorted(orphans_of(77, PREFIX, [])) == [handed, orphan]
