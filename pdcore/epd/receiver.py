"""The prefill side of EPD: ``Receiver`` (an ``EmbeddingReceiver``), over a ``PrefillPeer``'s planes.

The receive slots are cut from one buffer (and one deepstack buffer)
registered once with the peer's transport for the receiver's life, written
only through grants. Per-request codes, per-item states and the slot pool are
the compiled ``ReceiveTable`` (``pdcore.epd.recv_table``), driven from the
scheduler's thread here (``stage``, the rounds, ``release``) and from the
protocol's side by ``pdcore.protocol.receiver.ReceiverEngine`` (asks, grants,
landings, fences: its docstring tells an item's story), which runs on the
prefill peer's driver thread beside the prefill engine.

- ``poll``/``settle`` (or ``round``, which runs poll → replica MIN → settle
  through ``pdcore.core.agreement`` with the table's mismatch guard, and agrees
  the failure reasons) settle the agreed codes; what settled goes to the
  engine, which tells the failed requests' encode ranks and fences their slots.

The scheduler aborts a failed request toward its decode node with
``PrefillPeer.abort_room`` (it knows the decode room; this module does not).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from transport.base import byte_view

from ..core.agreement import Agreement
from ..core.errors import LocalProtocolError, StartError
from ..core.replica import check_replica
from ..node.device import stages
from ..protocol.engine import Services
from ..protocol.receiver import ReceiverEngine
from .config import ReceiverConfig
from .front import ReceiverFront
from .recv_table import ReceiveTable
from .types import EmbeddingItem, LandedRequest

__all__ = ["Receiver"]

log = logging.getLogger("pdcore.receiver")


def _slot_memory(buf: Any, nbytes: int, name: str) -> Any:
    if buf is None:
        return np.zeros(max(nbytes, 1), dtype=np.uint8)
    length = np.asarray(buf).nbytes if not hasattr(buf, "nbytes") else int(buf.nbytes)
    if length < nbytes:
        raise StartError(f"ReceiverConfig.{name}: holds {length} bytes, the slots need {nbytes}")
    return buf


class Receiver:
    """A prefill rank's receiver of image embeddings (implements ``EmbeddingReceiver``).

    Made by ``PrefillPeer.embedding_receiver``; every rank of the replica
    stages the same requests in the same order and settles the same codes.
    ``rows(slot, count)`` and ``deepstack_rows(slot, count)`` view a landed item's rows
    (``LandedItem.slot``, ``LandedItem.row_count``) until ``release`` hands the slot back.
    """

    def __init__(self, config: ReceiverConfig, *, transport: Any, driver: Any, services: Services, tp_rank: int,
                 tp_size: int, agreement: str, agreement_timeout: float) -> None:
        self._config = config
        self._driver = driver
        self._table = ReceiveTable(
            config.slots, config.slot_rows, max_requests=config.max_requests, max_items=config.max_items,
            rank=tp_rank, ranks=tp_size, sharded=config.shard_rows, timeout=config.timeout,
        )
        self._agreement = Agreement(self._table, agreement=agreement, shm_timeout=agreement_timeout)
        self._slot_bytes = config.slot_rows * config.row_bytes
        self._deep_bytes = config.slot_rows * config.deepstack_row_bytes
        self._memory = _slot_memory(config.buffer, config.slots * self._slot_bytes, "buffer")
        self._region = transport.register(self._memory, require_grant=True)
        self._deep_region = self._deep_memory = None
        if config.deepstack_width:
            self._deep_memory = _slot_memory(config.deepstack_buffer, config.slots * self._deep_bytes, "deepstack_buffer")
            try:
                self._deep_region = transport.register(self._deep_memory, require_grant=True)
            except BaseException:
                transport.deregister(self._region)
                raise
        # slots in device memory (or the stand-in device's) receive into host staging; rows() views the device
        self._staged = stages(transport, self._region)
        self._engine = ReceiverEngine(
            Services(config=config, session_id=services.session_id, epoch=services.epoch, table=self._table, stats=services.stats,
                     endpoint=transport.endpoint(),  # now: it describes the slots just registered
                     staged=self._staged),
            tp_rank=tp_rank, tp_size=tp_size, slots_addr=self._region.addr,
            deep_addr=self._deep_region.addr if self._deep_region is not None else 0,
        )
        driver.attach(self._engine)
        self.front = ReceiverFront(table=self._table, engine=self._engine, submit=driver.submit,
                                   result=driver.submit_result)
        self._checked_replica: object = None  # the last replica round() accepted

    @property
    def engine(self) -> ReceiverEngine:
        """The receiver's protocol (on its prefill peer's driver thread): the peer routes EPD frames to it."""
        return self._engine

    @property
    def stats(self) -> dict[str, int]:
        """Asks sent, items landed, slots fenced (the engine's counters)."""
        return self._engine.stats

    # -- the scheduler's calls (EmbeddingReceiver) ---------------------------------------------

    def stage(self, rid: str, items: list[EmbeddingItem] | tuple[EmbeddingItem, ...]) -> None:
        """Start receiving ``rid``'s items' embeddings; never blocks (an item with no free slot waits)."""
        self.front.stage(rid, items, time.monotonic())

    def poll(self) -> list[int]:
        """Every staged request's code on this rank, in staging order: 0 failed, 1 receiving, 2 landed."""
        return self.front.poll(time.monotonic())

    def settle(self, codes: Any) -> list[LandedRequest]:
        """Act on the replica-agreed ``codes`` (``poll`` order, or the reduced buffer of ``table.encode``)."""
        return self.front.settle(codes)

    def round(self, replica: object = None) -> list[LandedRequest]:
        """``poll`` → MIN across ``replica`` (a gloo group; None for one rank) → ``settle``, with the
        table's mismatch guard: ranks that staged different requests raise ``CollectiveError`` on every rank.
        Every rank reports the same reason for a request that failed (``failed``): the lowest rank's that
        failed it itself (``Agreement.agree_reasons``)."""
        if replica is not None and replica is not self._checked_replica:
            check_replica(replica, "receiver: round")
            self._checked_replica = replica
        landed = self._agreement.round(time.monotonic(), replica)
        failed = self._table.failed()
        agreed = None
        if failed:
            reasons = self._agreement.agree_reasons(replica, [reason for _, reason in failed])
            agreed = [(rid, reason) for (rid, _), reason in zip(failed, reasons)]
        self.front.after_round(landed, agreed, time.monotonic())
        return landed

    def release(self, slots: Any) -> None:
        """The data plane copied these slots' rows out: they take new receives."""
        self.front.release(slots, time.monotonic())

    def awaiting_release(self) -> bool:
        """A landed slot still waits for its rows to be copied out (``release``)."""
        return self._table.awaiting_release()

    def failed(self) -> list[tuple[str, str]]:
        """The requests the last settle dropped as failed: (rid, reason)."""
        return self.front.failed()

    def rows(self, slot: int, count: int) -> Any:
        """The first ``count`` rows of ``slot`` as a ``(count, row bytes)`` uint8 view (copy them out, then ``release``):
        a numpy array, or a tensor on the device for slots in device memory."""
        return self._view(self._region, self._memory, self._slot_bytes, self._config.row_bytes, slot, count)

    def deepstack_rows(self, slot: int, count: int) -> Any:
        """The first ``count`` deepstack rows of ``slot`` as a ``(count, deepstack row bytes)`` uint8 view
        (``LocalProtocolError`` if the receiver has no deepstack buffer); copy them out, then ``release``."""
        if not self._config.deepstack_width:
            raise LocalProtocolError("deepstack_rows: the receiver has no deepstack buffer")
        return self._view(self._deep_region, self._deep_memory, self._deep_bytes, self._config.deepstack_row_bytes, slot, count)

    def _view(self, region: Any, owner: Any, slot_bytes: int, row_bytes: int, slot: int, count: int) -> Any:
        if not 0 <= slot < self._config.slots or not 0 <= count <= self._config.slot_rows:
            raise LocalProtocolError(f"slot {slot} / {count} rows is outside the pool")
        if self._staged:  # the rows were copied into the buffer given (the registered region is its host mirror)
            start = slot * slot_bytes
            if isinstance(owner, np.ndarray):
                return owner.reshape(-1).view(np.uint8)[start:start + count * row_bytes].reshape(count, row_bytes)
            import torch  # a tensor was given: torch is loaded

            return owner.reshape(-1).view(torch.uint8)[start:start + count * row_bytes].view(count, row_bytes)
        view = byte_view(region.addr + slot * slot_bytes, count * row_bytes, owner)
        return np.frombuffer(view, dtype=np.uint8).reshape(count, row_bytes)

    @property
    def table(self) -> ReceiveTable:
        return self._table

    def close(self) -> None:
        """Release the agreement's shared memory (the peer's close stops the engine)."""
        self._agreement.close()
