"""The control-channel codec: pure, sans-IO (bytes in, messages out).

Frame layout: ``b"pd"`` + one protocol-version byte + the CRC-32 of the body
(4 bytes, little-endian) + the body, a msgpack map whose ``type`` key tags the
message. The checksum turns a frame corrupted on its way (a flipped byte that
would still decode, e.g. as another first token) into a ``RemoteProtocolError``;
it is no defence against a peer that lies (that is authentication's job). The
version sits *outside* the body so that a peer of another version gets a clear
"version" error even if a later version changes the body encoding entirely.

Why msgspec: it decodes msgpack straight into typed, frozen ``Struct``\\ s and
checks types, ranges, lengths and unknown fields in the same C pass, with
error messages that name the field (``- at `$.room```). Hand-written field
checks are where such code's defects come from (a field of the wrong type
that passes until it is used); msgspec is maintained, has no dependencies, and is several times faster
than json + dataclasses.

Rules:

- ``decode`` is the one door for a peer's bytes. It returns a message or raises
  ``RemoteProtocolError`` (nothing else); ``rooms`` holds the room the frame
  names whenever it can be recovered, so the caller fails that room and nothing
  more.
- ``encode`` applies the same rules to our own messages and raises
  ``LocalProtocolError``: a bad message is caught at the sender, not by a
  confused peer.
- Schemas are strict (unknown fields are errors): any change to a message is a
  new ``PROTOCOL_VERSION``.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Annotated, Any, Final, TypeGuard, Union

import msgspec
from msgspec import Meta

from transport.limits import U64_MAX

from ..core.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MAGIC",
    "MAX_FRAME_BYTES",
    "MAX_PAGES",
    "MAX_CANDIDATES",
    "MAX_TOKEN_ID",
    "MAX_COUNT",
    "MAX_REGIONS",
    "MAX_TP_SIZE",
    "Region",
    "Register",
    "Announce",
    "Status",
    "Abort",
    "AbortAck",
    "Heartbeat",
    "EmbedRegister",
    "EmbedAsk",
    "EmbedStatus",
    "Message",
    "MESSAGE_TYPES",
    "encode",
    "decode",
    "seal",
    "rooms_of",
    "check_endpoint",
    "check_json_object",
]

PROTOCOL_VERSION: Final = 4  # 2: a CRC-32 per frame; Announce.grant, Status.register_again. 3: EPD frames.
# 4: the frames a channel owes one peer in a pass travel as the parts of one ZeroMQ message
MAGIC: Final = b"pd"
_HEADER: Final = MAGIC + bytes([PROTOCOL_VERSION])
_CRC: Final = struct.Struct("<I")
_PREFIX: Final = len(_HEADER) + _CRC.size

# Bounds: every count and length a peer controls has one.
MAX_FRAME_BYTES: Final = 4 << 20
MAX_PAGES: Final = 1 << 18  # 256 Ki destination pages per request and rank
MAX_CANDIDATES: Final = 256
MAX_REGIONS: Final = 1024
MAX_TP_SIZE: Final = 1024
MAX_SESSION_ID: Final = 256
MAX_REASON: Final = 1024
MAX_TRANSPORT_ENDPOINT: Final = 4096
MAX_JSON_DEPTH: Final = 32
MAX_CONTROL_ENDPOINT: Final = 255  # a ZMQ routing id is at most 255 bytes
MAX_DTYPE: Final = 32

_I31 = (1 << 31) - 1
MAX_TOKEN_ID: Final = _I31  # a first token or drafter candidate: a non-negative int32
MAX_COUNT: Final = _I31  # cached tokens, a request pool index

U64 = Annotated[int, Meta(ge=0)]  # msgpack integers stop at 2**64 - 1
Room = U64
Rank = Annotated[int, Meta(ge=0, le=MAX_TP_SIZE - 1)]
TpSize = Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)]
PageId = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
TokenId = Annotated[int, Meta(ge=0, le=_I31)]
Count = Annotated[int, Meta(ge=0, le=_I31)]
StateValue = Annotated[int, Meta(ge=0, le=5)]  # a State (pdcore/core/_spec.py): 0 FAILED ... 5 SUCCESS
SessionId = Annotated[str, Meta(min_length=1, max_length=MAX_SESSION_ID, pattern=r"^[!-~]+$")]
Reason = Annotated[str, Meta(max_length=MAX_REASON)]
Rows = Annotated[int, Meta(ge=0, le=(1 << 62) - 1)]
DType = Annotated[str, Meta(min_length=1, max_length=MAX_DTYPE, pattern=r"^[a-z0-9_.]+$")]


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A registered memory region as the transport describes it (RDMA: rkey)."""

    addr: U64
    length: Annotated[int, Meta(ge=1)]
    key: U64


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    """Base of the control messages: frozen, keyword-only, never subclassed further.

    Each message says ``frozen=True`` again: it inherits it, but a type checker reads msgspec through
    ``dataclass_transform``, which does not (a frozen base with a subclass it takes for mutable is an error).
    """


class Register(_Msg, tag="register", frozen=True):
    """Sink rank → source rank, once per (session, epoch): where and how to write."""

    session_id: SessionId
    epoch: U64
    endpoint: Annotated[bytes, Meta(min_length=1, max_length=MAX_TRANSPORT_ENDPOINT)]
    regions: Annotated[tuple[Region, ...], Meta(max_length=MAX_REGIONS)]
    layout: dict[str, Any]
    tp_size: TpSize
    tp_rank: Rank


class Announce(_Msg, tag="announce", frozen=True):
    """Sink rank → source rank: the destination pages of one request (room)."""

    room: Room
    session_id: SessionId
    epoch: U64
    page_ids: Annotated[tuple[PageId, ...], Meta(max_length=MAX_PAGES)]
    request_pool_index: Count
    grant: U64 = 0  # the sink's transport grant for these pages: the source writes through it


class Status(_Msg, tag="status", frozen=True):
    """Source rank → sink rank: this rank's part of a room reached ``state``."""

    room: Room
    state: StateValue
    rank: Rank
    first_token: TokenId | None = None
    cached_tokens: Count = 0
    first_token_logprob: float | None = None  # finite, -inf or NaN (what samplers produce); never +inf
    spec_candidate_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_CANDIDATES)] | None = None
    reason: Reason = ""
    register_again: bool = False  # the source does not know this sink (any more): send Register again


class Abort(_Msg, tag="abort", frozen=True):
    """Either side: fail this room now. A source answers with ``AbortAck``."""

    room: Room
    reason: Reason = ""


class AbortAck(_Msg, tag="abort_ack", frozen=True):
    """Source rank → sink: no write of ``rank`` to this room is in flight or will be posted.

    Informational: the sink frees a room's pages once it revoked the room's
    grant (fence before free: pdcore/core/_spec.py), never on a source's word.
    """

    room: Room
    rank: Rank


class Heartbeat(_Msg, tag="heartbeat", frozen=True):
    """Liveness; a larger ``epoch`` for the same session means the peer restarted."""

    session_id: SessionId
    epoch: U64
    seq: U64


class EmbedRegister(_Msg, tag="embed_register", frozen=True):
    """EPD, prefill rank → encode rank, once per (session, epoch): where its receive slots are."""

    session_id: SessionId
    epoch: U64
    endpoint: Annotated[bytes, Meta(min_length=1, max_length=MAX_TRANSPORT_ENDPOINT)]
    tp_size: TpSize
    tp_rank: Rank


class EmbedAsk(_Msg, tag="embed_ask", frozen=True):
    """EPD, prefill rank → encode rank: write rows ``[row_start, row_start + row_count)`` of the
    image of ``room`` into ``addr`` (and its deepstack rows into ``deepstack_addr``) through ``grant``.

    ``rank`` of ``ranks`` is the asking prefill rank in its replica; ``rows`` (the
    image's span), ``hidden``, ``dtype`` and ``deepstack_width`` are what it expects,
    checked by the sender against the chunk before any byte moves. An empty shard
    asks for 0 rows (``addr`` 0): it is the fan-out's "I am here"."""

    room: Room
    session_id: SessionId
    epoch: U64
    rank: Rank
    ranks: TpSize
    sharded: bool
    rows: Rows
    row_start: Rows
    row_count: Rows
    hidden: Rows
    dtype: DType
    deepstack_width: Rows = 0
    addr: U64 = 0
    deepstack_addr: U64 = 0
    grant: U64 = 0


class EmbedStatus(_Msg, tag="embed_status", frozen=True):
    """EPD, encode rank → prefill rank: the room's rows for this rank landed (``ok``), or the room failed."""

    room: Room
    ok: bool
    rank: Rank
    reason: Reason = ""


Message = Union[Register, Announce, Status, Abort, AbortAck, Heartbeat, EmbedRegister, EmbedAsk, EmbedStatus]
MESSAGE_TYPES: Final = (Register, Announce, Status, Abort, AbortAck, Heartbeat, EmbedRegister, EmbedAsk, EmbedStatus)

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)


class _Envelope(msgspec.Struct):
    """Lenient view used only to name the type and recover the room of a bad frame."""

    type: object = None
    room: object = None


_ENVELOPE: Final = msgspec.msgpack.Decoder(_Envelope)


def rooms_of(msg: object) -> tuple[int, ...]:
    """The rooms a message concerns (what to fail if it cannot be sent or handled)."""
    room = getattr(msg, "room", None)
    return (room,) if _is_room(room) else ()


def _is_room(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= U64_MAX


def _peek(body: bytes | memoryview) -> tuple[str, tuple[int, ...]]:
    """(type name, rooms) of a frame that failed to decode; best effort, never raises."""
    try:
        env = _ENVELOPE.decode(body)
    except Exception:  # the frame is already known to be bad; this only improves the report
        return "?", ()
    kind = env.type if isinstance(env.type, str) and len(env.type) <= 32 else "?"
    return kind, (env.room,) if _is_room(env.room) else ()


def check_endpoint(endpoint: object, field: str = "endpoint") -> str:
    """Validate a ZMQ control endpoint ``tcp://host:port`` (IPv6 hosts in brackets).

    Raises ``LocalProtocolError`` naming ``field``; callers at a door relabel it.
    """
    if not isinstance(endpoint, str):
        raise LocalProtocolError(f"{field}: expected a str, got {type(endpoint).__name__}")
    if not 0 < len(endpoint) <= MAX_CONTROL_ENDPOINT:
        raise LocalProtocolError(f"{field}: length {len(endpoint)} is not in 1..{MAX_CONTROL_ENDPOINT}")
    if not endpoint.startswith("tcp://"):
        raise LocalProtocolError(f"{field}: {endpoint!r} does not start with tcp://")
    host, sep, port = endpoint[6:].rpartition(":")  # rpartition: IPv6 hosts contain ':'
    if not sep or not host:
        raise LocalProtocolError(f"{field}: {endpoint!r} has no host:port")
    if not (port.isascii() and port.isdigit()) or port != str(int(port)) or not 0 < int(port) < 65536:
        raise LocalProtocolError(f"{field}: port {port!r} is not a canonical integer in 1..65535")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare or not all(c.isascii() and (c.isalnum() or c in ".-_:%") for c in bare):
        raise LocalProtocolError(f"{field}: host {host!r} is not a hostname or address")
    if ":" in bare and bare == host:
        raise LocalProtocolError(f"{field}: IPv6 host {host!r} must be in brackets")
    return endpoint


def check_json_object(value: object, field: str) -> dict[str, Any]:
    """Check that ``value`` is a JSON object (finite numbers, bounded depth).

    Raises ``LocalProtocolError`` naming the path of the first bad value.
    """
    if not isinstance(value, dict):
        raise LocalProtocolError(f"{field}: expected a JSON object, got {type(value).__name__}")
    stack: list[tuple[object, str, int]] = [(value, field, 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise LocalProtocolError(f"{path}: nested deeper than {MAX_JSON_DEPTH}")
        kind = type(node)
        if type(node) is dict:  # type(node) rather than kind: the checker narrows node on it
            for k, v in node.items():
                if type(k) is not str:
                    raise LocalProtocolError(f"{path}: object key {k!r} is not a string")
                stack.append((v, f"{path}.{k}", depth + 1))
        elif type(node) is list or type(node) is tuple:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
        elif type(node) is float:
            if not math.isfinite(node):
                raise LocalProtocolError(f"{path}: {node!r} is not a finite number")
        elif node is not None and kind not in (str, int, bool):
            raise LocalProtocolError(f"{path}: {kind.__name__} is not a JSON value")
    return value


def _check(msg: Message) -> None:
    """Rules msgspec's per-field constraints cannot express (cross-field, nested JSON)."""
    kind = type(msg)
    if kind is Register or kind is EmbedRegister:
        assert isinstance(msg, (Register, EmbedRegister))
        if msg.tp_rank >= msg.tp_size:
            raise LocalProtocolError(f"register.tp_rank: {msg.tp_rank} is not below tp_size {msg.tp_size}")
        if kind is Register:
            assert isinstance(msg, Register)
            for i, r in enumerate(msg.regions):
                if r.addr + r.length - 1 > U64_MAX:
                    raise LocalProtocolError(f"register.regions[{i}]: addr + length overflows 64 bits")
            check_json_object(msg.layout, "register.layout")
    elif kind is EmbedAsk:
        assert isinstance(msg, EmbedAsk)
        _check_ask(msg)
    elif kind is Announce:
        assert isinstance(msg, Announce)
        if len(set(msg.page_ids)) != len(msg.page_ids):
            raise LocalProtocolError("announce.page_ids: a page appears twice", rooms=(msg.room,))
    elif kind is Status:
        assert isinstance(msg, Status)
        lp = msg.first_token_logprob
        # -inf (a token the sampler gave probability 0) and NaN (a sampler's overflow) are what samplers
        # produce and msgpack's float64 carries them; +inf is no log-probability of anything
        if lp is not None and lp == math.inf:
            raise LocalProtocolError("status.first_token_logprob: inf is not a log-probability "
                                     "(finite, -inf or NaN)", rooms=(msg.room,))


def _check_ask(msg: EmbedAsk) -> None:
    def bad(why: str) -> LocalProtocolError:
        return LocalProtocolError(f"embed_ask.{why}", rooms=(msg.room,))

    if msg.rank >= msg.ranks:
        raise bad(f"rank: {msg.rank} is not below ranks {msg.ranks}")
    if msg.rows < 1 or msg.hidden < 1:
        raise bad(f"rows/hidden: {msg.rows}/{msg.hidden} must be positive")
    if msg.row_start + msg.row_count > msg.rows:
        raise bad(f"row_count: rows {msg.row_start}+{msg.row_count} run past the image's {msg.rows}")
    if (msg.addr == 0) != (msg.row_count == 0):
        raise bad(f"addr: {msg.addr:#x} with row_count {msg.row_count} (an empty shard has no address, rows need one)")
    if (msg.deepstack_addr != 0) != (msg.deepstack_width != 0 and msg.row_count != 0):
        raise bad(
            f"deepstack_addr: {msg.deepstack_addr:#x} with deepstack_width {msg.deepstack_width} and row_count "
            f"{msg.row_count} (deepstack rows need an address exactly when there are some)"
        )


def seal(body: bytes) -> bytes:
    """A frame around an already encoded body: header and checksum (tests and fuzzers build odd bodies)."""
    return _HEADER + _CRC.pack(zlib.crc32(body)) + bytes(body)


def encode(msg: Message) -> bytes:
    """Serialise one message into a frame.

    Raises ``LocalProtocolError`` (naming the field) if the message breaks any
    rule the receiving ``decode`` enforces; any other exception is a bug.
    """
    kind = type(msg)
    if kind not in MESSAGE_TYPES:
        raise LocalProtocolError(f"not a control message: {kind.__name__}")
    rooms = rooms_of(msg)
    name = msg.__struct_config__.tag
    try:
        body = _ENCODER.encode(msg)
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise LocalProtocolError(f"{name}: cannot encode: {e}", rooms=rooms) from e
    if len(body) + _PREFIX > MAX_FRAME_BYTES:
        raise LocalProtocolError(f"{name}: frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}", rooms=rooms)
    try:
        _check(_DECODER.decode(body))  # the receiver's rules, applied before the bytes leave
    except msgspec.ValidationError as e:
        raise LocalProtocolError(f"{name}: {e}", rooms=rooms) from None
    return seal(body)


def decode(frame: bytes) -> Message:
    """Parse one frame from a peer.

    Returns a message of ``MESSAGE_TYPES``. Raises ``RemoteProtocolError`` for
    anything malformed, too large or of another protocol version, naming the
    field; ``rooms`` is the frame's room when it can be recovered. Any other
    exception is a bug.
    """
    n = len(frame)
    if n > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame: {n} bytes exceeds {MAX_FRAME_BYTES}")
    if n < len(_HEADER) or frame[:2] != MAGIC:
        raise RemoteProtocolError("frame.magic: not a pdcore control frame")
    version = frame[2]
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            f"frame.version: peer speaks protocol {version}, this peer speaks {PROTOCOL_VERSION}",
            rooms=_peek(memoryview(frame)[len(_HEADER) :])[1],
        )
    if n < _PREFIX:
        raise RemoteProtocolError("frame.checksum: the frame ends before its checksum")
    body = memoryview(frame)[_PREFIX:]
    (crc,) = _CRC.unpack_from(frame, len(_HEADER))
    if zlib.crc32(body) != crc:  # corrupted on the way: the room it names is a best guess
        raise RemoteProtocolError("frame.checksum: the body does not match its CRC-32", rooms=_peek(body)[1])
    try:
        msg = _DECODER.decode(body)
        _check(msg)
    except msgspec.ValidationError as e:
        kind, rooms = _peek(body)
        raise RemoteProtocolError(f"bad {kind} frame: {e}", rooms=rooms) from None
    except msgspec.DecodeError as e:
        raise RemoteProtocolError(f"frame.body: not msgpack: {e}") from None
    except RecursionError:
        raise RemoteProtocolError("frame.body: nested too deeply") from None
    except LocalProtocolError as e:  # the bytes came from a peer, so the fault is theirs
        raise RemoteProtocolError(str(e), rooms=e.rooms) from None
    return msg
