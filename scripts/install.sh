#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs hybridflow into it.
# torch goes first as exactly 2.13.0 (a CPU build on machines without CUDA); everything else after,
# so nothing can pull a different torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDFLOW_VENV:-.venv}
PYTHON=${PYTHON:-python3}
# The code-reward sandbox needs bubblewrap (and libseccomp for its seccomp filter): install them
# when we can (root with apt), otherwise say so; code rewards refuse to run without bubblewrap.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2) >/dev/null 2>&1 \
      || echo "warning: apt-get could not install bubblewrap; code rewards will refuse to run (see docs/rewards.md)" >&2
  else
    echo "warning: bubblewrap (bwrap) is not installed; code rewards will refuse to run until it is" \
         "(Debian/Ubuntu: sudo apt-get install bubblewrap; see docs/rewards.md)" >&2
  fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,math]"
echo "installed hybridflow into $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
