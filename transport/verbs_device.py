"""The verbs transport's device: the one checked import of pyverbs, and which device, port and GID to use.

It exists so that what a machine has (rdma-core's Python bindings, an RDMA device with an
active port, a usable GID) is asked in one place, before any transport starts: ``create("verbs")``
builds on ``open_device``, and the test skips and benchmarks ask ``unavailable_reason`` and
``describe_device`` the same question without starting a transport. Every other verbs module
reaches pyverbs through ``pv`` here (None where it is not importable); ``import transport``
never imports this module.

Device, port and GID: ``device`` by name (default: the first device with an active port), ``ib_port``
(default: its first active port), ``gid_index`` (default: on Ethernet ports the RoCE v2 GID,
preferring an IPv4-mapped one, then a global one, then a link-local one; on InfiniBand ports
index 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .errors import StartError

__all__ = [
    "DEVICE_HINT",
    "INSTALL_HINT",
    "Device",
    "describe_device",
    "gid_str",
    "missing_pyverbs",
    "open_device",
    "pv",
    "rdma_errno",
    "unavailable_reason",
]

INSTALL_HINT = (
    "install rdma-core's Python bindings and a verbs provider: on Debian/Ubuntu "
    "`apt-get install python3-pyverbs rdma-core ibverbs-providers` (Python 3.11 on bookworm; "
    "`bash ci/link-pyverbs.sh` exposes it to a virtualenv)"
)
DEVICE_HINT = (
    "load an RDMA driver or create a soft-RoCE device, e.g. "
    "`rdma link add rxe0 type rxe netdev eth0` (module rdma_rxe), or use transport 'tcp'"
)


def _import_pyverbs() -> Any:
    """Import pyverbs without letting its ``logging.basicConfig`` reconfigure the application's root logger."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import pyverbs.enums as enums
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ, cqe_status_to_str
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR, MW, MWBindInfo
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    return type(
        "_Pyverbs",
        (),
        {
            "e": enums,
            "GID": GID,
            "AHAttr": AHAttr,
            "GlobalRoute": GlobalRoute,
            "CQ": CQ,
            "status_str": staticmethod(cqe_status_to_str),
            "Context": Context,
            "get_device_list": staticmethod(get_device_list),
            "MR": MR,
            "MW": MW,
            "MWBindInfo": MWBindInfo,
            "PD": PD,
            "Error": PyverbsError,
            "RDMAError": PyverbsRDMAError,
            "QP": QP,
            "QPAttr": QPAttr,
            "QPCap": QPCap,
            "QPInitAttr": QPInitAttr,
            "SGE": SGE,
            "SendWR": SendWR,
        },
    )


try:
    pv: Any = _import_pyverbs()
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # pragma: no cover - depends on the machine
    pv = None
    _IMPORT_ERROR = _e

_IPV4_MAPPED = bytes(10) + b"\xff\xff"


def missing_pyverbs() -> str | None:
    """Why pyverbs cannot be used here (what to install), or None if it imported."""
    if pv is None:
        return f"pyverbs is not importable ({_IMPORT_ERROR}); {INSTALL_HINT}"
    return None


def rdma_errno(e: BaseException) -> int | None:
    """The errno a pyverbs error carries, if any (for ``TransportError.errno``)."""
    err = getattr(e, "error_code", None)
    return int(err) if isinstance(err, int) and err > 0 else None


def gid_str(raw: bytes) -> str:
    """A 16-byte GID as pyverbs spells it: eight colon-separated groups of four hex digits."""
    return ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))


def _gid_bytes(gid: Any) -> bytes:
    return bytes.fromhex(str(gid.gid).replace(":", ""))


@dataclass(frozen=True, slots=True)
class Device:
    """The device, port and GID a transport uses, and the limits of that port it needs."""

    name: str
    port: int
    gid_index: int
    gid: bytes
    lid: int
    mtu: int
    link_layer: int
    max_qp_wr: int
    max_cqe: int
    max_msg: int  # the port's largest message: a longer write is posted as several WRs


def _pick_gid(ctx: Any, port: int, gid_tbl_len: int, ethernet: bool) -> int | None:
    """The GID index to use on ``port``: RoCE v2 (IPv4-mapped > global > link-local) on Ethernet, else 0."""
    e = pv.e
    entries: list[tuple[int, bytes, int]] = []  # (index, gid, type)
    try:
        for g in ctx.query_gid_table(max(1, gid_tbl_len)):
            if g.port_num != port:
                continue
            raw = bytes.fromhex(g.gid_str().replace(":", ""))
            entries.append((g.gid_index, raw, g.gid_type))
        v2 = e.IBV_GID_TYPE_ROCE_V2
    except (pv.Error, AttributeError):  # older kernels: no gid table ioctl; walk the table
        entries = []
        for i in range(gid_tbl_len):
            try:
                raw = _gid_bytes(ctx.query_gid(port, i))
                kind = ctx.query_gid_type(port, i)
            except pv.Error:
                continue
            entries.append((i, raw, kind))
        v2 = e.IBV_GID_TYPE_SYSFS_ROCE_V2
    entries = [x for x in entries if any(x[1])]
    if not ethernet:
        return entries[0][0] if entries else None
    ranked = sorted(
        (x for x in entries if x[2] == v2),
        key=lambda x: (not x[1].startswith(_IPV4_MAPPED), x[1].startswith(b"\xfe\x80"), x[0]),
    )
    return ranked[0][0] if ranked else None


def open_device(name: str | None, ib_port: int | None, gid_index: int | None) -> tuple[Any, Device]:
    """Open the device and choose port and GID (pyverbs must have imported); ``StartError`` says what is missing."""
    e = pv.e
    try:
        devices = [d.name.decode() for d in pv.get_device_list()]
    except pv.Error as ex:
        devices = []
        why = str(ex)
    else:
        why = "the device list is empty"
    if not devices:
        raise StartError(f"verbs transport: no RDMA device ({why}); {DEVICE_HINT}")
    if name is not None and name not in devices:
        raise StartError(f"verbs transport: no RDMA device named {name!r}; devices here: {', '.join(devices)}")
    problems = []
    for dev in [name] if name is not None else devices:
        ctx = pv.Context(name=dev)
        try:
            attr = ctx.query_device()
            ports = [ib_port] if ib_port is not None else list(range(1, attr.phys_port_cnt + 1))
            for port in ports:
                try:
                    pa = ctx.query_port(port)
                except pv.Error as ex:
                    problems.append(f"{dev} port {port}: {ex}")
                    continue
                if pa.state != e.IBV_PORT_ACTIVE:
                    problems.append(f"{dev} port {port} is not active (state {pa.state})")
                    continue
                ethernet = pa.link_layer == e.IBV_LINK_LAYER_ETHERNET
                idx = gid_index if gid_index is not None else _pick_gid(ctx, port, pa.gid_tbl_len, ethernet)
                if idx is None:
                    problems.append(f"{dev} port {port} has no usable {'RoCE v2 ' if ethernet else ''}GID")
                    continue
                try:
                    gid = _gid_bytes(ctx.query_gid(port, idx))
                except pv.Error as ex:
                    problems.append(f"{dev} port {port} GID index {idx}: {ex}")
                    continue
                if not any(gid):
                    problems.append(f"{dev} port {port} GID index {idx} is empty")
                    continue
                info = Device(dev, port, idx, gid, pa.lid, pa.active_mtu, pa.link_layer, attr.max_qp_wr, attr.max_cqe,
                              min(pa.max_msg_sz or 1 << 31, 1 << 31))
                return ctx, info
        except BaseException:
            ctx.close()
            raise
        ctx.close()
    raise StartError(f"verbs transport: no usable port: {'; '.join(problems)}; {DEVICE_HINT}")


def describe_device(device: str | None = None, ib_port: int | None = None, gid_index: int | None = None) -> tuple[str, int, int]:
    """``(device, port, gid_index)`` that ``create("verbs", ...)`` with these options would use; ``StartError`` if none."""
    why = missing_pyverbs()
    if why is not None:
        raise StartError(f"verbs transport: {why}")
    ctx, info = open_device(device, ib_port, gid_index)
    ctx.close()
    return info.name, info.port, info.gid_index


def unavailable_reason(device: str | None = None) -> str | None:
    """Why ``create("verbs", device=device)`` cannot work here, or None if it can (for test skips)."""
    why = missing_pyverbs()
    if why is not None:
        return why
    try:
        ctx, _ = open_device(device, None, None)
    except StartError as ex:
        return str(ex)
    ctx.close()
    return None
