"""How a KV cache is laid out across tensor-parallel ranks, and which rank owes which heads to whom.

A ``KvLayout`` describes the cache of one model the same way on every rank of
both deployments: ``layers`` layers, each a K and a V buffer (``order`` "hnd"
or "nhd") or one latent buffer (``order`` "mla"); pages of ``page_tokens``
tokens; ``kv_heads`` KV heads in all (H) of ``head_bytes`` bytes per token
each (for MLA: one latent of ``head_bytes`` per token, the same on every rank).

``fused_kv=True`` (HND only) keeps a layer's K and V in one buffer, as vLLM's CPU cache does
(``[blocks, heads, tokens, K then V]``): each head's region of a page holds its tokens' K and V,
``head_bytes`` is a token's K and V together, and buffer ``l`` is layer ``l``. The planner
slices whole head regions, so where K and V sit inside a head's region does not matter.

Heads on a rank ``r`` of ``tp`` (``heads(r, tp)``): with ``tp <= H`` the
contiguous range ``[r*H/tp, (r+1)*H/tp)`` (``tp`` must divide H); with
``tp > H`` one head, ``(r*H) // tp``, replicated over the ``tp/H`` (or, when
H does not divide tp, ``floor`` or ``ceil`` of it) ranks that hold it. A page of a buffer on that rank holds
``page_tokens x heads x head_bytes`` bytes: heads outermost (HND: each head's
tokens contiguous) or tokens outermost (NHD: each token's heads contiguous).

Who writes what (``assignment``): decode rank ``d`` of ``D`` needs its heads;
each head comes from exactly one prefill rank of ``P``: the only holder when
``P <= H``; when ``P > H`` the head's holders are a run of ranks and the one at
offset ``d % len(run)`` writes (spreading the load). MLA: every prefill rank holds
the whole latent and ``(d*P) // D`` writes all of it. ``sources(d)`` are the
prefill ranks that owe decode rank ``d`` bytes; ``targets(p)`` the decode ranks
prefill rank ``p`` writes to (empty for some ranks under MLA: they still take
part in the agreement and see the same events).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ..core.errors import LocalProtocolError

__all__ = ["KvLayout", "ORDERS", "Share", "Segments"]

ORDERS = ("hnd", "nhd", "mla")
_MAX = 1 << 40


@dataclass(frozen=True, slots=True)
class Share:
    """Heads ``[first, first+count)`` (global numbering) that prefill rank ``source`` writes to a decode rank."""

    source: int
    first: int
    count: int


class Segments(NamedTuple):
    """How one (source page, destination page) pair of one buffer is cut into writes: ``slots`` segments of
    ``length`` bytes, segment ``t`` at ``src_off + t*src_stride`` in the source page and ``dst_off +
    t*dst_stride`` in the destination page; pages are ``src_page``/``dst_page`` bytes apart."""

    slots: int
    src_off: int
    dst_off: int
    src_stride: int
    dst_stride: int
    length: int
    src_page: int
    dst_page: int


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One model's KV cache layout; the same value on every rank of prefill and decode (the bootstrap compares)."""

    order: str
    kv_heads: int
    head_bytes: int
    page_tokens: int
    layers: int
    fused_kv: bool = False

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise LocalProtocolError(f"KvLayout.order: {self.order!r} is not one of {ORDERS}")
        for name in ("kv_heads", "head_bytes", "page_tokens", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX:
                raise LocalProtocolError(f"KvLayout.{name}: must be a positive int, got {value!r}")
        if not isinstance(self.fused_kv, bool):
            raise LocalProtocolError(f"KvLayout.fused_kv: must be a bool, got {self.fused_kv!r}")
        if self.fused_kv and self.order != "hnd":
            raise LocalProtocolError(f"KvLayout.fused_kv: K and V in one buffer needs order 'hnd' (whole head regions "
                                     f"per page), got {self.order!r}")
        if self.order == "mla" and self.kv_heads != 1:
            raise LocalProtocolError(f"KvLayout.kv_heads: an MLA cache has one latent per token, got {self.kv_heads}")

    @property
    def buffers(self) -> int:
        """Buffers per rank: K and V per layer (buffer ``2l`` is layer l's K, ``2l+1`` its V), or one per layer
        (a latent, or ``fused_kv``'s K and V together)."""
        return self.layers if self.order == "mla" or self.fused_kv else 2 * self.layers

    def check_tp(self, tp: int, what: str = "tp") -> None:
        """``tp`` ranks can share the heads: ``tp`` divides H, or exceeds it (replicated heads)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise LocalProtocolError(f"{what}: must be a positive int, got {tp!r}")
        h = self.kv_heads
        if self.order != "mla" and tp <= h and h % tp:
            raise LocalProtocolError(f"{what} {tp} cannot share {h} KV heads evenly: it must divide them or exceed them")

    def heads(self, rank: int, tp: int) -> tuple[int, int]:
        """(first head, head count) held by ``rank`` of ``tp``."""
        self.check_tp(tp)
        if not 0 <= rank < tp:
            raise LocalProtocolError(f"rank {rank} is not a rank of tp {tp}")
        h = self.kv_heads
        if self.order == "mla":
            return 0, 1
        if tp <= h:
            per = h // tp
            return rank * per, per
        return (rank * h) // tp, 1

    def page_bytes(self, tp: int) -> int:
        """Bytes of one page of one buffer on a rank of ``tp``."""
        return self.page_tokens * self.heads(0, tp)[1] * self.head_bytes

    def assignment(self, prefill_tp: int, decode_tp: int, d: int) -> tuple[Share, ...]:
        """Which prefill ranks write which heads to decode rank ``d``, by source rank."""
        self.check_tp(prefill_tp, "prefill tp")
        first, count = self.heads(d, decode_tp)
        p_tp = prefill_tp
        if self.order == "mla":
            return (Share((d * p_tp) // decode_tp, 0, 1),)
        h = self.kv_heads
        out: list[Share] = []
        if p_tp <= h:
            per = h // p_tp
            head = first
            while head < first + count:
                src = head // per
                end = min(first + count, (src + 1) * per)
                out.append(Share(src, head, end - head))
                head = end
        else:
            for head in range(first, first + count):
                lo, hi = -(-head * p_tp // h), -(-(head + 1) * p_tp // h)  # the ranks r with (r*H)//P == head
                out.append(Share(lo + d % (hi - lo), head, 1))
        return tuple(out)

    def sources(self, prefill_tp: int, decode_tp: int, d: int) -> tuple[int, ...]:
        return tuple(s.source for s in self.assignment(prefill_tp, decode_tp, d))

    def targets(self, prefill_tp: int, decode_tp: int, p: int) -> tuple[int, ...]:
        """Decode ranks that prefill rank ``p`` writes to (possibly none under MLA)."""
        return tuple(d for d in range(decode_tp) if p in self.sources(prefill_tp, decode_tp, d))

    def share(self, prefill_tp: int, decode_tp: int, p: int, d: int) -> Share | None:
        for s in self.assignment(prefill_tp, decode_tp, d):
            if s.source == p:
                return s
        return None

    def segments(self, prefill_tp: int, p: int, decode_tp: int, d: int) -> Segments | None:
        """How prefill rank ``p`` cuts each page pair it writes to decode rank ``d``; None if it owes nothing."""
        share = self.share(prefill_tp, decode_tp, p, d)
        if share is None:
            return None
        t, b = self.page_tokens, self.head_bytes
        sf, sc = self.heads(p, prefill_tp)
        df, dc = self.heads(d, decode_tp)
        spb, dpb = t * sc * b, t * dc * b
        if self.order == "mla" or share.count == sc == dc:  # the whole page on both sides
            return Segments(1, 0, 0, 0, 0, spb, spb, dpb)
        if self.order == "hnd":  # heads outermost: the share is one contiguous block of each page
            return Segments(1, (share.first - sf) * t * b, (share.first - df) * t * b, 0, 0, share.count * t * b, spb, dpb)
        return Segments(t, (share.first - sf) * b, (share.first - df) * b, sc * b, dc * b, share.count * b, spb, dpb)

    def slot_writes(self, prefill_tp: int, p: int, decode_tp: int, d: int, pages: int) -> int:
        """Writes of the per-token-slot scheme (one per buffer, page and token slot when heads are sliced,
        one per buffer and page otherwise): what this planner is measured against."""
        seg = self.segments(prefill_tp, p, decode_tp, d)
        if seg is None:
            return 0
        sliced = seg.length != seg.src_page or seg.src_page != seg.dst_page
        return self.buffers * pages * (self.page_tokens if sliced else 1)

    def to_json(self) -> dict[str, Any]:
        out = {"order": self.order, "kv_heads": self.kv_heads, "head_bytes": self.head_bytes,
               "page_tokens": self.page_tokens, "layers": self.layers}
        if self.fused_kv:  # absent when False: peers of before the field read the same layouts
            out["fused_kv"] = True
        return out

    @classmethod
    def from_json(cls, value: Any) -> KvLayout:
        """Parse a peer's layout (a JSON object); ``LocalProtocolError`` naming the field (the door relabels it)."""
        if not isinstance(value, dict):
            raise LocalProtocolError(f"kv_layout: expected an object, got {type(value).__name__}")
        fields = ("order", "kv_heads", "head_bytes", "page_tokens", "layers")
        extra = sorted(set(value) - set(fields) - {"fused_kv"})
        if extra:
            raise LocalProtocolError(f"kv_layout: unknown field {extra[0]!r}")
        missing = [f for f in fields if f not in value]
        if missing:
            raise LocalProtocolError(f"kv_layout: missing field {missing[0]!r}")
        return cls(**{f: value[f] for f in fields}, fused_kv=value.get("fused_kv", False))
