"""``make vllm``'s end-to-end run: vLLM prefill and decode servers joined by pdcore, against one instance.

What runs (separate processes; every wait has a deadline, a process that dies fails the run
with its log's tail):

1. the tiny model with seeded weights (``tiny_model.py``); one instance alone for the
   reference tokens (``instance.py reference``), while the servers start;
2. a prefill server (``kv_producer``) and a decode server (``kv_consumer``, no prefix caching,
   ``kv_load_failure_policy=recompute``) joined over TCP with a secret (the prefill side reads it
   from ``kv_connector_extra_config``, decode from ``PDCORE_SECRET_FILE``), and the router
   (``python -m pdcore.vllm.router``) in front;
3. the batch: prompts of lengths that are not multiples of the block size (32), up to 7 blocks,
   all at once through the router, half of them streamed: decode's tokens must equal the
   reference's for every one;
4. the negative control: one request gets one transferred page overwritten on purpose
   (``negative_control.py``): its tokens must differ;
5. cancellations: a request waiting for its KV whose client goes away, and a streamed one
   cancelled through the router, while others run: the others are intact and both servers end
   with no request and no KV block held;
6. a request whose transfer cannot happen (no bootstrap server at its address) is recomputed
   (``kv_load_failure_policy=recompute``): its tokens equal the reference's;
7. heterogeneous tp: the same prefill server (tp 1) feeds a decode server of tp 2 (two workers,
   one KV head each) through pdcore's planner, behind a second router: the batch again, every
   request's tokens equal to the reference's (the tp 1 decode server is stopped first: six vLLM
   processes on two cores starve pdcore's handshakes past their 5 s deadlines);
8. the prefill server killed (SIGKILL) while two requests wait for their KV on the tp 2 decode
   server (``kv_load_failure_policy=fail``): both end with an error within ``dead_after`` and
   a margin, and decode holds no block afterwards;
9. the offline pair (``pdcore.vllm.offline``): a prefill and a decode ``LLM`` in two processes.

Its closing line: ``vllm pd: N requests, M identical to one instance (...)``.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_model  # noqa: E402

BLOCK = 32
MAX_TOKENS = 8
LENGTHS = [5, 17, 31, 33, 47, 63, 65, 100, 130, 200]  # none a multiple of 32; 200 spans 7 blocks
START_DEADLINE = 420.0  # vLLM imports in 20-60 s and initialises in 10-30 s on a loaded 2-core machine
REQUEST_TIMEOUT = 120.0
DEAD_AFTER = 15.0  # decode's pdcore dead_after: how soon a killed prefill is noticed (5 s was missed under load: six vLLM processes on two cores starve the heartbeats)
BOOTSTRAP_TIMEOUT = 20.0  # decode's: how long a request whose prefill cannot be found waits for it

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the server's process: starts in seconds, not minutes
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # two instances on 2 cores: binding threads would make them collide
    "PYTHONUNBUFFERED": "1",
}

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"vllm: {msg} ({time.monotonic() - T0:.0f} s)", flush=True)


class Failure(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failure(what)


def free_port(preferred: int = 0) -> int:
    """``preferred`` if it is free (the README's commands use these ports), else any free port."""
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise Failure("no free port")


def shown(argv: list[str]) -> str:
    """A command line as a shell would take it (the README shows these)."""
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


class Proc:
    """A child process with its output in a log file; ``alive`` and ``tail`` for the failures."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._out = open(log, "wb")
        self.p = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(f"    {self.name}| {line}" for line in lines[-n:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._out.close()


def wait_for(cond: Any, deadline: float, what: str, procs: list[Proc], every: float = 0.25) -> Any:
    """Poll ``cond`` until it returns a truthy value, a watched process dies, or ``deadline`` (s) passes."""
    end = time.monotonic() + deadline
    tick = threading.Event()
    while True:
        value = cond()
        if value:
            return value
        for p in procs:
            if not p.alive():
                raise Failure(f"{p.name} exited ({p.p.returncode}) while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > end:
            raise Failure(f"{what}: not after {deadline:.0f} s")
        tick.wait(every)  # a poll interval, not a synchronisation: the condition decides


def get(port: int, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    except OSError:
        return 0, b""
    finally:
        c.close()


def gauges(port: int) -> dict[str, float]:
    status, body = get(port, "/metrics")
    out = {}
    for line in body.decode(errors="replace").splitlines():
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
            if line.startswith(f"vllm:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def idle(port: int) -> bool:
    g = gauges(port)
    return bool(g) and g.get("num_requests_waiting") == 0 and g.get("num_requests_running") == 0 and \
        g.get("kv_cache_usage_perc") == 0


def body(model: str, prompt: list[int], stream: bool = False, params: dict | None = None,
         max_tokens: int = MAX_TOKENS) -> dict:
    b: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if params is not None:
        b["kv_transfer_params"] = params
    return b


def post(port: int, b: dict, timeout: float = REQUEST_TIMEOUT) -> tuple[list[int], str]:
    """One completion: its token ids and finish reason (a stream is read to its end)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(b), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise Failure(f"completion answered {r.status}: {data[:400]!r}")
        if not b.get("stream"):
            choice = json.loads(data)["choices"][0]
            return list(choice["token_ids"]), choice["finish_reason"]
        tokens, reason = [], ""
        for line in data.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids") or []
                reason = choice.get("finish_reason") or reason
        check("data: [DONE]" in data.decode(), "a stream ended without [DONE]")
        return tokens, reason
    finally:
        c.close()


def open_request(port: int, b: dict) -> socket.socket:
    """Send a completion request on a raw socket and leave it waiting (the caller closes it: a cancel)."""
    data = json.dumps(b).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def expect_error(port: int, b: dict) -> int:
    """A completion that must fail: its HTTP status (0 if it succeeded)."""
    try:
        post(port, b)
    except Failure as e:
        msg = str(e)
        return int(msg.split("answered ", 1)[1].split(":", 1)[0]) if "answered " in msg else -1
    return 0


def batch_through(port: int, model: str, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
    """Every prompt at once through a router, half of them streamed."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(post, port, body(model, p, stream=i % 2 == 1)) for i, p in enumerate(prompts)]
        return [f.result(timeout=REQUEST_TIMEOUT + 30) for f in futures]


def start_router(python: str, prefill: int, decode: int, boot: int, port: int, log: Path, env: dict[str, str],
                 procs: list[Proc]) -> Proc:
    router = Proc(log.stem, [python, "-m", "pdcore.vllm.router", "--prefill", f"http://127.0.0.1:{prefill}",
                             "--decode", f"http://127.0.0.1:{decode}", "--bootstrap", f"127.0.0.1:{boot}",
                             "--port", str(port)], log, env)
    procs.append(router)
    print(f"vllm: {router.name}: {shown(router.p.args)}", flush=True)
    return router


def main() -> int:
    venv_python = sys.executable
    repo = HERE.parent.parent
    work = Path(tempfile.mkdtemp(prefix="pdcore-vllm-"))
    procs: list[Proc] = []
    env = {**os.environ, **ENV, "PYTHONPATH": f"{repo}{os.pathsep}{HERE}"}
    env.pop("PDCORE_SECRET_FILE", None)
    try:
        return run(venv_python, work, procs, env)
    except Failure as e:
        print(f"vllm: FAILED: {e}", flush=True)
        for p in procs:
            print(f"--- {p.name} (last lines of {p.log})\n{p.tail(25)}", flush=True)
        return 1
    finally:
        for p in procs:
            p.stop()


def run(python: str, work: Path, procs: list[Proc], env: dict[str, str]) -> int:
    model = str(tiny_model.write(work / "tiny", seed=0))
    secret = work / "pdcore.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    rng = random.Random(23)
    batch = [[rng.randrange(3, tiny_model.VOCAB) for _ in range(n)] for n in LENGTHS]
    corrupt = [rng.randrange(3, tiny_model.VOCAB) for _ in range(45)]
    waiting = [[rng.randrange(3, tiny_model.VOCAB) for _ in range(n)] for n in (40, 70, 50)]
    offline = [[rng.randrange(3, tiny_model.VOCAB) for _ in range(n)] for n in (9, 38, 77)]
    everything = batch + [corrupt] + waiting + offline
    (work / "prompts.json").write_text(json.dumps(everything))
    (work / "offline.json").write_text(json.dumps(offline))
    say(f"model and secret in {work}; {len(everything)} prompts")

    ref = Proc("reference", [python, str(HERE / "instance.py"), "reference", model, str(work / "prompts.json"),
                             str(work / "reference.json")], work / "reference.log", env)
    procs.append(ref)
    p_http, d_http, boot, r_port = free_port(8100), free_port(8200), free_port(8998), free_port(8000)
    server = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
              "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--block-size", str(BLOCK),
              "--host", "127.0.0.1"]
    prefill_cfg = {"kv_connector": "PdcoreConnector", "kv_connector_module_path": "pdcore.vllm.connector",
                   "kv_role": "kv_producer",
                   "kv_connector_extra_config": {"bootstrap_port": boot, "secret_file": str(secret),
                                                 "layerwise_min_pages": 2}}
    decode_cfg = {"kv_connector": "CorruptingConnector", "kv_connector_module_path": "negative_control",
                  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"bootstrap_timeout": BOOTSTRAP_TIMEOUT}}
    prefill = Proc("prefill", server + ["--port", str(p_http), "--kv-transfer-config", json.dumps(prefill_cfg)],
                   work / "prefill.log", env)
    decode = Proc("decode", server + ["--port", str(d_http), "--no-enable-prefix-caching",
                                      "--kv-transfer-config", json.dumps(decode_cfg)],
                  work / "decode.log", {**env, "PDCORE_SECRET_FILE": str(secret)})
    procs += [prefill, decode]
    for p in (prefill, decode):
        print(f"vllm: {p.name}: {shown(p.p.args)}", flush=True)
    say(f"started the reference instance, a prefill server (:{p_http}, bootstrap :{boot}) and a decode server "
        f"(:{d_http})")
    wait_for(lambda: get(p_http, "/health")[0] == 200 and get(d_http, "/health")[0] == 200, START_DEADLINE,
             "the prefill and decode servers to answer /health", [prefill, decode])
    router = start_router(python, p_http, d_http, boot, r_port, work / "router.log", env, procs)
    wait_for(lambda: get(r_port, "/health")[0] == 200, 60, "the router", [router, prefill, decode])
    say("servers and router up")
    wait_for(lambda: not ref.alive(), START_DEADLINE, "the reference instance", [])
    check(ref.p.returncode == 0, f"the reference instance failed:\n{ref.tail()}")
    reference = json.loads((work / "reference.json").read_text())["tokens"]
    ref_of = {tuple(p): t for p, t in zip(everything, reference)}
    say("reference tokens ready")

    # 3. the batch, all at once, half streamed
    got = batch_through(r_port, model, batch)
    identical = sum(t == ref_of[tuple(p)] for (t, _), p in zip(got, batch))
    for (t, reason), p in zip(got, batch):
        check(len(t) == MAX_TOKENS and reason == "length", f"prompt of {len(p)}: {len(t)} tokens, finish {reason!r}")
    check(identical == len(batch), f"only {identical} of {len(batch)} requests equal the reference: "
          + "; ".join(f"{len(p)} tokens: {t} vs {ref_of[tuple(p)]}" for (t, _), p in zip(got, batch)
                      if t != ref_of[tuple(p)]))
    streamed = (work / "prefill.log").read_text(errors="replace").count("sent (layer by layer)")
    check(streamed >= 1, "no request was written layer by layer (layerwise_min_pages=2)")
    say(f"batch: {identical}/{len(batch)} identical to one instance ({streamed} written layer by layer)")

    # 4. the negative control
    bad, _ = post(r_port, body(model, corrupt, params={"test_corrupt_page": True}))
    check("overwritten with noise" in (work / "decode.log").read_text(errors="replace"),
          "the negative control did not corrupt a page")
    check(bad != ref_of[tuple(corrupt)], f"a corrupted page left the tokens unchanged ({bad}): decode does not "
          "use the transferred KV")
    again, _ = post(r_port, body(model, corrupt))
    check(again == ref_of[tuple(corrupt)], f"the same prompt without corruption gave {again}")
    say("negative control: one corrupted page changed that request's tokens; without it they match")
    others = 1

    # 5. cancellations while others run
    room = random.Random().randrange(1 << 40, 1 << 62)
    fake = {"pdcore_room": room, "pdcore_bootstrap": f"127.0.0.1:{boot}"}  # a room prefill never registers
    sock = open_request(d_http, body(model, waiting[0], params=fake))
    wait_for(lambda: gauges(d_http).get("num_requests_waiting") == 1, 60, "decode to wait for the KV", [decode])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, r_port, body(model, p)) for p in batch[:3]]
        sock.close()  # the client goes away while its request waits for the transfer
        stream = open_request(r_port, body(model, waiting[2], stream=True, max_tokens=150))
        first = stream.recv(4096)  # the router's answer has begun: decode is generating
        check(first.startswith(b"HTTP/1.1 200"), f"the streamed request answered {first[:80]!r}")
        stream.close()  # cancelled through the router mid-stream
        done = [f.result(timeout=REQUEST_TIMEOUT + 30) for f in futures]
    check(all(t == ref_of[tuple(p)] for (t, _), p in zip(done, batch[:3])),
          "requests running beside the cancellations changed")
    others += len(done)
    wait_for(lambda: idle(d_http) and idle(p_http), 60, "both servers to hold no request and no block after the "
             "cancellations", [prefill, decode])
    check(json.loads(get(r_port, "/stats")[1]).get("cancelled", 0) >= 1, "the router saw no cancellation")
    say("cancelled: a request waiting for its KV and a stream through the router; the others intact, both "
        "servers idle with every block free")

    # 6. a transfer that cannot happen, under kv_load_failure_policy=recompute
    started = time.monotonic()
    lost = {"pdcore_room": room + 1, "pdcore_bootstrap": "127.0.0.1:1"}  # no bootstrap server there
    recomputed, _ = post(d_http, body(model, waiting[1], params=lost), timeout=BOOTSTRAP_TIMEOUT + 60)
    check(recomputed == ref_of[tuple(waiting[1])], f"a request recomputed after its transfer failed gave {recomputed}")
    check("failed" in (work / "decode.log").read_text(errors="replace"), "decode logged no failed transfer")
    say(f"a transfer that could not happen: recomputed (policy recompute) in {time.monotonic() - started:.0f} s, "
        "tokens as one instance's")

    # 7. heterogeneous tp: the same prefill server (tp 1) -> a decode server of tp 2, policy fail
    for p in (router, decode):
        p.stop()
    decode2_cfg = {"kv_connector": "PdcoreConnector", "kv_connector_module_path": "pdcore.vllm.connector",
                   "kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
                   "kv_connector_extra_config": {"dead_after": DEAD_AFTER}}
    d2_http, r2_port = free_port(8300), free_port(8001)
    decode2 = Proc("decode-tp2", server + ["--port", str(d2_http), "--no-enable-prefix-caching",
                                           "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                                           "--kv-transfer-config", json.dumps(decode2_cfg)],
                   work / "decode-tp2.log", {**env, "PDCORE_SECRET_FILE": str(secret)})
    procs.append(decode2)
    print(f"vllm: {decode2.name}: {shown(decode2.p.args)}", flush=True)
    wait_for(lambda: get(d2_http, "/health")[0] == 200, START_DEADLINE, "the tp 2 decode server", [decode2, prefill])
    router2 = start_router(python, p_http, d2_http, boot, r2_port, work / "router-tp2.log", env, procs)
    wait_for(lambda: get(r2_port, "/health")[0] == 200, 60, "the second router", [router2, decode2, prefill])
    got2 = batch_through(r2_port, model, batch)
    hetero = sum(t == ref_of[tuple(p)] for (t, _), p in zip(got2, batch))
    check(hetero == len(batch), f"tp 1 -> tp 2: only {hetero} of {len(batch)} requests equal the reference")
    say(f"prefill tp 1 -> decode tp 2 (pdcore's planner, one KV head per decode rank): {hetero}/{len(batch)} "
        "identical to one instance")

    # 8. the prefill server killed while two decode requests wait for their KV: policy fail, no hang
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(expect_error, d2_http, body(model, p, params={**fake, "pdcore_room": room + 2 + i}))
                   for i, p in enumerate(waiting[:2])]
        wait_for(lambda: gauges(d2_http).get("num_requests_waiting") == 2, 60, "decode to wait for two transfers",
                 [decode2])
        killed = time.monotonic()
        os.killpg(prefill.p.pid, signal.SIGKILL)
        prefill.p.wait(30)
        errors = [f.result(timeout=DEAD_AFTER + 60) for f in futures]
    took = time.monotonic() - killed
    check(all(e == 500 for e in errors), f"requests waiting on a killed prefill ended with {errors}, not an error")
    wait_for(lambda: idle(d2_http), 30, "the tp 2 decode server to hold no request and no block", [decode2])
    say(f"prefill killed: the 2 requests waiting for it failed (policy fail) in {took:.1f} s; decode holds nothing")

    # 9. the offline pair: two LLM objects in two processes
    for p in (router2, decode2):
        p.stop()
    oboot = free_port()
    first_room = random.Random().randrange(1 << 40)
    pair = [Proc(f"offline-{role}", [python, str(HERE / "instance.py"), role, model, str(work / "offline.json"),
                                     str(work / f"offline-{role}.json"), str(oboot), str(first_room)],
                 work / f"offline-{role}.log", env) for role in ("prefill", "decode")]
    procs += pair
    wait_for(lambda: not any(p.alive() for p in pair), START_DEADLINE, "the offline pair", [])
    for p in pair:
        check(p.p.returncode == 0, f"{p.name} failed:\n{p.tail()}")
    offline_tokens = json.loads((work / "offline-decode.json").read_text())["tokens"]
    offline_same = sum(t == ref_of[tuple(p)] for t, p in zip(offline_tokens, offline))
    check(offline_same == len(offline), f"offline pair: {offline_same}/{len(offline)} identical")
    say(f"offline LLM pair: {offline_same}/{len(offline)} identical")

    n = 2 * len(batch) + others + 1 + len(offline)
    m = identical + hetero + others + (recomputed == ref_of[tuple(waiting[1])]) + offline_same
    print(f"vllm pd: {n} requests, {m} identical to one instance ({len(batch)} through the router and pdcore, "
          f"{streamed} of them layer by layer, {len(batch)} from prefill tp 1 to decode tp 2, "
          f"{others} beside the negative control and the cancellations, "
          f"1 recomputed after its transfer failed, {len(offline)} through the offline pair; negative control "
          f"changed its tokens; 2 waiting on a killed prefill failed; {time.monotonic() - T0:.0f} s)", flush=True)
    return 0 if m == n else 1


if __name__ == "__main__":
    sys.exit(main())
