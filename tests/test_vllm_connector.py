"""``PdcoreConnector`` against the installed vLLM (``make vllm`` runs these in its venv; marker ``vllm``).

What it refuses at start, each with an error naming the reason, instead of wrong tokens later:
another vLLM release, ``kv_both``, pipeline parallelism, prefix caching on decode, hybrid KV
caches, a non-contiguous or shared layer cache; and that its step plan survives pickling (the
scheduler and the workers may be different processes).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
import warnings
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore")]


@pytest.fixture(scope="module")
def vc() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="needs vLLM: make vllm installs it in its own venv")
        from pdcore.vllm import connector

    return connector


def config(role: str = "kv_producer", prefix: bool = True, pp: int = 1, extra: dict | None = None) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=extra or {},
                                           is_kv_producer=role == "kv_producer"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix, block_size=32),
    )


def make(vc: ModuleType, cfg: Any, worker: bool = False, groups: int = 1) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    role = KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER
    return vc.PdcoreConnector(cfg, role, SimpleNamespace(kv_cache_groups=[object()] * groups))


def test_the_supported_release_is_installed_and_another_is_refused(vc: ModuleType, monkeypatch) -> None:
    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0"
    make(vc, config())  # starts
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 is not supported.*0\.32\.0"):
        make(vc, config())


@pytest.mark.parametrize(("cfg", "groups", "match"), [
    (dict(role="kv_both"), 1, "kv_role 'kv_both' is not supported"),
    (dict(pp=2), 1, "pipeline parallelism"),
    (dict(), 2, "hybrid KV caches"),
    (dict(extra={"bootstrap_prot": 1}), 1, "unknown key.*bootstrap_prot"),
    (dict(extra={"control": "pigeon"}), 1, r"\['control'\] must be 'tcp' or 'zmq', got 'pigeon'"),
])
def test_unsupported_setups_are_refused_at_start(vc: ModuleType, cfg: dict, groups: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(vc, config(**cfg), groups=groups)


def test_a_decode_instance_may_run_with_prefix_caching(vc: ModuleType) -> None:
    conn = make(vc, config(role="kv_consumer", prefix=True))
    t = {"pdcore_room": 7, "pdcore_bootstrap": "127.0.0.1:8998"}
    request = SimpleNamespace(request_id="a", kv_transfer_params=t, num_prompt_tokens=70)
    assert conn.get_num_new_matched_tokens(request, 32) == (37, True)  # the block its cache holds is not loaded


def test_a_preemption_reaches_the_workers_plan(vc: ModuleType) -> None:
    """The scheduler side driven through a preemption, as vLLM's scheduler calls it: the request arrives, its
    workers report it ready, the step that completes its prompt streams its blocks, then vLLM preempts it:
    the next plan tells the workers (which abort a transfer whose layers streamed from the blocks now gone)."""
    conn = make(vc, config())
    t = {"pdcore_room": 9, "pdcore_bootstrap": "127.0.0.1:8998"}
    request = SimpleNamespace(request_id="p", kv_transfer_params=t, num_prompt_tokens=100, num_computed_tokens=0)
    conn.on_new_request(request)
    assert [r.rid for r in conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).plan.registers] == ["p"]
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=vc.PdcoreWorkerReport({"p"}),
                                                 finished_sending=None, finished_recving=None))
    assert conn.get_num_new_matched_tokens(request, 0) == (0, False)  # ready: it runs
    conn._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([4, 5, 6, 7],))
    plan = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"p": 100})).plan
    assert plan.streams == {"p": (4, 5, 6, 7)}
    plan = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids={"p"})).plan
    assert plan.preempted == ["p"]


def test_layer_caches_pdcore_cannot_serve_are_refused(vc: ModuleType) -> None:
    import torch

    from pdcore import StartError

    conn = make(vc, config(role="kv_consumer", prefix=False), worker=True)
    base = torch.zeros(8, 2, 32, 64)
    with pytest.raises(StartError, match="not a contiguous CPU tensor"):
        conn.register_kv_caches({"layers.0.attn": base.transpose(1, 2)})
    shared = torch.zeros(16, 2, 32, 64)
    with pytest.raises(StartError, match="share KV cache memory"):
        conn.register_kv_caches({"layers.0.attn": shared, "layers.1.attn": shared})
    with pytest.raises(StartError, match="one page size for all layers"):
        conn.register_kv_caches({"layers.0.attn": torch.zeros(8, 2, 32, 64), "layers.1.attn": torch.zeros(8, 2, 32, 32)})
    with pytest.raises(StartError, match="CPU layout"):  # a cache laid out otherwise (block size 16 here)
        conn.register_kv_caches({"layers.0.attn": torch.zeros(8, 2, 16, 64)})


def test_the_step_plan_pickles(vc: ModuleType) -> None:
    from pdcore.vllm.book import Finish, Load, Register, StepPlan
    from pdcore.vllm.params import Transfer

    t = Transfer(3, "127.0.0.1", 8998)
    plan = StepPlan(registers=[Register("a", t)], loads=[Load("b", t, (1, 2))], streams={"a": (4,)},
                    finishes=[Finish("a", (4,), 9)], aborts=[("b", 3)])
    meta = pickle.loads(pickle.dumps(vc.PdcoreMetadata(plan)))
    assert meta.plan == plan
    report = pickle.loads(pickle.dumps(vc.PdcoreWorkerReport({"a"}).aggregate(vc.PdcoreWorkerReport({"b"}))))
    assert report.ready == {"a", "b"}


def test_the_cpu_cache_is_described_as_fused_hnd_so_other_tp_sizes_pair(vc: ModuleType) -> None:
    import torch

    from pdcore import StartError
    from pdcore.kv.layout import KvLayout

    cfg = config(role="kv_consumer", prefix=False)
    cfg.model_config = SimpleNamespace(get_total_num_kv_heads=lambda: 2)
    conn = make(vc, cfg, worker=True)
    one_head = torch.zeros(8, 1, 32, 64)  # a rank of tp 2: one of 2 KV heads, head_size 32 (K and V: 64)
    layout = conn._kv_layout(one_head, 2, 2, one_head[0].numel() * 4)
    assert layout == KvLayout(order="hnd", kv_heads=2, head_bytes=256, page_tokens=32, layers=2, fused_kv=True)
    assert layout.page_bytes(1) == 2 * layout.page_bytes(2)  # a tp 1 rank's block holds both heads
    with pytest.raises(StartError, match="2 KV heads over tp 1"):  # the shape disagrees with the model's heads
        conn._kv_layout(one_head, 2, 1, one_head[0].numel() * 4)


def _engine_core(report: Any) -> None:
    """Stands in for vLLM's engine-core process: a multiprocessing child that makes the scheduler's connector."""
    from types import SimpleNamespace as NS

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdcore.vllm import connector

    cfg = NS(kv_transfer_config=NS(kv_role="kv_consumer", kv_connector_extra_config={}, is_kv_producer=False),
             parallel_config=NS(pipeline_parallel_size=1), cache_config=NS(enable_prefix_caching=False, block_size=32))
    connector.PdcoreConnector(cfg, KVConnectorRole.SCHEDULER, NS(kv_cache_groups=[object()]))
    report.send(os.getpid())
    threading.Event().wait(120.0)  # the engine's loop: until the server's end ends it


def _api_server(report: Any) -> None:
    """Stands in for vLLM's API server: starts the engine core the way it does (multiprocessing), then waits."""
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=_engine_core, args=(report,), daemon=False).start()
    threading.Event().wait(120.0)


def test_the_engine_core_ends_with_its_server(vc: ModuleType) -> None:
    """Real processes, a real signal: SIGKILL of the API server's PID alone (as an operator does) ends the engine
    core it started, whose connector holds the pdcore rank and the bootstrap port (they stayed, before)."""
    ctx = multiprocessing.get_context("spawn")
    theirs, ours = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_api_server, args=(ours,))
    server.start()
    core = None
    try:
        assert theirs.poll(120.0), "the engine core did not start"
        core = theirs.recv()
        os.kill(server.pid, signal.SIGKILL)
        server.join(10.0)
        end = time.monotonic() + 30.0
        while os.path.exists(f"/proc/{core}") and _state(core) != "Z" and time.monotonic() < end:
            time.sleep(0.05)  # polling the process's state against a deadline
        assert not os.path.exists(f"/proc/{core}") or _state(core) == "Z", "the engine core outlived its server"
    finally:
        for pid in (server.pid, core):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_tiny_model_command_writes_a_model_vllm_can_tokenize_and_chat_with(tmp_path) -> None:
    import json
    import subprocess
    import sys

    folder = tmp_path / "tiny"
    run = subprocess.run([sys.executable, "-m", "pdcore.vllm.tiny_model", str(folder)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                   "tokenizer_config.json"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    assert len(tok) == config["vocab_size"] and tok.eos_token_id == config["eos_token_id"]
    assert tok.decode(tok("transfers")["input_ids"]) == "transfers"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("assistant: ")
