"""``transport/`` stands alone: it imports nothing from pdcore, and works where pdcore is absent.

pdcore re-exports the data plane's errors and deadline as the same classes
(``transport/errors.py`` says how), so ``except pdcore.PdError`` still catches
every transport error.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pdcore
import pdcore.core.deadline
import pdcore.core.errors
import transport
import transport.deadline
import transport.errors

TRANSPORT_DIR = Path(transport.__file__).resolve().parent

# Runs in a fresh interpreter: pdcore cannot be imported (a meta-path finder refuses it, so
# the editable install cannot provide it either), and the only transport on the path is a copy.
STANDALONE = r"""
import importlib.abc, sys

class NoPdcore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pdcore" or name.startswith("pdcore."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoPdcore())
sys.path.insert(0, sys.argv[1])

import numpy as np
import transport
from transport.deadline import Deadline
from transport.errors import TransportBaseError, TransportError

assert transport.__file__.startswith(sys.argv[1]), transport.__file__
try:
    import pdcore  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("pdcore was importable")

src = np.arange(4096, dtype=np.uint8)
dst = np.zeros(4096, dtype=np.uint8)
sink = transport.create("tcp", host="127.0.0.1")
source = transport.create("tcp", host="127.0.0.1")
try:
    source.register(src)
    sink.register(dst)
    peer = source.connect(sink.endpoint(), deadline=Deadline.after(10.0))
    source.write(peer, [(src.ctypes.data, dst.ctypes.data, 4096)])
    done = source.completions(deadline=Deadline.after(10.0))
    assert len(done) == 1 and done[0][1] is None, done
    assert bytes(dst) == bytes(src)
    try:
        source.write(peer, [(src.ctypes.data + 4096, dst.ctypes.data, 1)])  # outside every region
    except TransportError as exc:
        assert isinstance(exc, TransportBaseError) and exc.op == "write"
    else:
        raise AssertionError("a write outside the regions was posted")
finally:
    source.close(deadline=Deadline.after(5.0))
    sink.close(deadline=Deadline.after(5.0))
assert not [m for m in sys.modules if m == "pdcore" or m.startswith("pdcore.")]
print("standalone ok")
"""


def test_transport_works_where_pdcore_is_absent(tmp_path: Path) -> None:
    shutil.copytree(TRANSPORT_DIR, tmp_path / "transport", ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    proc = subprocess.run(
        [sys.executable, "-c", STANDALONE, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "standalone ok"


_PYX_IMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+c?import|c?import\s+(\S+))", re.MULTILINE)


def _imported_modules(path: Path) -> set[str]:
    text = path.read_text()
    if path.suffix == ".pyx":  # Cython is not Python: its import lines are plain enough for a regex
        return {(a or b).rstrip(",") for a, b in _PYX_IMPORT.findall(text)}
    names: set[str] = set()
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            names.update(a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def test_no_module_under_transport_imports_pdcore() -> None:
    files = sorted(p for ext in ("*.py", "*.pyi", "*.pyx", "*.pxd") for p in TRANSPORT_DIR.rglob(ext))
    assert any(p.name == "tcp.py" for p in files)
    offenders = {
        str(p.relative_to(TRANSPORT_DIR)): sorted(m for m in _imported_modules(p) if m.split(".")[0] == "pdcore")
        for p in files
    }
    assert not {k: v for k, v in offenders.items() if v}, "transport/ must not import pdcore"


def test_pdcore_reexports_the_same_classes() -> None:
    assert pdcore.PdError is pdcore.core.errors.PdError is transport.errors.TransportBaseError
    assert pdcore.TransportError is transport.errors.TransportError
    assert pdcore.StartError is transport.errors.StartError
    assert pdcore.CapacityError is transport.errors.CapacityError
    assert pdcore.core.deadline.Deadline is transport.deadline.Deadline
    assert pdcore.core.deadline.DeadlineExceeded is transport.deadline.DeadlineExceeded
    for cls in (pdcore.CollectiveError, pdcore.PeerError, pdcore.LocalProtocolError, pdcore.RemoteProtocolError):
        assert issubclass(cls, pdcore.PdError)
    from transport.plan import PlanError

    for exc in (transport.errors.TransportError("x", op="write"), transport.errors.StartError("x"), PlanError("x")):
        try:
            raise exc
        except pdcore.PdError as caught:
            assert caught is exc
