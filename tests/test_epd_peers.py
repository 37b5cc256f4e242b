"""EPD through real processes: encode deployments sending image embeddings to a prefill replica.

Every encode rank and every prefill rank is its own process (``epd_cluster``):
the prefill ranks form a real gloo group and agree each round; the encode
ranks are independent schedulers over a small pool of send slots whose rows
are poisoned as soon as their room concludes. Each request has 1-4 images of
varied row counts, from two encode deployments (one of dp 2 in the slow runs),
including an image with fewer rows than prefill ranks (an empty shard when
sharded), and one request whose image the encode scheduler fails.

Checked (``epd_cluster.check``): on every prefill rank every landed item is
exactly that rank's share (``slot=None``, 0 rows for an empty shard) and its
rows and deepstack rows are exactly the encoder's; every rank settled the same
requests' same items in the same round and failed the same requests in the
same round; the shares tile each image; every begun room concluded once and
its rows were intact until then. The receiver's deepstack width is one value
per receiver (the encode rank checks each ask against the chunk), so deepstack
rows travel in some runs and not in others.
"""

from __future__ import annotations

import copy

import pytest

from epd_cluster import Cluster, Encoder, Outcome, check, make_requests, run_cluster, share

SLOT_ROWS = 40


def _cluster(encode_tp: int, prefill_tp: int, sharded: bool, *, n: int, deepstack: int, dtype: str,
             second_dp: int, seed: int) -> Cluster:
    encoders = (Encoder(encode_tp), Encoder(encode_tp, dp=second_dp))
    return Cluster(
        encoders=encoders, prefill_tp=prefill_tp, shard_rows=sharded,
        requests=make_requests(n, encoders, prefill_tp, seed=seed, slot_rows=SLOT_ROWS),
        deepstack_width=deepstack, dtype=dtype, slot_rows=SLOT_ROWS,
    )


def _covers(cluster: Cluster) -> None:
    """The plan holds what the test claims to exercise."""
    reqs = cluster.requests
    assert any(len(r.images) == 4 for r in reqs) and all(1 <= len(r.images) <= 4 for r in reqs)
    assert any(len({img.deployment for img in r.images}) == 2 for r in reqs if not r.fails)
    assert any(img.rows < cluster.prefill_tp for r in reqs if not r.fails for img in r.images)
    assert len({img.rows for r in reqs for img in r.images}) >= 4
    assert sum(r.fails for r in reqs) == 1 and len({r.stage_round for r in reqs}) > 1
    rooms = [img.room for r in reqs for img in r.images]
    assert len(rooms) == len(set(rooms))
    if cluster.shard_rows:
        assert any(share(img.rows, k, cluster.prefill_tp, True)[1] == 0
                   for r in reqs for img in r.images for k in range(cluster.prefill_tp))
    for d, enc in enumerate(cluster.encoders):
        assert all(cluster.rooms_of(d, dp) for dp in range(enc.dp)), "every encode rank serves some room"


def _broken(outcome: Outcome, how: str) -> Outcome:
    """``outcome`` as a faulty program would have produced it."""
    bad = copy.deepcopy(outcome)
    last = bad.prefill[-1]
    if how == "late":  # the last rank settled a round later
        rnd, landed, failed = last["rounds"][0]
        last["rounds"][0] = (rnd + 1, landed, failed)
    elif how == "missing":  # an item left out of a landed request on the last rank
        rnd, landed, failed = next(r for r in last["rounds"] if any(len(items) > 1 for _, items in r[1]))
        i = last["rounds"].index((rnd, landed, failed))
        rid, items = next((rid, items) for rid, items in landed if len(items) > 1)
        landed = [(r, items[1:] if r == rid else it) for r, it in landed]
        last["rounds"][i] = (rnd, landed, failed)
    elif how == "shard":  # every rank landed rank 0's share
        for res in bad.prefill[1:]:
            res["rounds"] = copy.deepcopy(bad.prefill[0]["rounds"])
    elif how == "concluded":  # an encode rank never saw a room conclude
        key = next(k for k, v in bad.encode.items() if v["concluded"])
        bad.encode[key]["concluded"].pop()
    return bad


def test_e1_to_p2_sharded_with_deepstack() -> None:
    """The quick run: 6 requests, E(tp1) x 2 deployments -> P(tp2), sharded rows, deepstack rows, fp16."""
    cluster = _cluster(1, 2, True, n=6, deepstack=5, dtype="torch.float16", second_dp=1, seed=7)
    _covers(cluster)
    outcome = run_cluster(cluster)
    check(cluster, outcome)
    assert all(res["stats"]["landed"] > 0 for res in outcome.prefill)
    # control frames the encode ranks sent: only the statuses no write could carry (an empty share has no write, a
    # failed image none that landed); every other success rode its write into the asker's slot
    images = [img for r in cluster.requests for img in r.images]
    owed = sum(2 if img.fail else sum(share(img.rows, k, 2, True)[1] == 0 for k in range(2)) for img in images)
    assert sum(res["frames"] for res in outcome.encode.values()) == owed, (owed, outcome.encode)
    for how in ("late", "missing", "shard", "concluded"):  # the checks see what a broken program would do
        with pytest.raises(AssertionError):
            check(cluster, _broken(outcome, how))


SHAPES = [
    pytest.param(1, 2, True, 5, "torch.float16", id="E1-P2-sharded-deepstack"),
    pytest.param(1, 2, False, 0, "torch.float32", id="E1-P2-full"),
    pytest.param(2, 4, True, 0, "torch.float32", id="E2-P4-sharded"),
    pytest.param(2, 4, False, 3, "torch.float16", id="E2-P4-full-deepstack"),
]


@pytest.mark.slow
@pytest.mark.long  # CI runs the quick E1->P2 run above; make test-long runs the matrix
@pytest.mark.parametrize(("encode_tp", "prefill_tp", "sharded", "deepstack", "dtype"), SHAPES)
def test_every_rank_holds_exactly_its_rows(encode_tp: int, prefill_tp: int, sharded: bool, deepstack: int,
                                           dtype: str) -> None:
    """14 requests over two deployments, the second of dp 2; send slots and receive slots are reused many times."""
    cluster = _cluster(encode_tp, prefill_tp, sharded, n=14, deepstack=deepstack, dtype=dtype, second_dp=2,
                       seed=1000 + 10 * prefill_tp + sharded)
    _covers(cluster)
    outcome = run_cluster(cluster)
    check(cluster, outcome)
    items = sum(len(r.images) for r in cluster.requests)
    assert items > 2 * cluster.slots and items > 3 * cluster.send_slots  # both pools were reused


def test_the_shares_tile_every_image() -> None:
    """The harness's own share function (the tests' oracle) against the library's, for small images."""
    from pdcore.epd._recv_py import shard

    for ranks in (1, 2, 3, 4, 8):
        for rows in range(1, 20):
            spans = [share(rows, r, ranks, True) for r in range(ranks)]
            assert spans[0][0] == 0 and sum(c for _, c in spans) == rows
            assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(c for _, c in spans) - min(c for _, c in spans) <= 1
            assert spans == [shard(rows, r, ranks, True) for r in range(ranks)]
