"""The tiny Llama the vLLM end-to-end run serves: a local folder, seeded weights, no tokenizer.

Why seeded random weights (std 0.2) and not ``load_format="dummy"``: vLLM's dummy weights are
about ±1e-3, so the logits hardly depend on the context and a decode that ignored the
transferred KV would still pick the reference's tokens; with these the tokens do depend on
every cached key and value, which the negative control proves. head_dim is 32 because vLLM's
CPU attention refuses smaller heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
VOCAB = 512
FF = 128


def config() -> dict:
    """The model's config.json (LlamaForCausalLM)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the model, drawn from ``seed`` (norm weights are ones)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    out = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN),
           "lm_head.weight": rnd(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        out[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        out[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        out[p + "mlp.gate_proj.weight"] = rnd(FF, HIDDEN)
        out[p + "mlp.up_proj.weight"] = rnd(FF, HIDDEN)
        out[p + "mlp.down_proj.weight"] = rnd(HIDDEN, FF)
    return out


def write(folder: Path, seed: int = 0) -> Path:
    """Write config.json and model.safetensors into ``folder`` (created); returns it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config(), indent=1))
    save_file({k: v.contiguous() for k, v in weights(seed).items()}, str(folder / "model.safetensors"))
    return folder
