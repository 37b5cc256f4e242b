"""What both transfer-plan twins share: the ``Layout`` value, ``PlanError`` and input validation.

A layout describes one side's paged memory: ``len(bases)`` buffers (say 32
layers × K and V), buffer ``i`` starting at ``bases[i]`` and holding
``num_pages`` pages of ``page_bytes[i]`` bytes each, page ``p`` at
``bases[i] + p * page_bytes[i]``. The source and the destination of a
transfer each have their own layout; they must agree on the number of
buffers and on ``page_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcore.errors import PdError

__all__ = ["Layout", "PlanError", "validate"]

_U64_MAX = (1 << 64) - 1


class PlanError(PdError, ValueError):
    """A transfer plan was asked for with inputs that cannot describe a transfer."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One side's paged buffers: base addresses, bytes per page per buffer, pages per buffer."""

    bases: tuple[int, ...]
    page_bytes: tuple[int, ...]
    num_pages: int

    def __init__(self, bases: Sequence[int], page_bytes: Sequence[int], num_pages: int) -> None:
        bases_t = tuple(int(b) for b in bases)
        pb_t = tuple(int(b) for b in page_bytes)
        if not bases_t:
            raise PlanError("a layout needs at least one buffer")
        if len(pb_t) != len(bases_t):
            raise PlanError(f"{len(bases_t)} buffers but {len(pb_t)} page sizes; give one page size per buffer")
        if int(num_pages) <= 0:
            raise PlanError(f"a layout needs a positive number of pages, got {num_pages}")
        for i, (b, pb) in enumerate(zip(bases_t, pb_t)):
            if pb <= 0:
                raise PlanError(f"buffer {i}: bytes per page must be positive, got {pb}")
            if b < 0 or b + pb * int(num_pages) > _U64_MAX:
                raise PlanError(f"buffer {i}: [{b:#x}, +{pb} x {num_pages} pages) does not fit in 64-bit addresses")
        object.__setattr__(self, "bases", bases_t)
        object.__setattr__(self, "page_bytes", pb_t)
        object.__setattr__(self, "num_pages", int(num_pages))

    @classmethod
    def for_kv(
        cls, bases: Sequence[int], bytes_per_token: Sequence[int] | int, page_size: int, num_pages: int
    ) -> Layout:
        """A KV-cache layout: ``page_size`` tokens per page, ``bytes_per_token`` per buffer (or one for all)."""
        if page_size <= 0:
            raise PlanError(f"page_size (tokens per page) must be positive, got {page_size}")
        bpt = [bytes_per_token] * len(bases) if isinstance(bytes_per_token, int) else list(bytes_per_token)
        return cls(bases, [b * page_size for b in bpt], num_pages)


def _pages(name: str, pages: Any, num_pages: int) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be a 1-D sequence of page ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integer page ids, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_pages:
        bad = lo if lo < 0 else hi
        where = int(np.flatnonzero(arr == bad)[0])
        raise PlanError(f"{name}[{where}] = {bad} is out of range: the layout has pages 0..{num_pages - 1}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def validate(
    src: Layout, dst: Layout, src_pages: Any, dst_pages: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Check a plan request; return ``(src_pages, dst_pages)`` as int64 and ``(src_bases, dst_bases, page_bytes)`` as uint64.

    Rules: same number of buffers and same bytes per page on both sides, page
    lists of equal length, every id in range, no destination page twice.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise PlanError("src and dst must be transport.plan.Layout values")
    if len(src.bases) != len(dst.bases):
        raise PlanError(f"source has {len(src.bases)} buffers, destination {len(dst.bases)}")
    if src.page_bytes != dst.page_bytes:
        i = next(i for i, (a, b) in enumerate(zip(src.page_bytes, dst.page_bytes)) if a != b)
        raise PlanError(f"buffer {i}: {src.page_bytes[i]} bytes per page at the source, {dst.page_bytes[i]} at the destination")
    s = _pages("src_pages", src_pages, src.num_pages)
    d = _pages("dst_pages", dst_pages, dst.num_pages)
    if s.shape[0] != d.shape[0]:
        raise PlanError(f"{s.shape[0]} source pages but {d.shape[0]} destination pages; the lists pair up one to one")
    if d.size:
        counts = np.bincount(d, minlength=dst.num_pages)
        if int(counts.max()) > 1:
            page = int(np.flatnonzero(counts > 1)[0])
            raise PlanError(f"destination page {page} appears {int(counts[page])} times; a page can be written once")
    return (
        s,
        d,
        np.array(src.bases, np.uint64),
        np.array(dst.bases, np.uint64),
        np.array(src.page_bytes, np.uint64),
    )
