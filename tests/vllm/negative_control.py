"""The end-to-end run's negative control: the decode instance's connector, with one addition.

``CorruptingConnector`` is ``PdcoreConnector`` except that a request whose ``kv_transfer_params``
carry ``test_corrupt_page: true`` gets one transferred page (its first block, layer 0)
overwritten with seeded noise right after it landed, before vLLM reads it. Its tokens must then
differ from one instance's: if they did not, decode would not be using the KV pdcore moved.
Every other request takes the connector's own path unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pdcore.vllm.book import ConsumerWorker
from pdcore.vllm.connector import PdcoreConnector

KEY = "test_corrupt_page"
log = logging.getLogger("pdcore.vllm")


class CorruptingConnector(PdcoreConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asked: set[str] = set()  # scheduler side: requests that asked, not yet planned
        self._corrupt: set[str] = set()  # worker side
        self._layer0: torch.Tensor | None = None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens and (request.kv_transfer_params or {}).get(KEY):
            self._asked.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        meta.corrupt, self._asked = self._asked, set()
        return meta

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._corrupt |= getattr(connector_metadata, "corrupt", set())
        super().bind_connector_metadata(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        first = min(self._layer_index, key=self._layer_index.__getitem__)
        self._layer0 = kv_caches[first]

    def _consumer_worker(self, peer: Any, inbox: Any, replica: Any) -> ConsumerWorker:
        owner = self

        class Corrupting(ConsumerWorker):
            def landed(self, rid: str, pages: tuple[int, ...]) -> None:
                if rid in owner._corrupt and owner._layer0 is not None and pages:
                    owner._corrupt.discard(rid)
                    page = owner._layer0[pages[0]]
                    g = torch.Generator().manual_seed(7)
                    page.copy_(torch.randn(page.shape, generator=g, dtype=torch.float32).to(page.dtype) * 3)
                    log.warning("negative control: request %s: page %d of layer 0 overwritten with noise", rid, pages[0])

        return Corrupting(peer, inbox, replica)
