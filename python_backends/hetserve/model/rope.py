"""Rotary position embeddings: one function maps a checkpoint's RoPE spec to its frequencies, for every engine.

The spec is the normalised dict `LlamaConfig.rope` (model/config.py): {"type": ..., "theta": ..., params}. Types:
  default       inv_freq = theta ** (-2i / D)
  linear        inv_freq / factor
  dynamic       NTK-aware base growth past max_position_embeddings. Within max_position_embeddings it *is*
                `default` (transformers recomputes the base only once a sequence grows past it, re-rotating with a
                length-dependent base that a KV cache cannot reproduce), so we serve it up to there and no further:
                `served_max_position` caps the context, and a longer request is refused like any over-long one.
  llama3        Llama 3.1's wavelength-banded scaling (factor, low/high_freq_factor, original_max_position)
  yarn          YaRN ramp between interpolated and extrapolated frequencies + attention factor on cos/sin
  freq_factors  explicit per-frequency divisors (GGUF `rope_freqs.weight`, what llama.cpp's converter writes for
                Llama 3): inv_freq / factors
Anything else is refused by name (UnsupportedRope). All arithmetic is float32 in transformers' order, so the
tables equal what transformers computes (the engines' FP32 tokens are compared with it).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import numpy as np

SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")


class UnsupportedRope(ValueError):
    """A rope type or parameter this server does not implement (the message names it)."""


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def _need(spec: dict, *keys: str) -> None:
    missing = [k for k in keys if spec.get(k) is None]
    if missing:
        raise UnsupportedRope(f"rope type {spec['type']!r} needs {missing} (got {sorted(spec)})")


def _default(spec: dict, dim: int) -> Tuple[np.ndarray, float]:
    return _base_inv_freq(spec["theta"], dim), 1.0


def _linear(spec: dict, dim: int) -> Tuple[np.ndarray, float]:
    _need(spec, "factor")
    return (_base_inv_freq(spec["theta"], dim) / np.float32(spec["factor"])).astype(np.float32), 1.0


def _llama3(spec: dict, dim: int) -> Tuple[np.ndarray, float]:
    _need(spec, "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    inv = _base_inv_freq(spec["theta"], dim)
    factor, lo, hi = float(spec["factor"]), float(spec["low_freq_factor"]), float(spec["high_freq_factor"])
    old = float(spec["original_max_position_embeddings"])
    lo_wl, hi_wl = old / lo, old / hi
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > lo_wl, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(lo)) / np.float32(hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: dict, dim: int) -> Tuple[np.ndarray, float]:
    _need(spec, "factor", "original_max_position_embeddings")
    base, factor = float(spec["theta"]), float(spec["factor"])
    orig = float(spec["original_max_position_embeddings"])
    att = spec.get("attention_factor")
    if att is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        att = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = float(spec.get("beta_fast") or 32), float(spec.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_w = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    inv_ex, inv_in = (1.0 / pos_freqs).astype(np.float32), (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (inv_in * (1 - extra_w) + inv_ex * extra_w).astype(np.float32), float(att)


def _freq_factors(spec: dict, dim: int) -> Tuple[np.ndarray, float]:
    _need(spec, "factors")
    f = np.asarray(spec["factors"], np.float32)
    if f.shape != (dim // 2,):
        raise UnsupportedRope(f"rope_freqs has {f.size} factors; head_dim {dim} needs {dim // 2}")
    return (_base_inv_freq(spec["theta"], dim) / f).astype(np.float32), 1.0


ROPE_TYPES: Dict[str, Callable[[dict, int], Tuple[np.ndarray, float]]] = {
    "default": _default, "linear": _linear, "dynamic": _default, "llama3": _llama3, "yarn": _yarn,
    "freq_factors": _freq_factors,
}
assert tuple(ROPE_TYPES) == SUPPORTED


def inv_freq(spec: dict, head_dim: int) -> Tuple[np.ndarray, float]:
    """(inv_freq float32 [head_dim / 2], attention factor that multiplies cos and sin) for a rope spec."""
    fn = ROPE_TYPES.get(spec.get("type", "default"))
    if fn is None:
        raise UnsupportedRope(f"rope type {spec.get('type')!r} is not implemented (supported: {', '.join(SUPPORTED)})")
    return fn(spec, head_dim)


def served_max_position(spec: dict, max_position: int) -> int:
    """The context served for this rope spec: max_position, except where only a shorter one is exact."""
    if spec.get("type") == "dynamic" and spec.get("max_position_embeddings"):
        return min(max_position, int(spec["max_position_embeddings"]))
    return max_position


def tables(spec: dict, head_dim: int, max_pos: int) -> Tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [max_pos, head_dim / 2], computed like transformers (float32 position x inv_freq, cos/sin,
    times the attention factor): what the fused graph's caches and the native engine read per position."""
    inv, att = inv_freq(spec, head_dim)
    freqs = np.arange(max_pos, dtype=np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    if att != 1.0:
        cos, sin = (cos * np.float32(att)).astype(np.float32), (sin * np.float32(att)).astype(np.float32)
    return cos, sin
