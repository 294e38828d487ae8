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
LOG=$(mktemp -t hybridflow-install.XXXXXX.log)
# pip's full output goes to $LOG; the terminal gets one line per step, and on a failure pip's errors.
quiet_pip() {
  local what=$1; shift
  if "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q "$@" >>"$LOG" 2>&1; then
    echo "  ok  $what"
  else
    echo "  FAILED  $what; pip's errors (full log: $LOG):" >&2
    grep -E "^(ERROR|error)|Error|No matching distribution|conflict" "$LOG" | tail -n 20 >&2 || tail -n 20 "$LOG" >&2
    exit 1
  fi
}
quiet_pip "pip" --upgrade pip
quiet_pip "torch 2.13.0" "torch==2.13.0"
quiet_pip "hybridflow and its dependencies" -e ".[test,math]"
echo "installed hybridflow into $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
