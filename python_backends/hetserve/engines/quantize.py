"""Quantized decode graphs: INT8 weight-only MatMulNBits (ONNX Runtime CPU) and QDQ INT8 / FP8 (TensorRT).

INT8 MatMulNBits (`quantize_int8`, the `decode_int8` engine of both the standard and the fused graph):
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

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple


@dataclass(frozen=True)
class Int8Scheme:
    block: int = 32
    symmetric: bool = False
    accuracy_level: int = 4  # 4: int8 compute (fast); 0: fp32 compute of dequantized weights (slow on CPU)
    fine_block: int = 16
    # substrings of MatMul weight initializer names quantized with fine_block (standard graph: HF names with
    # dots as underscores; fused graph: layer{i}_qkv_t / _down_t / lm_head_t)
    fine: Tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        s = f"int8-{'symmetric' if self.symmetric else 'asymmetric'}-block{self.block}"
        return s + (f" (block {self.fine_block}: {', '.join(self.fine)})" if self.fine else "")


# Chosen: asymmetric block 32 with block 16 for v_proj, down_proj and lm_head (the fused graph's v_proj is inside
# layer{i}_qkv_t): held-in KLD 0.00287 = 0.69x llama.cpp Q8_0's 0.00416, step time within noise of block 32
# symmetric at batch 1 and 16 (all-block-16 asymmetric: 0.00222 but +13%).
INT8_SCHEME = Int8Scheme(block=32, symmetric=False, fine=("v_proj", "down_proj", "lm_head", "_qkv_t", "_down_t"))


@contextlib.contextmanager
def library_logs_to(path: Path):
    """ONNX Runtime's quantizers log every MatMul at INFO (~5,500 lines for the default model; the module also
    basicConfig()s the root logger at INFO on import): into `path` in the engine dir, not onto the console."""
    lg = logging.getLogger("onnxruntime")
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s [%(levelname)s] %(message)s"))
    propagate, level = lg.propagate, lg.level
    lg.addHandler(h)
    lg.propagate = False
    lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        lg.removeHandler(h)
        h.close()
        lg.propagate, lg.level = propagate, level


def _matmul_weights(model) -> dict:
    inits = {i.name for i in model.graph.initializer}
    return {n.name: n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits}


def quantize_int8(src: Path, dst: Path, scheme: Int8Scheme = INT8_SCHEME) -> None:
    """src fp32 ONNX (external data ok) -> dst with every constant-weight MatMul as 8-bit MatMulNBits."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for stale in (dst, dst.with_name(dst.name + ".data")):
        stale.unlink(missing_ok=True)
    model = onnx.load(str(src))
    weights = _matmul_weights(model)
    coarse = [n for n, w in weights.items() if not any(p in w for p in scheme.fine)]
    passes = [(scheme.fine_block, coarse)] if len(coarse) < len(weights) else []
    passes.append((scheme.block, []))  # the rest (nodes already converted are no longer MatMul)
    for block, exclude in passes:  # (nodes_to_include does not restrict in ORT 1.32; exclusion does)
        q = MatMulNBitsQuantizer(model, bits=8, block_size=block, is_symmetric=scheme.symmetric,
                                 accuracy_level=scheme.accuracy_level, nodes_to_exclude=exclude)
        q.process()
        model = q.model.model
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)


# --- QDQ graphs for TensorRT (explicit quantization of the standard-op graph) ----------------------------------
#
# int8_qdq  weight-only: int8 weights, one symmetric scale per output channel, DequantizeLinear -> MatMul
#           (TensorRT weight-only INT8 GEMM; activations stay in the graph's float type).
# fp8_qdq   W8A8 E4M3: weights E4M3 per output channel (amax/448), and every MatMul input through Quantize/Dequantize
#           with a per-tensor scale calibrated on TUNE_TEXTS (amax/448): TensorRT FP8 GEMMs (sm >= 89).
# Opset 19 (float8 Q/DQ); ONNX Runtime's CPU provider runs both graphs, so their numerics are checked here with
# the same graph TensorRT gets (no separate fake-quant graph). ReduceMean moves its axes to an input (opset 18).
QDQ_OPSET = 19
FP8_MAX = 448.0


def _to_opset19(model) -> None:
    import numpy as np
    from onnx import helper, numpy_helper

    for n in model.graph.node:
        if n.op_type == "ReduceMean":
            axes = next(a for a in n.attribute if a.name == "axes")
            name = n.name + "_axes"
            model.graph.initializer.append(numpy_helper.from_array(np.array(list(axes.ints), np.int64), name))
            n.input.append(name)
            n.attribute.remove(axes)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", QDQ_OPSET))
    model.ir_version = 9


def calibrate_matmul_inputs(fp32_onnx: Path, tokenizer, texts) -> dict:
    """Per-tensor amax of every constant-weight MatMul's activation input over `texts` (FP32 prefill)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from .runtime import causal_mask

    model = onnx.load(str(fp32_onnx))
    mm = _matmul_weights(model)
    acts = sorted({n.input[0] for n in model.graph.node if n.name in mm})
    known = {o.name for o in model.graph.output}
    for a in acts:
        if a not in known:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(a))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    L, KVH, D = (int(d.dim_value) for d in (model.graph.input[3].type.tensor_type.shape.dim[i] for i in (1, 2, 4)))
    amax = {a: 0.0 for a in acts}
    for text in texts:
        ids = np.asarray([tokenizer.encode(text)], np.int64)
        T = ids.shape[1]
        past = np.zeros((1, L, KVH, 0, D), np.float32)
        out = sess.run(None, {"input_ids": ids, "position_ids": np.arange(T)[None], "past_key": past,
                              "past_value": past, "attention_mask": causal_mask([0], [T], 0, T),
                              "last_index": np.array([T - 1])})
        for n, v in zip(names, out):
            if n in amax:
                amax[n] = max(amax[n], float(np.abs(v).max()))
    return amax


def quantize_qdq(src: Path, dst: Path, kind: str, act_amax: Optional[dict] = None) -> None:
    """src fp32 standard-op ONNX -> dst QDQ graph (`kind` int8 | fp8; fp8 needs act_amax from calibration)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if kind not in ("int8", "fp8"):
        raise ValueError(f"unknown QDQ kind {kind!r}")
    for stale in (dst, dst.with_name(dst.name + ".data")):
        stale.unlink(missing_ok=True)
    model = onnx.load(str(src))
    _to_opset19(model)
    mm = _matmul_weights(model)
    inits = {i.name: i for i in model.graph.initializer}
    new_nodes, act_q = [], {}
    for node in model.graph.node:
        if node.name in mm:
            w = numpy_helper.to_array(inits[mm[node.name]]).astype(np.float32)  # [K, N]
            wn = mm[node.name]
            if kind == "int8":
                s = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0  # per output channel
                q = numpy_helper.from_array(np.clip(np.rint(w / s), -127, 127).astype(np.int8), wn + "_q")
                axis = {"axis": 1}
            else:
                import ml_dtypes

                s = np.maximum(np.abs(w).max(axis=0), 1e-12) / FP8_MAX  # per output channel
                codes = (w / s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
                q = helper.make_tensor(wn + "_q", TensorProto.FLOAT8E4M3FN, w.shape, codes.tobytes(), raw=True)
                axis = {"axis": 1}
            model.graph.initializer.remove(inits[wn])
            model.graph.initializer.extend([q, numpy_helper.from_array(np.asarray(s, np.float32), wn + "_s")])
            new_nodes.append(helper.make_node("DequantizeLinear", [wn + "_q", wn + "_s"], [wn + "_dq"],
                                              name=node.name + "_wdq", **axis))
            x = node.input[0]
            if kind == "fp8":
                if x not in act_q:
                    a_s, a_z = x + "_as", x + "_az"
                    model.graph.initializer.extend([
                        numpy_helper.from_array(np.float32(max(act_amax[x], 1e-12) / FP8_MAX), a_s),
                        helper.make_tensor(a_z, TensorProto.FLOAT8E4M3FN, [], b"\x00", raw=True)])
                    new_nodes.append(helper.make_node("QuantizeLinear", [x, a_s, a_z], [x + "_q8"],
                                                      name=node.name + "_aq", saturate=1))
                    new_nodes.append(helper.make_node("DequantizeLinear", [x + "_q8", a_s, a_z], [x + "_dq8"],
                                                      name=node.name + "_adq"))
                    act_q[x] = x + "_dq8"
                x = act_q[x]
            node.input[0], node.input[1] = x, wn + "_dq"
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)
