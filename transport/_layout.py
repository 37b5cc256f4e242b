"""What both transfer-plan twins share: the ``Layout`` value, ``PlanError`` and input validation.

A layout describes one side's paged memory: ``len(bases)`` buffers (say 32
layers × K and V), buffer ``i`` starting at ``bases[i]`` and holding
``num_pages`` pages of ``page_bytes[i]`` bytes each, page ``p`` at
``bases[i] + p * page_bytes[i]``. The source and the destination of a
transfer each have their own layout; they must agree on the number of
buffers and on ``page_bytes``.

A sink's layout arrives in a control message, so nothing here costs more than
O(buffers + pages written) whatever ``num_pages`` claims, and a layout whose
last page would not fit in 64-bit addresses is refused, naming the field.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import TransportBaseError
from .limits import U64_MAX

__all__ = ["Layout", "PlanError", "validate"]

MAX_PAGE_ID = (1 << 63) - 1  # page ids are int64 in both twins


class PlanError(TransportBaseError, ValueError):
    """A transfer plan was asked for with inputs that cannot describe a transfer."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One side's paged buffers: base addresses, bytes per page per buffer, pages per buffer."""

    bases: tuple[int, ...]
    page_bytes: tuple[int, ...]
    num_pages: int

    def __init__(self, bases: Sequence[int], page_bytes: Sequence[int], num_pages: int) -> None:
        # The sink sends these in a control message: every check names the field, and
        # nothing here costs more than O(len(bases)) whatever num_pages claims.
        bases_t = _ints("bases", bases)
        pb_t = _ints("page_bytes", page_bytes)
        pages = _int("num_pages", num_pages)
        if not bases_t:
            raise PlanError("bases: a layout needs at least one buffer")
        if len(pb_t) != len(bases_t):
            raise PlanError(f"{len(bases_t)} buffers but {len(pb_t)} page sizes; give one page size per buffer")
        if pages <= 0:
            raise PlanError(f"num_pages: a layout needs a positive number of pages, got {pages}")
        if pages > MAX_PAGE_ID + 1:
            raise PlanError(f"num_pages: {pages} exceeds 2**63 (page ids are int64)")
        for i, pb in enumerate(pb_t):
            if pb <= 0:
                raise PlanError(f"page_bytes[{i}]: bytes per page must be positive, got {pb}")
        object.__setattr__(self, "bases", bases_t)
        object.__setattr__(self, "page_bytes", pb_t)
        object.__setattr__(self, "num_pages", pages)
        _check_extent(self)

    @classmethod
    def for_kv(
        cls, bases: Sequence[int], bytes_per_token: Sequence[int] | int, page_size: int, num_pages: int
    ) -> Layout:
        """A KV-cache layout: ``page_size`` tokens per page, ``bytes_per_token`` per buffer (or one for all)."""
        if page_size <= 0:
            raise PlanError(f"page_size (tokens per page) must be positive, got {page_size}")
        bpt = [bytes_per_token] * len(bases) if isinstance(bytes_per_token, int) else list(bytes_per_token)
        return cls(bases, [b * page_size for b in bpt], num_pages)


def _int(field: str, value: Any) -> int:
    """An exact integer (numpy ones too); bool, float and str are refused rather than coerced."""
    if isinstance(value, bool):
        raise PlanError(f"{field}: must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise PlanError(f"{field}: must be an integer, got {type(value).__name__}") from None


def _ints(field: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | np.ndarray):
        raise PlanError(f"{field}: must be a sequence of integers, got {type(values).__name__}")
    return tuple(_int(f"{field}[{i}]", v) for i, v in enumerate(values))


def _check_extent(layout: Layout) -> None:
    """Every page address and run length of a plan then fits in u64: the twins' arithmetic cannot wrap."""
    n = layout.num_pages
    for i, (b, pb) in enumerate(zip(layout.bases, layout.page_bytes)):
        if b < 0 or b + pb * n > U64_MAX:
            raise PlanError(
                f"bases[{i}] = {b:#x} + page_bytes[{i}] = {pb} x num_pages = {n} "
                "does not fit in 64-bit addresses"
            )


_SMALL = 4096  # page ids checked as Python ints up to this many: numpy's per-call cost is most of a short list's


def _small_pages(pages: Any, num_pages: int) -> tuple[np.ndarray, Sequence[int]] | None:
    """In-range page ids as int64 and as Python ints, checked without numpy: a list or tuple of ``int``,
    or a 1-D integer numpy array of at most ``_SMALL`` (the peers hand arrays over); None for anything
    else, which ``_pages`` checks and names."""
    if type(pages) is np.ndarray:
        if pages.ndim != 1 or pages.dtype.kind not in "iu" or not 0 < pages.size <= _SMALL:
            return None
        ids = pages.tolist()
    elif type(pages) in (list, tuple) and pages:
        ids = pages
        for p in ids:
            if type(p) is not int:  # bool, numpy integers, floats: numpy's path decides (and names) them
                return None
    else:
        return None
    if min(ids) < 0 or max(ids) >= num_pages:
        return None
    return np.array(ids, np.int64), ids


@functools.lru_cache(maxsize=256)
def _u64(values: tuple[int, ...]) -> np.ndarray:
    """``values`` (a layout's bases or page sizes, checked when it was made) as a read-only uint64 array."""
    arr = np.array(values, np.uint64)
    arr.flags.writeable = False
    return arr


def _pages(name: str, pages: Any, num_pages: int) -> tuple[np.ndarray, Sequence[int] | None]:
    """``pages`` checked, as int64, and as Python ints when ``_small_pages`` took them (else None)."""
    small = _small_pages(pages, num_pages)
    if small is not None:
        return small
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be a 1-D sequence of page ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64), None
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integer page ids, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_pages:
        bad = lo if lo < 0 else hi
        where = int(np.flatnonzero(arr == bad)[0])
        raise PlanError(f"{name}[{where}] = {bad} is out of range: the layout has pages 0..{num_pages - 1}")
    return np.ascontiguousarray(arr, dtype=np.int64), None


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
    s, _ = _pages("src_pages", src_pages, src.num_pages)
    d, ids = _pages("dst_pages", dst_pages, dst.num_pages)
    if s.shape[0] != d.shape[0]:
        raise PlanError(f"{s.shape[0]} source pages but {d.shape[0]} destination pages; the lists pair up one to one")
    if d.size > 1 and (ids is None or len(set(ids)) != len(ids)):
        # a sorted copy names the page: O(pages written), never O(the claimed num_pages)
        ds = np.sort(d)
        dup = np.flatnonzero(ds[1:] == ds[:-1])
        if dup.size:
            page = int(ds[dup[0]])
            times = int(np.count_nonzero(d == page))
            raise PlanError(f"destination page {page} appears {times} times; a page can be written once")
    return s, d, _u64(src.bases), _u64(dst.bases), _u64(src.page_bytes)
