"""``python -m pdcore demo|bootstrap|chaos``: the demo of a full transfer, the bootstrap server, or a chaos run."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    commands = {"demo": "pdcore.demo", "bootstrap": "pdcore.bootstrap", "chaos": "pdcore.chaos"}
    if not args or args[0] not in commands:
        print(f"usage: python -m pdcore {{{'|'.join(commands)}}} [options]  (--help on each)", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(commands[args[0]]).main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
