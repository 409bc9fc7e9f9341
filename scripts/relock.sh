#!/usr/bin/env bash
# Re-resolve nodeagent's dependencies to the newest releases its ranges admit, install them into a
# separate venv and run the test suite there, so that a break like a new msgspec's is found on
# purpose rather than by CI. requirements.lock is replaced only with --write, and only if the suite
# passed on the new versions (or --no-test was given).
#
#   bash scripts/relock.sh                  # resolve newest -> .venv-newest, run the suite, show the changes
#   bash scripts/relock.sh --write          # the same, then write requirements.lock if the suite passed
#   bash scripts/relock.sh --write --no-test  # only re-resolve and write (e.g. after editing pyproject.toml)
#   bash scripts/relock.sh -- -x tests/client_lib/test_protocol.py   # arguments after -- go to pytest
#
# The lock is for CPython 3.11 on Linux x86_64 (manylinux 2.28), the machines CI runs on.
set -euo pipefail
cd "$(dirname "$0")/.."
write=0 test=1 pytest_args=()
while [ $# -gt 0 ]; do
    case $1 in
        --write) write=1 ;;
        --no-test) test=0 ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "relock: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done
bash scripts/bootstrap.sh  # brings the pinned uv into .venv/uv
uv=.venv/uv/bin/uv
export PYTHONPATH=
new=$(mktemp --suffix=.lock)
trap 'rm -f "$new"' EXIT
links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
sources=()
for dir in $links; do sources+=(--find-links "$dir"); done
[ -n "$links" ] || sources+=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
echo "relock: resolving the newest releases of pyproject.toml's dependencies and its dev extra" >&2
"$uv" pip compile pyproject.toml --extra dev --upgrade --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 "${sources[@]}" --no-emit-find-links \
    --custom-compile-command "bash scripts/relock.sh --write" -o "$new" --quiet
changes=$(diff <(grep -E '^[A-Za-z0-9_.-]+==' requirements.lock) <(grep -E '^[A-Za-z0-9_.-]+==' "$new") \
          | grep -E '^[<>]' || true)
if [ -z "$changes" ]; then
    echo "relock: the lock already holds the newest releases" >&2
else
    echo "relock: changes against requirements.lock (< locked, > newest):" >&2
    echo "$changes" >&2
fi
status=0
if [ "$test" = 1 ]; then
    rm -rf .venv-newest
    "$(command -v python3)" -m venv .venv-newest
    echo "relock: installing the newest releases into .venv-newest" >&2
    "$uv" pip sync --python .venv-newest/bin/python "${sources[@]}" "$new"
    "$uv" pip install --python .venv-newest/bin/python --no-deps -e . --quiet
    echo "relock: running the suite on the newest releases" >&2
    .venv-newest/bin/python -m pytest "${pytest_args[@]}" || status=$?
    echo "relock: the suite on the newest releases exited $status" >&2
fi
if [ "$write" = 1 ]; then
    if [ "$status" -ne 0 ]; then
        echo "relock: requirements.lock left as it was: the suite failed on the newest releases" >&2
        exit "$status"
    fi
    cp "$new" requirements.lock
    echo "relock: wrote requirements.lock" >&2
fi
exit "$status"
