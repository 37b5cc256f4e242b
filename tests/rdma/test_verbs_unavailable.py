"""Without pyverbs, choosing "verbs" is a clear StartError (runs anywhere: no device needed)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_pyverbs_names_what_to_install() -> None:
    code = (
        "import sys; sys.modules['pyverbs'] = None\n"  # as if rdma-core's bindings were not installed
        "import transport\n"
        "from pdcore.core.errors import StartError\n"
        "try:\n"
        "    transport.create('verbs')\n"
        "except StartError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no StartError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "pyverbs" in out.stdout and "apt-get install python3-pyverbs" in out.stdout, out.stdout
