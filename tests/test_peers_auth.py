"""The deployment secret through the public API: peers, bootstrap server and transport together.

A deployment whose ranks and bootstrap server share a secret moves KV as
before; a rank with another secret (or none) fails at start or at first
contact with an error that says "authentication failed" and names the peer;
intruders on the control plane change nothing. Real sockets on loopback.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from pdcore import PrefillConfig, StartError
from pdcore.control import wire
from pdcore.control.auth import SECRET_FILE_ENV

from pd_pair import Pair
from raw_control import RawControl

SECRET = b"the-deployment-secret-of-this-test"
OTHER = b"a-secret-of-some-other-deployment!"


def threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("pdcore")}


def test_a_deployment_with_one_secret_moves_kv_intact() -> None:
    pair = Pair(secret=SECRET, server={"secret": SECRET})
    try:
        rids = [f"r{i}" for i in range(4)]
        pair.register_each(rids, 100)
        pair.drive(rids)
        assert all(pair.ended("decode", rid) == "RemotePrefillDone" and pair.landed_intact(rid) for rid in rids)
        assert pair.decode.diagnostics()["channel"]["auth_failures"] == 0 and pair.prefill.diagnostics()["channel"]["auth_failures"] == 0
    finally:
        pair.close()


def test_the_secret_never_shows_in_a_config_repr() -> None:
    cfg = PrefillConfig(kv_buffers=[np.zeros(64, np.uint8)], page_bytes=64, num_pages=1, bootstrap_host="h",
                        bootstrap_port=1, secret=SECRET)
    assert SECRET.decode() not in repr(cfg) and "secret" not in repr(cfg)
    with pytest.raises(StartError, match="PrefillConfig.secret"):
        PrefillConfig(kv_buffers=[np.zeros(64, np.uint8)], page_bytes=64, num_pages=1, bootstrap_host="h",
                      bootstrap_port=1, secret=b"short")


@pytest.mark.parametrize("secret", [OTHER, None], ids=["other-secret", "no-secret"])
def test_a_prefill_rank_with_another_secret_fails_at_start(secret: bytes | None) -> None:
    with pytest.raises(StartError, match="authentication failed") as info:
        Pair(server={"secret": SECRET}, prefill={"secret": secret}, bootstrap_timeout=5.0, start_timeout=5.0)
    assert "127.0.0.1" in str(info.value)  # names the bootstrap server it could not convince
    assert not threads()  # the half-built peer unwound


@pytest.mark.parametrize("secret", [OTHER, None], ids=["other-secret", "no-secret"])
def test_a_decode_rank_with_another_secret_fails_the_request_saying_why(secret: bytes | None) -> None:
    pair = Pair(server={"secret": SECRET}, prefill={"secret": SECRET}, decode={"secret": secret})
    try:
        pair.register("r0", room=7)
        pair.pump(lambda: pair.ended("decode", "r0") == "Failed", "decode to fail the request")
        reason = pair.reasons[("decode", "r0")]
        assert "authentication failed" in reason and f"127.0.0.1:{pair.port}" in reason
    finally:
        pair.close()


def test_the_secret_file_in_the_environment_is_used(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")  # as `echo` writes it: the newline is not part of the secret
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    pair = Pair(server={"secret": SECRET})  # neither peer is given the secret in its config
    try:
        pair.register("r0", room=3)
        pair.drive(["r0"])
        assert pair.ended("decode", "r0") == "RemotePrefillDone" and pair.landed_intact("r0")
    finally:
        pair.close()
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(StartError, match="secret file"):
        Pair(server={"secret": SECRET})


@pytest.mark.parametrize("plane", ["zmq", "tcp"])
def test_forged_control_frames_during_transfers_change_nothing(plane: str) -> None:
    """An outsider floods both peers' control endpoints with forgeries while requests move: all land.
    (On ZeroMQ it speaks NULL to a CURVE server; on tcp it proves a secret of its own.)"""
    pair = Pair(secret=SECRET, server={"secret": SECRET}, control=plane)
    socks = []
    try:
        rids = [f"r{i}" for i in range(6)]
        pair.register_each(rids, 200)
        pair.pump(lambda: all(pair.seen("decode", "Bootstrapped", r) for r in rids), "every request bootstrapped")
        for victim, claimed in ((pair.decode, pair.prefill), (pair.prefill, pair.decode)):
            sock = RawControl(victim.control_endpoint, plane, claimed.control_endpoint, secret=b"x" * 32)
            socks.append(sock)
            for i in range(6):
                for msg in (wire.Heartbeat(session_id="intruder", epoch=1 << 60, seq=1), wire.AbortAck(room=200 + i, rank=0),
                            wire.Status(room=200 + i, state=5, rank=0, first_token=1), wire.Abort(room=200 + i)):
                    sock.send(wire.encode(msg))
        pair.drive(rids)
        assert all(pair.ended("decode", rid) == "RemotePrefillDone" and pair.landed_intact(rid) for rid in rids)
        peers = (pair.decode, pair.prefill)
        pair.pump(lambda: all(p.diagnostics()["channel"]["auth_failures"] >= 1 for p in peers), "both intruders refused")
        assert pair.decode.diagnostics()["channel"]["protocol_errors"] == 0
    finally:
        for sock in socks:
            sock.close()
        pair.close()
    assert not threads()


def test_without_a_secret_a_process_says_so_once() -> None:
    """A fresh process starts a bootstrap server and a channel without a secret: one warning, not one each."""
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig()\n"
        "from pdcore.control.bootstrap import BootstrapServer\n"
        "from pdcore.control.channel import ControlChannel\n"
        "with BootstrapServer(), ControlChannel(lambda s, m: None, session_id='x'), "
        "ControlChannel(lambda s, m: None, session_id='y'): pass\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("no deployment secret") == 1, done.stderr
    assert done.stderr.count("unauthenticated") == 1
