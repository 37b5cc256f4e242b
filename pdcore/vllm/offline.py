"""The router's work for offline ``vllm.LLM`` objects: rooms in ``SamplingParams.extra_args``.

A prefill ``LLM`` (``kv_producer``) and a decode ``LLM`` (``kv_consumer``) run in two processes,
concurrently; both call ``pd_sampling_params`` with the same prompts' count, ``first_room`` and
bootstrap address, so request ``i`` has room ``first_room + i`` on both sides::

    # both processes (first_room: chosen once, e.g. by the parent, and given to both)
    prefill_sp, decode_sp = pd_sampling_params(sampling_params, len(prompts), "127.0.0.1:8998", first_room)
    # prefill process
    llm.generate(prompts, prefill_sp); finish_transfers(llm, timeout=120)
    # decode process
    outputs = llm.generate(prompts, decode_sp)

``finish_transfers`` keeps an in-process prefill engine stepping after ``generate`` returned
(its requests finished with their first token, their KV is still being written); an engine
core in its own process keeps stepping by itself (vLLM's ``has_pending_push_work``).
"""

from __future__ import annotations

import time
from typing import Any

from .params import split_address, transfer_params

__all__ = ["pd_sampling_params", "finish_transfers"]


def pd_sampling_params(sampling_params: Any, count: int, bootstrap: str, first_room: int) -> tuple[list[Any], list[Any]]:
    """Per request: the prefill copy (one token) and the decode copy of ``sampling_params``, each with
    the room's ``kv_transfer_params`` in ``extra_args``."""
    host, port = split_address(bootstrap, "bootstrap")
    if isinstance(first_room, bool) or not isinstance(first_room, int) or first_room < 0:
        raise ValueError(f"first_room must be an int >= 0, got {first_room!r}")
    prefill, decode = [], []
    for i in range(count):
        params = transfer_params(first_room + i, host, port)
        p = sampling_params.clone()
        p.max_tokens = 1
        p.extra_args = {**(p.extra_args or {}), "kv_transfer_params": params}
        d = sampling_params.clone()
        d.extra_args = {**(d.extra_args or {}), "kv_transfer_params": dict(params)}
        prefill.append(p)
        decode.append(d)
    return prefill, decode


def finish_transfers(llm: Any, timeout: float) -> int:
    """Step ``llm``'s in-process engine until this process's connector tracks no transfer; returns how
    many were left at ``timeout`` (0: all ended). Without an in-process connector (the engine core
    runs in its own process and steps by itself) it returns 0 at once."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    connector = get_kv_transfer_group()
    pending = getattr(connector, "pending_transfers", None)
    if pending is None:
        raise TypeError(f"finish_transfers: the KV connector is {type(connector).__name__}, not pdcore's")
    deadline = time.monotonic() + timeout
    while pending() and time.monotonic() < deadline:
        llm.llm_engine.step()
    return pending()
