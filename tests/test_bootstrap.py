"""scripts/bootstrap.sh is quiet unless something fails (issue 24): pip's dozens of
"WARNING: Location ... is ignored" lines stay in the log; a failing step shows it.
Runs the script in a copy of the repository's layout with a stand-in .venv/bin/python,
so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO

# A stand-in for the venv's python: `-m pip install ...` says what pip says on a host with a
# find-links location that does not exist, and fails when the spec is $FAIL_ON.
FAKE_PYTHON = """#!/bin/sh
for i in $(seq 1 30); do
    echo "WARNING: Location '/nonexistent/wheels-$i' is ignored: it is either a non-existing path or lacks a specific scheme." >&2
done
echo "Successfully installed something"
for arg in "$@"; do
    if [ -n "$FAIL_ON" ] && [ "$arg" = "$FAIL_ON" ]; then
        echo "ERROR: No matching distribution found for $arg" >&2
        exit 1
    fi
done
exit 0
"""


@pytest.fixture
def tree(tmp_path):
    """A checkout's layout: the script, pyproject.toml and an existing .venv."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def bootstrap(tree, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(tree / "scripts" / "bootstrap.sh")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_a_set_up_that_works_says_two_lines_and_keeps_pips_output_in_its_log(tree):
    out = bootstrap(tree)
    assert out.returncode == 0, out.stderr
    assert "WARNING" not in out.stdout + out.stderr
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 2 and ".venv/bin/nodeagent" in lines[-1], lines
    assert (tree / ".venv" / "bootstrap.log").read_text().count("WARNING: Location") == 60  # two pip runs
    assert bootstrap(tree).stderr == ""  # installed: a second run has nothing to do or say


def test_a_set_up_that_fails_shows_the_log_and_says_which_step(tree):
    out = bootstrap(tree, FAIL_ON="-e")
    assert out.returncode != 0
    assert "bootstrap: failed (status 1):" in out.stderr and "-e .[dev]" in out.stderr
    assert "ERROR: No matching distribution found for -e" in out.stderr
    assert not (tree / ".venv" / ".nodeagent-installed").exists()  # the next run tries again
