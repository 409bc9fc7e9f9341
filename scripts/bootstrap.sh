#!/usr/bin/env bash
# Create .venv with nodeagent and everything its tests and benchmarks need.
# Idempotent: re-runs only when pyproject.toml is newer than the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
# torch goes in first and pinned, so the dev extra's torch range is already
# satisfied and pip never resolves it to a newer (CUDA) build. Override with
# TORCH_SPEC (e.g. to use a GPU build you already have a wheel for).
torch_spec=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.nodeagent-installed

if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $($python --version 2>&1)" >&2
    "$python" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "bootstrap: installing $torch_spec and nodeagent[dev] into .venv" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$torch_spec"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
    touch "$stamp"
fi
