"""scripts/bootstrap.sh installs exactly requirements.lock, shows its steps, and keeps the noise
in its log; requirements.lock satisfies pyproject.toml. The script runs in a copy of the
repository's layout with stand-ins for the venv's python and for uv, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

# The venv's python: `-m pip install --target DIR uv==V` says what pip says on a host whose
# find-links do not exist and puts a stand-in uv in DIR/bin; `-m pip config get` finds nothing.
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2 $3" = "-m pip config" ]; then exit 1; fi
if [ "$1 $2 $3" = "-m pip install" ]; then
    for i in $(seq 1 30); do
        echo "WARNING: Location '/nonexistent/wheels-$i' is ignored: it is either a non-existing path." >&2
    done
    while [ $# -gt 0 ]; do
        if [ "$1" = "--target" ]; then target=$2; fi
        shift
    done
    mkdir -p "$target/bin" && cp "$FAKE_UV" "$target/bin/uv" && chmod +x "$target/bin/uv"
    echo "Successfully installed uv"
    exit 0
fi
exit 0
"""
# uv: writes its argv to $UV_CALLS, says what uv says, fails when an argument is $FAIL_ON.
FAKE_UV = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "uv 0.13.9"; exit 0; fi
echo "$*" >>"$UV_CALLS"
for arg in "$@"; do
    if [ -n "$FAIL_ON" ] && [ "$arg" = "$FAIL_ON" ]; then
        echo "error: Failed to install $arg" >&2
        exit 1
    fi
done
echo "Installed 3 packages in 12ms" >&2
echo " + msgspec==0.23.0" >&2
"""


@pytest.fixture
def tree(tmp_path):
    """A checkout's layout: the script, pyproject.toml, the lock and an existing .venv."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    for name in ("pyproject.toml", "requirements.lock"):
        shutil.copy(REPO / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "fake-uv").write_text(FAKE_UV)
    return tmp_path


def bootstrap(tree, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run(["bash", str(tree / "scripts" / "bootstrap.sh")], capture_output=True, text=True,
                          timeout=60, env={**base, "FAKE_UV": str(tree / "fake-uv"),
                                           "UV_CALLS": str(tree / "uv-calls"), **env})


def uv_calls(tree) -> list[str]:
    return (tree / "uv-calls").read_text().splitlines()


def test_a_set_up_shows_its_steps_and_keeps_pips_warnings_in_its_log(tree):
    out = bootstrap(tree)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    steps = [line for line in lines if line.startswith("bootstrap: [")]
    assert [s.split("]")[0] for s in steps] == ["bootstrap: [1/3", "bootstrap: [2/3", "bootstrap: [3/3"]
    assert " + msgspec==0.23.0" in lines  # the installer's own progress, shown as it goes
    assert "WARNING" not in out.stdout + out.stderr
    assert (tree / ".venv" / "bootstrap.log").read_text().count("WARNING: Location") == 30
    assert lines[-1].endswith(".venv/bin/nodeagent")
    assert bootstrap(tree).stderr == ""  # installed: a second run has nothing to do or say


def test_it_installs_exactly_the_lock_then_the_checkout_without_resolving(tree):
    assert bootstrap(tree).returncode == 0
    sync, editable = uv_calls(tree)
    assert sync.startswith("pip sync --python .venv/bin/python ") and sync.endswith(" requirements.lock")
    assert editable.startswith("pip install --python .venv/bin/python --no-deps -e .")


def test_a_changed_lock_installs_again(tree):
    assert bootstrap(tree).returncode == 0
    os.utime(tree / "requirements.lock", (os.path.getmtime(tree / ".venv" / ".nodeagent-installed") + 5,) * 2)
    out = bootstrap(tree)
    assert out.returncode == 0 and "[2/3]" in out.stderr and len(uv_calls(tree)) == 4


def test_torch_comes_from_a_configured_wheel_directory_else_pytorchs_cpu_index(tree):
    wheels = tree / "wheels"
    wheels.mkdir()
    pin = next(line for line in (tree / "requirements.lock").read_text().splitlines() if line.startswith("torch=="))
    (wheels / f"torch-{pin.removeprefix('torch==')}-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert bootstrap(tree, PIP_FIND_LINKS=str(wheels)).returncode == 0
    sync = uv_calls(tree)[0]
    assert f"--find-links {wheels}" in sync and "download.pytorch.org" not in sync
    (tree / ".venv" / ".nodeagent-installed").unlink()
    (tree / "uv-calls").unlink()
    assert bootstrap(tree).returncode == 0
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in uv_calls(tree)[0]


def test_a_failed_step_says_which_and_where_its_log_is(tree):
    out = bootstrap(tree, FAIL_ON="requirements.lock")
    assert out.returncode != 0
    assert "bootstrap: failed (status 1):" in out.stderr and "pip sync" in out.stderr
    assert "error: Failed to install requirements.lock" in out.stderr
    assert ".venv/bootstrap.log" in out.stderr.strip().splitlines()[-1]
    assert not (tree / ".venv" / ".nodeagent-installed").exists()  # the next run tries again


def _locked() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version.strip())
    return pins


def test_the_lock_satisfies_every_requirement_of_pyproject_and_its_dev_extra():
    """Editing a range in pyproject.toml without `bash scripts/relock.sh --write` fails here."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _locked()
    env = {"python_version": "3.11", "extra": "dev"}
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements.lock: run bash scripts/relock.sh --write"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock has {req.name}=={pins[name]}, outside {req}: run bash scripts/relock.sh --write")


def test_torch_is_locked_to_the_cpu_build():
    assert str(_locked()["torch"]) == "2.13.0+cpu"
