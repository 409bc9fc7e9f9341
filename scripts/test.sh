#!/usr/bin/env bash
# Set up, then run the test suite (GPU tests skip where no GPU is found), on every core: pytest-xdist
# with one worker a core (tests/conftest.py says how the tests that time things still run alone).
#
#   bash scripts/test.sh                      # the whole suite, in parallel
#   bash scripts/test.sh tests/daemon/test_cli.py    # arguments go to pytest
#   bash scripts/test.sh -p no:xdist          # serially, in one process (or -n 0)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
parallel=(-n auto --dist loadgroup)
for arg in "$@"; do
    case $arg in
        -n|-n*|--numprocesses|--numprocesses=*|*no:xdist|--dist|--dist=*) parallel=() ;;
    esac
done
# Bytecode caches: where PYTHONDONTWRITEBYTECODE is set, every process the tests start (hundreds:
# daemons, workers, clients; many import torch) would compile what it imports from source again,
# 8 s of CPU for torch alone against 3.5 s from the cache. Let the first import write them.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest "${parallel[@]}" "$@"
