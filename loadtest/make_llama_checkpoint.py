"""Seeded random-weight checkpoints with the shapes of Llama 3.2 1B / 3B (nothing downloads here).

  python3 loadtest/make_llama_checkpoint.py --shape 1b --out /tmp/llama1b        # HF dir, bf16 safetensors
  python3 loadtest/make_llama_checkpoint.py --shape 1b --out /tmp/llama1b --gguf # + /tmp/llama1b/model-f16.gguf

Config as published for meta-llama/Llama-3.2-{1B,3B}-Instruct (llama3 RoPE scaling, tied embeddings, GQA 8 KV
heads, vocab 128256). The tokenizer is the default model's (byte-level BPE, 49,152 ids; the model's vocabulary
is larger, as Qwen's padded vocabularies are); weights N(0, 0.02) in bf16, norms 1. The GGUF is the same weights
in f16 with llama.cpp's converter layout (q/k rows permuted, `rope_freqs` for the llama3 scaling), written one
tensor at a time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python_backends"), str(ROOT / "tests")]

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
}
COMMON = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, hidden_act="silu", attention_bias=False,
              mlp_bias=False, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"], model_type="llama")


def tensors(cfg: dict):
    """(HF name, shape) in file order."""
    C, F, H, KVH, D = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim"))
    yield "model.embed_tokens.weight", (cfg["vocab_size"], C)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (C,)
        yield p + "self_attn.q_proj.weight", (H * D, C)
        yield p + "self_attn.k_proj.weight", (KVH * D, C)
        yield p + "self_attn.v_proj.weight", (KVH * D, C)
        yield p + "self_attn.o_proj.weight", (C, H * D)
        yield p + "post_attention_layernorm.weight", (C,)
        yield p + "mlp.gate_proj.weight", (F, C)
        yield p + "mlp.up_proj.weight", (F, C)
        yield p + "mlp.down_proj.weight", (C, F)
    yield "model.norm.weight", (C,)


def value(name: str, shape, seed: int):
    """The bf16 tensor `name` (a torch tensor), the same for every call with the same seed."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def write_hf(out: Path, cfg: dict, seed: int) -> None:
    from safetensors.torch import save_file
    from zoo import tokenizer_json

    from hetserve.model.checkpoint import load_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({n: value(n, s, seed) for n, s in tensors(cfg)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tokenizer_json())
    tmpl = load_checkpoint(None).chat_template
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": tmpl, "add_bos_token": False}))


def write_gguf(path: Path, hf_dir: Path, cfg: dict, seed: int) -> None:
    import gguf
    from zoo import _permute, add_gguf_tokenizer, llama3_rope_freqs

    rs = cfg["rope_scaling"]
    H, KVH, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(path.stem)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_gguf_tokenizer(w, (hf_dir / "tokenizer.json").read_text(), cfg["vocab_size"], "gpt2",
                       cfg["bos_token_id"], [cfg["eos_token_id"]])
    from hetserve.model.checkpoint import load_checkpoint

    w.add_chat_template(load_checkpoint(None).chat_template)
    w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg["rope_theta"], D, rs["factor"], rs["low_freq_factor"],
                                                        rs["high_freq_factor"],
                                                        rs["original_max_position_embeddings"]))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for n, shape in tensors(cfg):
        if n in names:
            g = names[n]
        else:
            _, _, idx, rest = n.split(".", 3)
            g = f"blk.{idx}.{layer[rest.rsplit('.', 1)[0]]}.weight"
        a = value(n, shape, seed).float().numpy()
        if ".attn_q." in g or ".attn_k." in g:
            a = _permute(a, H if ".attn_q." in g else KVH)
        # norms stay f32 as llama.cpp's converter writes 1-D tensors
        w.add_tensor(g, a.astype(np.float16) if a.ndim == 2 else a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", action="store_true", help="also <out>/model-f16.gguf (same weights, f16)")
    a = ap.parse_args()
    cfg = {**COMMON, **SHAPES[a.shape]}
    out = Path(a.out)
    if not (out / "model.safetensors").exists():
        write_hf(out, cfg, a.seed)
    if a.gguf and not (out / "model-f16.gguf").exists():
        write_gguf(out / "model-f16.gguf", out, cfg, a.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
