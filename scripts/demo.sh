#!/usr/bin/env bash
# The main job: install, then run the built-in demo on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/hybridflow demo "$@"
