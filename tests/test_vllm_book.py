"""The vLLM connector's bookkeeping without vLLM: its parameters, the scheduler side's plan, and the
workers' books driving real pdcore peers (one process, real sockets) through whole requests.

What a wrong connector would do and these catch: transfer a block count decode did not allocate,
load a request twice (a failed load must be recomputed), run a prefill before decode announced,
free prefill's blocks before its transfer ended, report a failed load without its blocks (vLLM's
``kv_load_failure_policy`` would not apply), stream layers nobody asked for.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import numpy as np
import pytest

from pdcore import DecodeConfig, DecodePeer, PrefillConfig, PrefillPeer
from pdcore.control.bootstrap import BootstrapServer
from pdcore.core.deadline import Deadline
from pdcore.vllm.book import (
    SLOW_AFTER, ConsumerWorker, Finish, Load, ProducerWorker, Register, SchedulerBook, StepPlan, pages_for,
)
from pdcore.vllm.params import Transfer, options_from, transfer_of, transfer_params
from pdcore.vllm.version import UnsupportedVllm, check_vllm_version

BS = 32


def test_import_pdcore_and_pdcore_vllm_never_import_vllm() -> None:
    code = ("import sys, pdcore, pdcore.vllm, pdcore.vllm.book, pdcore.vllm.router, pdcore.vllm.offline; "
            "from pdcore import PrefillPeer; assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_version_check_names_the_supported_release() -> None:
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    with pytest.raises(UnsupportedVllm, match=r"vLLM 0\.31\.1 is not supported.*0\.32\.0"):
        check_vllm_version("0.31.1")


@pytest.mark.parametrize(("prompt", "pages"), [(1, 0), (2, 1), (5, 1), (32, 1), (33, 1), (34, 2), (65, 2), (66, 3)])
def test_pages_are_the_blocks_of_the_prompt_but_its_last_token(prompt: int, pages: int) -> None:
    assert pages_for(prompt, BS) == pages


def test_transfer_params_round_trip_and_bad_ones_name_the_key() -> None:
    params = transfer_params(7, "10.0.0.1", 8998)
    assert transfer_of(params) == Transfer(7, "10.0.0.1", 8998)
    assert transfer_of(None) is None and transfer_of({"other": 1}) is None
    with pytest.raises(ValueError, match="pdcore_room"):
        transfer_of({"pdcore_room": -1, "pdcore_bootstrap": "h:1"})
    with pytest.raises(ValueError, match="pdcore_room"):
        transfer_of({"pdcore_room": True, "pdcore_bootstrap": "h:1"})
    with pytest.raises(ValueError, match="no 'pdcore_bootstrap'"):
        transfer_of({"pdcore_room": 1})
    with pytest.raises(ValueError, match="pdcore_bootstrap.*TCP port"):
        transfer_of({"pdcore_room": 1, "pdcore_bootstrap": "h:99999"})


def test_extra_config_is_checked_key_by_key(tmp_path) -> None:
    opts = options_from({"bootstrap_port": 9000, "dead_after": 5, "layerwise_min_pages": 2})
    assert (opts.bootstrap_port, dict(opts.timeouts), opts.layerwise_min_pages) == (9000, {"dead_after": 5.0}, 2)
    for bad, key in (({"bootstrap_prot": 1}, "bootstrap_prot"), ({"bootstrap_port": 0}, "bootstrap_port"),
                     ({"bootstrap": "maybe"}, "bootstrap"), ({"waiting_timeout": -1}, "waiting_timeout"),
                     ({"layerwise_min_pages": "2"}, "layerwise_min_pages")):
        with pytest.raises(ValueError, match=key):
            options_from(bad)
    with pytest.raises(Exception, match="secret_file"):
        options_from({"secret_file": str(tmp_path / "missing")}).secret()
    secret = tmp_path / "s"
    secret.write_bytes(b"x" * 32)
    secret.chmod(0o600)
    assert options_from({"secret_file": str(secret)}).secret() == b"x" * 32


T = Transfer(5, "127.0.0.1", 8998)


def test_decode_loads_once_into_the_blocks_of_its_prompt_and_aborts_a_request_given_up() -> None:
    book = SchedulerBook(producer=False, block_size=BS)
    assert book.matched("a", None, 70, 0) == (0, False)  # no room: computed locally
    assert book.matched("a", T, 70, 0) == (69, True)
    assert book.matched("a", T, 1, 0) == (0, False)  # nothing to load
    book.allocated("a", T, 70, [11, 12, 13], 69)
    assert book.take_plan().loads == [Load("a", T, (11, 12, 13))]
    book.worker_output(None, {"a"})  # received (landed or failed)
    assert book.matched("a", T, 70, 0) == (0, False)  # a failed load is recomputed, never loaded again
    assert not book.finished("a", [11, 12, 13], 5)
    assert book.matched("a", T, 70, 0) == (69, True)  # the id left vLLM: a new request may reuse it
    book.allocated("b", T, 34, [3, 4], 33)
    assert not book.finished("b", [3, 4], None)  # vLLM keeps the blocks of a request still loading itself
    assert book.take_plan().aborts == [("b", 5)]
    with pytest.raises(RuntimeError, match="2 blocks for 69 tokens, 3 needed"):
        book.allocated("d", T, 70, [1, 2], 69)


def test_decode_with_prefix_caching_loads_only_the_blocks_it_lacks_and_releases_a_prompt_it_holds() -> None:
    """Decode's prefix cache holds the first block of a 70-token prompt: it loads the other two (prefill writes
    the tail of its three into them). A prompt it holds whole but its last token loads nothing, and its room
    is released (prefill holds the request until decode's word). A one-token prompt has no room to release."""
    book = SchedulerBook(producer=False, block_size=BS)
    assert book.matched("a", T, 70, 32) == (37, True)
    book.allocated("a", T, 70, [11, 12, 13], 37)
    assert book.take_plan().loads == [Load("a", T, (12, 13))]
    assert book.matched("b", T, 65, 64) == (0, False)
    assert book.matched("one", T, 1, 0) == (0, False)
    plan = book.take_plan()
    assert plan.releases == [Register("b", T)] and not plan.loads
    assert book.matched("b", T, 65, 64) == (0, False) and not book.take_plan()  # released once


def test_prefill_neither_holds_a_one_token_prompt_nor_more_than_max_transfers() -> None:
    """A one-token prompt has nothing for decode to fetch: not registered, never held. Past
    ``max_transfers`` held, a request is served here alone and its room refused (decode hears at once); once
    a transfer ends, the next is taken again."""
    book = SchedulerBook(producer=True, block_size=BS, max_transfers=2)
    book.admitted("one", T, 1)
    assert not book.take_plan() and book.matched("one", T, 1, 0) == (0, False)
    t = [Transfer(10 + i, "127.0.0.1", 8998) for i in range(4)]
    for i in range(3):
        book.admitted(f"r{i}", t[i], 70)
    plan = book.take_plan()
    assert [r.rid for r in plan.registers] == ["r0", "r1"] and plan.refusals == [Register("r2", t[2])]
    assert book.matched("r2", t[2], 70, 0) == (0, False)  # not held: it runs at once
    book.worker_output(None, None, {"r0"})
    assert book.finished("r0", [1, 2, 3], 5)  # its blocks wait for the transfer: still held
    book.admitted("r3", t[3], 70)
    assert book.take_plan().refusals == [Register("r3", t[3])]
    book.worker_output({"r0"}, None)  # r0's transfer ended
    book.admitted("r3", t[3], 70)
    assert [r.rid for r in book.take_plan().registers] == ["r3"]


def test_prefill_waits_until_ready_then_keeps_its_blocks_until_the_transfer_ended() -> None:
    book = SchedulerBook(producer=True, block_size=BS)
    book.admitted("p", T, 70)
    plan = book.take_plan()
    assert [r.rid for r in plan.registers] == ["p"]
    assert book.matched("p", T, 70, 0) == (None, False)  # ask again later: decode has not announced
    book.worker_output(None, None, {"p"})
    assert book.matched("p", T, 70, 0) == (0, False)
    book.scheduled("p", [7, 8, 9])
    assert book.take_plan().streams == {"p": (7, 8, 9)}
    assert book.finished("p", [7, 8, 9], 42)  # delay the free
    assert book.take_plan().finishes == [Finish("p", (7, 8, 9), 42)]
    assert book.pending_push()
    book.worker_output({"p"}, None)
    assert not book.pending_push()
    assert not book.finished("q", [1], 3)  # never registered: vLLM frees at once


class _Peers:
    """A prefill and a decode peer with two layer buffers each, in this process, under the books."""

    PAGE, PAGES = 1024, 16

    def __init__(self, layerwise_min_pages: int = 16, prefill_capacity: int = 4096, clock=time.monotonic,
                 idle_wait: float = 0.01) -> None:
        knobs = dict(page_bytes=self.PAGE, num_pages=self.PAGES, heartbeat_interval=0.05, dead_after=30.0,
                     bootstrap_timeout=30.0, waiting_timeout=30.0, tombstone_ttl=30.0)
        self.server = BootstrapServer()
        self.port = self.server.start()
        self.p_cache = [np.zeros(self.PAGES * self.PAGE, np.uint8) for _ in range(2)]
        self.d_cache = [np.zeros(self.PAGES * self.PAGE, np.uint8) for _ in range(2)]
        self.ppeer, outbox = PrefillPeer.start(PrefillConfig(kv_buffers=self.p_cache, bootstrap_host="127.0.0.1",
                                                             bootstrap_port=self.port, layerwise_min_pages=1,
                                                             capacity=prefill_capacity, **knobs))
        self.dpeer, inbox = DecodePeer.start(DecodeConfig(kv_buffers=self.d_cache, **knobs))
        self.prefill = ProducerWorker(self.ppeer, outbox, layerwise_min_pages=layerwise_min_pages, clock=clock,
                                      idle_wait=idle_wait)
        self.decode = ConsumerWorker(self.dpeer, inbox, clock=clock, idle_wait=idle_wait)
        self.transfer = Transfer(0, "127.0.0.1", self.port)

    def fill(self, pages: tuple[int, ...], seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        out = []
        for buf in self.p_cache:
            data = rng.integers(0, 256, len(pages) * self.PAGE, dtype=np.uint8)
            for i, p in enumerate(pages):
                buf[p * self.PAGE:(p + 1) * self.PAGE] = data[i * self.PAGE:(i + 1) * self.PAGE]
            out.append(data)
        return out

    def pages_of_decode(self, pages: tuple[int, ...]) -> list[np.ndarray]:
        return [np.concatenate([buf[p * self.PAGE:(p + 1) * self.PAGE] for p in pages]) for buf in self.d_cache]

    def steps(self, until, deadline: float = 30.0, finished: set[str] = frozenset()):
        """Both engines' steps: each worker polls; returns (sent, received, errors) once ``until`` holds."""
        end = Deadline.after(deadline)
        sent, received, errors = set(), set(), set()
        while True:
            sent |= self.prefill.step_done(finished)
            r, e = self.decode.step_done()
            received |= r
            errors |= e
            if until(sent, received, errors):
                return sent, received, errors
            if end.expired():
                raise AssertionError(f"not reached in {deadline} s: sent {sent}, received {received}, errors {errors}")
            time.sleep(0.002)  # a step's pace, not a synchronisation: ``until`` decides

    def close(self) -> None:
        self.ppeer.close()
        self.dpeer.close()
        self.server.close(Deadline.after(5.0))


@pytest.fixture()
def peers():
    made = []

    def make(**kw):
        made.append(_Peers(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _announced(pp: _Peers, dst: tuple[int, ...]) -> Transfer:
    """Prefill's book registers request "p", decode's loads it as "d" into blocks ``dst``; step until
    decode announced it, so prefill may run. The request's transfer (its room, its bootstrap server)."""
    t = pp.transfer
    pp.prefill.take(StepPlan(registers=[Register("p", t)]))
    pp.decode.take(StepPlan(loads=[Load("d", t, dst)]))
    pp.steps(lambda s, r, e: "p" in pp.prefill.take_ready())
    return t


def test_a_whole_request_lands_and_prefill_reports_it_only_once_vllm_finished_it(peers) -> None:
    pp = peers()
    src, dst = (3, 4, 5), (9, 1, 12)
    data = pp.fill(src, seed=1)
    _announced(pp, dst)
    pp.prefill.take(StepPlan(finishes=[Finish("p", src, 17)]))
    sent, received, errors = pp.steps(lambda s, r, e: "d" in r and pp.prefill.counts["succeeded"] == 1)
    assert received == {"d"} and not errors and not sent  # vLLM has not told this worker "p" finished
    assert all(np.array_equal(a, b) for a, b in zip(pp.pages_of_decode(dst), data))
    sent, _, _ = pp.steps(lambda s, r, e: bool(s), finished={"p"})
    assert sent == {"p"} and pp.prefill.pending() == 0 and pp.decode.pending() == 0
    assert pp.prefill.counts["whole"] == 1 and pp.prefill.counts["layer_by_layer"] == 0


def test_long_prompts_stream_layer_by_layer_and_short_ones_go_whole(peers) -> None:
    pp = peers(layerwise_min_pages=2)
    t, t2 = pp.transfer, Transfer(1, "127.0.0.1", pp.port)
    long_src, short_src = (2, 3, 4), (6,)
    data = pp.fill(long_src, seed=2)
    short = pp.fill(short_src, seed=3)
    pp.prefill.take(StepPlan(registers=[Register("long", t), Register("short", t2)]))
    pp.decode.take(StepPlan(loads=[Load("dl", t, (10, 11, 12)), Load("ds", t2, (13,))]))
    ready: set[str] = set()
    pp.steps(lambda s, r, e: ready.update(pp.prefill.take_ready()) or ready == {"long", "short"})
    pp.prefill.take(StepPlan(streams={"long": long_src, "short": short_src}))
    pp.prefill.layer_saved(0)
    pp.prefill.layer_saved(1)
    pp.prefill.take(StepPlan(finishes=[Finish("long", long_src, 1), Finish("short", short_src, 2)]))
    # decode hears of a landing from the note riding its last write, prefill from that write's ack: either first
    pp.steps(lambda s, r, e: r == {"dl", "ds"} and pp.prefill.counts["succeeded"] == 2, finished={"long", "short"})
    assert pp.prefill.counts == {"succeeded": 2, "failed": 0, "layer_by_layer": 1, "whole": 1, "refused": 0}
    assert all(np.array_equal(a, b) for a, b in zip(pp.pages_of_decode((10, 11, 12)), data))
    assert all(np.array_equal(a, b) for a, b in zip(pp.pages_of_decode((13,)), short))


def test_a_prefill_abort_fails_decode_with_its_blocks_as_load_errors(peers) -> None:
    pp = peers()
    _announced(pp, (7, 8))
    pp.prefill.take(StepPlan(finishes=[Finish("p", (1, 2), None)]))  # vLLM aborted it on prefill
    sent, received, errors = pp.steps(lambda s, r, e: "d" in r and bool(s), finished={"p"})
    assert errors == {7, 8} and sent == {"p"} and pp.decode.counts["failed"] == 1


def test_a_decode_abort_reports_received_without_load_errors(peers) -> None:
    pp = peers()
    t = _announced(pp, (7, 8))
    pp.decode.take(StepPlan(aborts=[("d", t.room)]))  # the client went away
    sent, received, errors = pp.steps(lambda s, r, e: "d" in r and pp.prefill.counts["failed"] == 1)
    assert not errors  # an abort is not a load error: vLLM frees the blocks once it hears "received"
    pp.prefill.take(StepPlan(finishes=[Finish("p", (1, 2), 3)]))  # prefill finished meanwhile: nothing to send
    sent, _, _ = pp.steps(lambda s, r, e: bool(s), finished={"p"})
    assert sent == {"p"}


def test_a_room_refused_or_pdcore_refuses_is_served_by_prefill_alone_and_decode_hears_at_once(peers) -> None:
    """Past ``max_transfers`` (a refusal in the plan) or past pdcore's own capacity (``register`` raises
    ``CapacityError``: the engine must not die of it): prefill reports the request ready at once, and the
    decode copy fails within a step or so (its blocks as load errors: vLLM recomputes), not at its timeouts
    (30 s here). A second request on a room already held is served alone too, and the first goes on."""
    pp = peers(prefill_capacity=2)
    t = [Transfer(30 + i, "127.0.0.1", pp.port) for i in range(4)]
    pp.prefill.take(StepPlan(registers=[Register("held0", t[0]), Register("held1", t[1]), Register("over", t[2])],
                             refusals=[Register("refused", t[3])]))
    assert pp.prefill.take_ready() == {"over"} and pp.prefill.counts["refused"] == 1
    pp.decode.take(StepPlan(loads=[Load("d-over", t[2], (4,)), Load("d-refused", t[3], (5,)),
                                   Load("d-held0", t[0], (6,))]))
    _, received, errors = pp.steps(lambda s, r, e: {"d-over", "d-refused"} <= r, deadline=10.0)
    assert errors == {4, 5} and "d-held0" not in received
    pp.prefill.take(StepPlan(registers=[Register("twin", t[0])]))  # a room already held (by held0)
    ready = pp.prefill.take_ready()
    assert "twin" in ready
    pp.steps(lambda s, r, e: ready.update(pp.prefill.take_ready()) or "held0" in ready)  # decode announced it
    src = (1,)
    data = pp.fill(src, seed=9)
    pp.prefill.take(StepPlan(finishes=[Finish("held0", src, 4)]))
    pp.steps(lambda s, r, e: "d-held0" in r)
    assert all(np.array_equal(a, b) for a, b in zip(pp.pages_of_decode((6,)), data))


def test_decode_with_a_prefix_cached_loads_the_tail_and_releases_what_it_holds_whole(peers) -> None:
    """Real peers: prefill hands over its three pages, decode announces the two it lacks and gets the last two;
    a request decode holds whole is released: prefill's copy is ready at once (its room failed: nothing to
    write), and decode reports nothing of it to vLLM."""
    pp = peers()
    t, t2 = pp.transfer, Transfer(1, "127.0.0.1", pp.port)
    src = (3, 4, 5)
    data = pp.fill(src, seed=4)
    pp.prefill.take(StepPlan(registers=[Register("p", t), Register("cached", t2)]))
    pp.decode.take(StepPlan(loads=[Load("d", t, (13, 14))], releases=[Register("d-cached", t2)]))
    ready: set[str] = set()
    pp.steps(lambda s, r, e: ready.update(pp.prefill.take_ready()) or ready == {"p", "cached"})
    assert pp.prefill.counts["failed"] == 1  # the released room
    pp.prefill.take(StepPlan(finishes=[Finish("p", src, 8), Finish("cached", (6,), 9)]))
    sent, received, errors = pp.steps(lambda s, r, e: len(s) == 2, finished={"p", "cached"})
    assert received == {"d"} and not errors and pp.decode.counts["released"] == 1
    assert all(np.array_equal(a[1 * pp.PAGE:], b) for a, b in zip(data, pp.pages_of_decode((13, 14))))


def test_a_request_preempted_mid_stream_is_aborted_and_one_preempted_before_it_streamed_is_not(peers) -> None:
    """vLLM preempts two prefill requests: one whose layers began to stream from its first pass's blocks (gone
    now): its room is aborted, decode recomputes it (load errors); one that had not streamed yet runs again
    and its finish sends the blocks of the pass that completed."""
    pp = peers(layerwise_min_pages=1)
    t, t2 = pp.transfer, Transfer(1, "127.0.0.1", pp.port)
    pp.prefill.take(StepPlan(registers=[Register("streamed", t), Register("later", t2)]))
    pp.decode.take(StepPlan(loads=[Load("d1", t, (10, 11)), Load("d2", t2, (12,))]))
    ready: set[str] = set()
    pp.steps(lambda s, r, e: ready.update(pp.prefill.take_ready()) or ready == {"streamed", "later"})
    pp.prefill.take(StepPlan(streams={"streamed": (1, 2)}))
    pp.prefill.layer_saved(0)  # its first layer went from blocks 1, 2
    pp.prefill.take(StepPlan(preempted=["streamed", "later"]))
    _, received, errors = pp.steps(lambda s, r, e: "d1" in r, deadline=10.0)
    assert errors == {10, 11}
    second = (7,)
    data = pp.fill(second, seed=5)
    pp.prefill.take(StepPlan(finishes=[Finish("later", second, 3)]))
    pp.steps(lambda s, r, e: "d2" in r)
    assert all(np.array_equal(a, b) for a, b in zip(pp.pages_of_decode((12,)), data))


def test_a_transfer_that_waits_long_is_said_once_with_its_state_and_what_the_rank_holds(peers, caplog) -> None:
    """Decode loads a request prefill never registers, prefill registers one decode never loads: past
    ``SLOW_AFTER`` of the workers' clock each worker names its request once (its room, its age, its state
    in the table) with what its rank's peer holds; a request younger than that is not named, and neither
    is one named before. (The clock is the workers' only: the peers run on real time.)"""
    now = [1000.0]
    pp = peers(clock=lambda: now[0])
    t, lone = pp.transfer, Transfer(1, "127.0.0.1", pp.port)
    pp.decode.take(StepPlan(loads=[Load("d", t, (3,))]))
    pp.prefill.take(StepPlan(registers=[Register("p", lone)]))
    caplog.set_level(logging.WARNING, logger="pdcore.vllm")
    pp.steps(lambda s, r, e: True)
    assert not [r for r in caplog.records if "waiting over" in r.getMessage()]
    now[0] += SLOW_AFTER + 1
    pp.decode.take(StepPlan(loads=[Load("young", Transfer(2, "127.0.0.1", pp.port), (4,))]))
    pp.steps(lambda s, r, e: True)
    said = [r.getMessage() for r in caplog.records if "waiting over" in r.getMessage()]
    assert len(said) == 2, said
    decode = next(m for m in said if "decode request" in m)
    prefill = next(m for m in said if "prefill request" in m)
    assert "d (room 0, 11.0 s, " in decode and "young" not in decode and "this rank: queues" in decode
    assert "p (room 1, 11.0 s, BOOTSTRAPPING)" in prefill and "prefill engine" in prefill
    now[0] += 5.0
    pp.steps(lambda s, r, e: True)
    assert len([r for r in caplog.records if "waiting over" in r.getMessage()]) == 2, "each is said once"


def test_a_step_that_computes_nothing_waits_for_the_peers_news_and_one_that_computes_polls_at_once(peers) -> None:
    """While requests wait for their transfers, vLLM steps again and again with nothing scheduled; each such step
    polls (an agreement round). Its workers wait for their peer's news first, bounded by ``idle_wait``: here a
    bound no step reaches (30 s), so the request lands only because the news ends each wait. A step that
    computed something (or one with nothing to wait for) polls at once."""
    pp = peers(idle_wait=30.0)
    src, dst = (3,), (9,)
    data = pp.fill(src, seed=4)
    _announced(pp, dst)
    assert pp.prefill._idle.waits == pp.decode._idle.waits == 0  # no step was idle
    pp.prefill.take(StepPlan(finishes=[Finish("p", src, 17)]))  # the forward pass: not idle
    pp.decode.take(StepPlan(idle=True))
    _, received, _ = pp.steps(lambda s, r, e: "d" in r)
    assert received == {"d"} and all(np.array_equal(a, b) for a, b in zip(pp.pages_of_decode(dst), data))
    assert pp.decode._idle.waits >= 1 and pp.prefill._idle.waits == 0
    pp.decode.take(StepPlan(idle=True))  # idle, nothing left to wait for: no wait
    waits = pp.decode._idle.waits
    pp.decode.step_done()
    assert pp.decode._idle.waits == waits


def test_wait_for_news_ends_at_the_drivers_next_input(peers) -> None:
    """A peer's ``wait_for_news``: a decode rank told of a request looks its deployment up (I/O, then an input on
    the driver's thread); the wait ends there, far ahead of its 30 s bound."""
    from pdcore import BootstrapInfo

    pp = peers()
    pp.dpeer.wait_for_news(0.0)  # what happened while the peers started
    pp.dpeer.register("n", BootstrapInfo("127.0.0.1", pp.port, 7))
    assert pp.dpeer.wait_for_news(30.0) is True
