"""Socket reads and writes that share one total deadline (a per-recv timeout lets a slow drip run forever).

The bootstrap server wraps each connection in these, and the client its socket, so
an idle or slow peer cannot hold a thread past the request's deadline.
"""

from __future__ import annotations

import io
import socket
from typing import Any

from ..core.deadline import Deadline, DeadlineExceeded


class DeadlineReader(io.RawIOBase):
    """Socket reads that share one total deadline (a per-recv timeout lets a slow drip run forever).

    The server moves ``deadline`` from the request head's to the whole request's once the head is in.
    """

    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        super().__init__()
        self._sock, self.deadline, self.what = sock, deadline, what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline.remaining()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self.what}: deadline passed")
        self._sock.settimeout(remaining)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise DeadlineExceeded(f"{self.what}: deadline passed") from None


class DeadlineWriter(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        super().__init__()
        self._sock, self._deadline, self._what = sock, deadline, what

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        remaining = self._deadline.remaining()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self._what}: deadline passed")
        self._sock.settimeout(remaining)  # sendall: the timeout bounds the whole call
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise DeadlineExceeded(f"{self._what}: deadline passed") from None
        return len(data)


class DeadlineSocket:
    """What ``http.client`` needs of a socket, with every operation under one deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline, what: str) -> None:
        self._sock, self._deadline, self._what = sock, deadline, what

    def sendall(self, data: Any) -> None:
        DeadlineWriter(self._sock, self._deadline, self._what).write(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        assert "r" in mode
        return io.BufferedReader(DeadlineReader(self._sock, self._deadline, self._what))

    def close(self) -> None:
        self._sock.close()
