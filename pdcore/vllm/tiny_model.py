"""A tiny Llama to try the connector with: ``python -m pdcore.vllm.tiny_model DIR [--seed N]``.

It writes a model folder vLLM serves (``--model DIR``): ``config.json``, seeded weights
(``model.safetensors``), and a byte-level tokenizer with a chat template (``tokenizer.json``,
``tokenizer_config.json``: what ``/v1/chat/completions`` and text prompts need; without one, serve
with ``--skip-tokenizer-init`` and send token ids). What vLLM's CPU backend takes, which this model
keeps to: a head size it supports (32 here; it refuses smaller ones, and takes 32, 64, 80, 96, 112,
128, 256), a block size that is a multiple of 32 (``--block-size 32``), ``--dtype float32``.

Why seeded random weights (std 0.2) and not ``load_format="dummy"``: vLLM's dummy weights are
about ±1e-3, so the logits hardly depend on the context and a decode that ignored the
transferred KV would still pick the reference's tokens; with these the tokens do depend on
every cached key and value, which the end-to-end run's negative control proves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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


def weights(seed: int) -> dict[str, Any]:
    """Every parameter of the model, drawn from ``seed`` (norm weights are ones)."""
    import torch

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


SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1 (bos), 2 (eos), as config() says
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def tokenizer(folder: Path) -> None:
    """A byte-level tokenizer of ``VOCAB`` ids (the specials, the 256 bytes, then fillers a random model may
    still produce), and a plain chat template: enough for text prompts and chat to work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))  # (the fillers are plain tokens: they decode as their names)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 512, "chat_template": CHAT_TEMPLATE,
    }, indent=1))


def write(folder: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """Write config.json, model.safetensors and (``with_tokenizer``) the tokenizer into ``folder``; returns it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config(), indent=1))
    save_file({k: v.contiguous() for k, v in weights(seed).items()}, str(folder / "model.safetensors"))
    if with_tokenizer:
        tokenizer(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcore.vllm.tiny_model", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="where to write the model (created)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    p.add_argument("--no-tokenizer", action="store_true", help="weights only (serve with --skip-tokenizer-init)")
    args = p.parse_args(argv)
    print(write(args.folder, args.seed, not args.no_tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
