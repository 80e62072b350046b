"""Quantization schemes of the decode graphs (the codecs that write them: onnx_weights.py) and FP8 calibration.

INT8 MatMulNBits (`INT8_SCHEME.codec()`, the `decode_int8` engine of both the standard and the fused graph):
8-bit weights in blocks along K with a scale (+ zero point when asymmetric) per block; accuracy_level 4 = int8
compute (activations quantized per block on the fly). Options measured on SmolLM2-135M, teacher-forced mean KLD
vs FP32 on the held-in texts (llama.cpp Q8_0 on the same texts: 0.00416), step time one core, box shared:
  block 32 symmetric (v3 default)  0.00420    block 32 asymmetric  0.00391
  block 16 symmetric               0.00285    block 16 asymmetric  0.00222   (+13% step time at batch 1 and 16)
  block 32 sym, fp32 compute       0.00152 (weight error alone; 30x slower)
Activation quantization dominates. Excluding one weight type at a time from quantization, the largest drops
were v_proj, down_proj and lm_head; `Int8Scheme.fine` gives those the finer block. See INT8_SCHEME.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Tuple

from .. import config


@dataclass(frozen=True)
class Int8Scheme:
    block: int = 32
    symmetric: bool = False
    accuracy_level: int = 4  # 4: int8 compute (fast); 0: fp32 compute of dequantized weights (slow on CPU)
    fine_block: int = 16
    # substrings of MatMul weight initializer names quantized with fine_block (standard graph: HF names with
    # dots as underscores; fused graph: layer{i}_qkv_t / _down_t / lm_head_t)
    fine: Tuple[str, ...] = field(default_factory=tuple)

    def codec(self):
        from .onnx_weights import NBits8Codec

        return NBits8Codec(self.block, self.symmetric, self.accuracy_level, self.fine_block, self.fine)

    def describe(self) -> str:
        s = f"int8-{'symmetric' if self.symmetric else 'asymmetric'}-block{self.block}"
        return s + (f" (block {self.fine_block}: {', '.join(self.fine)})" if self.fine else "")


# Chosen: asymmetric block 32 with block 16 for v_proj, down_proj and lm_head (the fused graph's v_proj is inside
# layer{i}_qkv_t): held-in KLD 0.00287 = 0.69x llama.cpp Q8_0's 0.00416, step time within noise of block 32
# symmetric at batch 1 and 16 (all-block-16 asymmetric: 0.00222 but +13%).
INT8_SCHEME = Int8Scheme(block=32, symmetric=False, fine=("v_proj", "down_proj", "lm_head", "_qkv_t", "_down_t"))


def calibrate_matmul_inputs(graph: Path, compact: bool, tokenizer, texts, n_tokens: int = 120,
                            batch: int = 2) -> dict:
    """Per-tensor amax of every constant-weight MatMul's activation input, keyed by the weight's name, over the
    first `n_tokens` tokens of each of `texts` (FP32 prefills of the standard-op graph at `graph`, `batch` texts a
    call)."""
    import numpy as np

    from .runtime import causal_mask, open_session

    acts: dict = {}  # activation tensor -> weight names that multiply it

    def add_amax_outputs(model) -> None:  # amax computed in the graph: outputs are scalars, not activations
        from onnx import TensorProto, helper

        inits = {i.name for i in model.graph.initializer}
        # an Exact16 weight reaches its MatMul through Reshape (its ordering dependency) and Cast: walk back
        src = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type in ("Cast", "Reshape")}
        for n in model.graph.node:
            if n.op_type == "MatMul":
                w = n.input[1]
                while w not in inits and w in src:
                    w = src[w]
                if w in inits:
                    acts.setdefault(n.input[0], []).append(w)
        for i, a in enumerate(acts):
            model.graph.node.extend([helper.make_node("Abs", [a], [f"calib_abs_{i}"]),
                                     helper.make_node("ReduceMax", [f"calib_abs_{i}"], [f"calib_amax_{i}"],
                                                      keepdims=0)])
            model.graph.output.append(helper.make_tensor_value_info(f"calib_amax_{i}", TensorProto.FLOAT, []))

    sess = open_session(graph, int(config.get("HETSERVE_THREADS")), compact=compact, edit=add_amax_outputs)
    rows = [tokenizer.encode(t)[:n_tokens] for t in texts]
    T = min(len(r) for r in rows)
    shape = next(i.shape for i in sess.get_inputs() if i.name == "past_key")  # [B, L, KVH, P, D]
    L, KVH, D = int(shape[1]), int(shape[2]), int(shape[4])
    names = [f"calib_amax_{i}" for i in range(len(acts))]
    amax: dict = {}
    for s in range(0, len(rows), batch):  # a few texts per call: a call's activations are what it holds
        ids = np.asarray([r[:T] for r in rows[s:s + batch]], np.int64)
        B = len(ids)
        past = np.zeros((B, L, KVH, 0, D), np.float32)
        out = sess.run(names, {"input_ids": ids, "position_ids": np.tile(np.arange(T), (B, 1)), "past_key": past,
                               "past_value": past, "attention_mask": causal_mask([0] * B, [T] * B, 0, T),
                               "last_index": np.full(B, T - 1)})
        for ws, v in zip(acts.values(), out):
            for w in ws:
                amax[w] = max(amax.get(w, 0.0), float(v))
    return amax
