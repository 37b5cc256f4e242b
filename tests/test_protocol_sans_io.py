"""The role engines and the fronts are sans-IO: nothing under ``pdcore/protocol/``, nor ``pdcore/pd/front.py`` or
``pdcore/epd/front.py``, imports a thread, socket, queue, clock or transport implementation, directly or through
the pdcore modules it imports (read from the source: every
import of every module they reach, ``TYPE_CHECKING`` blocks aside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"threading", "socket", "select", "selectors", "queue", "zmq", "time", "concurrent", "asyncio",
             "multiprocessing", "subprocess", "http", "urllib"}
FORBIDDEN_OURS = ("pdcore.node", "pdcore.pd", "pdcore.tools", "pdcore.sim", "pdcore.control.channel",
                  "pdcore.control.bootstrap", "pdcore.control.faulty", "pdcore.control.plane", "transport.tcp",
                  "transport.verbs", "transport.faulty", "transport.registry")


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                out.add(name)
                out.update(f"{name}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []) +
                      [h for handler in getattr(node, "handlers", []) for h in handler.body])

    visit(tree.body)
    return out


def _file(module: str) -> Path | None:
    for candidate in (ROOT / (module.replace(".", "/") + ".py"), ROOT / module.replace(".", "/") / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _io_imports(todo: list[str]) -> tuple[list[str], set[str]]:
    """What the modules ``todo`` reach, directly or through the pdcore modules they import, that does I/O."""
    seen: set[str] = set()
    bad: list[str] = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _file(module)
        if path is None:
            continue
        for name in _imports(path, module):
            top = name.split(".")[0]
            if top in FORBIDDEN or name.startswith(FORBIDDEN_OURS):
                bad.append(f"{module} imports {name}")
            elif top in ("pdcore", "transport") and name not in ("pdcore", "transport"):
                todo.append(name)
    return bad, seen


def test_the_engines_import_no_io() -> None:
    # the engines, and the rules an engine is given as its table (the encode engine's SendRooms)
    bad, seen = _io_imports([f"pdcore.protocol.{p.stem}" for p in (ROOT / "pdcore" / "protocol").glob("*.py")] +
                            ["pdcore.epd.sending"])
    assert not bad, "\n".join(sorted(set(bad)))
    assert "pdcore.protocol.prefill" in seen and "pdcore.epd.sending" in seen


def test_the_fronts_import_no_io() -> None:
    """The scheduler's side of every role (what both the peers and the simulator drive) is sans-IO too."""
    bad, seen = _io_imports(["pdcore.pd.front", "pdcore.epd.front"])
    assert not bad, "\n".join(sorted(set(bad)))
    assert "pdcore.control.wire" in seen and "pdcore.epd.types" in seen


def test_the_engines_do_not_import_the_role_packages() -> None:
    """The peers (``pdcore.pd``, ``pdcore.epd``, ``pdcore.node``) drive the engines and hand them their tables
    and rules (``Services``): an engine importing one of them would make the arrow between the packages
    point both ways."""
    bad = [f"pdcore.protocol.{p.stem} imports {name}"
           for p in (ROOT / "pdcore" / "protocol").glob("*.py")
           for name in _imports(p, f"pdcore.protocol.{p.stem}")
           if name.startswith(("pdcore.pd", "pdcore.epd", "pdcore.node", "pdcore.vllm", "pdcore.sim"))]
    assert not bad, "\n".join(sorted(bad))
