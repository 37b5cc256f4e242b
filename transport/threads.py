"""Threads the operating system knows by their name.

Python names its threads for itself only: ``top -H``, ``perf``, ``/proc/PID/task/TID/comm`` and a
core dump all show every thread of an inference server as ``python``. A peer runs a dozen of them
(its driver, its I/O threads, a control loop, the data plane's senders, ack readers and sinks), so
the question an operator asks first, which of them burns the CPU, had no answer from outside the
process. ``named_thread()`` makes a ``threading.Thread`` that, once running, gives the kernel its name
too: the Python name less the ``pdcore-`` every one of them starts with, cut to the kernel's 15
bytes (``tcp-sink-3``, ``decode-driver``, ``control-gate-41``). The benchmarks read CPU and
wake-ups per thread this way (``benchmarks/_usage.py``).

Linux only (``prctl(PR_SET_NAME)``); elsewhere, or if the call fails, the thread runs unnamed: a
name is for looking at, nothing depends on it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = ["OS_NAME_BYTES", "named_thread", "os_name"]

OS_NAME_BYTES: Final = 15  # TASK_COMM_LEN less its NUL
_PR_SET_NAME: Final = 15
_PREFIX: Final = "pdcore-"
_NAMING_WAIT: Final = 1.0  # seconds ``start()`` waits at most for the thread to have named itself


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:  # the process's own symbols hold libc's (find_library would run ldconfig at import)
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl: Final = _load_prctl()


def os_name(name: str) -> bytes:
    """The name the kernel gets for the thread Python calls ``name``."""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    return name.encode("utf-8", "replace")[:OS_NAME_BYTES]


def named_thread(target: Callable[..., object], name: str, args: tuple[Any, ...] = (), *, daemon: bool = True) -> threading.Thread:
    """A thread (not started) that runs ``target(*args)`` under ``name``; once its ``start()`` returned, the
    kernel knows the name too."""
    return _NamedThread(target, name, args, daemon)


class _NamedThread(threading.Thread):
    """The thread names itself (``prctl`` acts on the calling thread: naming another one by its ``pthread_t``
    could reach one that already ended) and ``start()`` waits for that, a moment, so whoever reads the name
    after starting it reads the right one."""

    def __init__(self, target: Callable[..., object], name: str, args: tuple[Any, ...], daemon: bool) -> None:
        super().__init__(target=target, name=name, args=args, daemon=daemon)
        self._named = threading.Event()

    def start(self) -> None:
        super().start()
        self._named.wait(_NAMING_WAIT)

    def run(self) -> None:
        if _prctl is not None:
            _prctl(_PR_SET_NAME, ctypes.c_char_p(os_name(self.name)), 0, 0, 0)  # a failure leaves it unnamed
        self._named.set()
        super().run()
