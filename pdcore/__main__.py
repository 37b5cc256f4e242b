"""``python -m pdcore COMMAND [options]``: the demo of a full transfer, the bootstrap server, a chaos run, or the simulator.

Each command owns its parser (``COMMAND --help`` lists its options); this module only lists the
commands and hands the rest of the command line to the chosen one, imported on demand (so
``--help`` starts no torch, no ZeroMQ).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

#: name -> (module whose ``main(argv)`` runs it, one line saying what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("pdcore.tools.demo_cli", "move N requests' KV cache from a prefill to a decode replica on this machine "
             "(real processes and sockets) and check every byte"),
    "bootstrap": ("pdcore.tools.bootstrap_cli", "run the bootstrap server: prefill ranks register with it, decode ranks "
                  "look up where a request's prefill ranks are"),
    "chaos": ("pdcore.tools.chaos", "run 2 prefill -> 2 decode replicas under kills, pauses and injected faults, "
              "then check the invariants a scheduler relies on"),
    "simulate": ("pdcore.sim.run", "run the protocol's role engines in one process over a simulated network, "
                 "transport and clock, seed after seed, checking every invariant after every step"),
}


def parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(
        textwrap.fill(text, 78, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
        for name, (_, text) in COMMANDS.items()
    )
    p = argparse.ArgumentParser(
        prog="python -m pdcore",
        usage="%(prog)s [-h] COMMAND [options]",
        description="pdcore: the transfer peer of disaggregated LLM serving\n(it moves the KV cache from prefill ranks to decode ranks).",
        epilog=f"commands:\n{listing}\n\n'python -m pdcore COMMAND --help' describes a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help="the command to run (listed below)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in COMMANDS:
        return int(importlib.import_module(COMMANDS[args[0]][0]).main(args[1:]))
    cli = parser()
    if not args:
        cli.print_help(sys.stderr)
        return 2
    cli.parse_args(args)  # --help exits 0; an unknown command or option exits 2 naming it
    return 2  # not reached: anything not a command is an argparse error


if __name__ == "__main__":
    sys.exit(main())
