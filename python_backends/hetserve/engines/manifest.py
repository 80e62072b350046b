"""Engine manifests and the KV compatibility hash.

The compatibility hash covers everything that decides what a KV tensor *means*: the checkpoint bytes, the model
shape, RoPE, and the KV layout. Prefill and decode engines of different precisions share it; a decode server
refuses KV whose hash differs (garbled output is the classic PD failure).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from ..model.checkpoint import LlamaConfig

KV_LAYOUT = "L,KVH,T,D"  # per sequence: [layers, kv_heads, tokens, head_dim], K after RoPE (HF rotate_half)
KV_WIRE_VERSION = 3  # kv/wire.py format (v2: per-token 8-bit scales, v3: HMAC tag); in the hash: old peers disagree
MANIFEST_VERSION = 1


def compat_hash(source_hash: str, config: LlamaConfig) -> str:
    blob = json.dumps({"source": source_hash, "config": config.to_dict(), "kv_layout": KV_LAYOUT,
                       "rope": "hf_rotate_half", "v": MANIFEST_VERSION,
                       "kv_wire": KV_WIRE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def write_manifest(engine_dir: Path, manifest: dict) -> None:
    tmp = engine_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(engine_dir / "manifest.json")


def read_manifest(engine_dir) -> Optional[dict]:
    p = Path(engine_dir) / "manifest.json"
    if not p.exists():
        return None
    return json.loads(p.read_text())
