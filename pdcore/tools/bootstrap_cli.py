"""``python -m pdcore bootstrap``: run one deployment's bootstrap server until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from ..control import auth
from ..control.bootstrap import DEFAULT_AUTH_WINDOW, DEFAULT_PORT, MAX_BODY_BYTES, BootstrapServer
from ..core.deadline import Deadline
from ..core.errors import StartError
from .cli import CliParser, float_range, int_range, secret_file

__all__ = ["main"]

log = logging.getLogger("pdcore.bootstrap")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdcore bootstrap --host H --port P [--secret-file F]``: serve until SIGINT/SIGTERM.

    The secret comes from ``--secret-file``, else from ``$PDCORE_SECRET_FILE``;
    without either the server runs unauthenticated (and warns). A bad option or
    a secret file that cannot be read is one error line naming it, exit 2.
    """
    parser = CliParser(
        prog="python -m pdcore bootstrap",
        description="Run the bootstrap server of one prefill deployment: its ranks register where they listen, "
        "decode ranks look them up. Serves until SIGINT or SIGTERM; prints 'listening on HOST:PORT' once up.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int_range(0, 65535), default=DEFAULT_PORT,
                        help="port to bind, 0..65535, 0 = any free port (default: %(default)s)")
    parser.add_argument("--max-body", type=int_range(1, 1 << 30), default=MAX_BODY_BYTES,
                        help="request body limit in bytes (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float_range(0.0, 3600.0, lo_open=True, what="seconds"), default=5.0,
                        help="seconds allowed for a whole request (default: %(default)s)")
    parser.add_argument("--header-timeout", type=float_range(0.0, 3600.0, lo_open=True, what="seconds"), default=2.0,
                        help="seconds allowed for a request's line and headers (default: %(default)s)")
    parser.add_argument("--secret-file", type=secret_file, metavar="PATH",
                        help=f"file holding the deployment secret, 16..4096 bytes (default: ${auth.SECRET_FILE_ENV}; "
                        "'none', or neither set: unauthenticated, with a warning; a set but empty variable is an error)")
    parser.add_argument("--auth-window", type=float_range(0.0, 3600.0, lo_open=True, what="seconds"), default=DEFAULT_AUTH_WINDOW,
                        help="accepted clock difference of a signed request, seconds (default: %(default)s)")
    parser.add_argument("--metrics", action="store_true",
                        help="serve Prometheus metrics at GET /metrics (needs pdcore[metrics])")
    args = parser.parse_args(argv)
    if args.secret_file is not None:
        secret = args.secret_file[1]
    else:
        try:
            secret = auth.resolve_secret(None)
        except StartError as e:  # names the variable and the file, never its content
            parser.error(str(e))
    registry = None
    if args.metrics:
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            parser.error("--metrics needs prometheus_client: pip install 'pdcore[metrics]'")
        registry = CollectorRegistry()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = {signal.SIGINT, signal.SIGTERM}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # threads started below inherit the mask
    try:
        try:
            server = BootstrapServer(
                args.host, args.port, secret=secret, max_body=args.max_body, request_timeout=args.request_timeout,
                header_timeout=args.header_timeout, auth_window=args.auth_window, metrics=registry,
            )  # fmt: skip
            port = server.start()
        except StartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if secret is not None:
            log.info("bootstrap server: requests are authenticated with the deployment secret")
        print(f"bootstrap server listening on {args.host}:{port}", flush=True)  # scripts read the port off this line
        received = signal.sigwait(stop)
        log.info("bootstrap server: %s, closing", signal.Signals(received).name)
        server.close(Deadline.after(10.0))
        return 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


if __name__ == "__main__":
    sys.exit(main())
