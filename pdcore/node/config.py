"""What every role's rank is configured with (``NodeConfig``), validated when built: a bad value is a
``StartError`` naming the field. Every timeout is in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..control.auth import check_secret
from ..core.errors import StartError

__all__ = ["NodeConfig", "check_registration", "check_seconds", "check_writable_buffer", "config_error"]


def config_error(config: object, name: str, why: str) -> StartError:
    """The ``StartError`` for a bad field: ``Class.name: why``."""
    return StartError(f"{type(config).__name__}.{name}: {why}")


def check_seconds(config: object, names: tuple[str, ...]) -> None:
    """Each named field is a positive, finite number of seconds."""
    for name in names:
        value = getattr(config, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise config_error(config, name, f"must be a positive number of seconds, got {value!r}")


#: where a buffer given to a config may live: "cuda" memory is staged through pinned host memory
DEVICES = ("cpu", "cuda")
#: ``NodeConfig.device_memory``'s values
DEVICE_MEMORY = ("auto", "standin")


def check_writable_buffer(config: object, name: str, buf: Any) -> None:
    """``buf`` is memory a peer's transport may write into: a contiguous, writable numpy array or a
    contiguous CPU or CUDA torch tensor (duck-typed: torch is not imported here; CUDA memory is
    staged through host memory, ``NodeConfig.device_memory``). Anything else is a
    ``StartError`` naming ``name``: the transport writes into registered memory without asking
    Python, so a read-only array or ``bytes`` would be written behind the language's back; and a
    ``bytearray``, an ``(addr, length)`` pair or another buffer object is not what the configs
    promise to check (``np.frombuffer(b, np.uint8)`` views a bytearray as an array)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.writeable:
            raise config_error(config, name, "is a read-only numpy array; the transport writes into it "
                               "(pass a writable array, e.g. np.zeros(n, np.uint8))")
        if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
            raise config_error(config, name, "is not contiguous (np.ascontiguousarray makes a contiguous copy)")
        if buf.nbytes == 0:
            raise config_error(config, name, "is empty")
        return
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):
        device = getattr(getattr(buf, "device", None), "type", "cpu")
        if device not in DEVICES:
            raise config_error(config, name, f"is a tensor on {device!r}; the transport takes CPU or CUDA memory")
        if not buf.is_contiguous():
            raise config_error(config, name, "is not a contiguous tensor (.contiguous() makes one)")
        return
    raise config_error(config, name, f"must be a writable numpy array or a contiguous CPU or CUDA torch tensor, got "
                       f"{type(buf).__name__}" + (" (np.frombuffer(b, np.uint8) views a bytearray as one)"
                                                  if isinstance(buf, bytearray) else ""))


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """What every rank's peer needs, whatever its role: its place in the replica, the planes, the knobs.

    ``secret`` is the deployment's shared secret (bytes, 16..4096; every rank
    and the bootstrap server hold the same one): it authenticates the bootstrap
    requests, the control channel and the data connections (``pdcore.control.auth``).
    None reads ``$PDCORE_SECRET_FILE`` at start (set but empty, or naming a file
    that cannot serve, is a ``StartError``); with neither, the planes run
    unauthenticated and the peer says so once. It never appears in a repr.

    The knobs (seconds), what each bounds and what happens when it fires:

    - ``heartbeat_interval`` (1): the control channel sends a heartbeat to every
      peer it has a connection to this often; it must be below ``dead_after``.
    - ``dead_after`` (10): a peer that sent nothing (heartbeats included) for this
      long, or came back with a newer epoch (restarted), is declared dead, and the
      rooms bound to it fail here (a decode room that already landed stays landed).
      A process that was itself paused (its control loop stopped for longer than
      max(3 x ``heartbeat_interval``, ``dead_after`` / 2)) gives its peers a fresh ``dead_after`` on waking.
    - ``tombstone_ttl`` (60): how long a room that failed is remembered, so a late
      frame for it (an announcement, an ask) is answered with its failure (prefill
      also fails a request registered for it meanwhile: do not reuse a failed room
      within it); and how long a PD peer treats a rid that ended as "just ended",
      its late outbox/inbox calls doing nothing instead of raising.
    - ``start_timeout`` (30): a prefill or encode rank's ``start`` retries its
      bootstrap server for this long (then ``StartError``); each data connection
      such a rank makes to a peer gets as long (a failed one fails the rooms waiting).
    - ``max_pending`` (4096): bounds the driver's inputs (16x), the I/O queue, the
      announcements a prefill rank parks before their room registers, and the
      tombstones and ended rids kept (4x); work past a queue's bound fails the
      room it concerns instead of waiting.

    ``device_memory`` says how buffers in device memory (KV pages, receive slots,
    send buffers given as CUDA tensors) reach the transport, which moves host
    memory: ``"auto"`` stages every CUDA tensor through pinned host memory the
    transport registers (gathered into it on a stream of its own before writes are
    posted; scattered from it after a room's bytes landed, and the room lands only
    then), and leaves host memory as it is. ``"standin"`` treats every buffer as
    device memory of a stand-in device (CPU memory copied by a thread whose copies
    finish late and out of order): what CI runs the staging path on, without a GPU.

    ``data_path_completion`` (True): where the transport carries notes (``"tcp"``),
    a room's success rides its last write, and no control frame follows it; False
    sends it on the control plane, as a transport without notes (``"verbs"``)
    always does. Failures, aborts and fences travel on the control plane either way.
    """

    tp_size: int = 1
    tp_rank: int = 0
    host: str = "127.0.0.1"
    transport: str = "tcp"
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    #: the control plane by name (``pdcore.control.plane``): "zmq" or "tcp", or "faulty:zmq" / "faulty:tcp"
    #: with ``control_options``
    control: str = "tcp"
    control_options: Mapping[str, Any] = field(default_factory=dict)
    heartbeat_interval: float = 1.0
    dead_after: float = 10.0
    tombstone_ttl: float = 60.0
    start_timeout: float = 30.0
    max_pending: int = 4096
    secret: bytes | None = field(default=None, repr=False)
    device_memory: str = "auto"
    data_path_completion: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.tp_size <= 1024 or not 0 <= self.tp_rank < self.tp_size:
            raise config_error(self, "tp_rank", f"need 0 <= tp_rank < tp_size <= 1024, got {self.tp_rank}/{self.tp_size}")
        check_seconds(self, ("heartbeat_interval", "dead_after", "tombstone_ttl", "start_timeout"))
        if self.heartbeat_interval >= self.dead_after:
            raise config_error(self, "heartbeat_interval", f"must be below dead_after ({self.dead_after} s)")
        if self.secret is not None:
            check_secret(self.secret, f"{type(self).__name__}.secret")
        from ..control.plane import PLANES

        if self.control not in PLANES:
            raise config_error(self, "control", f"must be one of {', '.join(PLANES)}, got {self.control!r}")
        if self.control in ("zmq", "tcp") and self.control_options:
            raise config_error(self, "control_options",
                               f"the {self.control!r} plane takes none, got {sorted(self.control_options)}")
        if self.max_pending < 1:
            raise config_error(self, "max_pending", f"must be positive, got {self.max_pending}")
        if self.device_memory not in DEVICE_MEMORY:
            raise config_error(self, "device_memory", f"must be one of {', '.join(DEVICE_MEMORY)}, got {self.device_memory!r}")
        if not isinstance(self.data_path_completion, bool):
            raise config_error(self, "data_path_completion", f"must be True or False, got {self.data_path_completion!r}")


def check_registration(config: Any) -> None:
    """The fields of a rank that registers with its deployment's bootstrap server (prefill, encode)."""
    if not 0 < config.bootstrap_port < 65536:
        raise config_error(config, "bootstrap_port", f"{config.bootstrap_port} is not a TCP port")
    if not 1 <= config.dp_size <= 1024 or not 0 <= config.dp_rank < config.dp_size:
        raise config_error(config, "dp_rank", f"need 0 <= dp_rank < dp_size, got {config.dp_rank}/{config.dp_size}")
