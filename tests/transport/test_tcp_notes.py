"""A batch's note (``write(..., note=...)``, ``on_note``): the completion that rides the data path.

Real TCP transports on loopback, a source and a sink with a grant between them (the compiled twin, or
the pure one under ``PDCORE_PURE_PYTHON=1``). What the layer above builds on: a note is handed once,
with its grant's key, before the source hears that its batch landed; never for a batch the sink
refused, nor after a refusal through its grant on its connection; a note ``write`` cannot send posts
nothing; and the wrappers carry their inner transport's notes (faulty: only with a whole batch).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from transport.base import MAX_NOTE, Transport
from transport.deadline import Deadline
from transport.errors import TransportError
from transport.faulty import FaultyTransport
from transport.tcp import TcpTransport
from transport.verbs import VerbsTransport
from transport.wrapping import SpoiledGrants

from _transport_support import Collector, MakeTransport, granted_link, transport_maker

PAGE = 4096


@pytest.fixture
def make_tcp() -> Iterator[MakeTransport]:
    yield from transport_maker("tcp", {"peer_timeout": 5.0})


@pytest.fixture
def make_staged() -> Iterator[MakeTransport]:
    """``staged:tcp`` with the stand-in copier, whose gathers complete late (as in test_staging.py)."""
    yield from transport_maker("staged:tcp", {"device": "standin", "peer_timeout": 5.0, "max_delay": 0.003})


class Notes:
    """A sink's note handler: records ``(grant_key, note)``; ``seen`` is what it had handed so far."""

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()

    def __call__(self, key: int, note: bytes) -> None:
        with self._lock:
            self.got.append((key, note))

    def seen(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return list(self.got)


class Link:
    """A source's random pages and a sink's zeroed ones behind one grant, connected, the sink's notes
    recorded in ``notes``."""

    def __init__(self, src_t: Transport, dst_t: Transport, pages: int = 8) -> None:
        self.src_t, self.dst_t = src_t, dst_t
        src = np.random.default_rng(3).integers(0, 256, pages * PAGE, dtype=np.uint8)
        self.src = src
        self.dst, self.rs, self.rd, self.grant, self.peer = granted_link(src_t, dst_t, src)
        self.notes = Notes()
        dst_t.on_note(self.notes)

    def page(self, i: int, j: int | None = None) -> tuple[int, int, int]:
        """The write of source page ``i`` to sink page ``j`` (default ``i``)."""
        return (self.rs.addr + i * PAGE, self.rd.addr + (i if j is None else j) * PAGE, PAGE)

    def landed(self, i: int) -> bool:
        return bool((self.dst[i * PAGE : (i + 1) * PAGE] == self.src[i * PAGE : (i + 1) * PAGE]).all())


def test_a_note_rides_its_batch_and_is_handed_once_before_the_source_hears_it_landed(make_tcp: MakeTransport) -> None:
    link = Link(make_tcp(), make_tcp())
    at_done: dict[int, list[tuple[int, bytes]]] = {}
    done = Collector()

    def on_done(batch_id: int, error: TransportError | None) -> None:
        at_done[batch_id] = link.notes.seen()  # what the sink's handler had returned by now
        done(batch_id, error)

    key = link.grant.key
    plan = [(0, b""), (1, b"room 1 landed"), (2, b""), (3, b"x" * MAX_NOTE), (4, b"")]
    ids = [link.src_t.write(link.peer, [link.page(i)], on_done, grant=key, note=note) for i, note in plan]
    got = done.wait(len(plan))
    assert [bid for bid, _ in got] == ids and all(err is None for _, err in got)
    assert all(link.landed(i) for i, _ in plan)
    assert link.notes.seen() == [(key, b"room 1 landed"), (key, b"x" * MAX_NOTE)]  # once each, in batch order
    # (the sink may be ahead of the source's ack reader: later notes may have been handed too)
    assert (key, b"room 1 landed") in at_done[ids[1]], "the source heard 'landed' before the note was handed"
    assert at_done[ids[3]] == link.notes.seen()
    assert link.dst_t.notes_dropped == link.dst_t.notes_withheld == 0  # type: ignore[attr-defined]


def test_a_note_on_a_refused_batch_is_not_handed_nor_one_after_it_through_its_grant(make_tcp: MakeTransport) -> None:
    """A batch outside its grant fails and hands no note; a later note through that grant on the same
    connection is withheld although its batch lands; another grant's note is handed; a note through a
    revoked grant is refused with its batch."""
    src_t, dst_t = make_tcp(), make_tcp()
    link = Link(src_t, dst_t)
    narrow = dst_t.grant(src_t.instance, [(link.rd.addr, 2 * PAGE)])  # pages 0 and 1 only
    done = Collector()
    src_t.write(link.peer, [link.page(0), link.page(2)], done, grant=narrow.key, note=b"outside")
    src_t.write(link.peer, [link.page(1)], done, grant=narrow.key, note=b"after a refusal")
    src_t.write(link.peer, [link.page(3)], done, grant=link.grant.key, note=b"another grant")
    got = done.wait(3)
    assert got[0][1] is not None and "outside grant" in str(got[0][1]) and got[1][1] is None and got[2][1] is None
    assert not link.landed(0) and not link.landed(2) and link.landed(1) and link.landed(3)
    assert link.notes.seen() == [(link.grant.key, b"another grant")]
    assert dst_t.notes_withheld == 1  # type: ignore[attr-defined]
    dst_t.revoke(link.grant, deadline=Deadline.after(5))
    src_t.write(link.peer, [link.page(4)], done, grant=link.grant.key, note=b"revoked")
    assert done.wait(4)[3][1] is not None and not link.landed(4)
    assert link.notes.seen() == [(link.grant.key, b"another grant")]


@pytest.mark.parametrize(("batch", "grant", "note", "why"), [
    ("one page", 0, b"n", "through a grant"),
    ("empty", 1, b"n", "at least one write"),
    ("one page", 1, b"n" * (MAX_NOTE + 1), f"at most {MAX_NOTE}"),
    ("one page", 1, "text", "a note is bytes"),
    ("one page", 1, bytearray(b"n"), "a note is bytes"),
    ("one page", 1, None, "a note is bytes"),
])
def test_a_note_write_cannot_send_raises_and_posts_nothing(make_tcp: MakeTransport, batch: str, grant: int, note: Any,
                                                             why: str) -> None:
    link = Link(make_tcp(), make_tcp())
    done = Collector()
    writes = [link.page(0)] if batch == "one page" else []
    with pytest.raises(TransportError, match=why) as e:
        link.src_t.write(link.peer, writes, done, grant=grant and link.grant.key, note=note)
    assert e.value.op == "write"
    fence = link.src_t.write(link.peer, [], done)  # completes after anything posted before it
    assert done.wait(1) == [(fence, None)] and not link.dst.any() and link.notes.seen() == []


def test_a_handler_that_raises_is_reported_and_the_sink_carries_on(make_tcp: MakeTransport,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    link = Link(make_tcp(), make_tcp())
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))

    def broken(key: int, note: bytes) -> None:
        link.notes(key, note)
        raise RuntimeError(f"owner's bug on {note!r}")

    link.dst_t.on_note(broken)
    done = Collector()
    for i in range(3):
        link.src_t.write(link.peer, [link.page(i)], done, grant=link.grant.key, note=b"%d" % i)
    assert [err for _, err in done.wait(3)] == [None] * 3 and all(link.landed(i) for i in range(3))
    assert [str(e) for e in reported] == [f"owner's bug on {b'%d' % i!r}" for i in range(3)]
    assert link.notes.seen() == [(link.grant.key, b"%d" % i) for i in range(3)]


def test_a_note_without_a_handler_is_dropped_and_counted(make_tcp: MakeTransport) -> None:
    link = Link(make_tcp(), make_tcp())
    dst_t: Any = link.dst_t
    done = Collector()
    dst_t.on_note(None)
    link.src_t.write(link.peer, [link.page(0)], done, grant=link.grant.key, note=b"nobody listens")
    done.wait(1)
    assert dst_t.notes_dropped == 1 and link.landed(0)
    dst_t.on_note(link.notes)
    link.src_t.write(link.peer, [link.page(1)], done, grant=link.grant.key, note=b"heard")
    done.wait(2)
    assert link.notes.seen() == [(link.grant.key, b"heard")] and dst_t.notes_dropped == 1
    with pytest.raises(TypeError):
        dst_t.on_note("not callable")


class _Mute(TcpTransport):
    """A TCP transport that says it carries no notes: what a wrapper over one must refuse."""

    @property
    def carries_notes(self) -> bool:
        return False


def test_which_transports_carry_notes_and_a_wrapper_says_its_inners() -> None:
    """tcp carries them, verbs does not (read without a device: the property needs none, and its
    ``write`` refuses a note before it looks at the peer); a wrapper is its inner transport."""
    verbs = object.__new__(VerbsTransport)  # no device here: nothing of it is started
    assert verbs.carries_notes is False
    verbs.on_note(print)
    with pytest.raises(TransportError, match="does not carry notes"):
        verbs.write(None, [(0, 0, 1)], grant=1, note=b"n")  # type: ignore[arg-type]
    tcp, mute = TcpTransport(), _Mute()
    wrapped = [FaultyTransport(tcp), FaultyTransport(mute)]
    try:
        assert tcp.carries_notes is True and [w.carries_notes for w in wrapped] == [True, False]
        handler = Notes()
        wrapped[1].on_note(handler)
        assert mute._note_handler is handler  # passed to the inner transport
        with pytest.raises(TransportError, match="tcp transport does not carry notes"):
            wrapped[1].write(None, [(0, 0, 1)], grant=1, note=b"n")  # type: ignore[arg-type]
        assert wrapped[1].stats["batches"] == 0
    finally:
        for t in wrapped:
            t.close()


def test_the_faulty_wrapper_passes_a_note_only_with_a_whole_batch(make_tcp: MakeTransport,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch fails (``fail_rate=1``) after posting a random prefix of its writes: the inner
    transport gets the note only when that prefix is the whole batch, and no note through the grant once
    one batch through it was cut short (the sink would take a later note as "every byte landed")."""
    inner, dst_t = make_tcp(), make_tcp()
    faulty = FaultyTransport(inner, seed=4, fail_rate=1.0, land_rate=1.0)
    try:
        link = Link(faulty, dst_t)
        posted: list[tuple[int, bytes]] = []
        write = inner.write

        def spy(peer: Any, batch: Any, on_done: Any = None, **kw: Any) -> int:
            posted.append((len(batch), kw["note"]))
            return write(peer, batch, on_done, **kw)

        monkeypatch.setattr(inner, "write", spy)
        done = Collector()
        for k in range(16):
            faulty.write(link.peer, [link.page(i) for i in range(4)], done, grant=link.grant.key, note=b"%d" % k)
        assert all(err is not None for _, err in done.wait(16))
        assert {n for n, _ in posted} > {4}, "the seed posted no prefix: pick another"
        first_cut = next(i for i, (n, _) in enumerate(posted) if n < 4)
        assert [note != b"" for _, note in posted] == [n == 4 and i < first_cut for i, (n, _) in enumerate(posted)], posted
        handed = [note for _, note in link.notes.seen()]
        assert handed == [note for _, note in posted if note]  # a failed batch may have had its note handed
    finally:
        faulty.close()


def test_the_faulty_wrapper_carries_no_note_through_a_grant_after_a_batch_it_never_posted(
        make_tcp: MakeTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the batches fail before posting anything (``land_rate=0``): from the first of them on, no batch
    through that grant carries its note to the inner transport, the whole ones either."""
    inner, dst_t = make_tcp(), make_tcp()
    faulty = FaultyTransport(inner, seed=4, fail_rate=0.5, land_rate=0.0)
    try:
        link = Link(faulty, dst_t)
        notes: list[bytes] = []
        write = inner.write

        def spy(peer: Any, batch: Any, on_done: Any = None, **kw: Any) -> int:
            notes.append(kw["note"])
            return write(peer, batch, on_done, **kw)

        monkeypatch.setattr(inner, "write", spy)
        done = Collector()
        for k in range(16):
            faulty.write(link.peer, [link.page(0)], done, grant=link.grant.key, note=b"%d" % k)
        errors = [err is not None for _, err in done.wait(16)]
        assert any(errors) and not all(errors), "the seed failed every batch or none: pick another"
        first = errors.index(True)
        assert notes == [b"%d" % k for k in range(first)] + [b""] * (16 - sum(errors) - first), notes
    finally:
        faulty.close()


def test_a_staged_batch_carries_its_note_after_its_gather(make_staged: MakeTransport) -> None:
    """The note rides the batch the wrapper posts once its gathers are done, and the sink's inner
    transport hands it before ``on_done`` (its bytes are in the sink's mirror then: ``land`` moves them)."""
    import torch

    src_t, dst_t = make_staged(seed=1), make_staged(seed=2)
    assert src_t.carries_notes and dst_t.carries_notes
    src = torch.arange(4 * PAGE, dtype=torch.int32).to(torch.uint8)
    rs, rd = src_t.register(src), dst_t.register(torch.zeros(4 * PAGE, dtype=torch.uint8), require_grant=True)
    g = dst_t.grant(src_t.instance, [(rd.addr, rd.length)])
    peer = src_t.connect(dst_t.endpoint(), deadline=Deadline.after(10))
    notes = Notes()
    dst_t.on_note(notes)
    seen: list[list[tuple[int, bytes]]] = []
    done = Collector()

    def on_done(batch_id: int, error: TransportError | None) -> None:
        seen.append(notes.seen())
        done(batch_id, error)

    batches = [[(rs.addr + i * PAGE, rd.addr + i * PAGE, PAGE)] for i in range(4)]
    for i, batch in enumerate(batches):
        src_t.write(peer, batch, on_done, grant=g.key, note=b"page %d" % i if i % 2 else b"")
    assert [err for _, err in done.wait(4)] == [None] * 4
    assert (g.key, b"page 1") in seen[1]  # (and maybe page 3's already: the sink may be ahead of the acks)
    assert seen[3] == notes.seen() == [(g.key, b"page 1"), (g.key, b"page 3")]
    with pytest.raises(TransportError, match="through a grant"):
        src_t.write(peer, batches[0], on_done, note=b"no grant")
    # a batch whose gather failed never reached the sink: no later note through its grant is handed
    src_t.copier().fail_next("gather", 1)
    after = Collector()
    src_t.write(peer, batches[0], after, grant=g.key)
    src_t.write(peer, batches[1], after, grant=g.key, note=b"after a lost batch")
    assert [err is None for _, err in after.wait(2)] == [False, True]
    assert notes.seen() == [(g.key, b"page 1"), (g.key, b"page 3")]


def test_the_wrappers_record_of_spoiled_grants_forgets_only_the_oldest_past_its_bound() -> None:
    spoiled = SpoiledGrants(3)
    for key in (1, 2, 3, 1, 4):  # spoiling 1 again makes it the newest
        spoiled.spoil(key)
    assert [k in spoiled for k in (1, 2, 3, 4)] == [True, False, True, True]
