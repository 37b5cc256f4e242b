"""One offline vLLM instance of the end-to-end run: ``reference`` (alone, no connector), or the
``prefill``/``decode`` half of an offline pair joined by pdcore (``pdcore.vllm.offline``).

``python instance.py ROLE MODEL PROMPTS.json OUT.json [BOOTSTRAP_PORT FIRST_ROOM]``: greedy, 8
tokens a request; writes each request's token ids (decode, reference) to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256, block_size=32)
MAX_TOKENS = 8


def main(argv: list[str]) -> int:
    role, model, prompts_path, out_path = argv[:4]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(prompts_path).read())
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    kwargs: dict = dict(ENGINE)
    if role != "reference":
        from vllm.config import KVTransferConfig

        from pdcore.vllm.offline import finish_transfers, pd_sampling_params

        port, first_room = int(argv[4]), int(argv[5])
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PdcoreConnector", kv_connector_module_path="pdcore.vllm.connector",
            kv_role="kv_producer" if role == "prefill" else "kv_consumer", kv_load_failure_policy="fail",
            kv_connector_extra_config={"bootstrap_port": port})
        kwargs["enable_prefix_caching"] = role == "prefill"
        prefill_sp, decode_sp = pd_sampling_params(sp, len(prompts), f"127.0.0.1:{port}", first_room)
    llm = LLM(model=model, **kwargs)
    if role == "prefill":
        llm.generate(inputs, prefill_sp, use_tqdm=False)
        left = finish_transfers(llm, timeout=180.0)
        json.dump({"left": left}, open(out_path, "w"))
        return 1 if left else 0
    started = time.monotonic()
    outs = llm.generate(inputs, decode_sp if role == "decode" else sp, use_tqdm=False)
    json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs],
               "finish": [o.outputs[0].finish_reason for o in outs], "seconds": time.monotonic() - started},
              open(out_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
