#!/usr/bin/env bash
# make gpu-check: what a machine with a GPU runs (CI has none), within 6 minutes, with only what such a
# machine has: Python, torch with CUDA, numpy and Cython installed; pyzmq, msgspec, pytest and
# prometheus_client as wheels in $PDCORE_WHEELS (make gpu-wheels downloads them; default .gpu-wheels),
# or from PyPI where it is reachable.
#   1. builds the compiled modules in place, in a venv that sees the machine's torch;
#   2. the demo with the KV cache in device memory, every byte checked: PD, then EPD (embeddings too);
#   3. the fence canary with device pages (a paused prefill, decode's pages handed back, checked);
#   4. the staging tests that need CUDA;
#   5. device KV against host KV, and the gather into pinned memory, measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${GPU_VENV:-.gpu-venv}
WHEELS=${PDCORE_WHEELS:-.gpu-wheels}
start=$(date +%s)
step() { echo "gpu-check [$(( $(date +%s) - start )) s]: $*"; }

step "a venv over the machine's torch"
test -x "$VENV/bin/python" || "$PYTHON" -m venv --system-site-packages "$VENV"
PY="$VENV/bin/python"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
if [ -d "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" pyzmq msgspec pytest pytest-timeout prometheus_client
else
    "$PY" -m pip install -q pyzmq msgspec pytest pytest-timeout prometheus_client
fi

step "building the compiled modules in place"
"$PY" setup.py -q build_ext --inplace >/dev/null

step "PD demo, KV cache in device memory, every page checked"
timeout 90 "$PY" -m pdcore demo --kv-device cuda --requests 100 --progress plain
step "EPD demo, KV cache and embedding buffers in device memory, every row and page checked"
timeout 90 "$PY" -m pdcore demo --epd --kv-device cuda --requests 60 --progress plain

step "the fence canary with device pages, and the staging tests that need CUDA"
PDCORE_FENCE_KV_DEVICE=cuda timeout 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
    "tests/test_fence_blackbox.py::test_decode_frees_pages_only_when_a_paused_prefill_can_no_longer_write_them[tcp]" \
    tests/transport/test_staging.py tests/test_device_kv.py -s -k "tcp or cuda or device"

step "device KV against host KV, in one run"
timeout 120 "$PY" benchmarks/device_kv.py --quick --kv-device cuda
step "done"
