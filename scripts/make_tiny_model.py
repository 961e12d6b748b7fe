#!/usr/bin/env python3
"""Write a small Qwen2 model with REAL (random, seeded) bf16 weights.

Usage: python scripts/make_tiny_model.py OUT_DIR [--seed 0] [--layers 4]
       [--hidden 2048] [--heads 16] [--kv-heads 2] [--intermediate 5632]
       python scripts/make_tiny_model.py OUT_DIR --arch gpt-oss|gemma2|gemma3|mistral
       [--seed 0] [--layers N] [--hidden H] [--sliding-window W]

``--arch`` writes a few-layer model with the attention of that family instead, built by
transformers from its config class with seeded random weights (``ARCHS``): gpt-oss
(attention sinks, 128-token sliding window on every other layer, head size 64, GQA 8,
a small MoE), Gemma 2 (logit soft cap 50, 4096 window on every other layer, head size
256), Gemma 3 (1024 window on 5 of every 6 layers, head size 256), Mistral v0.1 (4096
window on every layer, head size 128, GQA 4).

Default shape: 4 layers, hidden 2048, 16 q heads, 2 KV heads (GQA 8),
head_dim 128, intermediate 5632, vocab 152064, untied lm_head, rope_theta 1e6.
Weights: every matrix and bias ~ N(0, 0.02^2), every RMSNorm weight = 1,
generated on the CPU from a seeded ``torch.Generator`` in a fixed order (the
output is bit-identical for a given seed and shape) and written as one
``model.safetensors`` in bf16, with ``config.json``, ``generation_config.json``
and the same offline tokenizer as ``make_demo_model.py``.  Used by the
end-to-end agreement check (``scripts/e2e_agreement.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_demo_model import (  # noqa: E402
    QWEN25_7B_CONFIG,
    generation_config,
    write_json,
    write_tokenizer,
)

INIT_STD = 0.02

#: --arch: (transformers config class, its small shape).  Layer kinds (sliding / full)
#: follow the class's own default pattern for the layer count.
ARCHS = {
    "gpt-oss": ("GptOssConfig", dict(num_hidden_layers=4, hidden_size=512, intermediate_size=512,
                                     num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=128)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                    query_pre_attn_scalar=256, sliding_window=4096)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, hidden_size=512,
                                        intermediate_size=1024, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=1024)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=4, hidden_size=1024,
                                      intermediate_size=2048, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=128, sliding_window=4096)),
}


def arch_config(arch: str, layers=None, hidden=None, sliding_window=None):
    """The transformers config of a small ``arch`` model, with the demo tokenizer's vocab
    and special tokens (positions and RoPE: the family's own)."""
    import transformers
    cls, shape = ARCHS[arch]
    kw = {**shape, "vocab_size": QWEN25_7B_CONFIG["vocab_size"],
          "bos_token_id": QWEN25_7B_CONFIG["bos_token_id"],
          "eos_token_id": QWEN25_7B_CONFIG["eos_token_id"],
          "pad_token_id": QWEN25_7B_CONFIG["eos_token_id"],
          "initializer_range": INIT_STD}
    for key, value in (("num_hidden_layers", layers), ("hidden_size", hidden),
                       ("sliding_window", sliding_window)):
        if value is not None:
            kw[key] = value
    return getattr(transformers, cls)(**kw)


def write_arch_model(arch: str, out_dir: str, seed: int, **shape) -> int:
    """Build ``arch`` with seeded random weights and save it in bf16; returns its
    parameter count."""
    import torch
    from transformers import AutoModelForCausalLM
    cfg = arch_config(arch, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def tiny_config(layers: int, hidden: int, heads: int, kv_heads: int,
                intermediate: int, max_pos: int) -> dict:
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    # the demo model's Qwen2.5 config with the small shape swapped in
    return {
        **QWEN25_7B_CONFIG,
        "hidden_size": hidden,
        "initializer_range": INIT_STD,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_pos,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
    }


def weight_shapes(cfg: dict):
    """(name, shape, kind) in the fixed generation order; kind is 'normal' or 'ones'."""
    h = cfg["hidden_size"]
    d = cfg["head_dim"]
    nq = cfg["num_attention_heads"] * d
    nkv = cfg["num_key_value_heads"] * d
    inter = cfg["intermediate_size"]
    v = cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), "ones"),
            (p + "self_attn.q_proj.weight", (nq, h), "normal"),
            (p + "self_attn.q_proj.bias", (nq,), "normal"),
            (p + "self_attn.k_proj.weight", (nkv, h), "normal"),
            (p + "self_attn.k_proj.bias", (nkv,), "normal"),
            (p + "self_attn.v_proj.weight", (nkv, h), "normal"),
            (p + "self_attn.v_proj.bias", (nkv,), "normal"),
            (p + "self_attn.o_proj.weight", (h, nq), "normal"),
            (p + "post_attention_layernorm.weight", (h,), "ones"),
            (p + "mlp.gate_proj.weight", (inter, h), "normal"),
            (p + "mlp.up_proj.weight", (inter, h), "normal"),
            (p + "mlp.down_proj.weight", (h, inter), "normal"),
        ]
    out += [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "normal")]
    return out


def make_weights(cfg: dict, seed: int):
    import torch
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    tensors = {}
    for name, shape, kind in weight_shapes(cfg):
        if kind == "ones":
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.float32)
            t.normal_(0.0, INIT_STD, generator=gen)
            tensors[name] = t.to(torch.bfloat16)
    return tensors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=("qwen2", *ARCHS), default="qwen2")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="--arch: the window of the sliding layers (default: the family's)")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (gemma3 6)")
    ap.add_argument("--hidden", type=int, default=None, help="default 2048 (--arch: its own)")
    ap.add_argument("--heads", type=int, default=None, help="default 16 (not with --arch)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 2 (not with --arch)")
    ap.add_argument("--intermediate", type=int, default=None,
                    help="default 5632 (not with --arch)")
    ap.add_argument("--max-position-embeddings", type=int, default=32768)
    args = ap.parse_args(argv)
    given = [f for f in ("heads", "kv_heads", "intermediate") if getattr(args, f) is not None]
    if args.arch != "qwen2" and given:
        ap.error(f"--arch {args.arch} has its family's shape; drop --"
                 + ", --".join(f.replace("_", "-") for f in given))
    if args.arch == "qwen2" and args.sliding_window is not None:
        ap.error("--sliding-window needs --arch")

    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.out_dir, exist_ok=True)
    if args.arch != "qwen2":
        n = write_arch_model(args.arch, args.out_dir, args.seed, layers=args.layers,
                             hidden=args.hidden, sliding_window=args.sliding_window)
        write_json(os.path.join(args.out_dir, "generation_config.json"), generation_config())
        write_tokenizer(args.out_dir, 0, args.max_position_embeddings)
        print(f"wrote tiny {args.arch} ({n / 1e6:.1f}M params, seed {args.seed}) to {args.out_dir}")
        return 0
    def arg(value, default):
        return default if value is None else value
    cfg = tiny_config(arg(args.layers, 4), arg(args.hidden, 2048), arg(args.heads, 16),
                      arg(args.kv_heads, 2), arg(args.intermediate, 5632),
                      args.max_position_embeddings)
    tensors = make_weights(cfg, args.seed)
    n_params = sum(t.numel() for t in tensors.values())
    save_file(tensors, os.path.join(args.out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    write_json(os.path.join(args.out_dir, "config.json"), cfg)
    write_json(os.path.join(args.out_dir, "generation_config.json"), generation_config())
    write_tokenizer(args.out_dir, 0, args.max_position_embeddings)
    print(f"wrote tiny Qwen2 ({n_params / 1e6:.1f}M params, seed {args.seed}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
