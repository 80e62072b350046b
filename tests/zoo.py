"""Tiny seeded random-weight checkpoints of the Llama-family variants users bring (test helper, not a test).

Each variant is made with transformers itself (its config class, its save_pretrained), so the oracle and the
checkpoint agree by construction; GGUF variants are written with the `gguf` package's writer from the same weights,
laid out the way llama.cpp's converter lays them out (llama-arch Q/K rows permuted, `rope_freqs` for Llama 3).
Weights use a larger init than transformers' 0.02 so that greedy tokens are decided by clear margins, not ties.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

import numpy as np

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, initializer_range=0.15)

# name -> (transformers config class, overrides of SMALL)
VARIANTS: Dict[str, tuple] = {
    "llama3_rope": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "yarn": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    "linear_rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "dynamic_rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "mistral_window": ("MistralConfig", dict(sliding_window=24, head_dim=16)),
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
}


def tokenizer_json() -> str:
    """The default model's tokenizer (byte-level BPE, 49152 ids), from the engine build of the default GGUF."""
    from hetserve.model.checkpoint import load_checkpoint
    from hetserve.tokenizer import Tokenizer

    ck = load_checkpoint(None)
    return Tokenizer(ck.tokenizer_spec, ck.chat_template)._tok.to_str()


def make_hf(out: Path, variant: str, seed: int = 0, tok_json: Optional[str] = None, dtype: str = "float32",
            shard_bytes: Optional[int] = None, **overrides):
    """Write a seeded random checkpoint of `variant` to `out` (HF layout); returns the transformers model (fp32,
    eval) holding exactly the weights written (rounded through `dtype` when it is 16-bit)."""
    import torch
    import transformers

    cls_name, kw = VARIANTS[variant] if variant in VARIANTS else ("LlamaConfig", {})
    cfg = getattr(transformers, cls_name)(**{**SMALL, **kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg)
    with torch.no_grad():  # biases are zero-initialised; give them values so a dropped bias shows
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model = model.eval()
    out.mkdir(parents=True, exist_ok=True)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    kw2 = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(str(out), **kw2)
    model = model.float().eval()
    (out / "tokenizer.json").write_text(tok_json or tokenizer_json())
    return model


def greedy(model, ids, n: int):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def write_hf_config_v4(out: Path, **replace) -> None:
    """Rewrite config.json the way transformers 4 wrote it (`rope_theta` + `rope_scaling`), plus `replace`."""
    p = out / "config.json"
    c = json.loads(p.read_text())
    rp = c.pop("rope_parameters", None) or {}
    c["rope_theta"] = rp.pop("rope_theta", 10000.0)
    if rp.get("rope_type", "default") != "default":
        c["rope_scaling"] = rp
    c.update(replace)
    p.write_text(json.dumps(c, indent=2))


# ---- GGUF ---------------------------------------------------------------------------------------------------------
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute() of llama-arch q/k rows (HF rotate_half -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def random_quant_rows(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Raw blocks of a K-quant (or any block type) with random codes and small valid scales: a tensor as a
    published GGUF stores it (the gguf package dequantizes K-quants but has no quantizer for them)."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    half = lambda a: np.asarray(a, np.float16).view(np.uint8).reshape(*a.shape, 2)  # noqa: E731
    nb = rows * (cols // block)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # ... d (f16) last
        raw[..., -2:] = half(rng.uniform(0.002, 0.004, nb).reshape(rows, -1))
    elif qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):  # d, dmin (f16) first
        raw[..., 0:2] = half(rng.uniform(0.004, 0.008, nb).reshape(rows, -1))
        raw[..., 2:4] = half(rng.uniform(0.002, 0.004, nb).reshape(rows, -1))
    else:
        raise ValueError(f"no random block maker for {qtype}")
    return raw.reshape(rows, -1)


def write_gguf(path: Path, hf_dir: Path, model, arch: str = "llama", qtypes: Optional[dict] = None,
               rope_freqs: Optional[np.ndarray] = None, eos_ids=(2,), tokenizer: str = "gpt2", extra_kv=None,
               split_max_tensors: int = 0, extra_tensors: Optional[Dict[str, np.ndarray]] = None):
    """A GGUF of `model` (a transformers model), laid out like llama.cpp's converter. `qtypes` maps GGUF tensor-name
    suffixes to GGML types: Q8_0/Q4_0/Q4_1/F16/BF16 are quantized from the weights; K-quants are made as random
    raw blocks and *written back into `model`* dequantized, so transformers holds exactly the GGUF's weights.
    `split_max_tensors` > 0 writes split files (`<stem>-0000i-of-0000N.gguf`) as llama.cpp's gguf-split does."""
    import gguf
    import torch

    qtypes = qtypes or {}
    cfg = model.config
    H, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name(path.stem)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    rp = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for k, v in (extra_kv or {}).items():
        getattr(w, k)(v)
    add_gguf_tokenizer(w, (hf_dir / "tokenizer.json").read_text(), cfg.vocab_size, tokenizer, cfg.bos_token_id,
                       eos_ids)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(a, np.float32))
    rng = np.random.default_rng(1)
    sd = model.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for hf_name, t in sd.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name in names:
            g = names[hf_name]
        else:
            _, _, idx, rest = hf_name.split(".", 3)
            base, _, kind = rest.rpartition(".")
            g = f"blk.{idx}." + (layer[rest] if rest in layer else f"{layer[base]}.{kind}")
        a = t.float().numpy()
        perm = None
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            perm = H if ".attn_q." in g else KVH
            a = _permute(a, perm)
        qt = next((q for suf, q in qtypes.items() if g.endswith(suf)), None) if a.ndim == 2 else None
        if qt is None:
            w.add_tensor(g, a.astype(np.float32))
            continue
        if qt in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K):
            raw = random_quant_rows(rng, a.shape[0], a.shape[1], qt)
        else:
            raw = gguf.quants.quantize(a.astype(np.float32), qt)
        deq = gguf.quants.dequantize(raw, qt).reshape(a.shape).astype(np.float32)
        w.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=qt)
        hf_w = deq if perm is None else _unpermute(deq, perm)
        with torch.no_grad():
            model.get_parameter(hf_name).copy_(torch.from_numpy(hf_w))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def add_gguf_tokenizer(w, tok_json: str, vocab_size: int, model: str, bos_id: int, eos_ids, pre: str = "smollm"):
    """Byte-level BPE tokenizer metadata from a tokenizer.json (ids past its vocabulary padded as [PADi], as
    llama.cpp's converter pads a model vocabulary larger than the tokenizer's)."""
    tok = json.loads(tok_json)
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    tokens += [f"[PAD{i}]" for i in range(vocab_size - len(tokens))]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    types = [1] * len(tokens)
    for a in tok.get("added_tokens", []):
        if a.get("special"):
            types[a["id"]] = 3
    w.add_token_types(types)
    w.add_bos_token_id(bos_id)
    w.add_eos_token_id(eos_ids[0])
    if len(eos_ids) > 1:
        w.add_eot_token_id(eos_ids[1])


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The `rope_freqs` factors llama.cpp's converter writes for a Llama 3.1 rope_scaling (per frequency: 1,
    factor, or the smooth blend's divisor)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    lo_wl, hi_wl = orig / low, orig / high
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            s = (orig / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
