"""Who talks to whom for one prefill replica (tp ``P``) and one decode replica (tp ``D``), and what each writes.

Without a ``KvLayout`` (opaque pages, as before) the tp sizes must be equal and
rank ``r`` pairs with rank ``r``. With one, decode rank ``d`` announces its
pages to every prefill rank that owes it heads (``sources``) and waits for
each one's ``Status``; a prefill rank that owes no decode rank anything (MLA:
only ``(d*P)//D`` writes to ``d``) still hears of every room from one decode
rank (``notified``, with no pages) so its table moves with the replica's, and
waits for announcements from ``expects(p)``: the decode ranks it writes to, or
that one.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from transport.plan import Layout
from transport.plan import plan as plan_pages

from ..core.errors import LocalProtocolError
from .layout import KvLayout
from .planner import plan as plan_heads

__all__ = ["Routing", "routing"]


class Routing:
    def __init__(self, layout: KvLayout | None, prefill_tp: int, decode_tp: int) -> None:
        if layout is None and prefill_tp != decode_tp:
            raise LocalProtocolError(
                f"prefill tp {prefill_tp} and decode tp {decode_tp} differ: pairing them needs a KV layout "
                "(TransferConfig.kv_layout) on both sides"
            )
        if layout is not None:
            layout.check_tp(prefill_tp, "prefill tp")
            layout.check_tp(decode_tp, "decode tp")
        self.layout = layout
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        if layout is None:
            self._sources: tuple[tuple[int, ...], ...] = tuple((d,) for d in range(decode_tp))
        else:
            self._sources = tuple(layout.sources(prefill_tp, decode_tp, d) for d in range(decode_tp))
        targets: list[list[int]] = [[] for _ in range(prefill_tp)]
        for d, srcs in enumerate(self._sources):
            for p in srcs:
                targets[p].append(d)
        self._targets = tuple(tuple(t) for t in targets)
        self._notifier = tuple((p * decode_tp) // prefill_tp for p in range(prefill_tp))

    def sources(self, d: int) -> tuple[int, ...]:
        """Prefill ranks that write to decode rank ``d``."""
        return self._sources[d]

    def targets(self, p: int) -> tuple[int, ...]:
        """Decode ranks prefill rank ``p`` writes to (empty when it owes nobody)."""
        return self._targets[p]

    def notified(self, d: int) -> tuple[int, ...]:
        """Prefill ranks that owe nobody and hear of each room from decode rank ``d``."""
        return tuple(p for p in range(self.prefill_tp) if not self._targets[p] and self._notifier[p] == d)

    def expects(self, p: int) -> tuple[int, ...]:
        """Decode ranks whose announcement prefill rank ``p`` waits for."""
        return self._targets[p] or (self._notifier[p],)

    def owes(self, p: int, d: int) -> bool:
        return d in self._targets[p]

    def plan(self, p: int, d: int, src: Layout, dst: Layout, src_pages: Any, dst_pages: Any) -> np.ndarray:
        """The writes prefill rank ``p`` owes decode rank ``d`` for these page pairs."""
        if self.layout is None:
            return plan_pages(src, dst, src_pages, dst_pages)
        return plan_heads(
            self.layout, self.prefill_tp, p, self.decode_tp, d, src.bases, dst.bases, src_pages, dst_pages,
            src_num_pages=src.num_pages, dst_num_pages=dst.num_pages,
        )


@functools.lru_cache(maxsize=64)
def routing(layout: KvLayout | None, prefill_tp: int, decode_tp: int) -> Routing:
    """The (cached) ``Routing`` of a pair of tp sizes; ``LocalProtocolError`` if they cannot pair."""
    return Routing(layout, prefill_tp, decode_tp)
