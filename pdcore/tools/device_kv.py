"""The demos' KV cache and embedding buffers in device memory (``--kv-device``).

The demos fill and check page contents in numpy arrays (the ``cache`` a rank
holds). With ``--kv-device cuda`` the peer is given CUDA tensors instead: a
prefill rank copies the pages it filled to the device before it hands them over,
and a decode rank copies landed pages back to check them, so every byte the
check sees went host -> device -> (staging, network, staging) -> device -> host.
With ``--kv-device standin`` the arrays themselves are the stand-in device's
memory (``NodeConfig.device_memory``): the peers stage them exactly as device
memory, with copies that finish late and out of order, and nothing here copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["KV_DEVICES", "DeviceKv", "device_memory", "host_array"]

#: ``--kv-device``'s choices
KV_DEVICES = ("cpu", "cuda", "standin")


def device_memory(kv_device: str) -> str:
    """``NodeConfig.device_memory`` for a run's ``--kv-device``."""
    return "standin" if kv_device == "standin" else "auto"


def host_array(x: Any) -> np.ndarray:
    """A tensor (on any device) or array as a numpy array on the host."""
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


class DeviceKv:
    """A rank's buffers (numpy, where contents are filled and checked) and what its peer is given."""

    def __init__(self, host: list[np.ndarray], kv_device: str) -> None:
        self.host = host
        self.cuda = kv_device == "cuda"
        if self.cuda:
            import torch

            self.given: list[Any] = [torch.from_numpy(buf).to("cuda") for buf in host]
        else:
            self.given = list(host)

    def push(self, pages: list[int], page_bytes: int) -> None:
        """Pages filled in the host arrays go to the device (before they are handed over)."""
        if self.cuda:
            import torch

            index = torch.as_tensor(pages, device="cuda")
            for buf, dev in zip(self.host, self.given):
                rows = torch.from_numpy(buf.reshape(-1, page_bytes)[pages]).to("cuda")
                dev.view(-1, page_bytes).index_copy_(0, index, rows)

    def pull(self, pages: list[int], page_bytes: int) -> None:
        """Landed pages come back from the device into the host arrays (before they are checked)."""
        if self.cuda:
            import torch

            index = torch.as_tensor(pages, device="cuda")
            for buf, dev in zip(self.host, self.given):
                buf.reshape(-1, page_bytes)[pages] = dev.view(-1, page_bytes).index_select(0, index).cpu().numpy()

    def address(self, index: int) -> int:
        """Where buffer ``index`` the peer was given starts (a device address for CUDA tensors)."""
        given = self.given[index]
        return int(given.data_ptr()) if self.cuda else int(given.ctypes.data)

    def push_bytes(self, index: int, start: int, length: int) -> None:
        """Bytes written into host buffer ``index`` go to the device (before they are sent)."""
        if self.cuda:
            import torch

            self.given[index][start:start + length].copy_(torch.from_numpy(self.host[index][start:start + length]))
