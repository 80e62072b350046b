"""Engine manifests and the KV compatibility hash.

The compatibility hash covers everything that decides what a KV tensor *means*: the checkpoint bytes, the model
shape, RoPE, and the KV layout. Prefill and decode engines of different precisions share it; a decode server
refuses KV whose hash differs (garbled output is the classic PD failure).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, List, Optional

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


ENGINE_VARS = ("HETSERVE_PREFILL_ENGINE", "HETSERVE_DECODE_ENGINES", "HETSERVE_AGGREGATED_DECODE_ENGINE")


def configured_engines(engine_dir, var: str) -> List[str]:
    """The engines a server runs for `var` (one of ENGINE_VARS): the operator's setting when given, else what the
    build chose for this model's size (manifest `serving`, build_plan.py), else the setting's default."""
    from .. import config

    serving = (read_manifest(engine_dir) or {}).get("serving") or {}
    raw = serving[var] if not config.is_set(var) and var in serving else config.get(var)
    return [n.strip() for n in str(raw).split(",") if n.strip()]


def resolve_engine(manifest: dict, name: str) -> Optional[str]:
    """The engine to load for the configured `name`: itself when built, else the fallback the builder recorded under
    `unbuilt` (an engine this checkpoint cannot have, e.g. the native INT8 engine for a shape it does not run);
    None when neither exists."""
    if name in manifest.get("engines", {}):
        return name
    fb = manifest.get("unbuilt", {}).get(name, {}).get("fallback")
    return fb if fb in manifest.get("engines", {}) else None


def unresolved_engines(manifest: dict, names: Iterable[str]) -> List[str]:
    """Messages for the configured engines that cannot be loaded at all (`hetserve up` refuses before any server
    starts, rather than a server dying after start)."""
    out = []
    for n in names:
        if resolve_engine(manifest, n) is None:
            why = manifest.get("unbuilt", {}).get(n, {}).get("reason")
            out.append(f"engine {n!r} " + (f"was not built ({why})" if why else "is not in the manifest")
                       + f"; built: {sorted(manifest.get('engines', {}))}")
    return out


def load_tokenizer(engine_dir: str):
    """The tokenizer the engine dir was built with (its manifest's tokenizer file and chat template)."""
    from ..tokenizer import Tokenizer

    man = read_manifest(engine_dir)
    if man is None:
        raise FileNotFoundError(f"{engine_dir}: no manifest.json (run `hetserve build`)")
    t = man["tokenizer"]
    spec = {"kind": "hf", "path": str(Path(engine_dir) / t["file"]), "bos_token_id": t["bos_token_id"],
            "eos_token_id": t["eos_token_id"], "add_bos": t["add_bos"]}
    return Tokenizer(spec, man.get("chat_template"))
