"""Engine runtime: one forward-with-past call on ONNX Runtime (CPU) or TensorRT (GPU)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np

from ..model.checkpoint import LlamaConfig
from .manifest import read_manifest

NEG_INF = np.float32(-1e9)

# ORT graph rewrites we turn off. GatherSliceToSplitFusion turns the 30 per-layer Gathers of past_key/past_value
# into one Split that copies the whole past KV up front, before layer 0; with plain Gathers each layer copies its
# slice just before use. Same values; measured on the INT8 decode graph, one core, batch 16 x 192 past tokens:
# 50 -> 44 ms CPU per step (neutral at batch 1).
DISABLED_OPTIMIZERS = ("GatherSliceToSplitFusion",)


class EngineError(RuntimeError):
    pass


def causal_mask(past_lens: Sequence[int], new_lens: Sequence[int], P: int, T: int) -> np.ndarray:
    """Additive mask [B,1,T,P+T] for right-padded past (valid prefix of length past_lens[b]) and new tokens."""
    B = len(past_lens)
    m = np.full((B, 1, T, P + T), NEG_INF, dtype=np.float32)
    tri = np.tril(np.ones((T, T), dtype=bool))
    for b in range(B):
        pl, nl = int(past_lens[b]), int(new_lens[b])
        m[b, 0, :, :pl] = 0.0
        blk = m[b, 0, :, P:P + T]
        blk[tri] = 0.0
        if nl < T:  # padded query rows: attend to themselves only (output discarded)
            blk[nl:, :] = NEG_INF
            blk[np.arange(nl, T), np.arange(nl, T)] = 0.0
            blk[:, nl:] = np.where(np.eye(T, dtype=bool)[:, nl:], blk[:, nl:], NEG_INF)
    return m


class Engine:
    """A built engine (see builder.py): `forward` returns (logits[B,V], new_k[B,L,KVH,T,D], new_v)."""

    def __init__(self, engine_dir: str, name: str, threads: Optional[int] = None):
        self.dir = Path(engine_dir)
        man = read_manifest(self.dir)
        if man is None:
            raise EngineError(f"{engine_dir}: no manifest.json (run `hetserve build` first)")
        if name not in man["engines"]:
            raise EngineError(f"{engine_dir}: no engine {name!r}; have {sorted(man['engines'])}")
        self.manifest = man
        self.info = man["engines"][name]
        self.config = LlamaConfig.from_dict(man["config"])
        self.compat_hash = man["compat_hash"]
        self.name = name
        self.precision = self.info["precision"]
        backend = self.info["backend"]
        if backend == "onnxruntime":
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = int(threads or os.environ.get("HETSERVE_THREADS", 0) or 0)
            so.inter_op_num_threads = 1
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            providers = ["CPUExecutionProvider"]
            self._sess = ort.InferenceSession(str(self.dir / self.info["file"]), so, providers=providers,
                                              disabled_optimizers=list(DISABLED_OPTIMIZERS))
            self._run = self._run_ort
        elif backend == "tensorrt":  # pragma: no cover - needs a GPU
            from .trt_runtime import TrtRunner

            self._trt = TrtRunner(str(self.dir / self.info["file"]))
            self._run = self._trt.run
        else:
            raise EngineError(f"unknown engine backend {backend!r}")

    def warmup(self) -> None:
        """One tiny prefill + decode step so the first real request doesn't pay for lazy initialisation."""
        _, k, v = self.prefill([0, 1, 2, 3])
        self.prefill([4], k, v)

    def _run_ort(self, feeds: dict) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, k, v = self._sess.run(None, feeds)
        return lo, k, v

    def empty_past(self, batch: int) -> np.ndarray:
        c = self.config
        return np.zeros((batch, c.num_layers, c.num_kv_heads, 0, c.head_dim), dtype=np.float32)

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                past_key: np.ndarray, past_value: np.ndarray, last_index: np.ndarray):
        feeds = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.float32),
            "past_key": np.ascontiguousarray(past_key, dtype=np.float32),
            "past_value": np.ascontiguousarray(past_value, dtype=np.float32),
            "last_index": np.ascontiguousarray(last_index, dtype=np.int64),
        }
        return self._run(feeds)

    def prefill(self, ids: Sequence[int], past_k: Optional[np.ndarray] = None,
                past_v: Optional[np.ndarray] = None):
        """Single sequence; optional cached prefix KV ([L,KVH,P,D]). Returns logits[V], k/v [L,KVH,T,D]."""
        T = len(ids)
        if past_k is None:
            pk = pv = self.empty_past(1)
        else:
            pk, pv = past_k[None], past_v[None]
        P = pk.shape[3]
        lo, k, v = self.forward(np.asarray([ids]), np.arange(P, P + T)[None], causal_mask([P], [T], P, T),
                                pk, pv, np.array([T - 1]))
        return lo[0], k[0], v[0]
