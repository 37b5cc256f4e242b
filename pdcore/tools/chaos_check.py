"""A chaos run's verdict: each invariant a scheduler relies on, checked from the ranks' logs, and the report."""

from __future__ import annotations

from collections import Counter
from typing import Any


from .cli import report_start_failure
from .chaos_plan import ChaosPlan
from .chaos_runner import ChaosOutcome


Row = tuple[str, str, bool, list[str]]


def check(outcome: ChaosOutcome) -> list[Row]:
    """``(invariant, figure, holds, details)`` rows."""
    survivors = [i for i in outcome.incarnations if not i.killed]
    return [
        ("no hang (every process ended in time)", f"{len(outcome.hung)} hung", not outcome.hung, outcome.hung),
        ("no rank raised", f"{len(outcome.errors)} errors", not outcome.errors, outcome.errors),
        *_ends_and_agreement(outcome, survivors),
        *_decode_checks(outcome, survivors),
        _leftovers(survivors),
    ]


def _ends_and_agreement(outcome: ChaosOutcome, survivors: list[Any]) -> list[Row]:
    """Every request ends exactly once per rank, after its ``Bootstrapped``; every rank of a replica logs the same
    events in the same order (a rank's own view checked alone, then the ranks against each other)."""
    once: list[str] = []
    agree: list[str] = []
    missing: list[str] = []
    for inc in survivors:
        logs = [inc.done[r]["log"] for r in sorted(inc.done)]
        for rank in sorted(inc.done):
            result = inc.done[rank]
            registered = [rid for kind, rid, _ in result["log"] if kind == "Registered"]
            once += _ends_of_one_rank(f"{inc.name} rank {rank}", result["log"], registered)
            if result.get("abandoned"):
                once.append(f"{inc.name} rank {rank}: {len(result['unfinished'])} requests had not ended "
                            f"{outcome.plan.drain:g} s after stop: {result['unfinished'][:5]}")
            lost = set(inc.dispatched) - set(registered)
            if lost:
                missing.append(f"{inc.name} rank {rank}: {len(lost)} dispatched requests never registered: {sorted(lost)[:5]}")
        if len(logs) == len(inc.procs) and any(log != logs[0] for log in logs):
            first = next(i for i, log in enumerate(logs) if log != logs[0])
            a, b = logs[0], logs[first]
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            agree.append(f"{inc.name}: rank 0 and rank {first} differ at event {at}: "
                         f"{a[at:at + 3]} vs {b[at:at + 3]}")
    return [("every request ends exactly once per rank (in order)", f"{len(once) + len(missing)} violations",
             not once and not missing, once + missing),
            ("same events (payload too), same order on every rank", f"{len(agree)} replicas differ", not agree, agree)]


def _ends_of_one_rank(who: str, log: list[Any], registered: list[str]) -> list[str]:
    """One rank's log: each registered request ends once, none ends unregistered, none is ``Bootstrapped`` twice,
    and a success comes after its ``Bootstrapped``."""
    out: list[str] = []
    ends = Counter(rid for kind, rid, _ in log if kind not in ("Registered", "Bootstrapped"))
    boots = Counter(rid for kind, rid, _ in log if kind == "Bootstrapped")
    for rid in registered:
        if ends[rid] != 1:
            out.append(f"{who}: {rid} ended {ends[rid]} times")
    for rid in set(ends) - set(registered):
        out.append(f"{who}: {rid} ended but was never registered")
    for rid, n in boots.items():
        if n > 1:
            out.append(f"{who}: {rid} Bootstrapped {n} times")
    seen_boot: set[str] = set()
    for kind, rid, _ in log:  # a success comes after its Bootstrapped, even if the state jumped
        if kind == "Bootstrapped":
            seen_boot.add(rid)
        elif kind in ("Succeeded", "RemotePrefillDone") and rid not in seen_boot:
            out.append(f"{who}: {rid} {kind} without Bootstrapped before it")
    return out


def _decode_checks(outcome: ChaosOutcome, survivors: list[Any]) -> list[Row]:
    """What the surviving decode ranks found: the landed pages' bytes and first tokens, that anything landed at
    all, and the canary pages (handed back, yet written into)."""
    rows: list[Row] = []
    decode_done = [(i, r, i.done[r]) for i in survivors if i.role == "decode" for r in sorted(i.done)]
    mism = [f"{i.name} rank {r}: {rid}" for i, r, d in decode_done for rid in d["mismatched"]]
    landed = sum(1 for _, _, d in decode_done for kind, _, _ in d["log"] if kind == "RemotePrefillDone")
    rows.append(("RemotePrefillDone pages hold exactly prefill's bytes", f"{len(mism)} of {landed} wrong", not mism, mism))
    idle = [] if landed else ["no request landed: the faults (or the machine) left nothing to check the invariants on"]
    rows.append(("transfers happened (a run that moves nothing proves nothing)", f"{landed} landed", not idle, idle))
    bad_tokens = [f"{i.name} rank {r}: {rid}" for i, r, d in decode_done for rid in d["tokens_bad"]]
    valid = [f"{i.name} rank {r} sent: {x}" for i in survivors for r, d in sorted(i.done.items())
             for x in d.get("corrupted_still_valid", [])]
    notes = ["corrupted control frames that still decoded (past the wire's checksum):"] + valid if bad_tokens and valid else []
    rows.append(("RemotePrefillDone carries prefill's first token", f"{len(bad_tokens)} wrong", not bad_tokens,
                 bad_tokens + notes))

    canary = []
    for i, r, d in decode_done:
        for v in d["canary"]:
            whose = f"; it holds {v['writer']}'s prefill data (a late write)" if v["writer"] else ""
            canary.append(f"{i.name} rank {r}: page {v['page']} (handed back: {v['how']}) had {v['bytes']} bytes "
                          f"overwritten, found {v['when']} at {v['t'] - outcome.t0:.1f} s{whose}")
    rows.append(("0 bytes written into pages handed back", f"{len(canary)} pages", not canary, canary))
    return rows


def _leftovers(survivors: list[Any]) -> Row:
    """Nothing in flight, tracked or running once the timeouts were waited out (what was still there at the end
    and went within its timeout is a note, not a leak)."""
    left = []
    expired = []
    for inc in survivors:
        for rank, d in sorted(inc.done.items()):
            maps = {k: v for k, v in d["maps"].items() if v}
            if d["in_flight"] or d["tracked"] or maps:
                left.append(f"{inc.name} rank {rank}: in_flight={d['in_flight']} tracked={d['tracked']} maps={maps} "
                            f"(after waiting out the timeouts; at the end: {d['maps_at_end']})")
            elif any(d["maps_at_end"].values()):
                at_end = {k: v for k, v in d["maps_at_end"].items() if v}
                expired.append(f"{inc.name} rank {rank}: at the end {at_end}, gone within its timeout (not a leak)")
            if d["threads_after_close"]:
                left.append(f"{inc.name} rank {rank}: threads alive after close(): {d['threads_after_close']}")
    return ("nothing in flight, tracked or left running at the end", f"{len(left)} ranks", not left, left + expired)


def _reasons(survivors: list[Any]) -> Counter[str]:
    out: Counter[str] = Counter()
    for inc in survivors:
        if inc.role == "decode":
            for r in sorted(inc.done)[:1]:
                out.update(inc.done[r].get("reasons", {}))
    return out


def report(outcome: ChaosOutcome, *, verbose: bool = False) -> int:
    """Print the table of figures and invariants, then ``chaos: OK`` or ``chaos: FAILED``; 0 only if all hold.

    A run that never started (``outcome.start_failure``) prints no table: one line naming the rank
    and the cause (``verbose`` adds the tracebacks). A rank that raised later is one line in the
    details of "no rank raised"; ``verbose`` shows its traceback there.
    """
    plan = outcome.plan
    if outcome.start_failure is not None:
        return report_start_failure("chaos", outcome.start_failure, outcome.errors, verbose=verbose)
    rows = check(outcome)
    if not verbose and outcome.causes:
        rows = [(name, fig, good, outcome.causes if name == "no rank raised" else details)
                for name, fig, good, details in rows]
    survivors = [i for i in outcome.incarnations if not i.killed]
    decode_logs = [i.done[r]["log"] for i in survivors if i.role == "decode" for r in sorted(i.done)[:1]]
    ok = sum(1 for log in decode_logs for k, _, _ in log if k == "RemotePrefillDone")
    failed = sum(1 for log in decode_logs for k, _, _ in log if k == "Failed")
    faults = Counter(kind.split()[0] for _, kind in outcome.actions if kind.startswith(("SIGKILL", "SIGSTOP")))
    tfaults: Counter[str] = Counter()
    cfaults: Counter[str] = Counter()
    for inc in survivors:
        for d in inc.done.values():
            tfaults.update(d.get("transport_faults", {}))
            cfaults.update(d.get("control_faults", {}))
    info = [
        ("seed", str(plan.seed)),
        ("wall", f"{outcome.seconds:.1f} s"),
        ("requests dispatched", str(outcome.dispatched)),
        ("on surviving decode replicas", f"{ok} RemotePrefillDone, {failed} Failed"),
        ("most common failure reasons", "; ".join(f"{n}x {why}" for why, n in _reasons(survivors).most_common(3)) or "-"),
        ("replica kills / pauses", f"{faults['SIGKILL']} / {faults['SIGSTOP']}"),
        ("data-plane faults (survivors)", f"{tfaults['failed_posted']} failed after posting, "
                                          f"{tfaults['failed_unposted']} before, of {tfaults['batches']} batches"),
        ("control faults (survivors)", ", ".join(f"{v} {k}" for k, v in sorted(cfaults.items())) or "none"),
    ]
    table = [(k, v, "") for k, v in info] + [(name, fig, "ok" if good else "FAILED") for name, fig, good, _ in rows]
    w0 = max(len(r[0]) for r in table)
    w1 = max(len(r[1]) for r in table)
    line = "+" + "-" * (w0 + 2) + "+" + "-" * (w1 + 2) + "+" + "-" * 8 + "+"
    print(line)
    for k, v, s in table:
        print(f"| {k:<{w0}} | {v:<{w1}} | {s:<6} |")
    print(line)
    for name, _, good, details in rows:
        if details:
            print(f"{name}:")
            for d in details[:20]:
                print(f"  - {d}")
            if len(details) > 20:
                print(f"  ... {len(details) - 20} more")
    good = all(g for _, _, g, _ in rows)
    if not good:
        print(f"replay: python -m pdcore chaos --seed {plan.seed} " + _replay_args(plan))
    print("chaos: OK" if good else "chaos: FAILED")
    return 0 if good else 1


def _replay_args(plan: ChaosPlan) -> str:
    d = ChaosPlan().slower(plan.slow)
    args = [f"--seconds {plan.seconds:g}" if plan.seconds is not None else f"--requests {plan.requests}",
            f"--transport {plan.transport}", f"--control {plan.control}"]
    for name in ("fail_rate", "land_rate", "delay", "control_drop", "control_delay", "control_dup", "control_corrupt",
                 "dead_after", "window", "layers", "page_bytes", "num_pages", "max_pages"):
        if getattr(plan, name) != getattr(d, name):
            args.append(f"--{name.replace('_', '-')} {getattr(plan, name):g}")
    args += [f"--tp {plan.prefill_tp}"] if plan.prefill_tp != d.prefill_tp else []
    args += [f"--slow {plan.slow:g}"] if plan.slow != 1 else []
    args += ["--no-kills"] if not plan.kills else []
    args += ["--unsafe-no-grants"] if plan.unsafe_no_grants else []
    args += ["--no-pauses"] if not plan.pauses else []
    return " ".join(args)
