"""Where the deployment secret comes from: only an unset ``$PDCORE_SECRET_FILE`` means "no secret".

A variable that is set but empty, or names a file that is missing, a directory, or holds a
secret outside 16..4096 bytes, stops a real peer (and the bootstrap CLI) at start with one
error naming the variable: an operator who meant to authenticate must not get an open
deployment and a warning. A secret file readable by group or others works, with a warning.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdcore import DecodeConfig, DecodePeer
from pdcore.control import auth
from pdcore.core.errors import StartError
from pdcore.tools import chaos
from test_bootstrap import run_cli

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32


def _start_decode() -> None:
    peer, _ = DecodePeer.start(DecodeConfig(kv_buffers=[np.zeros(4096, np.uint8)], page_bytes=4096, num_pages=1))
    peer.close()


def _bad_value(tmp_path: Path, case: str) -> str:
    """The value of ``$PDCORE_SECRET_FILE`` for each refused case."""
    path = tmp_path / "secret"
    if case == "empty-variable":
        return ""
    if case == "missing-file":
        return str(path)
    if case == "directory":
        path.mkdir()
        return str(path)
    path.write_bytes({"too-short": b"x" * 15, "too-long": b"x" * 4097, "empty-file": b""}[case])
    path.chmod(0o600)
    return str(path)


BAD = ["empty-variable", "missing-file", "directory", "too-short", "too-long", "empty-file"]


@pytest.mark.parametrize("case", BAD)
def test_a_set_but_unusable_secret_file_variable_stops_a_peer_at_start_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.setenv(auth.SECRET_FILE_ENV, _bad_value(tmp_path, case))
    before = set(threading.enumerate())
    with pytest.raises(StartError) as info:
        _start_decode()
    assert "$PDCORE_SECRET_FILE" in str(info.value)
    assert "x" * 15 not in str(info.value)  # never the secret's bytes
    assert set(threading.enumerate()) <= before  # refused before any thread started


def test_only_an_unset_variable_means_unauthenticated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    assert auth.resolve_secret(None) is None


@pytest.mark.parametrize("case", ["empty-variable", "directory"])
def test_the_bootstrap_cli_refuses_a_set_but_unusable_variable_in_one_line(tmp_path: Path, case: str) -> None:
    proc = run_cli(tmp_path, env={auth.SECRET_FILE_ENV: _bad_value(tmp_path, case)})
    try:
        out, err = proc.communicate(timeout=30)  # before the fix the empty variable served, unauthenticated
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2, err
    assert len(lines) == 1 and "$PDCORE_SECRET_FILE" in lines[0] and "Traceback" not in lines[0], err
    assert lines[0].count("$PDCORE_SECRET_FILE") == 1, lines[0]  # named once, not prefixed twice
    assert out == b""


def test_a_secret_file_others_may_read_is_used_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exposed, private = tmp_path / "exposed", tmp_path / "private"
    for path, mode in ((exposed, 0o644), (private, 0o600)):
        path.write_bytes(SECRET + b"\n")
        path.chmod(mode)
    monkeypatch.setattr(auth, "_exposed_warned", set())
    with caplog.at_level(logging.WARNING, logger="pdcore.auth"):
        assert auth.load_secret(private) == SECRET
        assert not caplog.records
        monkeypatch.setenv(auth.SECRET_FILE_ENV, str(exposed))
        assert auth.resolve_secret(None) == SECRET
        assert auth.resolve_secret(None) == SECRET
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and str(exposed) in warned[0] and "644" in warned[0] and "chmod 600" in warned[0], warned
    assert SECRET.decode() not in warned[0]


def test_the_chaos_tool_draws_a_secret_per_run_not_a_fixed_one() -> None:
    plans: list[Any] = [chaos.ChaosPlan(), chaos.ChaosPlan()]
    secrets_ = [plan.secret for plan in plans]
    assert all(isinstance(s, bytes) and len(s) >= auth.MIN_SECRET_BYTES for s in secrets_)
    assert secrets_[0] != secrets_[1]
    assert plans[0].slower(2.0).secret == secrets_[0]  # one run, one secret: every rank gets the plan's
    assert all(b"pdcore chaos run deployment secret" not in p.read_bytes() for p in Path(chaos.__file__).parent.glob("chaos*.py"))
