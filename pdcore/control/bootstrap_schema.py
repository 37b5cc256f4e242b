"""The bootstrap API's values and its registry, sans-IO: what a rank registers, what a sink looks up.

``RankRegistration``, ``ParallelInfo``, ``RankInfo`` (msgspec structs: types, ranges
and unknown fields checked in one pass, each error naming the field), ``check_layout``
(the keys of a layout that peers read, checked by type), the ``parse_*`` functions
of request bodies and paths, and ``Registry``, which decides every registration by
the rules in ``pdcore/control/bootstrap.py``. Pure, so the fuzzers drive it without
sockets.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from ..core.errors import LocalProtocolError, RemoteProtocolError
from ..kv.layout import KvLayout
from .wire import MAX_SESSION_ID, MAX_TP_SIZE, check_endpoint, check_json_object


MAX_BODY_BYTES: Final = 1 << 20
MAX_RESPONSE_BYTES: Final = 2 * MAX_BODY_BYTES
DEFAULT_PORT: Final = 8998

_U63 = (1 << 63) - 1
MAX_LAYOUT_BUFFERS: Final = 4096  # entries of a layout's page_bytes: one per KV buffer of the rank
MAX_LAYOUT_PAGES: Final = 1 << 40  # a layout's num_pages, and each of its page_bytes, is below this
MAX_ROLE: Final = 64  # characters of a layout's role
Size = Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)]
Rank = Annotated[int, Meta(ge=0, le=MAX_TP_SIZE - 1)]
Epoch = Annotated[int, Meta(ge=0, le=_U63)]
SessionId = Annotated[str, Meta(min_length=1, max_length=MAX_SESSION_ID, pattern=r"^[!-~]+$")]
Endpoint = Annotated[str, Meta(min_length=1, max_length=255)]
Instance = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]  # a transport instance id, hex

Outcome = Literal["created", "unchanged", "replaced"]
PdErrorLike = LocalProtocolError | RemoteProtocolError

class RankRegistration(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a source rank PUTs: its control endpoint, place in the replica, layout."""

    session_id: SessionId
    epoch: Epoch
    endpoint: Endpoint
    tp_size: Size
    dp_size: Size
    tp_rank: Rank
    dp_rank: Rank
    layout: dict[str, Any]
    transport: Instance  # the rank's data-plane instance: what a sink grants its pages to


class ParallelInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The deployment's shape, as a sink sees it; ``complete`` once every rank registered.

    ``tp_sizes[g]`` is DP group ``g``'s tp size (groups may differ: DP attention with a tp size per
    group), 0 while none of its ranks registered. ``layout`` is group 0's (with a KV layout the
    groups' page sizes follow from their tp sizes; everything else is the same in every group).
    """

    dp_size: Size
    tp_sizes: Annotated[tuple[Annotated[int, Meta(ge=0, le=MAX_TP_SIZE)], ...], Meta(max_length=MAX_TP_SIZE)]
    layout: dict[str, Any]
    registered: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE * MAX_TP_SIZE)]
    complete: bool

    def tp_size(self, dp_rank: int) -> int:
        """DP group ``dp_rank``'s tp size (0: not known yet)."""
        return self.tp_sizes[dp_rank]


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One registered rank: where its control channel listens."""

    dp_rank: Rank
    tp_rank: Rank
    endpoint: Endpoint
    session_id: SessionId
    epoch: Epoch
    transport: Instance


_REG_DECODER: Final = msgspec.json.Decoder(RankRegistration)
_PAR_DECODER: Final = msgspec.json.Decoder(ParallelInfo)
_RANK_DECODER: Final = msgspec.json.Decoder(RankInfo)
ENCODER: Final = msgspec.json.Encoder(order="sorted")


def _decode_json(decoder: msgspec.json.Decoder[Any], body: bytes, what: str) -> Any:
    if len(body) > MAX_RESPONSE_BYTES:
        raise RemoteProtocolError(f"{what}: body of {len(body)} bytes is too large")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise RemoteProtocolError(f"{what}: {e}") from None
    except msgspec.DecodeError as e:
        raise RemoteProtocolError(f"{what}: not JSON: {e}") from None
    except RecursionError:
        raise RemoteProtocolError(f"{what}: nested too deeply") from None


def _relabel(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except LocalProtocolError as e:  # bytes from outside: the fault is the sender's
        raise RemoteProtocolError(f"{what}.{e}") from None


def _kind(value: Any) -> str:
    """What a bad value is, for an error message: its JSON-ish type and (cut) repr."""
    return f"{type(value).__name__} {_short(value)}"


def _positive_int(value: Any, bound: int, path: str) -> None:
    if type(value) is not int or not 0 < value < bound:  # type(): a bool is not an int here
        below = f"2**{bound.bit_length() - 1}"
        raise LocalProtocolError(f"{path}: expected a positive int below {below}, got {_kind(value)}")


def check_layout(layout: object, field: str = "layout") -> dict[str, Any]:
    """Check a registered layout: a bounded JSON object whose keys that peers read have their types.

    What the project's ranks register: prefill ``{"page_bytes": [int, ...], "num_pages": int, "kv": {...}}``
    (``kv`` optional), encode ``{"role": "encode"}``. The checks, by type (a bool is never an int):

    - ``page_bytes``: a list of 1..``MAX_LAYOUT_BUFFERS`` positive ints below ``MAX_LAYOUT_PAGES`` (bytes per
      page of each KV buffer); ``num_pages``: a positive int below ``MAX_LAYOUT_PAGES``. Either needs the other.
    - ``kv``: an object ``KvLayout.from_json`` accepts (null is refused: a rank without a KV layout omits it).
    - ``role``: a string of 1..``MAX_ROLE`` printable ASCII characters.

    Other keys are accepted, as before, as opaque JSON (``check_json_object``: finite numbers, bounded depth):
    no peer reads them, so they cannot trip one, and they take part in the registry's layout comparison
    like the rest. Raises ``LocalProtocolError`` naming the path (``layout.page_bytes[2]: ...``); the doors
    relabel it as the sender's fault.
    """
    check_json_object(layout, field)
    assert isinstance(layout, dict)
    pages, count = layout.get("page_bytes", _ABSENT), layout.get("num_pages", _ABSENT)
    if (pages is _ABSENT) != (count is _ABSENT):
        missing, present = ("num_pages", "page_bytes") if count is _ABSENT else ("page_bytes", "num_pages")
        raise LocalProtocolError(f"{field}.{missing}: missing beside {present} (a rank with pages registers both)")
    if pages is not _ABSENT:
        if type(pages) is not list or not 0 < len(pages) <= MAX_LAYOUT_BUFFERS:
            got = f"a list of {len(pages)}" if type(pages) is list else _kind(pages)
            raise LocalProtocolError(
                f"{field}.page_bytes: expected a list of 1..{MAX_LAYOUT_BUFFERS} positive ints (bytes per page "
                f"of each KV buffer), got {got}"
            )
        for i, size in enumerate(pages):
            _positive_int(size, MAX_LAYOUT_PAGES, f"{field}.page_bytes[{i}]")
        _positive_int(count, MAX_LAYOUT_PAGES, f"{field}.num_pages")
    kv = layout.get("kv", _ABSENT)
    if kv is not _ABSENT:
        try:
            KvLayout.from_json(kv)
        except LocalProtocolError as e:  # "KvLayout.order: x" -> "layout.kv.order: x", "kv_layout: x" -> "layout.kv: x"
            text = str(e)
            text = f".{text.removeprefix('KvLayout.')}" if text.startswith("KvLayout.") else \
                f": {text.removeprefix('kv_layout: ')}"
            raise LocalProtocolError(f"{field}.kv{text}") from None
        except (TypeError, ValueError) as e:  # from_json raises LocalProtocolError; anything else is still the value's
            raise LocalProtocolError(f"{field}.kv: not a KV layout: {e}") from None
    role = layout.get("role", _ABSENT)
    if role is not _ABSENT and (
        type(role) is not str or not 0 < len(role) <= MAX_ROLE or not all("!" <= c <= "~" for c in role)
    ):
        raise LocalProtocolError(
            f"{field}.role: expected a string of 1..{MAX_ROLE} printable ASCII characters, got {_kind(role)}"
        )
    return layout


def parse_registration(body: bytes) -> RankRegistration:
    """Validate a PUT /v1/ranks body (the layout by ``check_layout``). Raises ``RemoteProtocolError`` naming
    the field (the server answers it with 400)."""
    reg: RankRegistration = _decode_json(_REG_DECODER, body, "registration")
    if reg.tp_rank >= reg.tp_size:
        raise RemoteProtocolError(f"registration.tp_rank: {reg.tp_rank} is not below tp_size {reg.tp_size}")
    if reg.dp_rank >= reg.dp_size:
        raise RemoteProtocolError(f"registration.dp_rank: {reg.dp_rank} is not below dp_size {reg.dp_size}")
    _relabel("registration", check_endpoint, reg.endpoint)
    _relabel("registration", check_layout, reg.layout, "layout")
    return reg


def parse_parallel_info(body: bytes) -> ParallelInfo:
    """Validate a GET /v1/parallel response (the client's door): the layout by ``check_layout``, as the server
    checks registrations, so an answer a peer's pairing would trip over is a ``RemoteProtocolError`` here."""
    info: ParallelInfo = _decode_json(_PAR_DECODER, body, "parallel_info")
    if len(info.tp_sizes) != info.dp_size:
        raise RemoteProtocolError(f"parallel_info.tp_sizes: {len(info.tp_sizes)} groups, dp_size {info.dp_size}")
    if info.registered > sum(info.tp_sizes) and all(info.tp_sizes):
        raise RemoteProtocolError(f"parallel_info.registered: {info.registered} exceeds the groups' tp sizes")
    if info.complete != (all(info.tp_sizes) and info.registered == sum(info.tp_sizes)):
        raise RemoteProtocolError("parallel_info.complete: disagrees with registered")
    _relabel("parallel_info", check_layout, info.layout, "layout")
    return info


def parse_rank_info(body: bytes) -> RankInfo:
    """Validate a GET /v1/ranks/<dp>/<tp> response (the client's door)."""
    info: RankInfo = _decode_json(_RANK_DECODER, body, "rank_info")
    _relabel("rank_info", check_endpoint, info.endpoint)
    return info


def _canonical_int(text: str, field: str) -> int:
    if not (0 < len(text) <= 4 and text.isascii() and text.isdigit()) or text != str(int(text)):
        raise RemoteProtocolError(f"{field}: {text[:16]!r} is not a canonical integer")
    value = int(text)
    if value >= MAX_TP_SIZE:
        raise RemoteProtocolError(f"{field}: {value} is not below {MAX_TP_SIZE}")
    return value


def parse_rank_path(path: str) -> tuple[int, int] | None:
    """``/v1/ranks/<dp>/<tp>`` → (dp_rank, tp_rank); None if the path is not that route.

    Raises ``RemoteProtocolError`` naming ``dp_rank`` or ``tp_rank`` if malformed.
    """
    parts = path.split("/")
    if len(parts) != 5 or parts[0] != "" or parts[1] != "v1" or parts[2] != "ranks":
        return None
    return _canonical_int(parts[3], "dp_rank"), _canonical_int(parts[4], "tp_rank")


def _canonical_layout(layout: dict[str, Any]) -> bytes:
    return ENCODER.encode(layout)


def _group_neutral(layout: dict[str, Any]) -> bytes:
    """What must match across DP groups: with a KV layout (``"kv"``) the page sizes follow from each group's
    tp size and may differ; everything else, and opaque pages' sizes, must match."""
    if "kv" in layout:
        layout = {k: v for k, v in layout.items() if k != "page_bytes"}
    return _canonical_layout(layout)


_ABSENT: Final = object()


def _first_difference(a: Any, b: Any, path: str, *, skip_pages: bool = False) -> tuple[str, Any, Any]:
    """The first place two JSON values differ: ``(path, a's value, b's value)`` (``_ABSENT`` where a key is
    missing). ``skip_pages``: a top-level ``page_bytes`` beside a ``kv`` layout may differ (DP groups)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if skip_pages and key == "page_bytes" and "kv" in a and "kv" in b:
                continue
            va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
            if _canonical_layout({"v": va} if va is not _ABSENT else {}) != _canonical_layout(
                    {"v": vb} if vb is not _ABSENT else {}):
                return _first_difference(va, vb, f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (va, vb) in enumerate(zip(a, b)):
            if _canonical_layout({"v": va}) != _canonical_layout({"v": vb}):
                return _first_difference(va, vb, f"{path}[{i}]")
    return path, a, b


def _short(value: Any) -> str:
    """A value for an error message: ``(absent)``, or its repr cut at 80 characters."""
    if value is _ABSENT:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Registry:
    """The server's state, pure and not thread-safe: the server holds a lock around it."""

    def __init__(self) -> None:
        self._slots: dict[tuple[int, int], tuple[RankRegistration, bytes]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def register(self, reg: RankRegistration) -> Outcome:
        """Store a registration. Raises ``RemoteProtocolError`` (→ 409) on a conflict."""
        slot = (reg.dp_rank, reg.tp_rank)
        layout = _canonical_layout(reg.layout)
        for other_slot, (other, other_layout) in self._slots.items():
            if other_slot == slot:
                continue
            where = f"rank (dp {other.dp_rank}, tp {other.tp_rank})"
            if reg.dp_size != other.dp_size:
                raise RemoteProtocolError(
                    f"registration.dp_size: {reg.dp_size} disagrees with {other.dp_size} registered by {where}"
                )
            same_group = reg.dp_rank == other.dp_rank
            if same_group and reg.tp_size != other.tp_size:
                raise RemoteProtocolError(
                    f"registration.tp_size: {reg.tp_size} disagrees with {other.tp_size} registered by {where} "
                    f"of the same DP group"
                )
            if (layout if same_group else _group_neutral(reg.layout)) != (
                other_layout if same_group else _group_neutral(other.layout)
            ):
                path, mine, theirs = _first_difference(reg.layout, other.layout, "layout", skip_pages=not same_group)
                raise RemoteProtocolError(
                    f"registration.{path}: {_short(mine)} differs from {_short(theirs)} registered by {where}"
                )
            if reg.endpoint == other.endpoint:
                raise RemoteProtocolError(f"registration.endpoint: {reg.endpoint} is already used by {where}")
            if reg.session_id == other.session_id:
                raise RemoteProtocolError(f"registration.session_id: {reg.session_id} is already used by {where}")
        current = self._slots.get(slot)
        if current is not None:
            old = current[0]
            if reg.epoch < old.epoch:
                raise RemoteProtocolError(f"registration.epoch: {reg.epoch} is older than the registered {old.epoch}")
            if reg.epoch == old.epoch:
                for field in ("session_id", "endpoint", "tp_size", "dp_size", "transport"):
                    if getattr(reg, field) != getattr(old, field):
                        raise RemoteProtocolError(
                            f"registration.{field}: differs from the registration of the same epoch {old.epoch}"
                        )
                if layout != current[1]:
                    raise RemoteProtocolError(
                        f"registration.layout: differs from the registration of the same epoch {old.epoch}"
                    )
                return "unchanged"
        self._slots[slot] = (reg, layout)
        return "created" if current is None else "replaced"

    def parallel_info(self) -> ParallelInfo | None:
        """None while no rank registered."""
        if not self._slots:
            return None
        regs = [entry[0] for entry in self._slots.values()]
        dp_size = regs[0].dp_size
        tp_sizes = [0] * dp_size
        counts = [0] * dp_size
        for reg in regs:
            tp_sizes[reg.dp_rank] = reg.tp_size
            counts[reg.dp_rank] += 1
        layout = min(regs, key=lambda r: (r.dp_rank, r.tp_rank)).layout
        complete = all(size and count == size for size, count in zip(tp_sizes, counts))
        return ParallelInfo(
            dp_size=dp_size, tp_sizes=tuple(tp_sizes), layout=layout, registered=len(regs), complete=complete,
        )  # fmt: skip

    def lookup(self, dp_rank: int, tp_rank: int) -> RankInfo | None:
        entry = self._slots.get((dp_rank, tp_rank))
        if entry is None:
            return None
        reg = entry[0]
        return RankInfo(
            dp_rank=dp_rank, tp_rank=tp_rank, endpoint=reg.endpoint, session_id=reg.session_id, epoch=reg.epoch,
            transport=reg.transport,
        )  # fmt: skip
