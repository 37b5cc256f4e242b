"""The control plane, chosen by name as the transport is (``NodeConfig.control``).

- ``"zmq"``: ``pdcore.control.channel.ControlChannel`` (ZeroMQ ROUTER/DEALER,
  CURVE with a secret): what every deployment runs.
- ``"faulty:zmq"``: the same with seeded faults on the way out
  (``pdcore.control.faulty.FaultyChannel``; ``NodeConfig.control_options`` are
  its rates): what chaos runs inject, with no monkeypatching.

A driver uses one method of a control plane, ``send(endpoint, msg)``; a peer
also starts it, reads its ``endpoint`` and ``stats``, and closes it. The
simulator's ``pdcore.sim.control.SimChannel`` offers the same ``send`` to the
same driver code over a simulated network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .channel import ControlChannel

__all__ = ["PLANES", "create"]

PLANES = ("zmq", "faulty:zmq")


def create(name: str, on_message: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> ControlChannel:
    """The control plane ``name`` (one of ``PLANES``); ``options`` go to the chosen plane's constructor."""
    if name == "zmq":
        if options:
            raise ValueError(f"control plane 'zmq' takes no options, got {sorted(options)}")
        return ControlChannel(on_message, **kwargs)
    if name == "faulty:zmq":
        from .faulty import FaultyChannel

        return FaultyChannel(on_message, **dict(options or {}), **kwargs)
    raise ValueError(f"no control plane {name!r}: one of {', '.join(PLANES)}")
