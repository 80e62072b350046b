"""KV wire format shared by every transport.

A transfer is (header, payload). The payload is one contiguous byte buffer: K then V, each laid out
[layers, kv_heads, tokens, head_dim] in the wire dtype, followed for int8 by float32 scales
[2, layers, kv_heads] (symmetric, one scale per layer and head over all tokens and head_dim).
The header is JSON: model compat hash, layout, dtype, scale scheme, shape, token count, crc32 of the payload.
The receiver refuses any mismatch with a clear error instead of decoding garbage.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..engines.manifest import KV_LAYOUT

WIRE_VERSION = 1
DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}


class KVWireError(ValueError):
    """Handshake or integrity failure; the message says what differs."""


@dataclass
class KVHeader:
    compat_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    num_tokens: int
    head_dim: int
    checksum: int
    nbytes: int
    layout: str = KV_LAYOUT
    scale_scheme: str = "none"
    version: int = WIRE_VERSION

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw) -> "KVHeader":
        try:
            d = json.loads(raw if isinstance(raw, (str, bytes)) else bytes(raw))
            return cls(**d)
        except (ValueError, TypeError) as e:
            raise KVWireError(f"malformed KV header: {e}") from None

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)


def payload_nbytes(dtype: str, L: int, H: int, T: int, D: int) -> int:
    n = 2 * L * H * T * D * np.dtype(DTYPES[dtype]).itemsize
    if dtype == "int8":
        n += 2 * L * H * 4
    return n


def encode(k: np.ndarray, v: np.ndarray, compat_hash: str, dtype: str = "fp32") -> Tuple[KVHeader, np.ndarray]:
    """k, v: float [L, KVH, T, D] -> (header, uint8 payload)."""
    if dtype not in DTYPES:
        raise KVWireError(f"unknown KV wire dtype {dtype!r}; use one of {sorted(DTYPES)}")
    if k.shape != v.shape or k.ndim != 4:
        raise KVWireError(f"K/V shapes differ or are not 4-D: {k.shape} vs {v.shape}")
    L, H, T, D = k.shape
    if dtype == "int8":
        kv = np.stack([k, v]).astype(np.float32)  # [2,L,H,T,D]
        amax = np.abs(kv).max(axis=(3, 4))  # [2,L,H]
        scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(kv / scales[..., None, None]), -127, 127).astype(np.int8)
        payload = np.concatenate([q.reshape(-1).view(np.uint8), scales.reshape(-1).view(np.uint8)])
        scheme = "per-head-symmetric"
    else:
        dt = DTYPES[dtype]
        payload = np.concatenate([np.ascontiguousarray(k, dtype=dt).reshape(-1).view(np.uint8),
                                  np.ascontiguousarray(v, dtype=dt).reshape(-1).view(np.uint8)])
        scheme = "none"
    hdr = KVHeader(compat_hash=compat_hash, dtype=dtype, num_layers=L, num_kv_heads=H, num_tokens=T,
                   head_dim=D, checksum=zlib.crc32(payload), nbytes=int(payload.nbytes), scale_scheme=scheme)
    return hdr, payload


def verify(hdr: KVHeader, payload: np.ndarray, expect_hash: str, expect_shape: Tuple[int, int, int]) -> None:
    """expect_shape = (layers, kv_heads, head_dim) of the receiving engine."""
    if hdr.version != WIRE_VERSION:
        raise KVWireError(f"KV wire version {hdr.version} != {WIRE_VERSION}")
    if hdr.compat_hash != expect_hash:
        raise KVWireError(f"KV model hash mismatch: sender {hdr.compat_hash} != receiver {expect_hash} "
                          "(prefill and decode engines were built from different checkpoints/configs)")
    if hdr.layout != KV_LAYOUT:
        raise KVWireError(f"KV layout mismatch: sender {hdr.layout!r} != receiver {KV_LAYOUT!r}")
    if hdr.dtype not in DTYPES:
        raise KVWireError(f"unsupported KV dtype {hdr.dtype!r}")
    L, H, D = expect_shape
    if (hdr.num_layers, hdr.num_kv_heads, hdr.head_dim) != (L, H, D):
        raise KVWireError(f"KV shape mismatch: sender (layers,kv_heads,head_dim)="
                          f"{(hdr.num_layers, hdr.num_kv_heads, hdr.head_dim)} != receiver {(L, H, D)}")
    if hdr.num_tokens <= 0:
        raise KVWireError("KV transfer has no tokens")
    want = payload_nbytes(hdr.dtype, L, H, hdr.num_tokens, D)
    if hdr.nbytes != want or payload.nbytes != want:
        raise KVWireError(f"KV payload size {payload.nbytes} B (header says {hdr.nbytes}) != expected {want} B")
    crc = zlib.crc32(payload)
    if crc != hdr.checksum:
        raise KVWireError(f"KV checksum mismatch: got crc32 {crc:#010x}, header {hdr.checksum:#010x} "
                          "(corrupted in transit)")


def decode(hdr: KVHeader, payload: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """payload (verified) -> float32 k, v [L, KVH, T, D]."""
    shape = hdr.shape
    n = int(np.prod(shape))
    buf = np.asarray(payload, dtype=np.uint8).reshape(-1)
    if hdr.dtype == "int8":
        q = buf[:2 * n].view(np.int8).reshape((2,) + shape)
        scales = buf[2 * n:].view(np.float32).reshape(2, shape[0], shape[1])
        kv = q.astype(np.float32) * scales[..., None, None]
        return kv[0], kv[1]
    dt = DTYPES[hdr.dtype]
    isz = np.dtype(dt).itemsize
    k = buf[:n * isz].view(dt).reshape(shape).astype(np.float32)
    v = buf[n * isz:2 * n * isz].view(dt).reshape(shape).astype(np.float32)
    return k, v
