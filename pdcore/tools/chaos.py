"""``python -m pdcore chaos``: 2P(tp2) -> 2D(tp2) real processes under kills, pauses and faults,
with the invariants a scheduler relies on checked at the end.

The main process (the *runner*) runs one bootstrap server per prefill replica, routes requests
to replicas as a router would, and injects the faults; every rank of every replica is its own
process running a miniature scheduler loop (``demo.py``'s, plus what chaos needs):

- the runner talks to rank 0 of each replica only; rank 0 broadcasts new requests and the stop
  signal to its replica every round (as a real TP scheduler broadcasts its batch), so every rank
  registers the same requests in the same round;
- decode ranks allocate pages on ``Bootstrapped``, announce them, check every byte on
  ``RemotePrefillDone``, and fill every page they take back (after ``Failed`` or after the check)
  with a canary that must stay intact until the page is taken again; never-used pages must stay
  zero. A broken canary is a byte written into a page that was not lent to any transfer;
- prefill ranks fill each request's pages with a pattern only that (request, rank) has, record
  usage and hand the pages to the outbox.

Faults (all seeded from ``--seed``; a failure prints the seed to replay it):

- **kills**: every rank of a replica gets SIGKILL; the replica restarts after a moment (new
  processes, new sessions, the same bootstrap server);
- **pauses**: SIGSTOP of one rank or of a whole replica for longer than ``dead_after``, then
  SIGCONT (a paused process resumes: its in-flight writes may still land). Half of the prefill
  pauses are timed from inside: the runner arms the replica's ranks, and each stops itself
  (``SIGSTOP`` to its own pid) right after handing over a big request, so writes are still
  queued in the stopped process (a request holds up to 8 MiB per rank, more than the socket
  buffers take) and go out when it resumes, long after decode declared it dead;
- **data plane**: the ``faulty:<inner>`` transport (``transport/faulty.py``) fails a fraction of
  batches, some after their bytes landed, and delays completions;
- **control plane**: frames are dropped, delayed (per-peer order kept), duplicated or corrupted
  (bytes flipped in the encoded frame) on the way out of each rank's ``ControlChannel``.

Invariants: no process hangs (each ends within its deadline), no rank raised; every request a
surviving replica registered ends exactly once on each of its ranks, with the same events in the
same order on every rank of the replica; every ``RemotePrefillDone`` has exactly the prefill's
bytes in its pages (and the right first token); no byte lands in a page after it was handed
back (canaries); nothing is left in flight or tracked at the end, and no ``pdcore-*`` thread
outlives ``close()``.

The parts: ``chaos_plan`` (the seeded plan), ``chaos_ranks`` (the rank processes),
``chaos_runner`` (replicas, routing, kills and pauses), ``chaos_check`` (the invariants
and the report); this module is the command line and gathers their public names.
"""

from __future__ import annotations

import random
import sys

from .chaos_check import check, report
from .chaos_plan import ChaosPlan
from .chaos_runner import ChaosOutcome, run
from .cli import CliParser, float_range, int_range, memory_bytes, transport_help, transport_name
from .progress import RunProgress

__all__ = ["ChaosPlan", "ChaosOutcome", "run", "check", "report", "main"]


def parser() -> CliParser:
    d = ChaosPlan()
    fraction = float_range(0.0, 1.0, what="a fraction")
    p = CliParser(
        prog="python -m pdcore chaos",
        description="2 prefill -> 2 decode replicas (tp 2 each by default) as real processes under replica kills, "
        "SIGSTOP pauses, data-plane and control-plane faults; checks the invariants a scheduler relies on and "
        "prints a table, then 'chaos: OK' or 'chaos: FAILED' (exit 0 / 1) with the command that replays the run.",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float_range(0, 86400, lo_open=True, what="seconds"), metavar="SECONDS",
                        help=f"length of the faulty phase (0 < SECONDS <= 86400; default: {d.seconds:g} unless "
                        "--requests is given)")
    length.add_argument("--requests", type=int_range(1, 1 << 20), metavar="N",
                        help=f"dispatch this many requests (1..{1 << 20}), then stop once they ended "
                        f"(at most {d.max_seconds:g} s of faults); default: run for --seconds")
    p.add_argument("--seed", type=int_range(0, (1 << 63) - 1), default=None, metavar="N",
                   help="seeds the requests and the fault schedule (a non-negative integer; default: random, printed)")
    p.add_argument("--transport", type=transport_name, default=d.transport, metavar="NAME", help=transport_help())
    p.add_argument("--control", choices=("zmq", "tcp"), default=d.control,
                   help="the control plane (faulty:<it> with control faults; default: %(default)s)")
    p.add_argument("--tp", type=int, default=d.prefill_tp, choices=(1, 2),
                   help="ranks per replica, prefill and decode alike (1: no torch.distributed group; default: %(default)s)")
    p.add_argument("--fail-rate", type=fraction, default=d.fail_rate, metavar="F",
                   help="data plane (faulty:<name> only): fraction of batches failed (0..1; default: %(default)s)")
    p.add_argument("--land-rate", type=fraction, default=d.land_rate, metavar="F",
                   help="of those, the fraction posted first, so their bytes land (0..1; default: %(default)s)")
    p.add_argument("--delay", type=float_range(0.0, 10.0, what="seconds"), default=d.delay, metavar="SECONDS",
                   help="data plane: max extra completion delay (0..10; default: %(default)s)")
    p.add_argument("--control-drop", type=fraction, default=d.control_drop, metavar="F",
                   help="control plane: fraction of frames dropped (0..1; default: %(default)s)")
    p.add_argument("--control-delay", type=fraction, default=d.control_delay, metavar="F",
                   help=f"control plane: fraction of frames held back up to {d.control_max_delay:g} s, per-peer order "
                   "kept (0..1; default: %(default)s)")
    p.add_argument("--control-dup", type=fraction, default=d.control_dup, metavar="F",
                   help="control plane: fraction of frames sent twice (0..1; default: %(default)s)")
    p.add_argument("--control-corrupt", type=fraction, default=d.control_corrupt, metavar="F",
                   help="control plane: fraction of frames with 1-3 bytes flipped (0..1; default: %(default)s)")
    p.add_argument("--no-kills", action="store_true", help="no SIGKILL of replicas (default: kills and restarts)")
    p.add_argument("--no-pauses", action="store_true", help="no SIGSTOP pauses of ranks (default: pauses)")
    p.add_argument("--dead-after", type=float_range(0, 3600, lo_open=True, what="seconds"), default=d.dead_after,
                   metavar="SECONDS", help=f"a peer silent this long is dead (above the {d.heartbeat_interval:g} s "
                   "heartbeat, at most 3600; scaled by --slow; default: %(default)s)")
    p.add_argument("--slow", type=float_range(0, 100, lo_open=True, what="a factor"), default=1.0, metavar="FACTOR",
                   help="scale every timer (heartbeats, dead_after, timeouts, drain) for a slow machine, "
                   "e.g. 4 under emulation (0 < FACTOR <= 100; default: %(default)s)")
    p.add_argument("--window", type=int_range(1, 1024), default=d.window, metavar="N",
                   help="live requests per decode replica (1..1024; default: %(default)s)")
    p.add_argument("--layers", type=int_range(1, 1024), default=d.layers, metavar="N",
                   help="KV cache buffers per rank (1..1024; default: %(default)s)")
    p.add_argument("--page-bytes", type=int_range(1, 64 << 20), default=d.page_bytes, metavar="BYTES",
                   help=f"bytes per page per buffer (1..{64 << 20}; default: %(default)s)")
    p.add_argument("--num-pages", type=int_range(1, 1 << 20), default=d.num_pages, metavar="N",
                   help=f"pages per buffer (1..{1 << 20}, at least --max-pages; default: %(default)s)")
    p.add_argument("--max-pages", type=int_range(1, 4096), default=d.max_pages, metavar="N",
                   help="pages per request: 1..this, at random (1..4096; default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no line per fault (default: one line per fault)")
    p.add_argument("--unsafe-no-grants", action="store_true",
                   help="check the checker: decode fences without grants; the canary row must then fail")
    p.add_argument("--log-level", type=str.upper, default=d.log_level,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="of the ranks' pdcore loggers; WARNING shows every fault (default: %(default)s)")
    p.add_argument("--progress", choices=("auto", "rich", "plain", "none"), default="auto",
                   help="live progress: auto (a rich bar on a terminal, plain lines every few seconds otherwise), "
                   "rich, plain or none (default: %(default)s)")
    p.add_argument("--verbose", action="store_true",
                   help="print the traceback of every rank that raised (default: one line naming the cause)")
    return p


def main(argv: list[str] | None = None) -> int:
    d = ChaosPlan()
    cli = parser()
    args = cli.parse_args(argv)
    if args.dead_after <= d.heartbeat_interval:
        cli.error(f"argument --dead-after: must be above the heartbeat interval ({d.heartbeat_interval:g} s), "
                  f"got {args.dead_after:g}")
    if args.max_pages > args.num_pages:
        cli.error(f"argument --max-pages: a request of {args.max_pages} pages would never fit in --num-pages "
                  f"{args.num_pages}")
    ranks = 2 * d.replicas * args.tp
    cache = ranks * args.layers * args.num_pages * args.page_bytes
    memory = memory_bytes()
    if memory is not None and cache > memory:
        cli.error(f"argument --page-bytes/--layers/--num-pages: {args.layers} layers x {args.num_pages} pages x "
                  f"{args.page_bytes} bytes on {ranks} ranks is {cache / 1e9:.1f} GB of KV cache; "
                  f"this machine has {memory / 1e9:.1f} GB")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    seconds = args.seconds if args.seconds is not None else (None if args.requests is not None else d.seconds)
    plan = ChaosPlan(
        seed=seed, seconds=seconds, requests=args.requests, transport=args.transport, control=args.control, fail_rate=args.fail_rate,
        land_rate=args.land_rate, delay=args.delay, control_drop=args.control_drop, control_delay=args.control_delay,
        control_dup=args.control_dup, control_corrupt=args.control_corrupt, kills=not args.no_kills,
        pauses=not args.no_pauses, dead_after=args.dead_after, window=args.window, verbose=not args.quiet,
        log_level=args.log_level, layers=args.layers, page_bytes=args.page_bytes, num_pages=args.num_pages,
        max_pages=args.max_pages, unsafe_no_grants=args.unsafe_no_grants, prefill_tp=args.tp, decode_tp=args.tp,
    )
    plan = plan.slower(args.slow)
    from ..core.table import IMPLEMENTATION

    print(f"pdcore chaos: seed {seed}, {plan.replicas}P(tp{plan.prefill_tp}) -> {plan.replicas}D(tp{plan.decode_tp}), "
          f"transport {plan.transport}, control {plan.control}, dead_after {plan.dead_after:g} s, "
          + (f"{plan.seconds:g} s" if plan.seconds is not None else f"{plan.requests} requests")
          + f", {IMPLEMENTATION} state table", flush=True)
    with RunProgress("chaos", mode=args.progress) as progress:
        outcome = run(plan, progress=progress)
    return report(outcome, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
