"""A batch's note: the small opaque bytes a source attaches to a batch and the sink hands to its owner.

The contract is ``transport/base.py``'s ("Notes"); here are the two steps every transport takes the
same way, so they are worded once: ``check_note`` (``write``'s validation of a note, before anything
is posted) and ``call_on_note`` (the sink's call of its owner's handler, on a transport thread).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

from .errors import TransportError
from .limits import MAX_NOTE

__all__ = ["MAX_NOTE", "NoteHandler", "call_on_note", "check_handler", "check_note"]

#: ``handler(grant_key, note)``: a note landed with every byte of its batch, through grant ``grant_key``.
NoteHandler: TypeAlias = Callable[[int, bytes], None]


def check_note(note: Any, writes: int, grant: int, carries: bool, name: str) -> None:
    """``TransportError(op="write")`` unless ``note`` may ride a batch of ``writes`` writes: ``bytes``;
    and, when not empty, on a transport that carries notes (``carries``; ``name`` words the error), at
    most ``MAX_NOTE`` of them, through a grant (``grant`` != 0: the sink hands a note with the key of
    the grant its frame landed through, which is what makes it trustworthy), on a batch of at least
    one write (an empty batch lands nothing to vouch for). A ``write`` calls it only when ``note`` is
    not the empty ``bytes``, so a batch without one pays for that test alone."""
    if type(note) is not bytes:
        raise TransportError(f"a note is bytes, got {type(note).__name__}", op="write")
    if not note:
        return
    if not carries:
        raise TransportError(f"the {name} transport does not carry notes (carries_notes is False)", op="write")
    if len(note) > MAX_NOTE:
        raise TransportError(f"a note holds at most {MAX_NOTE} bytes, got {len(note)}", op="write")
    if not grant:
        raise TransportError("a note rides only a batch written through a grant (grant=0)", op="write")
    if writes < 1:
        raise TransportError("a note rides only a batch of at least one write (this one is empty)", op="write")


def check_handler(handler: Any) -> NoteHandler | None:
    """``on_note``'s argument, checked: a callable, or None; else ``TypeError`` (at once, not on the
    transport thread that would have called it)."""
    if handler is not None and not callable(handler):
        raise TypeError(f"a note handler is a callable (grant_key, note) -> None, or None; got {type(handler).__name__}")
    return handler


def call_on_note(handler: NoteHandler, grant: int, note: bytes) -> None:
    """Run the sink owner's note handler on a transport thread; its exception is the owner's bug,
    reported through ``threading.excepthook``, and the thread carries on (as ``call_on_done``)."""
    try:
        handler(grant, note)
    except Exception:
        exc_type, exc, tb = sys.exc_info()
        threading.excepthook(threading.ExceptHookArgs((exc_type, exc, tb, threading.current_thread())))
