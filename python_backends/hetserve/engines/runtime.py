"""Engine runtime: ONNX Runtime (CPU) or TensorRT (GPU) engines and the decode batch that owns running KV.

Attention back ends (the manifest's "attention" per engine, see builder.py):
  standard  onnx_graph.py: additive mask, past KV in, the new tokens' KV out (the host appends it).
            `Engine.forward` / `Engine.prefill`; TensorRT engines are always this.
  gqa       onnx_fused.py: GroupQueryAttention reads and writes a per-layer KV buffer in place.
            `Engine.prefill` (batch 1) and `Engine.new_batch().step()` (the decode server's hot path);
            `Engine.forward` too, for masks of the causal_mask form with unpadded new tokens (tools).
  native    engines/native.py (backend "native"): the whole forward pass in C, INT8, over per-sequence KV
            buffers; ragged batches (`Engine.prefill_into`), `forward`/`prefill` as above.
`Engine.new_batch()` gives the scheduler one interface over all (StandardBatch / GqaBatch / NativeBatch,
decode_batch.py).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .. import config
from ..model.checkpoint import LlamaConfig
from .cpu_clock import ENGINE_CPU
from .feeds import NEG_INF, EngineError, causal_mask  # noqa: F401  (re-exported: the engines' API)
from .manifest import read_manifest, resolve_engine

# ORT graph rewrites we turn off. GatherSliceToSplitFusion turns the 30 per-layer Gathers of past_key/past_value
# into one Split that copies the whole past KV up front, before layer 0; with plain Gathers each layer copies its
# slice just before use. Same values; measured on the INT8 decode graph, one core, batch 16 x 192 past tokens:
# 50 -> 44 ms CPU per step (neutral at batch 1).
DISABLED_OPTIMIZERS = ("GatherSliceToSplitFusion",)


def open_session(path: Path, threads: int, compact: bool = False, profile: Optional[str] = None,
                 edit: Optional[Callable] = None):
    """An ONNX Runtime session on the graph at `path`. compact (graphs whose weights are stored narrower than
    they are used: onnx_weights.py): constant folding off, so ONNX Runtime does not materialise the fp32 weights
    at load, and no CPU arena, so each MatMul's dequantized weight is freed after use instead of cached.
    edit(model): changes the graph (never its weights) before loading; the edited graph is written beside the
    original only while the session is created, so its external data resolves the same way."""
    import onnxruntime as ort

    from .trt_runtime import ort_providers  # CUDA EP when HETSERVE_ORT_DEVICE=cuda[:N] (onnxruntime-gpu)

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    disabled = list(DISABLED_OPTIMIZERS)
    if compact:  # (the memory pattern pre-plans a block for a call's every tensor: -0.4 GiB at 1B without it)
        disabled.append("ConstantFolding")
        so.enable_cpu_mem_arena = False
        so.enable_mem_pattern = False
    if edit is None:
        return ort.InferenceSession(str(path), so, providers=ort_providers(), disabled_optimizers=disabled)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    edit(model)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{id(model)}.onnx")
    try:
        tmp.write_bytes(model.SerializeToString())
        return ort.InferenceSession(str(tmp), so, providers=ort_providers(), disabled_optimizers=disabled)
    finally:
        tmp.unlink(missing_ok=True)


def score_view_edit(model) -> None:
    """The standard-op graph with the rows whose logits are computed taken from a new input `score_rows` [N]
    (flat b * T + t) instead of one last position per row (onnx_graph.LAST_ROWS_NODE)."""
    from onnx import TensorProto, helper

    from .onnx_graph import LAST_ROWS_NODE

    node = next((n for n in model.graph.node if n.name == LAST_ROWS_NODE), None)
    if node is None:
        raise EngineError(f"graph has no {LAST_ROWS_NODE} node (rebuild the engines)")
    node.input[1] = "score_rows"
    model.graph.input.append(helper.make_tensor_value_info("score_rows", TensorProto.INT64, ["N"]))
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[0].dim_param = "N"


def load_engine(engine_dir: str, name: str, threads: Optional[int] = None) -> "Engine":
    """Engine(engine_dir, name), or its fallback when this checkpoint has no such engine (the builder recorded why
    under `unbuilt`) or this machine cannot run it (the native engine on a CPU or without a compiler it needs): a
    warning says which and why, never a silent swap."""
    from .native import NativeUnavailable

    log = logging.getLogger("hetserve.engines")
    man = read_manifest(Path(engine_dir)) or {}
    fb = resolve_engine(man, name)
    if fb and fb != name:
        log.warning("engine %s was not built for this checkpoint (%s); loading %s instead", name,
                    man["unbuilt"][name].get("reason"), fb)
        return Engine(engine_dir, str(fb), threads=threads)
    try:
        return Engine(engine_dir, name, threads=threads)
    except NativeUnavailable as e:
        fb = man.get("engines", {}).get(name, {}).get("fallback")
        if not fb:
            raise
        log.warning("engine %s cannot run here (%s); loading %s instead", name, e, fb)
        return Engine(engine_dir, fb, threads=threads)



def _standard_feeds(input_ids, position_ids, attention_mask, past_key, past_value, last_index) -> dict:
    """The standard-op graph's inputs (onnx_graph.INPUT_NAMES), contiguous and in their dtypes."""
    return {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.float32),
            "past_key": np.ascontiguousarray(past_key, dtype=np.float32),
            "past_value": np.ascontiguousarray(past_value, dtype=np.float32),
            "last_index": np.ascontiguousarray(last_index, dtype=np.int64)}


class Engine:
    """A built engine (see builder.py): `forward` returns (logits[B,V], new_k[B,L,KVH,T,D], new_v)."""

    def __init__(self, engine_dir: str, name: str, threads: Optional[int] = None, score_view: bool = False):
        """score_view: logits of any rows of the flattened [B*T] positions (`score`), for teacher-forced quality
        measurement in one call instead of one call per token (standard-op graphs only)."""
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
        self.attention = self.info.get("attention", "standard")
        backend = self.info["backend"]
        if backend == "onnxruntime":
            prof = config.get("HETSERVE_ORT_PROFILE")  # per-op timings (JSON trace) for loadtest/README
            if score_view and self.attention != "standard":
                raise EngineError(f"engine {name!r}: a score view needs the standard-op graph")
            self._score_view = score_view
            self._sess = open_session(self.dir / self.info["file"], int(threads or config.get("HETSERVE_THREADS")),
                                      compact=bool(self.info.get("compact")),
                                      profile=f"{prof}_{name}" if prof else None,
                                      edit=score_view_edit if score_view else None)
            self._run = self._run_ort
        elif backend == "native":  # engines/native.py: INT8 C engine over per-sequence KV buffers
            from .native import NativeModel

            self.native = NativeModel(self.dir, self.info, self.config)
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
        if self._score_view and "score_rows" not in feeds:
            B, T = feeds["input_ids"].shape
            feeds["score_rows"] = np.arange(B, dtype=np.int64) * T + feeds["last_index"]
        with ENGINE_CPU.timed():
            lo, k, v = self._sess.run(None, feeds)
        return lo, k, v

    def score(self, input_ids, position_ids, attention_mask, past_key, past_value, rows: np.ndarray):
        """Like `forward`, with the logits of flat positions `rows` (b * T + t) instead of one per row."""
        if not getattr(self, "_score_view", False):
            raise EngineError(f"engine {self.name!r} was not opened with score_view=True")
        feeds = _standard_feeds(input_ids, position_ids, attention_mask, past_key, past_value,
                                np.zeros(len(input_ids), np.int64))
        feeds["score_rows"] = np.asarray(rows, np.int64)
        return self._run(feeds)

    def empty_past(self, batch: int) -> np.ndarray:
        c = self.config
        return np.zeros((batch, c.num_layers, c.num_kv_heads, 0, c.head_dim), dtype=np.float32)

    @property
    def ragged(self) -> bool:
        """True: `prefill_into` computes rows of different lengths in one call, in place (no padding)."""
        return self.attention == "native"

    def new_batch(self, rows: int = 16):
        """The running-batch KV store for this engine's attention back end (see decode_batch.py)."""
        from .decode_batch import GqaBatch, NativeBatch, StandardBatch

        cls = {"gqa": GqaBatch, "native": NativeBatch}.get(self.attention, StandardBatch)
        return cls(self, rows)

    def prefill_into(self, rows) -> np.ndarray:
        """Ragged engines: rows of (ids, start, k, v), each computing ids at positions start.. with its K/V written
        into k, v ([L, KVH, cap, D], positions < start hold the past). Logits [len(rows), V] of each last token."""
        if not self.ragged:
            raise EngineError(f"engine {self.name!r} ({self.attention} attention) has no ragged prefill")
        return self.native.run_sequences(rows)

    def end_profiling(self) -> Optional[str]:
        return self._sess.end_profiling() if hasattr(self, "_sess") else None

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                past_key: np.ndarray, past_value: np.ndarray, last_index: np.ndarray):
        if self.attention == "native":
            from . import native

            return native.forward(self.native, input_ids, position_ids, attention_mask, past_key, past_value,
                                  last_index, self.name)
        if self.attention == "gqa":
            return self._forward_gqa(input_ids, position_ids, attention_mask, past_key, past_value, last_index)
        return self._run(_standard_feeds(input_ids, position_ids, attention_mask, past_key, past_value, last_index))

    def prefill(self, ids: Sequence[int], past_k: Optional[np.ndarray] = None,
                past_v: Optional[np.ndarray] = None):
        """Single sequence; optional cached prefix KV ([L,KVH,P,D]). Returns logits[V], k/v [L,KVH,T,D]."""
        T = len(ids)
        if self.attention == "native":
            from . import native

            return native.prefill(self.native, ids, past_k, past_v)
        if self.attention == "gqa":
            return self._prefill_gqa(ids, past_k, past_v)
        if past_k is None:
            pk = pv = self.empty_past(1)
        else:
            pk, pv = past_k[None], past_v[None]
        P = pk.shape[3]
        lo, k, v = self.forward(np.asarray([ids]), np.arange(P, P + T)[None], causal_mask([P], [T], P, T),
                                pk, pv, np.array([T - 1]))
        return lo[0], k[0], v[0]

    def _prefill_gqa(self, ids, past_k, past_v):
        """Batch 1 through GroupQueryAttention with separate past/present (the kernel concatenates once)."""
        P = 0 if past_k is None else int(past_k.shape[2])
        pk = None if past_k is None else past_k[None]
        pv = None if past_v is None else past_v[None]
        lo, k, v = self._run_gqa(np.asarray([ids], np.int64), np.array([P]), pk, pv, np.array([len(ids) - 1]))
        return lo[0], k[0], v[0]

    def _run_gqa(self, ids, past_lens, past_k, past_v, last_index):
        """ids [B,T] after right-padded past KV [B,L,KVH,P,D] (row b valid up to past_lens[b]); returns logits
        and the new tokens' k, v [B,L,KVH,T,D] (read out of the present buffers at each row's offset)."""
        from .onnx_fused import past_names

        c = self.config
        B, T = ids.shape
        L = c.num_layers
        lens = np.asarray(past_lens, np.int64)
        feeds = {"input_ids": ids, "seqlens_k": (lens + T - 1).astype(np.int32),
                 "total_sequence_length": np.array(int(lens.max()) + T, np.int32),
                 "last_index": np.asarray(last_index, np.int64)}
        pk, pv = past_names(L)
        empty = np.zeros((B, c.num_kv_heads, 0, c.head_dim), np.float32)
        for li in range(L):
            feeds[pk[li]] = empty if past_k is None else np.ascontiguousarray(past_k[:, li], np.float32)
            feeds[pv[li]] = empty if past_v is None else np.ascontiguousarray(past_v[:, li], np.float32)
        with ENGINE_CPU.timed():
            out = self._sess.run(None, feeds)
        if B == 1 or not lens.any():
            k = np.stack([o[:, :, lens[0]:lens[0] + T] for o in out[1:1 + L]], axis=1)
            v = np.stack([o[:, :, lens[0]:lens[0] + T] for o in out[1 + L:]], axis=1)
        else:
            cols = lens[:, None] + np.arange(T)[None, :]  # [B,T]
            rows = np.arange(B)[:, None]
            k = np.stack([o.transpose(0, 2, 1, 3)[rows, cols].transpose(0, 2, 1, 3) for o in out[1:1 + L]], 1)
            v = np.stack([o.transpose(0, 2, 1, 3)[rows, cols].transpose(0, 2, 1, 3) for o in out[1 + L:]], 1)
        return out[0], np.ascontiguousarray(k), np.ascontiguousarray(v)

    def _forward_gqa(self, input_ids, position_ids, attention_mask, past_key, past_value, last_index):
        """`forward` semantics on the fused graph, for masks that causal_mask(past_lens, [T]*B, P, T) makes
        (right-padded past, no padded new tokens) and matching positions; anything else is refused."""
        ids = np.ascontiguousarray(input_ids, np.int64)
        B, T = ids.shape
        P = int(past_key.shape[3])
        m = np.asarray(attention_mask)
        lens = (m[:, 0, 0, :P] == 0).sum(axis=1) if P else np.zeros(B, np.int64)
        if (m.shape != (B, 1, T, P + T) or not np.array_equal(m, causal_mask(lens, [T] * B, P, T))
                or not np.array_equal(np.asarray(position_ids), lens[:, None] + np.arange(T)[None, :])):
            raise EngineError(f"engine {self.name!r} (gqa attention) takes only causal masks over a right-padded "
                              "past with unpadded new tokens; use a standard-attention engine (prefill_fp32)")
        if not P:
            return self._run_gqa(ids, lens, None, None, last_index)
        if T > 1 and B > 1:  # the GQA kernel takes T > 1 after a past only at batch 1
            rows = [self._run_gqa(ids[b:b + 1], lens[b:b + 1], past_key[b:b + 1], past_value[b:b + 1],
                                  np.asarray(last_index)[b:b + 1]) for b in range(B)]
            return tuple(np.concatenate(x) for x in zip(*rows))
        return self._run_gqa(ids, lens, past_key, past_value, last_index)
