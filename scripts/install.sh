#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs hybridflow into it.
# torch goes first as exactly 2.13.0 (a CPU build on machines without CUDA); everything else after,
# so nothing can pull a different torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDFLOW_VENV:-.venv}
PYTHON=${PYTHON:-python3}
bash scripts/install_sandbox.sh  # bubblewrap for the code-reward sandbox (warns when it cannot)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,math]"
echo "installed hybridflow into $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
