"""The model config every engine reads (LlamaConfig), and the one place that turns a checkpoint's config into it.

Refuse, never guess: every key of a Hugging Face `config.json` is either implemented here (HANDLED), known not to
change the math (HARMLESS), or the build fails naming the key and its value (UnsupportedConfig). A silently ignored
field (RoPE scaling, a sliding window, a bias) gives fluent wrong answers, so an unknown key is an error, not a
warning. GGUF metadata is read the same way in checkpoint.py (GGUF_HANDLED / GGUF_HARMLESS).

Semantics follow transformers per architecture (a Llama config's `sliding_window` is ignored by transformers'
Llama, so it is here too; Mistral applies it to every layer; Qwen2 per `layer_types` / `max_window_layers`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

from . import rope as rope_mod


class CheckpointError(ValueError):
    """The checkpoint cannot be read (missing files, tensors, shapes)."""


class UnsupportedConfig(CheckpointError):
    """A config key/value that changes the math and is not implemented; the message names it."""


# model_type -> architecture family (what the engines implement)
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

# keys implemented below (each changes the math and is honoured by every engine)
HANDLED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "tie_word_embeddings", "max_position_embeddings", "model_type", "bos_token_id", "eos_token_id",
}
# keys that do not change the forward pass (training, bookkeeping, generic PretrainedConfig fields)
HARMLESS = {
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "name_or_path",
    "pad_token_id", "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "embd_pdrop",
    "resid_pdrop", "pretraining_tp", "output_hidden_states", "output_attentions", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "torchscript",
    "use_return_dict", "unsloth_version", "unsloth_fixed", "bad_words_ids", "decoder_start_token_id",
    "sep_token_id", "cross_attention_hidden_size", "max_length", "num_labels", "use_bfloat16", "pruned_heads",
}
# rope parameters each type reads (anything else inside rope_scaling / rope_parameters is refused)
ROPE_KEYS = {
    "default": set(), "linear": {"factor"}, "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """What the engines implement: a Llama-family decoder (Llama, Mistral, Qwen2)."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position: int  # the context served (model/rope.served_max_position)
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_ids: tuple
    name: str = "llama"
    arch: str = "llama"
    rope: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "default", "theta": 10000.0})
    layer_windows: tuple = ()  # per layer: attend to the last N positions (self included); 0 = all
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)

    @property
    def rope_theta(self) -> float:
        return float(self.rope["theta"])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_windows"] = list(self.layer_windows)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        if "rope_theta" in d:  # manifests before the rope spec
            d.setdefault("rope", {"type": "default", "theta": float(d.pop("rope_theta"))})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_windows"] = tuple(d.get("layer_windows", ()))
        return cls(**d)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _refuse(key: str, value: Any, why: str = "not implemented by hetserve's engines") -> UnsupportedConfig:
    return UnsupportedConfig(f"config key {key!r} = {value!r}: {why}; refusing to build rather than serve a model "
                             "that would compute something else")


def rope_spec_from_hf(hf: dict, where: str) -> Dict[str, Any]:
    """The normalised rope spec of an HF config: transformers 4 `rope_theta` + `rope_scaling`, or transformers 5
    `rope_parameters` (theta inside)."""
    params = hf.get("rope_parameters")
    key = "rope_parameters"
    if not params:
        params, key = hf.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        raise _refuse(key, params, "expected a mapping")
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise _refuse(key, sorted(params), "per-layer-type rope parameters")
    rtype = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    if rtype not in ROPE_KEYS:
        raise _refuse(f"{key}.rope_type", rtype, f"rope type not implemented (supported: {', '.join(ROPE_KEYS)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(f"{key}.partial_rotary_factor", params["partial_rotary_factor"])
    params.pop("partial_rotary_factor", None)
    extra = sorted(set(params) - ROPE_KEYS[rtype])
    if extra:
        raise _refuse(f"{key}.{extra[0]}", params[extra[0]], f"unknown parameter of rope type {rtype!r}")
    spec: Dict[str, Any] = {"type": rtype, "theta": float(theta), **params}
    if rtype == "llama3":
        spec.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rtype == "yarn":
        spec.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rtype == "dynamic":
        spec["max_position_embeddings"] = int(hf.get("max_position_embeddings", 2048))
    try:
        rope_mod.inv_freq(spec, 2)  # required parameters present
    except rope_mod.UnsupportedRope as e:
        raise UnsupportedConfig(f"{where}: {e}") from None
    return spec


def _layer_windows(hf: dict, arch: str, n_layers: int) -> Tuple[int, ...]:
    sw = hf.get("sliding_window")
    if arch == "llama" or not sw:
        return (0,) * n_layers  # transformers' Llama has no window whatever the config says
    if arch == "mistral":
        if hf.get("layer_types"):
            raise _refuse("layer_types", hf["layer_types"], "Mistral with alternating attention layers")
        return (int(sw),) * n_layers
    # qwen2: per layer_types, or windows from max_window_layers on when use_sliding_window
    types = hf.get("layer_types")
    if not hf.get("use_sliding_window", False):
        return (0,) * n_layers
    if not types:
        mwl = int(hf.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad or len(types) != n_layers:
        raise _refuse("layer_types", types, "expected one of full_attention / sliding_attention per layer")
    return tuple(int(sw) if t == "sliding_attention" else 0 for t in types)


def architecture(hf: dict, where: str) -> str:
    """The family an HF config's model_type belongs to, or UnsupportedConfig naming it."""
    mt = hf.get("model_type")
    arch = ARCHITECTURES.get(mt or "")
    if arch is None:
        raise UnsupportedConfig(f"{where}: unsupported model_type {mt!r} (supported: {', '.join(ARCHITECTURES)})")
    return arch


def from_hf(hf: dict, where: str, eos_ids: tuple, has_lm_head: bool, name: str) -> LlamaConfig:
    """LlamaConfig from an HF config.json (as a dict), refusing what the engines do not implement."""
    mt = hf.get("model_type")
    arch = architecture(hf, where)
    if "quantization_config" in hf:
        raise _refuse("quantization_config", hf["quantization_config"].get("quant_method", "?"),
                      "pre-quantized checkpoints (GPTQ/AWQ/...) are not read; give the full-precision weights or "
                      "a GGUF")
    unknown = sorted(k for k in hf if k not in HANDLED and k not in HARMLESS)
    if unknown:
        raise _refuse(unknown[0], hf[unknown[0]], f"unknown key for model_type {mt!r} (known keys: "
                      "model/config.py HANDLED / HARMLESS)")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "only silu (SwiGLU) MLPs")
    if arch == "llama":
        if hf.get("layer_types") and set(hf["layer_types"]) != {"full_attention"}:
            raise _refuse("layer_types", hf["layer_types"], "Llama with sliding layers")
    n_head = int(hf["num_attention_heads"])
    n_layers = int(hf["num_hidden_layers"])
    spec = rope_spec_from_hf(hf, where)
    max_pos = int(hf.get("max_position_embeddings", 2048))
    qkv_bias = arch == "qwen2" or bool(hf.get("attention_bias", False))
    if arch != "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise _refuse("attention_bias" if hf.get("attention_bias") else "mlp_bias", True,
                      f"not a {mt} config field (transformers' {mt} model ignores it)")
    return LlamaConfig(
        num_layers=n_layers,
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_heads=n_head,
        num_kv_heads=int(hf.get("num_key_value_heads") or n_head),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_head),
        vocab_size=int(hf["vocab_size"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=rope_mod.served_max_position(spec, max_pos),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", not has_lm_head)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
        arch=arch,
        rope=spec,
        layer_windows=_layer_windows(hf, arch, n_layers),
        qkv_bias=qkv_bias,
        o_bias=arch == "llama" and bool(hf.get("attention_bias", False)),
        mlp_bias=arch == "llama" and bool(hf.get("mlp_bias", False)),
    )
