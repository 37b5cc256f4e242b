"""The one registry of transports, by name. Modules are imported only when their name is chosen.

``"verbs"`` lives in ``transport.verbs`` and is imported only by
``create("verbs")``, so nothing else needs pyverbs.

``"faulty:<inner>"`` (e.g. ``"faulty:tcp"``) builds ``<inner>`` and wraps it in
``transport.faulty.FaultyTransport``, which fails a seeded fraction of batches
and delays completions (chaos runs, tests). Its options are split: the
wrapper takes ``seed``, ``fail_rate``, ``land_rate`` and ``delay``
(``transport.faulty.WRAPPER_OPTIONS``); every other option goes to the inner
transport: ``create("faulty:tcp", seed=1, fail_rate=0.05, host="127.0.0.1")``; so does
``secret`` (the deployment secret: ``create("faulty:tcp", secret=s)`` authenticates the
inner transport's handshakes).

``"staged:<inner>"`` (e.g. ``"staged:tcp"``) wraps ``<inner>`` in
``transport.staging.StagedTransport``, which registers device memory (CUDA tensors) through
pinned host mirrors; the wrapper takes ``transport.staging.WRAPPER_OPTIONS`` (``device``,
``seed``, ...), the inner transport every other option.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from .errors import StartError

from .base import Transport

__all__ = ["available", "create", "register_transport"]

_lock = threading.Lock()
#: "<prefix><inner>" names a wrapper around the inner transport: prefix -> the wrapper's module (which names its
#: class in ``WRAPPER``, and the options it takes in ``WRAPPER_OPTIONS``)
_WRAPPERS = {"faulty:": "transport.faulty", "staged:": "transport.staging"}
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
    """Import and return the class registered under ``name``; ``StartError`` if unknown or not importable.

    For ``"faulty:<inner>"`` that is the wrapper's class (once ``<inner>`` is known to be usable)."""
    wrapper = _wrapper(name)
    if wrapper is not None:
        prefix, module = wrapper
        transport_class(name[len(prefix) :])
        return module.WRAPPER
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
    """Build and start the transport registered under ``name`` with its ``options``.

    ``"faulty:<inner>"``: the wrapper's options go to the wrapper, the rest to ``create("<inner>")``."""
    wrapper = _wrapper(name)
    if wrapper is not None:
        prefix, module = wrapper
        own = {k: options.pop(k) for k in module.WRAPPER_OPTIONS if k in options}
        inner = create(name[len(prefix) :], **options)
        try:
            return module.WRAPPER(inner, **own)
        except BaseException:
            inner.close()
            raise
    return transport_class(name)(**options)


def _wrapper(name: str) -> tuple[str, Any] | None:
    """``(prefix, the wrapper's module)`` if ``name`` names a wrapper, else None."""
    for prefix, module in _WRAPPERS.items():
        if name.startswith(prefix):
            return prefix, importlib.import_module(module)
    return None
