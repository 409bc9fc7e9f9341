#!/usr/bin/env bash
# Create .venv with exactly the versions in requirements.lock, and nodeagent itself (editable).
# Idempotent: re-runs only when requirements.lock or pyproject.toml is newer than the last install.
# The installer is uv (pinned below, installed from PyPI into .venv/uv); it prints each step with
# its counts and times. Its full output is kept in .venv/bootstrap.log and shown if a step fails.
#
#   bash scripts/bootstrap.sh            # what scripts/test.sh and scripts/demo.sh run first
#   bash scripts/relock.sh --help        # re-resolve to the newest releases and test against them
#
# Torch is the CPU build torch==2.13.0+cpu. It comes from a local wheel directory where pip is
# configured with one (PIP_FIND_LINKS or pip's find-links setting), else from PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
uv_spec=uv==0.13.9
lock=${NODEAGENT_LOCK:-requirements.lock}
stamp=.venv/.nodeagent-installed
log=.venv/bootstrap.log
torch_index=https://download.pytorch.org/whl/cpu

say() { echo "bootstrap: $*" >&2; }

# Run "$@" with its output shown live (uv's lines are few: a step's counts and each package) and
# kept in $log; on failure say which step failed and where the whole output is.
step() {
    local status=0
    "$@" 2>&1 | tee -a "$log" >&2 || status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || say "failed (status $status): $*; the whole output is in $log"
    return "$status"
}

# Run "$@" with its output in $log only (pip's warnings about absent find-links are many); on
# failure show the log's end.
quietly() {
    local status=0
    "$@" >>"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        say "failed (status $status): $*"
        tail -n 40 "$log" >&2
        say "the whole output is in $log"
    fi
    return "$status"
}

if [ ! -f "$lock" ]; then
    say "no $lock here; run from a checkout of nodeagent"
    exit 2
fi
if [ -f "$stamp" ] && [ "$stamp" -nt "$lock" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $($python --version 2>&1)"
    "$python" -m venv .venv
fi
: >"$log"
if [ ! -x .venv/uv/bin/uv ] || [ "$(.venv/uv/bin/uv --version 2>/dev/null | cut -d' ' -f2)" != "${uv_spec#uv==}" ]; then
    say "[1/3] installing the installer, $uv_spec"
    rm -rf .venv/uv
    quietly .venv/bin/python -m pip install --disable-pip-version-check --target .venv/uv "$uv_spec"
fi
uv=(.venv/uv/bin/uv)

# Where the CPU torch wheel comes from: a configured local wheel directory, else PyTorch's index.
links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
sources=()
for dir in $links; do
    sources+=(--find-links "$dir")
done
torch_pin=$(grep -E '^torch==' "$lock" | head -1)
if [ -z "$links" ] || ! ls $links 2>/dev/null | grep -q "^torch-${torch_pin#torch==}-"; then
    sources+=(--extra-index-url "$torch_index" --index-strategy unsafe-best-match)
fi
count=$(grep -cE '^[A-Za-z0-9_.-]+==' "$lock")
say "[2/3] installing the $count locked packages of $lock into .venv (log: $log)"
step "${uv[@]}" pip sync --python .venv/bin/python "${sources[@]}" "$lock"
say "[3/3] installing nodeagent from this checkout (editable)"
step "${uv[@]}" pip install --python .venv/bin/python --no-deps -e .
touch "$stamp"
say "done; the nodeagent command is .venv/bin/nodeagent"
