"""How a graph's weights are stored and multiplied: written one tensor at a time, never the model in memory.

`ExternalData` appends each initializer to the graph's `.data` file as the builder makes it (page-aligned, so
ONNX Runtime maps it from disk) and keeps only the tensor's reference in the ModelProto: peak memory while
building is one tensor (plus its transpose), not the model, at any model size.

A `WeightCodec` decides how every constant-weight MatMul of a graph (onnx_graph.py, onnx_fused.py) is emitted:

  Float32Codec   fp32 weights, MatMul                                  (prefill_fp32, decode_fp32)
  Exact16Codec   each tensor in bf16 or fp16 when that holds its values exactly (a bf16 or f16 checkpoint),
                 Cast to fp32 before the MatMul: the FP32 engine's math at half the memory, for models whose FP32
                 weights do not fit (the Cast runs per call, so it is a prefill and reference engine, not decode)
  NBits8Codec    INT8 MatMulNBits blocks (ONNX Runtime's own block quantizer, per tensor)   (decode_int8)
  QdqCodec       QDQ int8 weight-only or FP8 E4M3 (TensorRT's explicit quantization; ONNX Runtime runs it)

Graphs whose weights must stay compact in memory (`compact`: Exact16 and QDQ) are loaded with constant folding
off (it would materialise the fp32 weights) and without the CPU arena (runtime.open_session).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

ALIGN = 4096  # page size: ONNX Runtime maps page-aligned external data instead of reading it
INLINE_MAX = 1024  # smaller tensors stay inside the graph file (as onnx.save_model's size_threshold)
FP8_MAX = 448.0
# Exact16 graphs cast each weight to fp32 per call; a weight larger than this is split into column blocks so the
# transient fp32 copy is at most this (1 GiB for a Llama 3 1B LM head otherwise, on top of the mapped weights).
SPLIT_BYTES = 256 << 20


class ExternalData:
    """One `.data` file next to a graph, written as tensors arrive. Use as a context manager; `close` then write
    the graph (`save_graph`). A failed build deletes the whole temporary build directory (builder.py)."""

    def __init__(self, graph_path: Path):
        self.path = graph_path.with_name(graph_path.name + ".data")
        self._f = open(self.path, "wb")
        self.bytes = 0

    def tensor(self, name: str, data, dtype: int, shape) -> TensorProto:
        """`data`: bytes or a buffer (memoryview) of the tensor's raw little-endian values."""
        if memoryview(data).nbytes <= INLINE_MAX:
            return helper.make_tensor(name, dtype, list(shape), bytes(data), raw=True)
        pad = (-self.bytes) % ALIGN
        self._f.write(b"\0" * pad)
        off = self.bytes + pad
        self._f.write(data)
        self.bytes = off + memoryview(data).nbytes
        t = TensorProto(name=name, data_type=dtype, dims=list(shape), data_location=TensorProto.EXTERNAL)
        for k, v in (("location", self.path.name), ("offset", str(off)), ("length", str(len(data)))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    def array(self, name: str, arr: np.ndarray) -> TensorProto:
        arr = np.ascontiguousarray(arr)
        data = arr.tobytes() if arr.nbytes <= INLINE_MAX else memoryview(arr.reshape(-1).view(np.uint8))  # no copy
        return self.tensor(name, data, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ExternalData":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_graph(model: onnx.ModelProto, path: Path) -> None:
    """The graph file itself (its weights are already in the `.data` file)."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
        f.flush()
        os.fsync(f.fileno())


def transposed(a: np.ndarray, rows: int = 256) -> np.ndarray:
    """a.T, contiguous, copied in row blocks that stay in cache (2.5-4x faster than one strided copy of a large
    matrix; the graph builders transpose every weight of the model)."""
    out = np.empty((a.shape[1], a.shape[0]), a.dtype)
    for i in range(0, a.shape[0], rows):
        out[:, i:i + rows] = a[i:i + rows].T
    return out


def _narrow_exact(arr: np.ndarray, rows: int = 4096) -> Tuple[np.ndarray, int]:
    """`arr` (float32) as bf16 or fp16 when either holds every value exactly, else float32. Checked in row
    chunks (no second float32 copy of a 1 GiB embedding); bf16 by its bits: a float32 whose low 16 bits are zero
    is a bf16 value, and its high 16 bits are that value."""
    import ml_dtypes

    bits = arr.reshape(len(arr), -1).view(np.uint32) if arr.ndim else arr.reshape(1).view(np.uint32)
    if not any((bits[i:i + rows] & 0xFFFF).any() for i in range(0, len(bits), rows)):
        high = np.ascontiguousarray(bits.view(np.uint16)[:, 1::2] if sys.byteorder == "little"
                                    else bits.view(np.uint16)[:, 0::2])  # the high half of each float32
        return high.view(ml_dtypes.bfloat16).reshape(arr.shape), TensorProto.BFLOAT16
    n = arr.astype(np.float16)
    if all(np.array_equal(n[i:i + rows].astype(np.float32), arr[i:i + rows], equal_nan=True)
           for i in range(0, max(len(arr), 1), rows)):
        return n, TensorProto.FLOAT16
    return arr, TensorProto.FLOAT


class WeightCodec:
    """Emits `x @ w.T` for a constant weight w [N, K] (the checkpoint's [out, in] layout; each codec transposes
    after it has narrowed the values, so the transposed copy is the small one) and stores embedding tables."""
    compact = False  # True: load with constant folding and the CPU arena off (see module docstring)
    opset = 17
    domains: Tuple[str, ...] = ()  # operator domains besides ONNX's own that the graph must import

    def matmul(self, g, x: str, w: np.ndarray, wname: str) -> str:
        return g.op("MatMul", [x, g.weight(transposed(np.asarray(w, np.float32)), wname)])

    def table(self, g, arr: np.ndarray, name: str, ids: str) -> str:
        """Gather rows `ids` of an embedding table (float32 output)."""
        return g.op("Gather", [g.weight(arr, name), ids], axis=0)


class Float32Codec(WeightCodec):
    pass


class Exact16Codec(WeightCodec):
    compact = True

    def __init__(self):
        self.stored: Dict[str, int] = {}  # ONNX dtype -> number of weights stored in it (for the manifest)
        self._dep: Dict[str, str] = {}

    def _store(self, g, arr: np.ndarray, wname: str, transpose: bool) -> Tuple[str, bool]:
        narrow, t = _narrow_exact(np.asarray(arr, np.float32))
        del arr
        key = TensorProto.DataType.Name(t).lower()
        self.stored[key] = self.stored.get(key, 0) + int(narrow.size)
        return g.weight(transposed(narrow) if transpose else narrow, wname), t != TensorProto.FLOAT

    def matmul(self, g, x, w, wname):
        n = max(1, -(-w.shape[0] * w.shape[1] * 4 // SPLIT_BYTES))
        if n > 1:  # a large weight (a 128k-vocabulary LM head) in column blocks: one block's fp32 copy at a time
            step = -(-w.shape[0] // n)
            return g.op("Concat", [self.matmul(g, x, w[i:i + step], f"{wname}_part{i // step}")
                                   for i in range(0, w.shape[0], step)], axis=-1)
        wn, narrow = self._store(g, w, wname, transpose=True)
        if not narrow:
            return g.op("MatMul", [x, wn])
        # Reshaped (to its own shape, no copy) by a shape computed from x: the cast cannot run before x exists.
        # ONNX Runtime otherwise schedules the casts of weights (inputs: initializers only) ahead of their layers,
        # and many fp32 copies are alive at once (+5 GiB at a 3B model).
        shape = g.op("Mul", [g.const(np.array(w.shape[::-1], np.int64), "i64"), self._after(g, x)])
        return g.op("MatMul", [x, g.op("Cast", [g.op("Reshape", [wn, shape])], to=TensorProto.FLOAT)])

    def _after(self, g, x: str) -> str:
        """[1] (int64), computed from x."""
        if x not in self._dep:
            n = g.op("Slice", [g.op("Shape", [x]), g.const(np.array([0], np.int64), "i64"),
                               g.const(np.array([1], np.int64), "i64")])
            self._dep[x] = g.op("Div", [n, n])  # [B] / [B] = [1] (B >= 1)
        return self._dep[x]

    def table(self, g, arr, name, ids):
        w, narrow = self._store(g, arr, name, transpose=False)
        rows = g.op("Gather", [w, ids], axis=0)
        return g.op("Cast", [rows], to=TensorProto.FLOAT) if narrow else rows

    def describe(self) -> str:
        tot = sum(self.stored.values()) or 1
        return ", ".join(f"{k} {100 * v / tot:.0f}%" for k, v in sorted(self.stored.items()))


@dataclass(frozen=True)
class NBits8Codec(WeightCodec):
    """INT8 MatMulNBits: blocks of `block` along K (`fine_block` for weights whose name contains a `fine`
    substring), scale (+ zero point when asymmetric) per block; the scheme and its measurements: quantize.py."""
    block: int = 32
    symmetric: bool = False
    accuracy_level: int = 4
    fine_block: int = 16
    fine: Tuple[str, ...] = field(default_factory=tuple)
    domains = ("com.microsoft",)

    def matmul(self, g, x, w, wname):
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        block = self.fine_block if any(p in wname for p in self.fine) else self.block
        cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=self.symmetric,
                                           accuracy_level=self.accuracy_level, bits=8)
        N, K = w.shape
        packed, scales, zp = DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(
            transposed(np.asarray(w, np.float32)))
        ins = [x, g.weight(packed, wname + "_Q8"), g.weight(scales, wname + "_scales")]
        if not self.symmetric:
            ins.append(g.weight(zp, wname + "_zero_points"))
        out = g.name("MatMulNBits")
        g.nodes.append(helper.make_node("MatMulNBits", ins, [out], name=g.name("n_MatMulNBits"),
                                        domain="com.microsoft", K=K, N=N, bits=8, block_size=block,
                                        accuracy_level=self.accuracy_level))
        return out


@dataclass
class QdqCodec(WeightCodec):
    """QDQ weights, one symmetric scale per output channel: `int8` weight-only (W8A32/A16) or `fp8` E4M3 weights,
    with activations through an E4M3 Quantize/Dequantize pair per MatMul input (static per-tensor scale from
    calibration: `act_amax[weight name]`) unless `fp8_activations` is off (W8A16)."""
    kind: str = "int8"
    act_amax: Optional[Dict[str, float]] = None
    fp8_activations: bool = True
    keep: Tuple[str, ...] = ()  # weights whose name contains one of these stay in float (not quantized)
    compact = True
    opset = 19  # float8 Quantize/Dequantize

    def __post_init__(self):
        if self.kind not in ("int8", "fp8"):
            raise ValueError(f"unknown QDQ kind {self.kind!r}")
        self._act: Dict[str, str] = {}

    def matmul(self, g, x, w, wname):
        if any(k in wname for k in self.keep):
            return super().matmul(g, x, w, wname)
        from .build_plan import chunk_rows

        w = np.asarray(w, np.float32)  # [N, K]: one scale per row = per output channel of x @ w.T
        rows = chunk_rows(w.shape[1])
        s = np.maximum(np.abs(w).max(axis=1), 1e-12) / (127.0 if self.kind == "int8" else FP8_MAX)
        if self.kind == "int8":
            codes = np.empty(w.shape, np.int8)
            for i in range(0, len(w), rows):  # cache-sized chunks (build_plan.CHUNK_BYTES)
                codes[i:i + rows] = np.clip(np.rint(w[i:i + rows] / s[i:i + rows, None]), -127, 127)
            q = g.weight(transposed(codes), wname + "_q")
        else:
            import ml_dtypes

            e4m3 = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
            for i in range(0, len(w), rows):
                e4m3[i:i + rows] = w[i:i + rows] / s[i:i + rows, None]
            codes = transposed(e4m3.view(np.uint8))
            q = g.add_init(g.data.tensor(wname + "_q", memoryview(codes.reshape(-1)), TensorProto.FLOAT8E4M3FN,
                                         codes.shape))
        wdq = wname + "_dq"
        g.nodes.append(helper.make_node("DequantizeLinear", [q, g.weight(s.astype(np.float32), wname + "_s")], [wdq],
                                        name=g.name("n_DequantizeLinear"), axis=1))
        if self.kind == "fp8" and self.fp8_activations:
            x = self._fp8_activation(g, x, wname)
        return g.op("MatMul", [x, wdq])

    def _fp8_activation(self, g, x: str, wname: str) -> str:
        if x not in self._act:  # q/k/v (gate/up) share their input: one Q/DQ pair for it
            if not self.act_amax or wname not in self.act_amax:
                raise ValueError(f"fp8 QDQ: no calibrated activation range for {wname}")
            a_s = g.const(np.float32(max(self.act_amax[wname], 1e-12) / FP8_MAX), "as")
            a_z = g.add_init(helper.make_tensor(g.name("az"), TensorProto.FLOAT8E4M3FN, [], b"\x00", raw=True))
            q8 = g.op("QuantizeLinear", [x, a_s, a_z], saturate=1)
            self._act[x] = g.op("DequantizeLinear", [q8, a_s, a_z])
        return self._act[x]
