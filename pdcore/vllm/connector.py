"""``PdcoreConnector``: pdcore as a vLLM v1 KV connector (vLLM 0.32.0, ``pdcore.vllm.SUPPORTED_VLLM``).

Loaded by module path::

    KVTransferConfig(kv_connector="PdcoreConnector", kv_connector_module_path="pdcore.vllm.connector",
                     kv_role="kv_producer" | "kv_consumer", kv_connector_extra_config={...})

Each vLLM worker is a pdcore rank (``PrefillPeer`` on a ``kv_producer``, ``DecodePeer`` on a
``kv_consumer``); ``register_kv_caches`` gives pdcore one buffer per attention layer, exactly as
vLLM laid it out (``[num_blocks, ...]``, one block of one layer contiguous), so a vLLM block is a
pdcore page and no byte is copied on either side. The rules of a request's life are in
``pdcore.vllm.book`` (tested without vLLM); this module maps vLLM's calls onto them.

Every worker polls its peer once per step (``get_finished``), also on steps without a forward
pass; nothing here waits on the network. The cache is described to pdcore as a ``KvLayout``
(HND, K and V in one buffer per layer), so prefill and decode of different tp sizes pair through
pdcore's planner, each decode rank getting its heads. What is refused at start, each with the
reason: ``kv_both``, pipeline parallelism, hybrid KV caches (several KV cache groups), layers sharing
one cache tensor, a cache not in vLLM's CPU layout. A decode instance may run with prefix caching: it
loads only the blocks its cache lacks (prefill writes the tail of the prompt's).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import re
import signal
import sys
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from ..core.errors import LocalProtocolError, StartError
from ..kv.layout import KvLayout
from .book import ConsumerWorker, ProducerWorker, SchedulerBook, StepPlan
from .params import ConnectorOptions, Transfer, options_from, transfer_of
from .version import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdcoreConnector", "PdcoreMetadata", "PdcoreWorkerReport"]

log = logging.getLogger("pdcore.vllm")


def _log_like_vllm() -> None:
    """pdcore's records (its peers' warnings, the connector's lines) go where vLLM's go."""
    ours, theirs = logging.getLogger("pdcore"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False

_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_PR_SET_PDEATHSIG = 1


def end_with_the_server() -> bool:
    """In vLLM's engine-core process (a child the API server started): ask the kernel for SIGTERM when the
    server goes, so killing the server's PID ends the engine too, and with it this rank (its peer, its
    bootstrap port). A process nobody started through ``multiprocessing`` (the server itself, an engine
    run in the server's process) is left alone. True if it is set up."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("pdcore: cannot ask to end with the vLLM server (prctl: errno %d)", ctypes.get_errno())
        return False
    if os.getppid() != parent.pid:  # it went before the request was made
        os.kill(os.getpid(), signal.SIGTERM)
    return True


class PdcoreMetadata(KVConnectorMetadata):
    """One step's ``StepPlan``, from the scheduler side to every worker (pickled across processes)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class PdcoreWorkerReport(KVConnectorWorkerMetadata):
    """Worker to scheduler, one step: prefill requests ready to run (bootstrapped, or failed)."""

    def __init__(self, ready: set[str]) -> None:
        self.ready = ready

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # every rank of a replica gets the same events in the same round (pdcore's agreement)
        assert isinstance(other, PdcoreWorkerReport)
        return PdcoreWorkerReport(self.ready | other.ready)


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class PdcoreConnector(KVConnectorBase_V1):
    """pdcore's KV connector: prefill (``kv_producer``) writes, decode (``kv_consumer``) receives.

    ``kv_connector_extra_config`` is read by ``pdcore.vllm.params.options_from`` (bootstrap server,
    listen address, secret file, timeouts); a request's room and bootstrap address come from its
    ``kv_transfer_params`` (``pdcore.vllm.params.transfer_params``, which the router sets).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm_version(vllm.__version__)
        _log_like_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"PdcoreConnector: kv_role {ktc.kv_role!r} is not supported; use 'kv_producer' on the "
                             "prefill instance and 'kv_consumer' on the decode instance")
        self._producer = ktc.kv_role == "kv_producer"
        self._options: ConnectorOptions = options_from(ktc.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(f"PdcoreConnector: pipeline parallelism (pipeline_parallel_size="
                             f"{parallel.pipeline_parallel_size}) is not supported yet")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(f"PdcoreConnector: hybrid KV caches ({len(kv_cache_config.kv_cache_groups)} KV cache "
                             "groups: sliding window, mamba, ...) are not supported yet")
        self._block_size = vllm_config.cache_config.block_size
        self._book: SchedulerBook | None = None
        self._requests: dict[str, Request] = {}
        self._worker: ProducerWorker | ConsumerWorker | None = None
        self._peer: Any = None
        self._server: Any = None
        self._layer_index: dict[str, int] = {}
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:  # (the engine core holds the scheduler: it ends with the server)
            self._book = SchedulerBook(self._producer, self._block_size, self._options.max_transfers)
            end_with_the_server()

    # -- the scheduler side -------------------------------------------------------------------

    def _transfer(self, request: Request) -> Transfer | None:
        try:
            return transfer_of(request.kv_transfer_params)
        except ValueError as e:  # a client's bad params must not stop the engine: served locally
            log.error("pdcore: request %s is served without a transfer: %s", request.request_id, e)
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._book is not None
        return self._book.matched(request.request_id, self._transfer(request), request.num_prompt_tokens,
                                  num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self._book is not None
        if self._producer:
            transfer = self._transfer(request)
            self._book.admitted(request.request_id, transfer, request.num_prompt_tokens)
            if self._book.knows(request.request_id):
                self._requests[request.request_id] = request

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._book is not None
        transfer = self._transfer(request)
        if transfer is None:
            return
        (block_ids,) = blocks.get_block_ids()
        self._book.allocated(request.request_id, transfer, request.num_prompt_tokens, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._book is not None
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted:
            self._book.preempted(preempted)
        if self._producer and self._requests:
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                request = self._requests.get(rid)
                if request is None:
                    continue
                before = request.num_computed_tokens  # advanced after this call (Scheduler.schedule)
                if before < request.num_prompt_tokens <= before + n and self._kv_cache_manager is not None:
                    (block_ids,) = self._kv_cache_manager.get_block_ids(rid)
                    self._book.scheduled(rid, block_ids)
        plan = self._book.take_plan()
        plan.idle = not any(scheduler_output.num_scheduled_tokens.values())  # the workers run nothing but the poll
        return PdcoreMetadata(plan)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._book is not None
        rid = request.request_id
        self._requests.pop(rid, None)
        first = None
        if request.status in _DONE and request.output_token_ids:
            first = int(request.output_token_ids[0])
        return self._book.finished(rid, block_ids, first), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._book is not None
        report = connector_output.kv_connector_worker_meta
        ready = report.ready if isinstance(report, PdcoreWorkerReport) else ()
        self._book.worker_output(connector_output.finished_sending, connector_output.finished_recving, ready)

    def has_pending_push_work(self) -> bool:
        return self._book is not None and self._book.pending_push()

    # -- the worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start this worker's pdcore rank over vLLM's KV cache: one buffer per layer, a block a page."""
        if self._worker is not None:
            return
        names = sorted(kv_caches, key=_natural)
        if not names:
            raise StartError("PdcoreConnector: vLLM registered no KV cache layers")
        caches = [kv_caches[n] for n in names]
        first = caches[0]
        spans = []
        for name, t in zip(names, caches):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise StartError(f"PdcoreConnector: KV cache of layer {name!r} is not a contiguous CPU tensor "
                                 f"(device {t.device}, strides {tuple(t.stride())}); pdcore's transports need one")
            if t.shape != first.shape or t.dtype != first.dtype:
                raise StartError(f"PdcoreConnector: layer {name!r} has KV cache {tuple(t.shape)} {t.dtype}, layer "
                                 f"{names[0]!r} {tuple(first.shape)} {first.dtype}; one page size for all layers is needed")
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise StartError(f"PdcoreConnector: layers {a!r} and {b!r} share KV cache memory (KV sharing across "
                                 "layers is not supported yet)")
        self._check_cpu_layout(first)
        self._layer_index = {n: i for i, n in enumerate(names)}
        num_pages = int(first.shape[0])
        page_bytes = first[0].numel() * first.element_size()
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        layout = self._kv_layout(first, len(caches), tp_size, page_bytes)
        replica = None
        if tp_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            replica = get_tp_group().cpu_group
        opts = self._options
        secret = opts.secret()
        knobs = dict(opts.timeouts)
        common = dict(kv_buffers=caches, page_bytes=page_bytes, num_pages=num_pages, tp_size=tp_size,
                      tp_rank=tp_rank, host=opts.host, control=opts.control, secret=secret, kv_layout=layout, **knobs)
        if self._producer:
            from ..pd.config import PrefillConfig
            from ..pd.prefill import PrefillPeer

            if tp_rank == 0:
                self._server = _bootstrap_server(opts, secret)
            config = PrefillConfig(**common, bootstrap_host=opts.bootstrap_host, bootstrap_port=opts.bootstrap_port,
                                   layerwise_min_pages=opts.layerwise_min_pages)
            self._peer, outbox = PrefillPeer.start(config)
            self._worker = ProducerWorker(self._peer, outbox, replica, opts.layerwise_min_pages)
        else:
            from ..pd.config import DecodeConfig
            from ..pd.decode import DecodePeer

            self._peer, inbox = DecodePeer.start(DecodeConfig(**common))
            self._worker = self._consumer_worker(self._peer, inbox, replica)
        log.info("pdcore: %s rank %d/%d over %d layers of %d blocks x %d bytes", "prefill" if self._producer else
                 "decode", tp_rank, tp_size, len(caches), num_pages, page_bytes)

    def _check_cpu_layout(self, cache: torch.Tensor) -> None:
        if cache.dim() != 4 or cache.shape[2] != self._block_size:
            raise StartError(f"PdcoreConnector: a layer's KV cache is {tuple(cache.shape)}; the connector knows vLLM's "
                             f"CPU layout [num_blocks, kv_heads, block_size={self._block_size}, 2 * head_size] only")

    def _kv_layout(self, cache: torch.Tensor, layers: int, tp_size: int, page_bytes: int) -> KvLayout:
        """vLLM's CPU cache as a pdcore ``KvLayout``: per layer one buffer ``[blocks, heads, tokens, K then V]``
        (HND, K and V fused), so prefill and decode of different tp sizes get their heads from the planner."""
        self._check_cpu_layout(cache)
        heads = self._vllm_config.model_config.get_total_num_kv_heads()
        layout = KvLayout(order="hnd", kv_heads=heads, head_bytes=int(cache.shape[3]) * cache.element_size(),
                          page_tokens=int(cache.shape[2]), layers=layers, fused_kv=True)
        try:
            want = layout.page_bytes(tp_size)
        except LocalProtocolError as e:
            raise StartError(f"PdcoreConnector: {e}") from None
        if want != page_bytes:
            raise StartError(f"PdcoreConnector: a block of a layer holds {page_bytes} bytes, but {heads} KV heads over "
                             f"tp {tp_size} in vLLM's CPU layout would make {want}")
        return layout

    def _consumer_worker(self, peer: Any, inbox: Any, replica: Any) -> ConsumerWorker:
        """The decode worker's book (a subclass may return its own: the negative control does)."""
        return ConsumerWorker(peer, inbox, replica)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PdcoreMetadata):
            self._worker.take(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: pdcore's writes land on their own; ``get_finished`` reports them."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only once its whole KV landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Prefill: this layer's KV is in the cache; long prompts completed this step stream it now."""
        if isinstance(self._worker, ProducerWorker):
            index = self._layer_index.get(layer_name)
            if index is not None:
                self._worker.layer_saved(index)

    def wait_for_save(self) -> None:
        """Nothing to wait for: writes go on while the engine steps; the blocks are kept until they end."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Poll this rank's peer: requests sent (prefill) or received, landed or failed (decode)."""
        worker = self._worker
        if isinstance(worker, ProducerWorker):
            return worker.step_done(finished_req_ids) or None, None
        if isinstance(worker, ConsumerWorker):
            received, errors = worker.step_done()
            self._load_errors |= errors
            return None, received or None
        return None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Prefill: the requests that became ready to run this step (the scheduler holds them till then)."""
        if isinstance(self._worker, ProducerWorker):
            ready = self._worker.take_ready()
            if ready:
                return PdcoreWorkerReport(ready)
        return None

    def pending_transfers(self) -> int:
        """Worker: the requests this rank still tracks (registered, not yet reported to vLLM)."""
        return 0 if self._worker is None else self._worker.pending()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Decode: the blocks of requests whose transfer failed, reported with their ``get_finished``."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close the peer (its peers hear of the requests still in flight) and the bootstrap server."""
        from ..core.deadline import Deadline

        if self._peer is not None:
            self._peer.close()
            self._peer = None
        if self._server is not None:
            self._server.close(Deadline.after(5.0))
            self._server = None


def _bootstrap_server(opts: ConnectorOptions, secret: bytes | None) -> Any:
    """Prefill rank 0: start the deployment's bootstrap server, or join the one running (``bootstrap``)."""
    if opts.bootstrap == "join":
        return None
    from ..control.bootstrap import BootstrapServer

    server = BootstrapServer(opts.bootstrap_host, opts.bootstrap_port, secret=secret)
    try:
        server.start()
    except StartError as e:
        if opts.bootstrap == "start":
            raise StartError(f"PdcoreConnector: cannot start the bootstrap server on {opts.bootstrap_host}:"
                             f"{opts.bootstrap_port}: {e}") from e
        log.info("pdcore: a bootstrap server runs on %s:%d already (%s): joining it", opts.bootstrap_host,
                 opts.bootstrap_port, e)
        return None
    log.info("pdcore: bootstrap server on %s:%d", opts.bootstrap_host, opts.bootstrap_port)
    return server
