#!/usr/bin/env bash
# Set up, then start a daemon on the embedded default (cpu) backend with a demo:
# an inference client and a training client sharing one device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/nodeagent demo "$@"
