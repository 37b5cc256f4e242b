"""The control plane, chosen by name as the transport is (``NodeConfig.control``).

- ``"zmq"``: ``pdcore.control.channel.ControlChannel`` (ZeroMQ ROUTER/DEALER,
  CURVE with a secret): what every deployment runs.
- ``"tcp"``: ``pdcore.control.tcp_plane.TcpPlane`` (sealed frames over plain
  TCP, its loop on the driver's thread: one wake-up a side per message).
- ``"faulty:zmq"``, ``"faulty:tcp"``: either with seeded faults on the way out
  (``pdcore.control.faulty``; ``NodeConfig.control_options`` are its rates):
  what chaos runs inject, with no monkeypatching.

A driver uses one method of a control plane, ``send(endpoint, msg)``; a peer
also starts it, reads its ``endpoint`` and ``stats``, and closes it. The
simulator's ``pdcore.sim.control.SimChannel`` offers the same ``send`` to the
same driver code over a simulated network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .channel import ControlChannel
from .plane_base import PlaneBase
from .tcp_plane import TcpPlane

__all__ = ["PLANES", "create"]

PLANES = ("zmq", "tcp", "faulty:zmq", "faulty:tcp")


def create(name: str, on_message: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> PlaneBase:
    """The control plane ``name`` (one of ``PLANES``); ``options`` go to the chosen plane's constructor."""
    if name in ("zmq", "tcp"):
        if options:
            raise ValueError(f"control plane {name!r} takes no options, got {sorted(options)}")
        return (ControlChannel if name == "zmq" else TcpPlane)(on_message, **kwargs)
    if name in ("faulty:zmq", "faulty:tcp"):
        from .faulty import FaultyChannel, FaultyTcpPlane

        return (FaultyChannel if name == "faulty:zmq" else FaultyTcpPlane)(on_message, **dict(options or {}), **kwargs)
    raise ValueError(f"no control plane {name!r}: one of {', '.join(PLANES)}")
