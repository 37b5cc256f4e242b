#!/usr/bin/env bash
# The wheel a user would install: build it from this tree, install it into a fresh venv (no Cython,
# no source tree on the path), and run a small demo from it. Prints one line per step.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf 'wheel: %s (%s)\n' "$*" "$(date -u +%T)"; }

step "building the wheel (pip wheel, isolated build: setuptools, Cython and numpy fetched for the build only)"
"$python" -m pip wheel -qq --no-deps -w "$work/dist" "$repo"
wheel=("$work"/dist/pdcore-*.whl)
step "built $(basename "${wheel[0]}") ($(du -h "${wheel[0]}" | cut -f1))"
step "a fresh venv; torch 2.13.0 (the CPU wheel on disk) first, then the wheel and its dependencies"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -qq --no-compile torch==2.13.0
"$work/venv/bin/pip" install -qq --no-compile "${wheel[0]}[metrics]"
cd "$work"  # not the source tree: the demo must run from the installed wheel alone
if "$work/venv/bin/python" -c "import Cython" 2>/dev/null; then
    echo "wheel: Cython is installed in the fresh venv; the check would prove nothing" >&2
    exit 1
fi
"$work/venv/bin/python" - <<'PY'
import pdcore, pdcore.core.table, pdcore.epd.recv_table, pdcore.kv.planner, pdcore.tools.demo, pdcore.protocol.prefill, pdcore.sim.run, transport.plan
from pdcore import EmbeddingItem  # every subpackage made it into the wheel, with its compiled module
assert "site-packages" in pdcore.__file__, pdcore.__file__
assert pdcore.core.table.IMPLEMENTATION == "cython" and transport.plan.IMPLEMENTATION == "cython"
assert pdcore.epd.recv_table.ReceiveTable.__module__ == "pdcore.epd._recv" and pdcore.kv.planner.cut.__module__ == "pdcore.kv._heads"
assert pdcore.Succeeded.__module__ == "pdcore.core._events"  # compiled from a .py, under another name
assert EmbeddingItem.__module__ == "pdcore.epd._types"  # so are the EPD values
import pdcore.control.tcp_frames, pdcore.core._hash
assert pdcore.control.tcp_frames.Sealer.__module__ == "pdcore.control._seal"  # the control plane's sealed frames
print(f"wheel: installed at {pdcore.__file__.rsplit('/', 2)[0]}, compiled twins in use")
PY
step "python -m pdcore demo from the installed wheel"
"$work/venv/bin/python" -m pdcore demo --requests 40
step "ok"
