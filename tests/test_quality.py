"""Quality gate (engines/quality.py): figures `hetserve build` writes per engine and KV wire dtype, their bounds,
INT8 vs llama.cpp Q8_0 on the same held-out texts, the QDQ graphs (TensorRT-parseable, run by ONNX Runtime and
by the decode server)."""
import os

import numpy as np
import pytest

from hetserve.engines import quality
from hetserve.engines.manifest import read_manifest


@pytest.fixture(scope="module")
def man(engine_dir):
    return read_manifest(engine_dir)


def test_manifest_quality_per_engine_and_kv_dtype_within_bounds(man):
    rows = {}
    for name, e in man["engines"].items():
        if not name.startswith("decode_") or e["backend"] not in ("onnxruntime", "native"):
            continue
        q = e["quality"]
        assert q["texts"] == f"eval/{quality.TEXTS_VERSION}" and q["tokens"] == 10 * (quality.N_TOKENS - quality.CTX)
        assert q["reference"] == quality.REFERENCE
        rows[name] = (e["precision"], q)
    for dt in ("fp16", "int8", "fp8"):
        rows[f"kv:{dt}"] = (f"kv:{dt}", man["kv_quality"][dt])
    assert {p for p, _ in rows.values()} >= {"fp32", "int8", "int8_qdq", "fp8_qdq", "kv:fp16", "kv:int8", "kv:fp8"}
    for name, (key, q) in rows.items():
        print(f"{name:22s} mean KLD {q['mean_kld']:.6f} same-top {q['same_top_pct']:.1f}%")
        assert q["mean_kld"] <= quality.BOUNDS[key], (name, q)
    assert rows["kv:int8"][1]["mean_kld"] <= 3e-4  # issue 15 target (v1 per-head scales: ~1e-3)
    assert rows["kv:int8"][1]["same_top_pct"] >= 98.0 and rows["decode_int8"][1]["same_top_pct"] >= 95.0
    # issue 11: the native INT8 engine (the decode server's default) is not worse than the one it replaced
    nat, ort = rows["decode_int8_native"][1], rows["decode_int8"][1]
    assert nat["mean_kld"] <= ort["mean_kld"] * 1.05 and nat["same_top_pct"] >= ort["same_top_pct"] - 0.5


def test_gate_can_fail(engine_dir):
    """A broken KV handoff (V zeroed) or noise on the logits is far outside every bound."""
    from hetserve.engines.manifest import load_tokenizer
    from hetserve.engines.runtime import Engine

    ids = quality.token_matrix(load_tokenizer(engine_dir), quality.EVAL_TEXTS[:2])
    eng = Engine(engine_dir, quality.REFERENCE, threads=1)
    ref = quality.teacher_forced(eng, ids)
    broken = quality.teacher_forced(eng, ids, kv_roundtrip=lambda k, v: (k, np.zeros_like(v)))
    q = quality.compare(ref, broken, "t")
    assert q.mean_kld > 10 * max(quality.BOUNDS.values()) and q.same_top_pct < 90
    assert quality.compare(ref, ref, "t").mean_kld == 0.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_compare_equals_the_textbook_kld():
    """compare's KLD (sum p (x - y) - lse x + lse y, threaded chunks) is sum p (log p - log q) in float64, and its
    same-top-1 the argmax of the log-probabilities: logits far apart, near each other, shifted by a constant
    (KLD 0), and more positions than one chunk."""
    rng = np.random.default_rng(3)
    ref = (rng.standard_normal((70, 500)) * 4).astype(np.float32)
    for other in (ref + rng.standard_normal(ref.shape).astype(np.float32),
                  ref + np.float32(1e-3) * rng.standard_normal(ref.shape).astype(np.float32),
                  ref + np.float32(25.0)):
        lp, lq = _log_softmax(ref), _log_softmax(other)
        k = np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0)
        got = quality.compare(ref[:, None], other[:, None], "t", chunk=16)
        assert got.tokens == 70
        assert abs(got.mean_kld - k.mean()) <= 1e-12 + 1e-9 * k.mean()
        assert abs(got.p99_kld - np.percentile(k, 99)) <= 1e-12 + 1e-9 * k.max()
        assert got.same_top_pct == (lp.argmax(-1) == lq.argmax(-1)).mean() * 100


def test_native_rows_per_core_equal_one_batch(engine_dir, monkeypatch):
    """The gate runs a native engine's rows on one engine per core: the logits are those of one batch, bit for
    bit (three engines over four rows: uneven parts)."""
    from hetserve.engines.manifest import load_tokenizer

    ids = quality.token_matrix(load_tokenizer(engine_dir), quality.EVAL_TEXTS[:4])
    eng = quality.open_for_scoring(engine_dir, "decode_int8_native")
    one = quality.teacher_forced(eng, ids)
    monkeypatch.setattr(quality.os, "cpu_count", lambda: 3)
    opened = []

    def reopen():
        opened.append(quality.open_for_scoring(engine_dir, "decode_int8_native"))
        return opened[-1]
    split = quality.teacher_forced_per_core(eng, ids, reopen)
    assert len(opened) == 2 and np.array_equal(one, split)


def test_score_view_equals_one_step_per_token(engine_dir):
    """The gate scores standard-op graphs in one call (score view); it must give what one decode step per token
    gives: the same logits for the FP32 graph (plain and after a KV wire round trip), and the same KLD for the FP8
    QDQ graph (its per-element FP8 rounding turns float-order differences into different roundings, so logits are
    compared through the figure the gate reports)."""
    from hetserve.engines.manifest import load_tokenizer
    from hetserve.engines.runtime import Engine

    ids = quality.token_matrix(load_tokenizer(engine_dir), quality.EVAL_TEXTS[:4])
    name = quality.REFERENCE
    steps, view = Engine(engine_dir, name, threads=1), quality.open_for_scoring(engine_dir, name, threads=1)
    assert view._score_view and not steps._score_view
    for rt in (None, quality.wire_roundtrip("int8")):
        a = quality.teacher_forced(steps, ids, kv_roundtrip=rt)
        b = quality.teacher_forced(view, ids, kv_roundtrip=rt)
        assert a.shape == b.shape == (4, quality.N_TOKENS - quality.CTX, steps.config.vocab_size)
        assert np.abs(a - b).max() < 2e-3 * max(1.0, float(np.abs(a).max()))
    ref = b if rt is None else quality.teacher_forced(view, ids)
    fp8 = "decode_fp8_qdq"
    k_steps = quality.compare(ref, quality.teacher_forced(Engine(engine_dir, fp8, threads=1), ids), "t").mean_kld
    k_view = quality.compare(ref, quality.teacher_forced(quality.open_for_scoring(engine_dir, fp8, threads=1), ids),
                             "t").mean_kld
    assert abs(k_steps - k_view) <= 0.2 * k_steps, (k_steps, k_view)


def test_int8_vs_llamacpp_q8_0_same_texts(engine_dir, man, tmp_path_factory):
    """INT8 decode mean KLD (both INT8 engines) <= 0.7x llama.cpp Q8_0's on the held-out texts (Q8_0 made by
    llama.cpp's own quantizer from the same GGUF; logits of llama.cpp F32 and our FP32 engine agree to ~1e-6 KLD)."""
    pytest.importorskip("llama_cpp")
    rows = quality.llamacpp_rows(engine_dir, str(tmp_path_factory.mktemp("llamacpp")))
    q8 = rows["llamacpp_q8_0_vs_llamacpp_f32"]["mean_kld"]
    assert rows["llamacpp_f32_vs_hetserve_fp32"]["mean_kld"] < 1e-4  # same model, same texts, same ids
    for name in ("decode_int8", "decode_int8_native"):  # ONNX Runtime MatMulNBits; native W8A8, fp16 KV cache
        ours = man["engines"][name]["quality"]["mean_kld"]
        print(f"{name} {ours:.6f} vs llama.cpp Q8_0 {q8:.6f} (ratio {ours / q8:.2f}); "
              f"llama.cpp F32 vs our FP32 {rows['llamacpp_f32_vs_hetserve_fp32']['mean_kld']:.2e}")
        assert ours <= 0.7 * q8, name


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_qdq_graph_is_standard_ops_with_qdq(man, engine_dir, kind):
    import onnx

    m = onnx.load(os.path.join(engine_dir, man["engines"][f"decode_{kind}_qdq"]["file"]), load_external_data=False)
    assert {o.domain for o in m.opset_import} == {""} and m.opset_import[0].version == 19
    ops = [n.op_type for n in m.graph.node]
    assert all(n.domain in ("", "ai.onnx") for n in m.graph.node)  # TensorRT's parser: no com.microsoft ops
    n_mm = sum(1 for n in m.graph.node if n.op_type == "MatMul" and n.input[1].endswith("_dq"))
    lm_quantized = kind == "int8"  # the FP8 recipe leaves lm_head in float (builder.FP8_KEEP)
    assert n_mm == ops.count("DequantizeLinear") - ops.count("QuantizeLinear") == 7 * 30 + lm_quantized
    assert any(n.op_type == "MatMul" and n.input[1] == "lm_head_t" for n in m.graph.node) != lm_quantized
    wtype = {"int8": onnx.TensorProto.INT8, "fp8": onnx.TensorProto.FLOAT8E4M3FN}[kind]
    assert {i.data_type for i in m.graph.initializer if i.name.endswith("_q")} == {wtype}
    if kind == "fp8":  # activations quantized too: one Q/DQ per distinct MatMul input (q/k/v share one)
        assert ops.count("QuantizeLinear") == 30 * 4


@pytest.fixture(scope="module")
def qdq_topology(engine_dir):
    from hetserve.topology import Topology

    base = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000")) + 500
    env = {"HETSERVE_DECODE_ENGINES": "decode_fp32,decode_int8_qdq,decode_fp8_qdq", "HETSERVE_BREAKER_P99_MS": "60000",
           "HETSERVE_KV_TIMEOUT_MS": "2000"}
    with Topology(engine_dir, base_port=base, env=env) as topo:
        yield topo


FP8_TIE = 0.75  # logits; the FP8 QDQ decode engine's top-1/top-2 gaps here are 0.33-1.15


@pytest.mark.parametrize("prec", ["int8_qdq", "fp8_qdq"])
def test_decode_server_runs_qdq_engines(qdq_topology, engine_dir, tokenizer, prec):
    """decode_precision=<qdq> on the live servers gives the greedy tokens of the same engines run here (FP32
    prefill, fp32 KV wire, then the QDQ decode engine), teacher-forced on the server's tokens: each one is the
    local argmax, or (fp8 only) within FP8_TIE logits of it. The server's batched step and this one-row loop run
    different kernels; FP8 QDQ (same top-1 87.5% vs FP32) flips near ties between them on some CPUs (measured on
    an AVX2 EPYC: one token of 8, 0.40 logits from the local top-1), INT8 QDQ must match exactly."""
    from hetserve import client
    from hetserve.engines.runtime import Engine

    prompt = "The three primary colours are"
    g = client.generate(qdq_topology.prefill_grpc, prompt, max_tokens=8, ignore_eos=True, decode_precision=prec,
                        kv_dtype="fp32", apply_chat_template=False)
    pre, dec = Engine(engine_dir, "prefill_fp32", threads=1), Engine(engine_dir, f"decode_{prec}", threads=1)
    ids = tokenizer.encode(prompt)
    lo, k, v = pre.prefill(ids)
    assert len(g.token_ids) == 8
    gaps = []
    for t in g.token_ids:
        gaps.append(float(lo.max() - lo[t]))  # 0 when the server's token is the local argmax
        lo, nk, nv = dec.prefill([t], k, v)
        k, v = np.concatenate([k, nk], axis=2), np.concatenate([v, nv], axis=2)
    tie = FP8_TIE if prec == "fp8_qdq" else 0.0
    assert max(gaps) <= tie and sum(x > 0 for x in gaps) <= (2 if tie else 0), (prec, g.token_ids, gaps)
