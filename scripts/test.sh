#!/usr/bin/env bash
# Install (with the CPU build of vLLM, so the vLLM rollout tests run; HYBRIDFLOW_VLLM=0 skips it),
# fetch the offline SmolLM2 checkpoint, then run the test suite.
# Pass pytest arguments through, e.g. `bash scripts/test.sh -m "not slow"` for the quick subset.
set -euo pipefail
cd "$(dirname "$0")/.."
HYBRIDFLOW_VLLM=${HYBRIDFLOW_VLLM:-1} bash scripts/install.sh
if [ -f scripts/get_smollm2.py ]; then
  .venv/bin/python scripts/get_smollm2.py || echo "warning: SmolLM2 conversion failed; tests that need it will skip"
fi
export OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
