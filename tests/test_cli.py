"""``python -m pdcore``: a command line that explains itself and refuses bad values before anything starts.

Every test runs the real CLI in a subprocess (bounded by a timeout). A bad value must end in one
line on stderr naming the option, exit 2, no traceback and nothing on stdout (the header a run
prints before it starts its ranks never appears). A rank that cannot start ends the run at once
with one line naming the cause and no results table; a run whose stdout is not a terminal shows
its progress as plain lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "bootstrap", "chaos")


def cli(*args: str, timeout: float = 60.0, extra_path: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pdcore ARGS`` with stdout and stderr captured (not a terminal)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("PDCORE_SECRET_FILE", "COLUMNS")}
    full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (extra_path, REPO) if p is not None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pdcore", *args], capture_output=True, text=True, timeout=timeout, env=full_env,
        cwd=REPO,
    )  # fmt: skip


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ help


def test_help_lists_every_command_with_a_line_each() -> None:
    done = cli("--help")
    assert done.returncode == 0, done.stderr
    for name in COMMANDS:
        row = [line for line in done.stdout.splitlines() if re.match(rf"\s+{name}\s+\S", line)]
        assert row, f"{name} is not listed with a description:\n{done.stdout}"
    assert not done.stderr


def test_no_command_shows_the_listing_and_an_unknown_one_is_refused() -> None:
    bare = cli()
    assert bare.returncode == 2 and all(name in bare.stderr for name in COMMANDS), bare.stderr
    unknown = cli("nosuch")
    assert unknown.returncode == 2 and "nosuch" in unknown.stderr and "Traceback" not in unknown.stderr


@pytest.mark.parametrize("command", ["demo", "chaos"])
def test_every_option_has_help_with_its_default(command: str) -> None:
    import importlib

    from pdcore.__main__ import COMMANDS

    module = importlib.import_module(COMMANDS[command][0])
    actions = [a for a in module.parser()._actions if a.option_strings and a.dest != "help"]
    done = cli(command, "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines
    for action in actions:
        assert action.help, f"{action.option_strings} has no help"
        assert action.option_strings[0] in text
        flag = action.nargs == 0  # --verbose, --no-kills: say what happens without them, where that is not obvious
        if not flag:
            assert "default" in action.help, f"{action.option_strings[0]}: the help does not give its default"
        if action.choices:
            assert all(str(c) in text for c in action.choices), f"{action.option_strings[0]}: choices not shown"


def test_bootstrap_is_dispatched_to_its_own_parser() -> None:
    done = cli("bootstrap", "--help")
    assert done.returncode == 0 and "--port" in done.stdout, done.stderr


# ------------------------------------------------------------------------------ bad values


BAD_DEMO = [
    (["--requests", "-5"], "--requests"),
    (["--requests", "0"], "--requests"),
    (["--requests", "many"], "--requests"),
    (["--transport", "nosuch"], "--transport"),
    (["--transport", "faulty:nosuch"], "--transport"),
    (["--page-bytes", "0"], "--page-bytes"),
    (["--layers", "0"], "--layers"),
    (["--max-pages", "0"], "--max-pages"),
    (["--prefill-tp", "0"], "--prefill-tp"),
    (["--decode-tp", "-1", "--prefill-tp", "1"], "--decode-tp"),
    (["--prefill-tp", "2", "--decode-tp", "1"], "--prefill-tp"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "-3"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--seed", "-1"], "--seed"),
    (["--secret-file", "/nonexistent/pdcore-secret"], "--secret-file"),
    (["--progress", "loud"], "--progress"),
    (["--page-bytes", str(64 << 20), "--layers", "1024", "--max-pages", "4096"], "--page-bytes"),
]

BAD_CHAOS = [
    (["--seconds", "0"], "--seconds"),
    (["--requests", "-1"], "--requests"),
    (["--seconds", "5", "--requests", "5"], "--requests"),
    (["--transport", "nosuch"], "--transport"),
    (["--transport", "faulty:"], "--transport"),
    (["--tp", "3"], "--tp"),
    (["--fail-rate", "1.5"], "--fail-rate"),
    (["--land-rate", "-0.1"], "--land-rate"),
    (["--control-drop", "2"], "--control-drop"),
    (["--delay", "-1"], "--delay"),
    (["--dead-after", "0.1"], "--dead-after"),
    (["--slow", "0"], "--slow"),
    (["--window", "0"], "--window"),
    (["--layers", "0"], "--layers"),
    (["--page-bytes", "0"], "--page-bytes"),
    (["--max-pages", "600"], "--max-pages"),
    (["--seed", "-2"], "--seed"),
    (["--log-level", "loud"], "--log-level"),
]


def _refused(done: subprocess.CompletedProcess[str], option: str, seconds: float) -> None:
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    err = lines(done.stderr)
    assert len(err) == 1 and option in err[0], f"want one line naming {option}, got: {err}"
    assert not done.stdout, f"something started: {done.stdout}"
    assert seconds < 30, f"refusing took {seconds:.1f} s"


@pytest.mark.parametrize(("args", "option"), BAD_DEMO, ids=[" ".join(a) for a, _ in BAD_DEMO])
def test_demo_refuses_a_bad_value_in_one_line(args: list[str], option: str) -> None:
    t = time.monotonic()
    done = cli("demo", *args)
    _refused(done, option, time.monotonic() - t)


@pytest.mark.parametrize(("args", "option"), BAD_CHAOS, ids=[" ".join(a) for a, _ in BAD_CHAOS])
def test_chaos_refuses_a_bad_value_in_one_line(args: list[str], option: str) -> None:
    t = time.monotonic()
    done = cli("chaos", *args)
    _refused(done, option, time.monotonic() - t)


def test_demo_refuses_a_secret_file_with_a_bad_secret(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    t = time.monotonic()
    done = cli("demo", "--secret-file", str(short))
    _refused(done, "--secret-file", time.monotonic() - t)


def test_an_unknown_transport_fails_fast() -> None:
    t = time.monotonic()
    done = cli("demo", "--transport", "nosuch", timeout=30)
    _refused(done, "--transport", time.monotonic() - t)
    assert "tcp" in done.stderr  # it says what is known


# ------------------------------------------------------------------------------ a rank that cannot start


@pytest.fixture
def broken_transport(tmp_path: Path) -> Path:
    """A directory whose ``sitecustomize`` registers transport "broken", whose module does not exist:
    the parser accepts it (it is registered), and each rank fails to start it (in the child process)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import transport.registry\n"
        "transport.registry.register_transport('broken', 'pdcore_test_no_such_module:Transport')\n"
    )
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True], ids=["plain", "verbose"])
def test_demo_start_failure_is_one_line_and_no_table(broken_transport: Path, verbose: bool) -> None:
    args = ["demo", "--transport", "broken", "--requests", "4", "--prefill-tp", "1", "--decode-tp", "1"]
    done = cli(*args, *(["--verbose"] if verbose else []), timeout=240, extra_path=broken_transport)
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    cause = [line for line in lines(done.stderr) if "could not start" in line]
    assert len(cause) == 1, done.stderr
    assert "pdcore_test_no_such_module" in cause[0] and "rank" in cause[0], cause
    assert ("Traceback" in done.stderr) == verbose, done.stderr
    if not verbose:
        assert lines(done.stderr) == cause, done.stderr
    assert "requests ok" not in done.stdout and "+---" not in done.stdout, done.stdout
    assert "identical events" not in done.stdout
    assert lines(done.stdout)[-1] == "demo: FAILED"


@pytest.mark.slow
def test_chaos_start_failure_is_one_line_and_no_table(broken_transport: Path) -> None:
    done = cli("chaos", "--transport", "broken", "--tp", "1", "--seconds", "5", "--seed", "1",
               timeout=240, extra_path=broken_transport)
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    assert lines(done.stderr) == [line for line in lines(done.stderr) if "could not start" in line], done.stderr
    assert len(lines(done.stderr)) == 1 and "pdcore_test_no_such_module" in done.stderr
    assert "no rank raised" not in done.stdout and "+---" not in done.stdout, done.stdout
    assert lines(done.stdout)[-1] == "chaos: FAILED"


# ------------------------------------------------------------------------------ progress


@pytest.mark.slow
def test_a_tiny_demo_prints_plain_progress_and_ok() -> None:
    done = cli("demo", "--requests", "8", "--prefill-tp", "1", "--decode-tp", "1", "--layers", "2",
               "--page-bytes", "4096", timeout=240)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "\x1b[" not in out and "\r" not in out, "terminal control codes in a non-terminal stdout"
    assert re.search(r"^demo: starting 2 ranks", out, re.M), out
    assert re.search(r"^demo: 2 ranks ready in [\d.]+ s; running 8 requests$", out, re.M), out
    assert re.search(r"^demo: 8/8 requests done, 0 failed, [\d.]+ \w*B, .*/s, [\d.]+ s$", out, re.M), out
    assert "| requests ok" in out and "8 / 8" in out  # the summary table, as scripts read it
    assert lines(out)[-1] == "demo: OK"
