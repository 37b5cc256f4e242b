"""``python -m pdcore demo [--epd] [options]``: the command line of the two demos.

It parses and checks the options (a bad value is one line naming it, exit 2,
before anything starts), chooses the run's secret, then runs the PD demo
(``pdcore.tools.demo``) or, with ``--epd``, the EPD demo (``pdcore.tools.epd_demo``),
and prints its summary.
"""

from __future__ import annotations

import secrets

from . import epd_demo
from .cli import (
    CliParser,
    announce_and_run,
    float_range,
    int_range,
    memory_bytes,
    page_text,
    secret_file,
    transport_help,
    transport_name,
)
from .demo import Plan, make_requests, report, run
from .device_kv import KV_DEVICES

__all__ = ["parser", "main"]

PROGRESS_HELP = ("live progress: auto (a rich bar on a terminal, plain lines every few seconds otherwise), "
                 "rich, plain or none (default: %(default)s)")
MAX_REQUESTS = 1 << 20  # TransferConfig.capacity's bound (a demo's capacity is max(64, requests))


def parser() -> CliParser:
    p = CliParser(
        prog="python -m pdcore demo",
        description="Move N requests' KV cache from a prefill replica to a decode replica on this machine: "
        "real processes (one per rank), real gloo groups, the chosen transport over loopback. Every byte of "
        "every page is checked; prints a summary table and 'demo: OK' or 'demo: FAILED' (exit 0 / 1).",
    )
    p.add_argument("--requests", type=int_range(1, MAX_REQUESTS), default=200, metavar="N",
                   help=f"requests to move (1..{MAX_REQUESTS}; default: %(default)s)")
    p.add_argument("--prefill-tp", type=int_range(1, 64), default=2, metavar="N",
                   help="ranks of the prefill replica (1..64; without --layout it must equal --decode-tp; "
                   "default: %(default)s)")
    p.add_argument("--decode-tp", type=int_range(1, 64), default=2, metavar="N",
                   help="ranks of the decode replica (1..64; default: %(default)s)")
    p.add_argument("--layers", type=int_range(1, 1024), default=8, metavar="N",
                   help="model layers with --layout (K and V buffers each, one latent with mla), else KV cache "
                   "buffers per rank (1..1024; default: %(default)s)")
    p.add_argument("--page-bytes", type=int_range(1, 64 << 20), default=32768, metavar="BYTES",
                   help=f"bytes per page per buffer without --layout (1..{64 << 20}; default: %(default)s)")
    p.add_argument("--layout", choices=("opaque", "hnd", "nhd", "mla"), default="opaque",
                   help="what a page holds: opaque bytes (prefill and decode tp equal), KV heads outermost (hnd) "
                   "or tokens outermost (nhd) split over the ranks, or an MLA latent every rank holds "
                   "(default: %(default)s)")
    p.add_argument("--kv-heads", type=int_range(1, 1024), default=8, metavar="N",
                   help="KV heads of the model with --layout hnd/nhd (1..1024; default: %(default)s)")
    p.add_argument("--head-bytes", type=int_range(1, 1 << 20), default=None, metavar="BYTES",
                   help="bytes per head (mla: per latent) per token (default: 256, or 64 with --model tiny)")
    p.add_argument("--page-tokens", type=int_range(1, 1024), default=16, metavar="N",
                   help="tokens per page with --layout (1..1024; default: %(default)s)")
    p.add_argument("--layerwise", action="store_true",
                   help="prefill hands each request over layer by layer (begin / layers_done / finish)")
    p.add_argument("--model", choices=("none", "tiny"), default="none",
                   help="tiny: prefill ranks compute a tiny seeded decoder's KV, decode ranks decode 4 tokens from "
                   "their heads and compare them with one process's (needs --layout; default: %(default)s)")
    p.add_argument("--max-pages", type=int_range(1, 4096), default=16, metavar="N",
                   help="pages per request: 1..this, at random (1..4096; default: %(default)s)")
    p.add_argument("--transport", type=transport_name, default="tcp", metavar="NAME", help=transport_help())
    p.add_argument("--control", choices=("zmq", "tcp"), default="tcp",
                   help="the control plane: ZeroMQ with CURVE, or sealed frames over TCP on the driver's thread "
                        "(default: %(default)s)")
    p.add_argument("--kv-device", choices=KV_DEVICES, default="cpu",
                   help="where the KV cache (and, with --epd, the embedding buffers) live: cpu, cuda (staged through "
                        "pinned host memory) or standin (host memory the peers stage as device memory, with copies "
                        "that finish late and out of order; no GPU needed) (default: %(default)s)")
    p.add_argument("--seed", type=int_range(0, (1 << 63) - 1), default=0, metavar="N",
                   help="seeds the requests' sizes and rooms (a non-negative integer; default: %(default)s)")
    p.add_argument("--timeout", type=float_range(0, 86400, lo_open=True, what="seconds"), default=180.0,
                   metavar="SECONDS", help="the run's deadline, after start-up (0 < SECONDS <= 86400; default: %(default)s)")
    p.add_argument("--secret-file", type=secret_file, metavar="PATH",
                   help="file holding the deployment secret (16..4096 bytes), or 'none' to run unauthenticated "
                   "(default: a random secret generated for this run)")
    p.add_argument("--progress", choices=("auto", "rich", "plain", "none"), default="auto", help=PROGRESS_HELP)
    p.add_argument("--verbose", action="store_true",
                   help="print the traceback of every rank that raised (default: one line naming the cause)")
    epd_demo.add_arguments(p)  # --epd and its options
    return p


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.kv_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            cli.error("argument --kv-device: cuda needs a GPU that torch sees, and this machine has none "
                      "(--kv-device standin runs the same staging path without one)")
    kv = None
    if args.layout == "opaque":
        if args.prefill_tp != args.decode_tp:
            cli.error(f"argument --prefill-tp/--decode-tp: opaque pages pair prefill and decode ranks one to one, so "
                      f"the tp sizes must be equal (got {args.prefill_tp} and {args.decode_tp}); give --layout to "
                      "pair different sizes")
        if args.model != "none":
            cli.error("argument --model: a model needs a KV layout (--layout hnd, nhd or mla)")
    else:
        from ..core.errors import LocalProtocolError
        from ..kv import KvLayout

        head_bytes = args.head_bytes or (64 if args.model == "tiny" else 256)
        if args.model == "tiny" and head_bytes % 8:
            cli.error(f"argument --head-bytes: the tiny model stores float64, {head_bytes} is not a multiple of 8")
        try:
            kv = KvLayout(order=args.layout, kv_heads=1 if args.layout == "mla" else args.kv_heads,
                          head_bytes=head_bytes, page_tokens=args.page_tokens, layers=args.layers)
            kv.check_tp(args.prefill_tp, "--prefill-tp")
            kv.check_tp(args.decode_tp, "--decode-tp")
        except LocalProtocolError as e:
            cli.error(f"argument --layout/--kv-heads: {e}")
    num_pages = max(512, 4 * args.max_pages * 32)
    page_bytes = [args.page_bytes] * 2 if kv is None else [kv.page_bytes(args.prefill_tp), kv.page_bytes(args.decode_tp)]
    buffers = args.layers if kv is None else kv.buffers
    cache = (args.prefill_tp * page_bytes[0] + args.decode_tp * page_bytes[1]) * buffers * num_pages
    memory = memory_bytes()
    if memory is not None and cache > memory:
        cli.error(f"argument --page-bytes/--layers/--max-pages: {buffers} buffers x {num_pages} pages x "
                  f"{page_bytes} bytes on {args.prefill_tp + args.decode_tp} ranks is {cache / 1e9:.1f} GB of "
                  f"KV cache; this machine has {memory / 1e9:.1f} GB")

    from ..core.table import IMPLEMENTATION

    if args.secret_file is None:
        secret: bytes | None = secrets.token_bytes(32)
        auth_note = "authenticated (a secret generated for this run)"
    elif args.secret_file[1] is None:
        secret, auth_note = None, "UNAUTHENTICATED (--secret-file none)"
    else:
        secret = args.secret_file[1]
        auth_note = f"authenticated (secret from {args.secret_file[0]})"
    if args.epd:
        return epd_demo.main(args, cli, secret=secret, auth_note=auth_note, num_pages=num_pages)

    plan = Plan(
        requests=make_requests(args.requests, seed=args.seed, max_pages=args.max_pages),
        prefill_tp=[args.prefill_tp],
        decode_tp=[args.decode_tp],
        layers=args.layers,
        page_bytes=args.page_bytes,
        num_pages=num_pages,
        transport=args.transport,
        control=args.control,
        timeout=args.timeout,
        secret=secret,
        kv=kv,
        layerwise=args.layerwise,
        model=None if args.model == "none" else args.model,
        kv_device=args.kv_device,
    )
    if kv is None:
        shape = f"{args.layers} layers x {page_text(args.page_bytes)} pages"
    else:
        heads = "an MLA latent" if kv.order == "mla" else f"{kv.kv_heads} KV heads ({kv.order})"
        shape = (f"{kv.layers} layers, {heads} of {kv.head_bytes} B, {kv.page_tokens} tokens a page"
                 f"{', layer-wise' if args.layerwise else ''}{', tiny model' if args.model == 'tiny' else ''}")
    line = (f"pdcore demo: {args.requests} requests, prefill tp {args.prefill_tp} -> decode tp {args.decode_tp}, "
            f"{shape}, transport {args.transport}, control {args.control}, {IMPLEMENTATION} state table, {auth_note}"
            f"{'' if args.kv_device == 'cpu' else f', KV on {args.kv_device}'}")
    return announce_and_run(line, plan, run, report, args)
