"""Build the Llama forward graph directly in ONNX (opset 17, standard ops only, TensorRT-friendly).

One graph serves prefill and decode steps ("forward with past"):

  inputs   input_ids      int64  [B, T]
           position_ids   int64  [B, T]
           attention_mask float32 [B, 1, T, P+T]   additive (0 = attend, -1e9 = masked)
           past_key       float32 [B, L, KVH, P, D] (P may be 0)
           past_value     float32 [B, L, KVH, P, D]
           last_index     int64  [B]               position in T whose logits are returned
  outputs  logits         float32 [B, V]
           present_key    float32 [B, L, KVH, T, D] K (after RoPE) of the T new tokens only
           present_value  float32 [B, L, KVH, T, D]

Config semantics (model/config.py): RoPE frequencies and attention factor from model/rope.py, q/k/v, o and MLP
biases when the config has them, and per-layer sliding windows added to the caller's causal mask in the graph (from
position_ids: a right-padded past holds positions 0..len-1), so every caller's mask stays the plain causal one.

Batch-major KV ([B, ...]) lets the decode batcher keep one buffer whose first n rows are the running batch
(contiguous, no per-step copy). The host owns the KV cache; the graph only sees the past it is given.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..model import rope as rope_mod
from ..model.checkpoint import Checkpoint
from .onnx_weights import ExternalData, Float32Codec, WeightCodec, save_graph

OPSET = 17
INPUT_NAMES = ("input_ids", "position_ids", "attention_mask", "past_key", "past_value", "last_index")
OUTPUT_NAMES = ("logits", "present_key", "present_value")
LAST_ROWS_NODE = "n_last_rows"  # Gather(flat hidden [B*T, C], rows [B]): the rows whose logits are computed


class _G:
    """Nodes + initializers of a graph being built; weights go straight to `data` (onnx_weights.ExternalData)."""

    def __init__(self, data: Optional[ExternalData] = None, opset: int = OPSET):
        self.nodes: List[onnx.NodeProto] = []
        self.inits: List[TensorProto] = []
        self._n = 0
        self.data, self.opset = data, opset

    def name(self, base):
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, arr, base="c"):
        n = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), n))
        return n

    def add_init(self, t: TensorProto) -> str:
        self.inits.append(t)
        return t.name

    def weight(self, arr: np.ndarray, name: str) -> str:
        """A weight initializer (float32 unless given narrower), written to the external data file."""
        arr = np.asarray(arr)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        if self.data is None:
            return self.add_init(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return self.add_init(self.data.array(name, arr))

    def reduce_mean(self, x: str, axes) -> str:  # axes: an attribute before opset 18, an input from 18 on
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const(np.array(axes, np.int64), "axes")], keepdims=1)
        return self.op("ReduceMean", [x], axes=list(axes), keepdims=1)

    def op(self, op_type, inputs, base=None, n_out=1, **attrs):
        outs = [self.name(base or op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name("n_" + op_type), **attrs))
        return outs[0] if n_out == 1 else outs


def build_graph(ckpt: Checkpoint, path: Path, codec: Optional[WeightCodec] = None,
                progress: Optional[Callable[[int], None]] = None) -> None:
    """Write the standard-op graph to `path` (+ `path`.data), weights as `codec` says (default fp32);
    `progress(1)` after each layer."""
    codec = codec or Float32Codec()
    with ExternalData(path) as data:
        model = _standard_graph(ckpt, _G(data, codec.opset), codec, progress or (lambda n: None))
    save_graph(model, path)


def _standard_graph(ckpt: Checkpoint, g: "_G", codec: WeightCodec, progress) -> onnx.ModelProto:
    c = ckpt.config
    W = ckpt.weights
    L, H, KVH, D, C = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    G = H // KVH
    i64 = lambda v: g.const(np.array(v, dtype=np.int64), "i64")  # noqa: E731
    f32 = lambda v: g.const(np.array(v, dtype=np.float32), "f32")  # noqa: E731

    def linear(x, wname, bias):  # x W^T (+ b when the config has this bias); W stored [out, in]
        w = wname + ".weight"
        y = codec.matmul(g, x, W[w], w.replace(".", "_"))
        return g.op("Add", [y, name_init(wname + ".bias")]) if bias else y

    def rmsnorm(x, wname):
        wn = name_init(wname)
        var = g.reduce_mean(g.op("Mul", [x, x]), [-1])
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, eps])])])
        return g.op("Mul", [g.op("Mul", [x, inv]), wn])

    def name_init(wname):
        return g.weight(W[wname].astype(np.float32), wname.replace(".", "_"))

    eps = f32(c.rms_norm_eps)
    shape_ids = g.op("Shape", ["input_ids"])
    B = g.op("Gather", [shape_ids, i64(0)], axis=0)
    T = g.op("Gather", [shape_ids, i64(1)], axis=0)
    B1, T1 = g.op("Unsqueeze", [B, i64([0])]), g.op("Unsqueeze", [T, i64([0])])

    h = codec.table(g, W["model.embed_tokens.weight"], "model_embed_tokens_weight", "input_ids")  # [B,T,C]

    # RoPE tables from explicit positions (HF rotate_half convention; frequencies per model/rope.py)
    inv_freq, att = rope_mod.inv_freq(c.rope, D)
    pos = g.op("Cast", ["position_ids"], to=TensorProto.FLOAT)
    freqs = g.op("Mul", [g.op("Unsqueeze", [pos, i64([-1])]), f32(inv_freq)])  # [B,T,D/2]
    embp = g.op("Concat", [freqs, freqs], axis=-1)
    cos, sin = g.op("Cos", [embp]), g.op("Sin", [embp])
    if att != 1.0:  # YaRN's attention factor scales cos and sin (transformers' attention_scaling)
        cos, sin = g.op("Mul", [cos, f32(att)]), g.op("Mul", [sin, f32(att)])
    cos = g.op("Unsqueeze", [cos, i64([1])])  # [B,1,T,D]
    sin = g.op("Unsqueeze", [sin, i64([1])])
    half = D // 2

    def rope(x):  # x [B,n,T,D]
        x1 = g.op("Slice", [x, i64([0]), i64([half]), i64([-1])])
        x2 = g.op("Slice", [x, i64([half]), i64([D]), i64([-1])])
        rot = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rot, sin])])

    def heads(x, n):  # [B,T,n*D] -> [B,n,T,D]
        r = g.op("Reshape", [x, g.op("Concat", [B1, T1, i64([n, D])], axis=0)])
        return g.op("Transpose", [r], perm=[0, 2, 1, 3])

    mask5 = g.op("Unsqueeze", ["attention_mask", i64([1])])  # [B,1,1,T,S]
    masks = {0: mask5}

    def window_mask(w):  # the causal mask plus: key at position j is out of reach of query at q when q - j >= w
        if w not in masks:
            P = g.op("Gather", [g.op("Shape", ["past_key"]), i64(3)], axis=0)
            past_pos = g.op("Expand", [g.op("Unsqueeze", [g.op("Range", [i64(0), P, i64(1)]), i64([0])]),
                                       g.op("Concat", [B1, g.op("Unsqueeze", [P, i64([0])])], axis=0)])
            key_pos = g.op("Concat", [past_pos, "position_ids"], axis=1)  # [B,S]: a valid past is 0..len-1
            diff = g.op("Sub", [g.op("Unsqueeze", ["position_ids", i64([2])]),
                                g.op("Unsqueeze", [key_pos, i64([1])])])  # [B,T,S]
            far = g.op("Where", [g.op("GreaterOrEqual", [diff, i64(w)]), f32(-1e9), f32(0.0)])
            masks[w] = g.op("Add", [mask5, g.op("Unsqueeze", [far, i64([1, 2])])])
        return masks[w]
    scale = f32(1.0 / np.sqrt(D))
    pres_k, pres_v = [], []
    for li in range(L):
        p = f"model.layers.{li}."
        x = rmsnorm(h, p + "input_layernorm.weight")
        q = rope(heads(linear(x, p + "self_attn.q_proj", c.qkv_bias), H))
        k = rope(heads(linear(x, p + "self_attn.k_proj", c.qkv_bias), KVH))
        v = heads(linear(x, p + "self_attn.v_proj", c.qkv_bias), KVH)
        pres_k.append(g.op("Unsqueeze", [k, i64([1])]))
        pres_v.append(g.op("Unsqueeze", [v, i64([1])]))
        pk = g.op("Gather", ["past_key", i64(li)], axis=1)
        pv = g.op("Gather", ["past_value", i64(li)], axis=1)
        K = g.op("Unsqueeze", [g.op("Concat", [pk, k], axis=2), i64([2])])  # [B,KVH,1,S,D]
        V = g.op("Unsqueeze", [g.op("Concat", [pv, v], axis=2), i64([2])])
        qg = g.op("Reshape", [g.op("Mul", [q, scale]), g.op("Concat", [B1, i64([KVH, G]), T1, i64([D])], axis=0)])
        scores = g.op("Add", [g.op("MatMul", [qg, g.op("Transpose", [K], perm=[0, 1, 2, 4, 3])]),
                              window_mask(c.layer_windows[li])])
        ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), V])  # [B,KVH,G,T,D]
        ctx = g.op("Reshape", [ctx, g.op("Concat", [B1, i64([H]), T1, i64([D])], axis=0)])
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]),
                               g.op("Concat", [B1, T1, i64([H * D])], axis=0)])
        h = g.op("Add", [h, linear(ctx, p + "self_attn.o_proj", c.o_bias)])
        x = rmsnorm(h, p + "post_attention_layernorm.weight")
        gate = linear(x, p + "mlp.gate_proj", c.mlp_bias)
        up = linear(x, p + "mlp.up_proj", c.mlp_bias)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        h = g.op("Add", [h, linear(act, p + "mlp.down_proj", c.mlp_bias)])
        progress(1)

    h = rmsnorm(h, "model.norm.weight")
    flat = g.op("Reshape", [h, i64([-1, C])])
    rows = g.op("Add", [g.op("Mul", [g.op("Range", [i64(0), B, i64(1)]), T]), "last_index"])
    last = "last_hidden"  # [B,C]; runtime.score_view gathers other rows (every scored position) here
    g.nodes.append(helper.make_node("Gather", [flat, rows], [last], axis=0, name=LAST_ROWS_NODE))
    lm = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    g.nodes.append(helper.make_node("Identity", [codec.matmul(g, last, W[lm], "lm_head_t")],
                                    ["logits"], name="n_lm_head"))
    g.nodes.append(helper.make_node("Concat", pres_k, ["present_key"], axis=1, name="n_present_key"))
    g.nodes.append(helper.make_node("Concat", pres_v, ["present_value"], axis=1, name="n_present_value"))

    F, I = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", I, ["B", "T"]),
        helper.make_tensor_value_info("position_ids", I, ["B", "T"]),
        helper.make_tensor_value_info("attention_mask", F, ["B", 1, "T", "S"]),
        helper.make_tensor_value_info("past_key", F, ["B", L, KVH, "P", D]),
        helper.make_tensor_value_info("past_value", F, ["B", L, KVH, "P", D]),
        helper.make_tensor_value_info("last_index", I, ["B"]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", F, ["B", c.vocab_size]),
        helper.make_tensor_value_info("present_key", F, ["B", L, KVH, "T", D]),
        helper.make_tensor_value_info("present_value", F, ["B", L, KVH, "T", D]),
    ]
    graph = helper.make_graph(g.nodes, "hetserve_llama", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)] + [
        helper.make_opsetid(d, 1) for d in codec.domains], producer_name="hetserve")
    model.ir_version = 8 if g.opset < 19 else 9
    return model
