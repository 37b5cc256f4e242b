"""What the command-line tools share: a one-line-error parser and argparse types that name the range.

Every bad value is refused by the parser, before anything starts, with one line
naming the option (exit 2); never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..control.auth import load_secret
from ..core.errors import StartError
from .progress import RunProgress

__all__ = [
    "CliParser",
    "int_range",
    "float_range",
    "transport_name",
    "transport_help",
    "secret_file",
    "memory_bytes",
    "report_start_failure",
]


class CliParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose error is one line (``prog: error: argument --x: why``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``lo..hi``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need an integer in {lo}..{hi}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"need an integer in {lo}..{hi}, got {value}")
        return value

    return parse


def float_range(lo: float, hi: float, *, lo_open: bool = False, what: str = "a number") -> Callable[[str], float]:
    """An argparse type: a finite number in ``lo..hi`` (``lo`` itself excluded if ``lo_open``)."""
    bounds = f"above {lo:g} and at most {hi:g}" if lo_open else f"in {lo:g}..{hi:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need {what} {bounds}, got {text!r}") from None
        if not (math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi):
            raise argparse.ArgumentTypeError(f"need {what} {bounds}, got {text}")
        return value

    return parse


def transport_name(text: str) -> str:
    """An argparse type: a registered transport (``transport.registry.available()``) or ``faulty:<one>``."""
    from transport import registry

    known = registry.available()
    inner = text[len("faulty:"):] if text.startswith("faulty:") else text
    if inner not in known:
        names = ", ".join(known)
        raise argparse.ArgumentTypeError(f"unknown transport {text!r}; choose one of {names}, or faulty:<one of them>")
    return text


def transport_help() -> str:
    from transport import registry

    return (f"data plane: {', '.join(registry.available())}, or faulty:<name> (that transport with injected "
            "faults) (default: %(default)s)")


def secret_file(text: str) -> tuple[str, bytes | None]:
    if text == "none":
        return text, None
    try:
        return text, load_secret(text)
    except StartError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_bytes() -> int | None:
    """This machine's physical memory, if the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def report_start_failure(command: str, cause: str, errors: Sequence[str], *, verbose: bool) -> int:
    """A run that never started: one line naming the cause (``verbose``: every rank's error first), no table."""
    if verbose:
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
    hint = "" if verbose or not errors else " (--verbose shows the traceback)"
    print(f"{command}: could not start: {cause}{hint}", file=sys.stderr, flush=True)
    print(f"{command}: FAILED")
    return 1


def page_text(nbytes: int) -> str:
    """A page's size as the demos' opening line words it: whole KiB when it is some, else bytes."""
    return f"{nbytes // 1024} KiB" if nbytes % 1024 == 0 else f"{nbytes} B"


def announce_and_run(line: str, plan: Any, run: Callable[..., Any], report: Callable[..., int],
                     args: argparse.Namespace) -> int:
    """A demo's run, the same for the plain and the ``--epd`` one: its opening ``line``, then ``plan``
    run under the progress display ``--progress`` asks for, then its report (its exit status)."""
    print(line, flush=True)
    with RunProgress("demo", mode=args.progress) as progress:
        outcome = run(plan, progress=progress)
    return report(plan, outcome, verbose=args.verbose)
