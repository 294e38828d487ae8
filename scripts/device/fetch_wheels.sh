#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels the GPU machine of the device tool lacks for hybridflow: its image
# has torch 2.11 + CUDA and most of our dependencies but not these, and it reaches no registry. Ray (79 MB) is
# over the tool's 64 MiB carry limit: scripts/device/ray_stand_in is an import-only stand-in (local mode only).
# vLLM cannot be carried at all (its CUDA wheel and the torch it pins are several hundred MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.19.0 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 gguf==0.19.0 bm25s==0.3.16 peft==0.21.2
du -sh .whl
