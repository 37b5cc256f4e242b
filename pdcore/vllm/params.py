"""What the connector reads from outside: a request's ``kv_transfer_params`` and the instance's
``kv_connector_extra_config``. Pure: no vLLM, so the router and the tests use it without vLLM.

A request's params join its prefill and decode sides: the router gives both instances the same
room and the prefill deployment's bootstrap address (``transfer_params``); a request without
them is served locally, as if no connector were there. A malformed value is a ``ValueError``
naming the key: a wrong room would pair the request with another one's KV.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ROOM_KEY", "BOOTSTRAP_KEY", "Transfer", "transfer_of", "transfer_params", "ConnectorOptions",
           "options_from"]

#: the keys of ``kv_transfer_params`` the connector reads
ROOM_KEY = "pdcore_room"
BOOTSTRAP_KEY = "pdcore_bootstrap"

_U63 = (1 << 63) - 1


@dataclass(frozen=True)
class Transfer:
    """One request's transfer: its room and the prefill deployment's bootstrap server."""

    room: int
    host: str
    port: int


def split_address(value: Any, where: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``, else ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"{where} must be 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{where} must be 'host:port' with a TCP port, got {value!r}")
    return host, int(port)


def transfer_of(params: Mapping[str, Any] | None) -> Transfer | None:
    """The transfer ``params`` describe, None if they name no room (a request served locally)."""
    if not params or ROOM_KEY not in params:
        return None
    room = params[ROOM_KEY]
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= _U63:
        raise ValueError(f"kv_transfer_params[{ROOM_KEY!r}] must be an int in 0..2**63-1, got {room!r}")
    if BOOTSTRAP_KEY not in params:
        raise ValueError(f"kv_transfer_params has {ROOM_KEY!r} but no {BOOTSTRAP_KEY!r} ('host:port' of the "
                         "prefill deployment's bootstrap server)")
    host, port = split_address(params[BOOTSTRAP_KEY], f"kv_transfer_params[{BOOTSTRAP_KEY!r}]")
    return Transfer(room, host, port)


def transfer_params(room: int, bootstrap_host: str, bootstrap_port: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` both instances get for one request (the router's half)."""
    params = {ROOM_KEY: room, BOOTSTRAP_KEY: f"{bootstrap_host}:{bootstrap_port}"}
    transfer_of(params)  # the same checks the connector makes
    return params


_SECONDS = ("bootstrap_timeout", "waiting_timeout", "dead_after", "start_timeout")
_KEYS = {"bootstrap_host", "bootstrap_port", "bootstrap", "host", "control", "secret_file", "layerwise_min_pages",
         "max_transfers", *_SECONDS}


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config``, checked. Keys (all optional):

    - ``bootstrap_host``, ``bootstrap_port`` (127.0.0.1, 8998): prefill: the bootstrap server its
      ranks register with; ``bootstrap`` ("auto"): "start" one in the rank-0 worker, "join" one that
      runs already (``python -m pdcore bootstrap``), or "auto": start one, join if the port is taken.
    - ``host`` (127.0.0.1): the address this rank's control channel and transport listen on.
    - ``control`` ("tcp"): the control plane, "tcp" (sealed frames, its loop on the driver's thread)
      or "zmq" (ZeroMQ with CURVE: frames encrypted on the wire). Every instance must name the same.
    - ``secret_file``: the deployment secret; else ``$PDCORE_SECRET_FILE``; with neither the
      planes run unauthenticated (pdcore warns once).
    - ``layerwise_min_pages`` (16): prefill: prompts of at least this many blocks are written layer
      by layer during their forward pass (``save_kv_layer``), shorter ones whole after it.
    - ``max_transfers`` (1024): prefill: transfers held at once (a request is held from its arrival
      until its transfer ended). A request that arrives past the bound is served by prefill alone and
      its decode copy is told at once (decode then computes the prompt itself, by its
      ``kv_load_failure_policy``); so is one pdcore refuses. Never an error of the engine.
    - ``bootstrap_timeout``, ``waiting_timeout``, ``dead_after``, ``start_timeout`` (seconds):
      pdcore's knobs of the same names (``pdcore.TransferConfig``).
    """

    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    bootstrap: str = "auto"
    host: str = "127.0.0.1"
    control: str = "tcp"
    secret_file: str | None = None
    layerwise_min_pages: int = 16
    max_transfers: int = 1024
    timeouts: tuple[tuple[str, float], ...] = ()

    def secret(self) -> bytes | None:
        """The deployment secret: ``secret_file``, else ``$PDCORE_SECRET_FILE``, else None.

        A file that cannot serve is a ``pdcore.StartError`` naming where it came from."""
        from ..control.auth import load_secret, resolve_secret

        if self.secret_file is not None:
            return load_secret(self.secret_file, "kv_connector_extra_config['secret_file']")
        return resolve_secret(None)


def options_from(extra: Mapping[str, Any] | None) -> ConnectorOptions:
    """``kv_connector_extra_config`` as ``ConnectorOptions``; an unknown key or a bad value is a
    ``ValueError`` naming it (a typo would otherwise silently keep a default)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; the pdcore connector reads "
                         f"{sorted(_KEYS)}")
    where = "kv_connector_extra_config"
    for name in ("bootstrap_host", "host"):
        if name in extra and (not isinstance(extra[name], str) or not extra[name]):
            raise ValueError(f"{where}[{name!r}] must be a host name or address, got {extra[name]!r}")
    port = extra.get("bootstrap_port", 8998)
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{where}['bootstrap_port'] must be a TCP port, got {port!r}")
    mode = extra.get("bootstrap", "auto")
    if mode not in ("auto", "start", "join"):
        raise ValueError(f"{where}['bootstrap'] must be 'auto', 'start' or 'join', got {mode!r}")
    control = extra.get("control", "tcp")
    if control not in ("tcp", "zmq"):
        raise ValueError(f"{where}['control'] must be 'tcp' or 'zmq', got {control!r}")
    secret_file = extra.get("secret_file")
    if secret_file is not None and (not isinstance(secret_file, (str, os.PathLike)) or not str(secret_file)):
        raise ValueError(f"{where}['secret_file'] must be a path, got {secret_file!r}")
    layerwise = extra.get("layerwise_min_pages", 16)
    if isinstance(layerwise, bool) or not isinstance(layerwise, int) or layerwise < 0:
        raise ValueError(f"{where}['layerwise_min_pages'] must be an int >= 0, got {layerwise!r}")
    bound = extra.get("max_transfers", 1024)
    if isinstance(bound, bool) or not isinstance(bound, int) or not 1 <= bound <= 1 << 20:
        raise ValueError(f"{where}['max_transfers'] must be an int in 1..{1 << 20}, got {bound!r}")
    timeouts = []
    for name in _SECONDS:
        if name in extra:
            value = extra[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}[{name!r}] must be a positive number of seconds, got {value!r}")
            timeouts.append((name, float(value)))
    return ConnectorOptions(
        bootstrap_host=extra.get("bootstrap_host", "127.0.0.1"), bootstrap_port=port, bootstrap=mode,
        host=extra.get("host", "127.0.0.1"), control=control, secret_file=None if secret_file is None else str(secret_file),
        layerwise_min_pages=layerwise, max_transfers=bound, timeouts=tuple(timeouts),
    )
