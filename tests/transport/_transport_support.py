"""What the transport tests share (a plain module: tests/ is not a package).

``TRANSPORTS`` lists the transports the conformance suite runs on: ``"tcp"``
always; the verbs transport appends ``"verbs"`` when an RDMA device is
present, with its options (device name, ...) in ``TRANSPORT_OPTIONS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transport.base import Transport

TRANSPORTS: list[Any] = ["tcp"]
#: Per-transport constructor options the suite needs.
TRANSPORT_OPTIONS: dict[str, dict[str, Any]] = {"tcp": {}}

MakeTransport = Callable[..., Transport]
