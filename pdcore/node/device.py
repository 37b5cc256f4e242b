"""Device-resident memory at a peer: when its transport stages memory, and where a device address lands.

The transports move host memory. A peer whose configured buffers live on the
GPU (CUDA tensors), or one told to use the stand-in device
(``NodeConfig.device_memory == "standin"``), wraps its transport in
``transport.staging.StagedTransport``: every device buffer it registers gets a
host mirror, and the mirror is what the transport registers, what regions and
layouts name and what peers write into. So the engines and planners above
work on host addresses unchanged; two things change for them:

- a room written into device memory lands when its bytes are *on the device*:
  an engine given ``Services.staged`` copies them in with a ``Land`` first;
- an address the scheduler gives in device memory (an EPD send chunk's
  ``source``) names the device buffer: ``MirrorMap.host`` says where its
  bytes are staged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from transport.base import Region, Transport, buffer_span
from transport.device_copy import is_cuda_tensor

from .config import NodeConfig

__all__ = ["MirrorMap", "cuda_present", "staged_transport", "stages"]


def cuda_present() -> bool:
    """True where torch is loaded and sees a GPU (never imports torch: a peer without it has no device memory)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def staged_transport(inner: Transport, config: NodeConfig, buffers: Iterable[Any]) -> Transport:
    """``inner``, wrapped to stage device memory if this peer may register any: its configured buffers
    hold a CUDA tensor, the machine has a GPU (an EPD receiver's slots are given after start), or the
    config asks for the stand-in device."""
    if config.device_memory == "standin":
        device = "standin"
    elif any(is_cuda_tensor(b) for b in buffers) or cuda_present():
        device = "auto"
    else:
        return inner
    from transport.staging import StagedTransport  # only a peer that stages memory loads it

    return StagedTransport(inner, device=device)


def stages(transport: Transport, region: Region) -> bool:
    """True if ``region`` (as ``transport.register`` returned it) is staged device memory: what lands there
    must be copied in. The transport that made the mirror says so (``mirror_of``)."""
    staging = sys.modules.get("transport.staging")  # not loaded: nothing is staged
    return (staging is not None and isinstance(transport, staging.StagedTransport)
            and transport.mirror_of(region) is not None)


class MirrorMap:
    """Device buffers' address ranges -> their host mirrors' (what the transport registered)."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int, int]] = []  # (device addr, length, mirror addr)

    def add(self, buf: Any, mirror_addr: int) -> None:
        addr, length = (int(buf.data_ptr()), int(buf.nbytes)) if hasattr(buf, "data_ptr") else buffer_span(buf)[:2]
        self._spans.append((addr, length, mirror_addr))

    def host(self, addr: int, nbytes: int) -> int:
        """Where ``[addr, addr + nbytes)`` of a device buffer is staged; ``addr`` itself if no mirror holds it."""
        for base, length, mirror in self._spans:
            if base <= addr and addr + nbytes <= base + length:
                return mirror + (addr - base)
        return addr

    def __bool__(self) -> bool:
        return bool(self._spans)
