"""The one registry of transports, by name. Modules are imported only when their name is chosen.

``"verbs"`` lives in ``transport.verbs`` and is imported only by
``create("verbs")``, so nothing else needs pyverbs.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from pdcore.errors import StartError

from .base import Transport

__all__ = ["available", "create", "register_transport"]

_lock = threading.Lock()
_FACTORIES: dict[str, str] = {
    "tcp": "transport.tcp:TcpTransport",
    "verbs": "transport.verbs:VerbsTransport",
}


def register_transport(name: str, target: str) -> None:
    """Make ``create(name)`` build ``target`` (``"package.module:Class"``, imported lazily)."""
    module, sep, cls = target.partition(":")
    if not name or not sep or not module or not cls:
        raise ValueError(f"register_transport needs a name and 'module:Class', got {name!r}, {target!r}")
    with _lock:
        _FACTORIES[name] = target


def available() -> tuple[str, ...]:
    """Every registered name (a name may still fail to start, e.g. ``verbs`` without pyverbs)."""
    with _lock:
        return tuple(sorted(_FACTORIES))


def transport_class(name: str) -> type[Transport]:
    """Import and return the class registered under ``name``; ``StartError`` if unknown or not importable."""
    with _lock:
        target = _FACTORIES.get(name)
    if target is None:
        raise StartError(f"unknown transport {name!r}; known transports: {', '.join(available())}")
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise StartError(f"transport {name!r} is not usable here: importing {module_name} failed: {e}") from e
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise StartError(f"transport {name!r}: {target} is not a Transport subclass")
    return cls


def create(name: str, **options: Any) -> Transport:
    """Build and start the transport registered under ``name`` with its ``options``."""
    return transport_class(name)(**options)
