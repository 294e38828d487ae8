# Source this at the start of a device-tool command (carry .whl and nothing else of ours):
#   source scripts/device/setup.sh && python3 benchmarks/gpu_families.py ...
# It installs the carried wheels into /tmp/site and puts them, the ray stand-in and the checkout on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/scripts/device/ray_stand_in:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  RAY_AUTH_MODE=disabled
