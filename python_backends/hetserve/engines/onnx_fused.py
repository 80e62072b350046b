"""The Llama forward graph on ONNX Runtime contrib ops (com.microsoft): the "gqa" attention back end.

Per layer: SkipSimplifiedLayerNormalization (residual add + RMSNorm in one op), one MatMul for q/k/v, one
GroupQueryAttention (RoPE from cos/sin caches, causal attention, and the new tokens' K/V written into the KV
buffer), the o-projection, a second SkipSimplifiedLayerNormalization, one MatMul for gate/up, SiLU*up, the down
projection: ~10 ops where the standard graph (onnx_graph.py) has ~40. MatMuls are quantized to MatMulNBits by
the builder for INT8 engines. TensorRT cannot parse com.microsoft ops: GPU engines keep the standard graph.

  inputs   input_ids              int64 [B, T]
           seqlens_k              int32 [B]   past length + T - 1 per row (GQA's convention)
           total_sequence_length  int32 []    max over rows of past length + T
           last_index             int64 [B]   position in T whose logits are returned
           past_key_<l>           float [B, KVH, S, D] per layer l (S = buffer capacity, rows right-padded)
           past_value_<l>         float [B, KVH, S, D]
  outputs  logits                 float [B, V]
           present_key_<l>        float [B, KVH, S', D]
           present_value_<l>      float [B, KVH, S', D]

When present_key_<l> is bound (IOBinding) to the same memory as past_key_<l>, the GQA CPU kernel appends the
new tokens' K/V at each row's own offset in place (S' = S) and attends over seqlens_k + 1 entries of the row:
no concatenation, no copy. Bound to separate outputs, the present is past + new (S' = S + T; batch 1 prefill).
K is stored after RoPE (HF rotate_half), the same meaning as the standard graph's KV (manifest KV_LAYOUT).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..model import rope
from ..model.checkpoint import Checkpoint
from .onnx_graph import _G, OPSET
from .onnx_weights import ExternalData, Float32Codec, WeightCodec, save_graph

MS = "com.microsoft"


def past_names(num_layers: int):
    return [f"past_key_{i}" for i in range(num_layers)], [f"past_value_{i}" for i in range(num_layers)]


def present_names(num_layers: int):
    return [f"present_key_{i}" for i in range(num_layers)], [f"present_value_{i}" for i in range(num_layers)]


def build_fused_graph(ckpt: Checkpoint, path: Path, codec: Optional[WeightCodec] = None,
                      progress: Optional[Callable[[int], None]] = None) -> None:
    """Write the fused graph to `path` (+ `path`.data), MatMul weights as `codec` says (default fp32)."""
    codec = codec or Float32Codec()
    with ExternalData(path) as data:
        model = _fused_graph(ckpt, _G(data, codec.opset), codec, progress or (lambda n: None))
    save_graph(model, path)


def _fused_graph(ckpt: Checkpoint, g: _G, codec: WeightCodec, progress) -> onnx.ModelProto:
    c = ckpt.config
    W = ckpt.weights
    L, H, KVH, D, C = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    eps = float(c.rms_norm_eps)

    def init(arr, name):
        return g.weight(np.asarray(arr, dtype=np.float32), name)

    def linear(x, names, bias, out):  # x concat(W_i)^T (+ concat(b_i) when the config has these biases)
        w = W[names[0] + ".weight"] if len(names) == 1 else np.concatenate([W[n + ".weight"] for n in names])
        y = codec.matmul(g, x, w, out)
        if bias:
            y = g.op("Add", [y, init(np.concatenate([W[n + ".bias"] for n in names]), out + "_bias")])
        return y

    def norm_w(wname):
        return init(W[wname], wname.replace(".", "_"))

    cos, sin = rope.tables(c.rope, D, c.max_position)
    cos_n, sin_n = init(cos, "cos_cache"), init(sin, "sin_cache")
    h = codec.table(g, W["model.embed_tokens.weight"], "model_embed_tokens_weight", "input_ids")  # [B,T,C]
    pk, pv = past_names(L)
    ok, ov = present_names(L)

    def skip_norm(x, residual, wname):  # (normed(x + residual), x + residual)
        outs = [g.name("sln"), "", "", g.name("resid")]
        g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [x, residual, norm_w(wname)], outs,
                                        name=g.name("n_SkipSLN"), domain=MS, epsilon=eps))
        return outs[0], outs[3]

    x = g.op("SimplifiedLayerNormalization", [h, norm_w("model.layers.0.input_layernorm.weight")],
             axis=-1, epsilon=eps, stash_type=1)
    for li in range(L):
        p = f"model.layers.{li}."
        a = p + "self_attn."
        qkv = linear(x, [a + "q_proj", a + "k_proj", a + "v_proj"], c.qkv_bias, f"layer{li}_qkv_t")
        attn = g.name("attn")
        # sliding window: ORT's local_window_size and transformers' sliding_window both count the query itself
        # (w positions attended; checked token-exact against transformers in tests/test_model_zoo.py)
        win = int(c.layer_windows[li]) if c.layer_windows[li] else -1
        g.nodes.append(helper.make_node(
            "GroupQueryAttention", [qkv, "", "", pk[li], pv[li], "seqlens_k", "total_sequence_length", cos_n, sin_n],
            [attn, ok[li], ov[li]], name=g.name("n_GQA"), domain=MS, num_heads=H, kv_num_heads=KVH, do_rotary=1,
            rotary_interleaved=0, scale=float(1.0 / np.sqrt(D)), local_window_size=win))
        o = linear(attn, [a + "o_proj"], c.o_bias, f"layer{li}_o_t")
        x, h = skip_norm(o, h, p + "post_attention_layernorm.weight")
        m = p + "mlp."
        gu = linear(x, [m + "gate_proj", m + "up_proj"], c.mlp_bias, f"layer{li}_gate_up_t")
        gate, up = g.op("Split", [gu], n_out=2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        down = linear(act, [m + "down_proj"], c.mlp_bias, f"layer{li}_down_t")
        nxt = f"model.layers.{li + 1}.input_layernorm.weight" if li + 1 < L else "model.norm.weight"
        x, h = skip_norm(down, h, nxt)
        progress(1)

    i64 = lambda v: g.const(np.array(v, dtype=np.int64), "i64")  # noqa: E731
    shape_ids = g.op("Shape", ["input_ids"])
    T = g.op("Gather", [shape_ids, i64(1)], axis=0)
    B = g.op("Gather", [shape_ids, i64(0)], axis=0)
    flat = g.op("Reshape", [x, i64([-1, C])])
    rows = g.op("Add", [g.op("Mul", [g.op("Range", [i64(0), B, i64(1)]), T]), "last_index"])
    last = g.op("Gather", [flat, rows], axis=0)  # [B,C]
    lm = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    g.nodes.append(helper.make_node("Identity", [codec.matmul(g, last, W[lm], "lm_head_t")],
                                    ["logits"], name="n_lm_head"))

    F = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              helper.make_tensor_value_info("last_index", TensorProto.INT64, ["B"])]
    inputs += [helper.make_tensor_value_info(n, F, ["B", KVH, "S", D]) for n in pk + pv]
    outputs = [helper.make_tensor_value_info("logits", F, ["B", c.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, F, ["B", KVH, "S_out", D]) for n in ok + ov]
    graph = helper.make_graph(g.nodes, "hetserve_llama_gqa", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="hetserve")
    model.ir_version = 8
    return model
