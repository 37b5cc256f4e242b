"""pdcore under vLLM: a KV connector, a router, and the helpers both use (``pip install pdcore[vllm]``).

- ``pdcore.vllm.connector.PdcoreConnector``: the v1 KV connector (``kv_producer`` on a prefill
  instance, ``kv_consumer`` on a decode instance); each vLLM worker is a pdcore rank and a vLLM
  block is a pdcore page. It imports vLLM; nothing else here does, and ``import pdcore`` never
  imports this package.
- ``pdcore.vllm.router``: ``python -m pdcore.vllm.router``, the OpenAI-compatible front of one
  prefill and one decode ``vllm serve`` instance; ``pdcore.vllm.offline``: the same for offline
  ``LLM`` objects (rooms in ``SamplingParams.extra_args``).
- ``pdcore.vllm.params``: the ``kv_transfer_params`` the router hands both instances and the
  connector's ``kv_connector_extra_config``; ``pdcore.vllm.book``: the connector's bookkeeping,
  kept free of vLLM so it is tested without it; ``pdcore.vllm.version``: which vLLM it supports.
"""

from .version import SUPPORTED_VLLM, check_vllm_version

__all__ = ["SUPPORTED_VLLM", "check_vllm_version"]
