"""Device-resident KV pages and receive slots over real peers, processes and sockets, on the stand-in device.

With ``device_memory="standin"`` every buffer a peer is given is treated as device memory: the transport
registers a host mirror of it, a prefill or encode rank gathers pages (rows) into the mirror before the
writes go (copies that finish late and out of order), and a decode or prefill rank scatters what landed
from its mirror into the buffer before the room counts as landed. So a byte the demo's check finds in a
decode page went buffer -> mirror -> network -> mirror -> buffer, and a check that ran before the scatter
finished would see zeros. The same path runs CUDA tensors on a GPU machine (``make gpu-check``).
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

from pdcore import DecodeConfig, PrefillConfig, StartError
from pdcore.tools.demo import Plan, make_requests, run

pytestmark = pytest.mark.slow

KNOBS: dict[str, Any] = dict(layers=2, page_bytes=4096, num_pages=1024, timeout=60.0, bootstrap_timeout=60.0,
                             waiting_timeout=60.0, heartbeat_interval=0.25, dead_after=5.0,
                             secret=secrets.token_bytes(32))


def test_device_pages_move_every_byte_through_the_staging_path() -> None:
    plan = Plan(requests=make_requests(60, seed=3, max_pages=8), prefill_tp=[2], decode_tp=[2], kv_device="standin",
                **KNOBS)
    outcome = run(plan)
    assert outcome.start_failure is None and not outcome.errors, outcome.errors
    for (index, rank), result in outcome.decode.items():
        mine = [r for r in plan.requests if r.decode == index]
        assert result["ok"] == len(mine) and not result["failed"], (rank, result["ok"], result["failed"])
        assert not result["mismatched"], f"decode rank {rank}: device pages differ for {result['mismatched'][:5]}"
        assert not result["tokens_bad"]
    for result in (*outcome.prefill.values(), *outcome.decode.values()):
        assert not result["in_flight"] and result["tracked"] == 0 and not any(result["maps"].values())


def test_device_embeddings_and_pages_pass_both_hops(capsys: pytest.CaptureFixture[str]) -> None:
    from pdcore.tools.epd_demo import make_plan, report, summarize
    from pdcore.tools.epd_demo import run as run_epd

    plan = make_plan(8, seed=2, max_pages=4, kv_device="standin", **{k: v for k, v in KNOBS.items()
                                                                      if k not in ("bootstrap_timeout", "waiting_timeout")})
    plan.embed_timeout = plan.park_timeout = 30.0
    outcome = run_epd(plan)
    code = report(plan, outcome)
    text = capsys.readouterr()
    assert outcome.start_failure is None and not outcome.errors, outcome.errors
    s = summarize(plan, outcome)
    assert s.good and code == 0, text.out + text.err
    assert s.rows_verified == s.rows_expected > 0 and not s.rows_bad and not s.kv_mismatched


def test_a_peer_says_its_device_memory_is_staged() -> None:
    """Which path device memory takes is in diagnostics (and so in the metrics): here the stand-in's staging."""
    from pdcore import DecodePeer

    peer, _inbox = DecodePeer.start(DecodeConfig(kv_buffers=[np.zeros(4096, np.uint8)], page_bytes=4096, num_pages=1,
                                                 device_memory="standin", secret=KNOBS["secret"]))
    try:
        assert peer.diagnostics()["transport"]["device_path"] == "staging"
    finally:
        peer.close()


def test_a_tensor_on_another_device_is_refused_naming_the_devices_taken() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(StartError, match=r"kv_buffers\[0\].*'meta'.*CPU or CUDA"):
        DecodeConfig(kv_buffers=[torch.empty(4096, dtype=torch.uint8, device="meta")], page_bytes=4096, num_pages=1)
    with pytest.raises(StartError, match="device_memory.*auto, standin.*'gpu'"):
        PrefillConfig(kv_buffers=[np.zeros(4096, np.uint8)], page_bytes=4096, num_pages=1, bootstrap_host="127.0.0.1",
                      bootstrap_port=1, device_memory="gpu")


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a GPU (make gpu-check runs it)")
def test_cuda_pages_move_every_byte() -> None:
    plan = Plan(requests=make_requests(40, seed=4, max_pages=8), prefill_tp=[1], decode_tp=[1], kv_device="cuda",
                **KNOBS)
    outcome = run(plan)
    assert not outcome.errors and all(not r["mismatched"] and r["ok"] == 40 for r in outcome.decode.values())
