"""The EPD demo end to end (``pdcore.tools.epd_demo.run``): encode -> prefill -> decode, real processes and groups.

Two encode deployments (tp 1 x dp 2, tp 2 x dp 1), each behind its own bootstrap
server, feed two prefill replicas of tp 2 (replica 0 receives full copies,
replica 1 sharded rows with deepstack rows), which hand the KV to one decode
replica of tp 2. A request's KV derives from the rows that landed, so a wrong
row on a prefill rank shows twice: in the rank's row check and in decode's
page check. The unit tests at the top need no process.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdcore.tools.epd_demo import (
    EpdPlan,
    Summary,
    expected_key,
    expected_rows,
    image_rows,
    make_plan,
    report,
    run,
    share,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]
KNOBS: dict[str, Any] = dict(layers=2, page_bytes=4096, num_pages=256, timeout=60.0, heartbeat_interval=0.25,
                             dead_after=5.0, secret=secrets.token_bytes(32))


def _plan(n: int, seed: int) -> EpdPlan:
    plan = make_plan(n, seed=seed, max_pages=4, **KNOBS)
    plan.embed_timeout = plan.park_timeout = 30.0
    return plan


def _uses(plan: EpdPlan, encoder: int) -> set[str]:
    return {rid for rid, images in plan.images.items() if any(i.encoder == encoder for i in images)}


# ------------------------------------------------------------------------------ no processes


def test_rows_are_a_function_of_room_row_and_column() -> None:
    whole = image_rows(12345, 0, 10, 8)
    assert whole.shape == (10, 8) and whole.dtype == np.uint32
    assert np.array_equal(image_rows(12345, 3, 4, 8), whole[3:7])  # a share is a slice of the image
    assert not np.array_equal(image_rows(12346, 0, 10, 8), whole)
    assert not np.array_equal(image_rows(12345, 0, 10, 8, salt=1), whole)  # deepstack rows differ
    assert len(np.unique(whole)) == whole.size  # no two cells alike: a misplaced row or column shows
    assert image_rows(1 << 63, 0, 0, 8).shape == (0, 8)


def test_shares_tile_the_image_and_the_key_follows_the_rows() -> None:
    for rows in (1, 2, 7, 48):
        spans = [share(rows, r, 2, True) for r in range(2)]
        assert spans[0][0] == 0 and spans[0][0] + spans[0][1] == spans[1][0] and sum(c for _, c in spans) == rows
        assert share(rows, 1, 2, False) == (0, rows)
    plan = _plan(6, seed=3)
    for r in plan.pd.requests:
        other = EpdPlan(**{**plan.__dict__, "images": {**plan.images, r.rid: tuple(
            type(i)(i.index, i.encoder, i.room + 1, i.rows) for i in plan.images[r.rid])}})
        assert expected_key(other, r) != expected_key(plan, r)  # another image, other KV
        assert expected_rows(plan, r)[0] == sum(i.rows for i in plan.images[r.rid]) * (1 if plan.shard[r.prefill] else 2)


# ------------------------------------------------------------------------------ runs


def _judge(plan: EpdPlan, capsys: pytest.CaptureFixture[str]) -> tuple[Summary, int, str]:
    outcome = run(plan)
    code = report(plan, outcome)
    out = capsys.readouterr()
    assert outcome.start_failure is None, out.err
    assert not outcome.errors, "\n".join(outcome.errors)
    assert len(outcome.encode) == 4 and len(outcome.prefill) == 4 and len(outcome.decode) == 2
    return summarize(plan, outcome), code, out.out + out.err


@pytest.mark.slow
@pytest.mark.long  # CI's `make demo` runs the whole EPD demo; the broken run below stays in `make test`
def test_every_request_passes_both_hops_full_copies_and_shards(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(12, seed=1)
    assert _uses(plan, 0) and _uses(plan, 1) and _uses(plan, 0) & _uses(plan, 1)  # images of mixed origin
    assert {r.prefill for r in plan.pd.requests} == {0, 1}
    s, code, text = _judge(plan, capsys)
    assert s.good and code == 0, text
    assert s.ok == s.expected and not s.failed and not s.embed_failed and not s.rows_bad and not s.kv_mismatched
    images = sum(map(len, plan.images.values()))
    assert s.images_sent == sum(  # every encode rank of the image's DP group sends it to its block
        plan.encoders[i.encoder].tp for v in plan.images.values() for i in v)
    assert s.images_sent >= images and not s.unconcluded
    want_rows = sum(expected_rows(plan, r)[0] for r in plan.pd.requests)
    want_bytes = sum(expected_rows(plan, r)[1] for r in plan.pd.requests)
    assert s.rows_verified == s.rows_expected == want_rows > 0
    assert s.embed_bytes == s.embed_bytes_expected == want_bytes
    assert s.kv_bytes > 0 and s.agree
    assert "demo: OK" in text


@pytest.mark.slow
def test_a_broken_deployment_fails_its_requests_and_a_wrong_row_is_caught(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = _plan(12, seed=1)
    plan.encode_hidden = {1: plan.hidden - 1}  # E1's chunks have the wrong hidden: its rooms fail both sides
    broken = _uses(plan, 1)
    clean = sorted(set(plan.images) - broken)
    assert broken and len(clean) >= 2
    # one request of each prefill replica gets a flipped byte from E0: its rows land, wrong
    by_rid = {r.rid: r for r in plan.pd.requests}
    corrupt = {next(rid for rid in clean if by_rid[rid].prefill == p) for p in (0, 1)}
    plan.encode_corrupt = {plan.images[rid][0].room for rid in corrupt}
    s, code, text = _judge(plan, capsys)
    assert code == 1 and not s.good and "demo: FAILED" in text
    assert set(s.embed_failed) == broken, (sorted(s.embed_failed), sorted(broken))
    assert all("hidden" in why for why in s.embed_failed.values()), s.embed_failed
    assert s.failed == broken  # aborted toward decode (abort_room): decode saw Failed, never the pages
    assert set(s.rows_bad) == corrupt and all("main rows differ" in why for why in s.rows_bad.values())
    assert s.kv_mismatched == corrupt  # the KV derives from the rows that landed
    assert s.ok == set(clean) - corrupt and not s.ok & broken
    assert s.rows_verified == s.rows_expected and not s.leftovers
    # an image of a failed request that no prefill rank asked for waits at its encode rank (park timeout)
    assert s.unconcluded <= {i.room for rid in broken for i in plan.images[rid]}


# ------------------------------------------------------------------------------ the command line


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PDCORE_SECRET_FILE", "COLUMNS")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "pdcore", "demo", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def test_help_lists_the_epd_options_with_their_defaults() -> None:
    done = _cli("--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for option in ("--epd", "--epd-shard", "--encode-tp", "--encode-dp", "--max-images", "--max-rows", "--hidden",
                   "--deepstack"):
        assert option in text
    assert "mixed (replica 0 full copies, replica 1 shards), all or none (default: mixed)" in text


@pytest.mark.parametrize(("args", "option"), [
    (["--encode-tp", "3"], "--encode-tp"),
    (["--prefill-tp", "1", "--decode-tp", "1"], "--encode-tp"),  # the default 1,2 does not divide 1
    (["--encode-tp", "1,2", "--encode-dp", "1"], "--encode-dp"),
    (["--encode-tp", "0"], "--encode-tp"),
    (["--epd-shard", "half"], "--epd-shard"),
    (["--max-rows", "65536", "--hidden", "65536"], "--max-rows"),
    (["--layout", "hnd"], "--layout"),
])
def test_a_bad_epd_option_is_refused_in_one_line(args: list[str], option: str) -> None:
    done = _cli("--epd", *args)
    assert done.returncode == 2 and not done.stdout, (done.stdout, done.stderr)
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and option in err[0] and "Traceback" not in done.stderr, err
