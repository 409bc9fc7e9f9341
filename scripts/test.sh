#!/usr/bin/env bash
# Set up, then run the test suite (GPU tests skip where no GPU is found).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
