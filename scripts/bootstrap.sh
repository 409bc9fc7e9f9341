#!/usr/bin/env bash
# Create .venv with nodeagent and everything its tests and benchmarks need.
# Idempotent: re-runs only when pyproject.toml is newer than the last install.
# Quiet unless something fails: pip's output (its warnings too) goes to
# .venv/bootstrap.log, shown when a step fails. BOOTSTRAP_VERBOSE=1 shows it live.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
# torch goes in first and pinned, so the dev extra's torch range is already
# satisfied and pip never resolves it to a newer (CUDA) build. Override with
# TORCH_SPEC (e.g. to use a GPU build you already have a wheel for).
torch_spec=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.nodeagent-installed
log=.venv/bootstrap.log

# Run "$@" with its output in $log; on failure show the log and say where it is.
quietly() {
    if [ "${BOOTSTRAP_VERBOSE:-0}" = 1 ]; then
        "$@" 2>&1 | tee -a "$log"
        return "${PIPESTATUS[0]}"
    fi
    local status=0
    "$@" >>"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        echo "bootstrap: failed (status $status): $*" >&2
        echo "bootstrap: ---- $log ----" >&2
        tail -n 60 "$log" >&2
        echo "bootstrap: ---- end of $log (the whole of it is kept there) ----" >&2
    fi
    return "$status"
}

if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $($python --version 2>&1)" >&2
    "$python" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "bootstrap: installing $torch_spec and nodeagent[dev] into .venv (a few minutes the first time; log: $log)" >&2
    : >"$log"
    quietly .venv/bin/python -m pip install --disable-pip-version-check "$torch_spec"
    quietly .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]'
    touch "$stamp"
    echo "bootstrap: done; the nodeagent command is .venv/bin/nodeagent" >&2
fi
