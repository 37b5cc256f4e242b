"""The EPD receiver table: compiled (``_recv``) or its pure twin (``_recv_py``), as ``pdcore/twins.py`` chooses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..twins import IMPLEMENTATION, load

__all__ = ["IMPLEMENTATION", "ReceiveTable", "Ask", "FINGERPRINT_BYTES"]

if TYPE_CHECKING:
    from ._recv_py import FINGERPRINT_BYTES, Ask, ReceiveTable
else:
    _recv = load("pdcore.epd._recv")
    FINGERPRINT_BYTES, Ask, ReceiveTable = _recv.FINGERPRINT_BYTES, _recv.Ask, _recv.ReceiveTable
