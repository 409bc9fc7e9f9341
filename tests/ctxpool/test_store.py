"""Model store: factory paths, weight files, checks, weights in one shared segment."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile

import pytest
import torch

from client_lib import protocol as p
from client_lib import tensors
from ctxpool import hostmem, peer_open, store
from tests import safetensors_files as safetensors
from ctxpool.messages import PeerIdentity
from ctxpool.store import ModelError
from tests import models_for_tests as m


@pytest.fixture
def shm_names(request):
    """Fresh segment names for this test; fails if any of them is left in /dev/shm."""
    made: list[str] = []

    def fresh() -> str:
        made.append(tensors.segment_name("na-test-store"))
        return made[-1]

    yield fresh
    left = [n for n in made if os.path.exists(f"/dev/shm/{n}")]
    for n in left:
        tensors.unlink_segment(n)
    assert not left, f"segments left behind: {left}"


def _error(fn, *args) -> ModelError:
    with pytest.raises(ModelError) as info:
        fn(*args)
    assert info.value.code == p.ErrorCode.MODEL
    return info.value


# ------------------------------------------------------------------ factory


@pytest.mark.parametrize("path", ["no_colon", "a:b:c", "1pkg:f", "pkg:", ":f", "pkg.:f", "pkg:f()"])
def test_malformed_factory_paths(path):
    assert "package.module:callable" in str(_error(store.resolve_factory, path))


def test_missing_module_names_the_search_path():
    err = _error(store.resolve_factory, "no_such_pkg_xyz.models:build")
    assert "'no_such_pkg_xyz'" in str(err) and "searched sys.path" in str(err) and sys.path[0] in str(err)


def test_missing_attribute_and_not_callable():
    assert "has no attribute 'nothing_here'" in str(_error(store.resolve_factory,
                                                           "tests.models_for_tests:nothing_here"))
    assert "not callable" in str(_error(store.resolve_factory, "tests.models_for_tests:NOT_CALLABLE"))
    assert store.resolve_factory("tests.models_for_tests:mlp") is m.mlp
    assert store.resolve_factory("tests.models_for_tests:Tied.forward") is m.Tied.forward


def test_module_that_raises_on_import_and_one_written_after_start(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "na_broken_models.py").write_text("import na_not_there_either\n")
    err = _error(store.resolve_factory, "na_broken_models:build")
    assert "importing 'na_broken_models' failed" in str(err) and "na_not_there_either" in str(err)
    (tmp_path / "na_raising_models.py").write_text("raise RuntimeError('boom at import')\n")
    assert "RuntimeError: boom at import" in str(_error(store.resolve_factory, "na_raising_models:build"))
    # written after the first import attempts: found (import caches invalidated)
    (tmp_path / "na_late_models.py").write_text("def build():\n    return 1\n")
    assert store.resolve_factory("na_late_models:build")() == 1


def test_factory_that_raises_or_builds_no_module():
    assert "raised RuntimeError: factory failed on purpose" in str(
        _error(store.build_module, "tests.models_for_tests:factory_raises"))
    assert "returned a int, not a torch.nn.Module" in str(
        _error(store.build_module, "tests.models_for_tests:not_a_module"))
    assert not store.build_module("tests.models_for_tests:mlp").training


# ------------------------------------------------------------------ weights


def test_weights_file_errors(tmp_path):
    assert "does not exist" in str(_error(store.load_weights, str(tmp_path / "missing.safetensors")))
    assert "must be absolute" in str(_error(store.load_weights, "relative.pt"))
    (tmp_path / "dir.pt").mkdir()
    assert "is not a regular file" in str(_error(store.load_weights, str(tmp_path / "dir.pt")))
    os.mkfifo(tmp_path / "fifo.safetensors")  # opened without blocking, then refused
    assert "is not a regular file" in str(_error(store.load_weights, str(tmp_path / "fifo.safetensors")))
    (tmp_path / "w.npz").write_bytes(b"x")
    assert "unknown suffix '.npz'" in str(_error(store.load_weights, str(tmp_path / "w.npz")))


def test_format_errors_quote_nothing_read_from_the_file(tmp_path):
    """A file that is not what it claims may be anyone's: no bytes, lengths or sizes from it."""
    shadow_like = tmp_path / "shadow.safetensors"
    shadow_like.write_bytes(b"root:$6$hash-material-that-must-stay-private:19000:0:99999:7:::\n" * 11)
    header_len = struct.unpack("<Q", shadow_like.read_bytes()[:8])[0]
    err = str(_error(store.load_weights, str(shadow_like)))
    assert "not a safetensors file" in err
    assert str(header_len) not in err and str(shadow_like.stat().st_size) not in err and "root:" not in err
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(struct.pack("<Q", 40) + b'{"a": 1')
    err = str(_error(store.load_weights, str(cut)))
    assert "its header length does not fit the file" in err and "40" not in err.replace(str(tmp_path), "")
    pickled = tmp_path / "notes.pt"
    pickled.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    err = str(_error(store.load_weights, str(pickled)))
    assert "weights_only=True" in err and "'r'" not in err and "root:" not in err
    huge = tmp_path / "huge_shape.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [0, 2 ** 61, 2 ** 61], "data_offsets": [0, 0]}}).encode()
    huge.write_bytes(struct.pack("<Q", len(header)) + header)
    assert "bad shape" in str(_error(store.load_weights, str(huge)))


def test_wrong_format_files(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    assert "not a safetensors file" in str(_error(store.load_weights, str(garbage)))
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    assert "shorter than the 8-byte header length" in str(_error(store.load_weights, str(short)))
    not_json = tmp_path / "notjson.safetensors"
    not_json.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    assert "header is not JSON" in str(_error(store.load_weights, str(not_json)))
    for name, text in [("dtype", {"w": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}),
                       ("offsets", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})]:
        path = tmp_path / f"bad_{name}.safetensors"
        header = json.dumps(text).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        assert name in str(_error(store.load_weights, str(path))).replace("data_offsets", "offsets")
    not_torch = tmp_path / "model.pt"
    not_torch.write_bytes(b"this is not a torch file")
    assert "weights_only=True" in str(_error(store.load_weights, str(not_torch)))
    a_list = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], a_list)
    assert "holds a list, not a state dict" in str(_error(store.load_weights, str(a_list)))


def test_safetensors_round_trip_every_dtype(tmp_path):
    original = {f"t_{dtype}".replace("torch.", ""): (torch.randn(3, 5) * 9).to(dtype)
                for dtype in safetensors.DTYPES.values()}
    original["empty"] = torch.zeros(0, 4)
    original["scalar"] = torch.tensor(2.5)
    path = str(tmp_path / "all.safetensors")
    safetensors.save(original, path, metadata={"format": "pt"})
    loaded = store.load_weights(path)
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_torch_state_dict_and_checkpoint_wrapper(tmp_path):
    module = m.conv_bn()
    path = tmp_path / "ckpt.pth"
    torch.save({"state_dict": module.state_dict(), "epoch": 3}, path)
    loaded = store.load_weights(str(path))
    assert loaded.keys() == module.state_dict().keys()
    assert torch.equal(loaded["conv.weight"], module.conv.weight)


def test_check_weights_lists_what_does_not_fit():
    module = m.mlp()
    store.check_weights(module, module.state_dict())
    state = {k: v for k, v in m.mlp_wider().state_dict().items() if k != "2.bias"}
    state["extra.weight"] = torch.zeros(1)
    err = str(_error(store.check_weights, module, state))
    assert "1 missing keys (2.bias)" in err
    assert "1 unexpected keys (extra.weight)" in err
    assert "0.weight: file [32, 8] vs module [16, 8]" in err and "2.weight: file [4, 32] vs module [4, 16]" in err


def test_a_tied_weight_given_under_one_name_is_enough():
    module = m.tied()
    state = module.state_dict()
    del state["head.weight"]  # what a deduplicating exporter writes
    store.check_weights(module, state)
    # The tie is what makes it enough: the same module untied misses the weight,
    untied = m.tied()
    untied.head.weight = torch.nn.Parameter(untied.head.weight.detach().clone())
    assert "1 missing keys (head.weight)" in str(_error(store.check_weights, untied, state))
    # and a tied weight given under neither name is missing under both.
    del state["embed.weight"]
    assert "2 missing keys" in str(_error(store.check_weights, module, state))


# ----------------------------------------------------------- shared memory


def test_weights_placed_in_one_segment_and_attached_zero_copy(shm_names, tmp_path):
    source = m.conv_bn()
    with torch.no_grad():
        source.bn.running_mean.uniform_(-1, 1)
        source.bn.running_var.uniform_(0.5, 2)
    source.bn.num_batches_tracked.fill_(7)
    path = str(tmp_path / "convbn.safetensors")
    safetensors.save(source.state_dict(), path)
    state = store.load_weights(path)
    built = m.conv_bn()
    store.check_weights(built, state)
    manifest = store.place_in_shared_memory(built, state, shm_names())
    assert set(manifest.entries) == {"conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
                                     "bn.running_var", "bn.num_batches_tracked", "scale"}
    assert manifest.entries["bn.num_batches_tracked"].dtype == "int64"
    assert all(e.offset % tensors.ALIGN_BYTES == 0 for e in manifest.entries.values())
    assert store.model_bytes(manifest) == sum(t.numel() * t.element_size()
                                              for t in list(source.parameters()) + list(source.buffers()))
    first, second = m.conv_bn(), m.conv_bn()
    seg1 = store.attach_module(first, manifest)
    seg2 = store.attach_module(second, manifest)
    try:
        x = torch.randn(2, 3, 5, 5)
        source.eval(), first.eval(), second.eval()
        with torch.no_grad():
            assert torch.equal(first(x), source(x)) and torch.equal(second(x), source(x))
        assert int(first.bn.num_batches_tracked) == 7
        assert "scale" not in first.state_dict()  # still non-persistent
        assert isinstance(first.conv.weight, torch.nn.Parameter) and not first.conv.weight.requires_grad
        # one memory: a write through one module's view shows in the other's
        with torch.no_grad():
            first.conv.bias[0] = 123.0
        assert float(second.conv.bias[0]) == 123.0
    finally:
        del first, second
        seg1.close(), seg2.close()
        tensors.unlink_segment(manifest.segment)


def test_factory_init_is_used_without_weights_and_tied_weights_stay_tied(shm_names):
    built = m.tied()
    manifest = store.place_in_shared_memory(built, None, shm_names())
    entries = manifest.entries
    assert entries["embed.weight"].offset == entries["head.weight"].offset
    assert manifest.total_bytes == hostmem.ALIGN_BYTES * -(-10 * 6 * 4 // hostmem.ALIGN_BYTES)
    other = m.tied()
    seg = store.attach_module(other, manifest)
    try:
        assert other.head.weight is other.embed.weight
        assert torch.equal(other.embed.weight, built.embed.weight)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(other(ids), built(ids)))
    finally:
        del other
        seg.close()
        tensors.unlink_segment(manifest.segment)


def test_attach_refuses_a_module_that_differs_and_a_segment_that_is_gone(shm_names):
    manifest = store.place_in_shared_memory(m.mlp(), None, shm_names())
    try:
        err = str(_error(store.attach_module, m.mlp_wider(), manifest))
        assert "differs from the prepared weights" in err and "0.weight: [32, 8] vs stored [16, 8]" in err
        err = str(_error(store.attach_module, m.conv_bn(), manifest))
        assert "missing 0.weight" in err and "unexpected conv.weight" in err
    finally:
        tensors.unlink_segment(manifest.segment)
    assert "weights of the model are gone" in str(_error(store.attach_module, m.mlp(), manifest))


def test_a_failed_placement_leaves_no_segment(shm_names):
    module = m.mlp()
    module.register_buffer("odd", torch.zeros(3, dtype=torch.uint16))  # a dtype that cannot cross
    name = shm_names()
    assert "uint16" in str(_error(store.place_in_shared_memory, module, None, name))
    assert not os.path.exists(f"/dev/shm/{name}")
    with torch.device("meta"):
        on_meta = m.mlp()
    name = shm_names()
    assert "meta device" in str(_error(store.place_in_shared_memory, on_meta, None, name))
    assert not os.path.exists(f"/dev/shm/{name}")
    name = shm_names()
    unchecked = dict(m.mlp().state_dict(), **{"0.weight": torch.zeros(3)})  # not through check_weights
    with pytest.raises(RuntimeError):
        store.place_in_shared_memory(m.mlp(), unchecked, name)  # fails while copying, after creating
    assert not os.path.exists(f"/dev/shm/{name}")


# ------------------------------------------------------- the reader's rights


@pytest.fixture
def public_dir():
    """A directory any user may search (pytest's tmp_path lies under a 0700 one)."""
    path = tempfile.mkdtemp(prefix="na-store-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_weights_are_opened_with_the_readers_rights(public_dir):
    """What a root worker reads for a peer is what that peer may read: search rights on
    the directories, symlinks followed as the peer, its groups; errors the peer's own."""
    if os.geteuid() != 0:
        pytest.skip(f"opening a file as another user needs root; these tests run as uid {os.geteuid()}")
    nobody = PeerIdentity(uid=65534, gid=65534, groups=[])
    state = m.mlp().state_dict()
    readable = os.path.join(public_dir, "readable.safetensors")
    safetensors.save(state, readable)
    os.chmod(readable, 0o644)
    loaded = store.load_weights(readable, reader=nobody)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())

    private = os.path.join(public_dir, "private")
    os.mkdir(private, 0o700)
    safetensors.save(state, os.path.join(private, "there.safetensors"))
    os.chmod(os.path.join(private, "there.safetensors"), 0o644)
    there = str(_error(store.load_weights, os.path.join(private, "there.safetensors"), nobody))
    absent = str(_error(store.load_weights, os.path.join(private, "absent.safetensors"), nobody))
    assert "Permission denied" in there and there.replace("there", "X") == absent.replace("absent", "X")

    secret = os.path.join(public_dir, "root-only.bin")
    with open(secret, "wb") as f:
        f.write(b"root:$6$private-hash:19000:0:99999:7:::\n" * 9)
    os.chmod(secret, 0o600)
    os.symlink(secret, os.path.join(public_dir, "link.safetensors"))
    err = str(_error(store.load_weights, os.path.join(public_dir, "link.safetensors"), nobody))
    assert "Permission denied" in err and str(os.path.getsize(secret)) not in err and "root:" not in err
    assert store.load_weights(os.path.join(private, "there.safetensors")).keys() == state.keys()  # root itself may

    group_only = os.path.join(public_dir, "group.safetensors")  # readable through a supplementary group
    safetensors.save(state, group_only)
    os.chown(group_only, 0, 61_999)
    os.chmod(group_only, 0o640)
    assert "Permission denied" in str(_error(store.load_weights, group_only, nobody))
    in_group = PeerIdentity(uid=65534, gid=65534, groups=[61_999])
    assert store.load_weights(group_only, reader=in_group).keys() == state.keys()


def test_the_peers_groups_come_from_its_process_and_only_while_it_is_that_user():
    me = peer_open.identity_of(os.getuid(), os.getgid(), os.getpid())
    assert me.groups == sorted(set(os.getgroups()))
    assert peer_open.identity_of(os.getuid() + 1, os.getgid(), os.getpid()).groups == []  # pid reused by another
    assert peer_open.identity_of(os.getuid(), os.getgid(), None).groups == []
