"""Real checkpoints: every Llama-family variant is served exactly as transformers computes it, or refused by name.

A zoo of tiny seeded random-weight checkpoints (tests/zoo.py: made here with transformers and the `gguf` writer),
each built with the real builder. Per variant: FP32 greedy tokens (prefill + the batched decode engines, two rows of
different lengths) equal transformers FP32 for 24 tokens on prompts longer than the sliding window and than
`original_max_position_embeddings`; a cached-prefix prefill (prefix reuse) equals the whole-prompt prefill; the INT8
engines (ORT and native) and every KV wire dtype are gated on teacher-forced KL divergence against FP32 (the gates
are below, measured by the builder on texts of 128 tokens). Refusals are tests too: the message names the key.
"""
import dataclasses
import json
import shutil

import numpy as np
import pytest

import zoo

# mean teacher-forced KLD vs the FP32 engine (which is checked token-exact against transformers: an engine that drops
# what the FP32 engine applies fails here). Measured on this zoo (builder v9, 2026-12-05): int8 2.1e-4..8.7e-4,
# native 2.1e-4..9.5e-4, kv fp16 <= 2e-7, kv int8 1.0e-5..9.0e-5, kv fp8 2.5e-4..2.3e-3 (yarn the highest).
GATES = {"decode_int8": 3e-3, "decode_int8_native": 3e-3, "kv:fp16": 1e-4, "kv:int8": 3e-4, "kv:fp8": 3e-3}
N_NEW = 24


@pytest.fixture(scope="session")
def tok_json():
    return zoo.tokenizer_json()


def _prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 49000, 100).tolist(), rng.integers(3, 49000, 61).tolist()]


def _build(src, out):
    from hetserve.engines.builder import build_engines

    return build_engines(str(src), str(out), tensorrt=False, log=lambda s: None)


@pytest.fixture(scope="module", params=sorted(zoo.VARIANTS))
def variant(request, tmp_path_factory, tok_json):
    d = tmp_path_factory.mktemp(request.param)
    model = zoo.make_hf(d / "hf", request.param, tok_json=tok_json)
    man = _build(d / "hf", d / "eng")
    yield request.param, d / "eng", model, man
    shutil.rmtree(d, ignore_errors=True)


def _greedy_engines(eng_dir, prompts):
    """Greedy tokens of each prompt: prefill_fp32, then each FP32 decode engine running all prompts as one batch."""
    from hetserve.engines.runtime import Engine

    pre = Engine(str(eng_dir), "prefill_fp32", threads=1)
    kvs = [pre.prefill(p) for p in prompts]
    out = {}
    for name in ("decode_fp32", "decode_fp32_standard"):
        batch = Engine(str(eng_dir), name, threads=1).new_batch(len(prompts))
        for _, k, v in kvs:
            batch.add(k, v)
        toks = [[int(lo.argmax())] for lo, _, _ in kvs]
        for _ in range(N_NEW - 1):
            logits = batch.step(np.array([t[-1] for t in toks]))
            for t, lg in zip(toks, logits):
                t.append(int(lg.argmax()))
        out[name] = toks
    return out


def _assert_exact(eng_dir, model, prompts):
    ref = [zoo.greedy(model, p, N_NEW) for p in prompts]
    for name, toks in _greedy_engines(eng_dir, prompts).items():
        for i, (got, want) in enumerate(zip(toks, ref)):
            assert got == want, f"{name} prompt {i}: {sum(a == b for a, b in zip(got, want))}/{N_NEW} equal"


def _assert_gates(man):
    measured = {n: (e.get("quality") or {}).get("mean_kld") for n, e in man["engines"].items()}
    measured.update({f"kv:{n}": q["mean_kld"] for n, q in man["kv_quality"].items()})
    for name, gate in GATES.items():
        assert measured.get(name) is not None, f"{name}: not built or not measured ({sorted(man['engines'])})"
        assert measured[name] <= gate, f"{name}: mean KLD {measured[name]} > gate {gate}"


def test_fp32_greedy_equals_transformers(variant):
    name, eng, model, man = variant
    prompts = _prompts()
    c = man["config"]
    # the prompts reach past what each variant changes: the window, and the pre-scaling context
    assert len(prompts[0]) > max(c["layer_windows"]) and len(prompts[0]) > 64
    _assert_exact(eng, model, prompts)


def test_cached_prefix_prefill_equals_whole_prompt(variant):
    """Prefix reuse: the suffix prefilled on the cached prefix's KV gives the whole prompt's logits and KV."""
    from hetserve.engines.runtime import Engine

    _, eng, _, _ = variant
    p = _prompts()[0]
    for name in ("prefill_fp32", "prefill_int8_native"):
        e = Engine(str(eng), name, threads=1)
        lo, k, v = e.prefill(p)
        _, k1, v1 = e.prefill(p[:40])
        lo2, k2, v2 = e.prefill(p[40:], k1, v1)
        tol = 1e-3 if name == "prefill_fp32" else 3e-2
        np.testing.assert_allclose(lo2, lo, atol=tol * max(1.0, float(np.abs(lo).max())), err_msg=name)
        np.testing.assert_allclose(k2, k[:, :, 40:], atol=tol, err_msg=name)


def test_int8_and_kv_wire_quality_gated(variant):
    _assert_gates(variant[3])


def test_manifest_records_the_semantics(variant):
    name, _, model, man = variant
    c = man["config"]
    hf = model.config
    assert c["arch"] == hf.model_type
    want_rope = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
    assert c["rope"]["type"] == want_rope
    if name == "mistral_window":
        assert c["layer_windows"] == [24, 24]
    elif name == "qwen2_window":  # layers below max_window_layers attend fully (transformers' layer_types)
        assert c["layer_windows"] == [0, 24]
    else:
        assert c["layer_windows"] == [0, 0]


# ---- layouts: transformers 4 config, bf16 shards, Qwen2.5 files --------------------------------------------------
def test_transformers4_config_layout_reads_the_same(tmp_path, tok_json):
    from hetserve.model.checkpoint import load_checkpoint

    zoo.make_hf(tmp_path / "v5", "llama3_rope", tok_json=tok_json)
    shutil.copytree(tmp_path / "v5", tmp_path / "v4")
    zoo.write_hf_config_v4(tmp_path / "v4")
    v4 = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert "rope_scaling" in v4 and "rope_parameters" not in v4
    a, b = load_checkpoint(str(tmp_path / "v5")).config, load_checkpoint(str(tmp_path / "v4")).config
    assert a == dataclasses.replace(b, name=a.name) and a.rope["type"] == "llama3" and a.rope_theta == 500000.0


def test_bf16_sharded_safetensors_lazy_and_exact(tmp_path, tok_json):
    """A bf16 checkpoint in several shards (model.safetensors.index.json): read memory-mapped, tensor by tensor,
    exactly the values transformers holds."""
    from hetserve.model.checkpoint import load_checkpoint

    model = zoo.make_hf(tmp_path, "qwen2", tok_json=tok_json, dtype="bfloat16", shard_bytes=2_000_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ck = load_checkpoint(str(tmp_path))
    sd = {n: t.numpy() for n, t in model.state_dict().items()}
    assert set(ck.weights.shapes) == set(sd) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for n in ck.weights.shapes:
        np.testing.assert_array_equal(ck.weights[n], sd[n], err_msg=n)


def test_bf16_checkpoint_16bit_prefill_weights_exact(tmp_path, tok_json):
    """The prefill/reference graph of large models keeps a bf16 checkpoint's own values (Cast to fp32 per call):
    greedy tokens still equal transformers FP32, the graph stores every MatMul weight in bf16, and the manifest
    says so (the path every build above 2 GiB of FP32 weights takes; forced here on a tiny model)."""
    import onnx

    from hetserve.engines.builder import build_engines

    model = zoo.make_hf(tmp_path / "hf", "llama3_rope", tok_json=tok_json, dtype="bfloat16")
    man = build_engines(str(tmp_path / "hf"), str(tmp_path / "eng"), tensorrt=False, log=lambda s: None,
                        prefill_weights="exact16")
    ref = man["engines"]["prefill_fp32"]
    assert ref["compact"] and "bfloat16 100%" in ref["weights"], ref
    g = onnx.load(str(tmp_path / "eng" / ref["file"]), load_external_data=False)
    inits = {i.name: i.data_type for i in g.graph.initializer}
    src = {n.output[0]: n.input[0] for n in g.graph.node if n.op_type in ("Cast", "Reshape")}

    def stored(w):  # MatMul <- Cast <- Reshape (the cast's ordering dependency) <- the bf16 initializer
        while w in src:
            w = src[w]
        return inits.get(w)
    weights = [stored(n.input[1]) for n in g.graph.node if n.op_type == "MatMul" and n.input[1] in src]
    L = man["config"]["num_layers"]
    assert len(weights) == 7 * L + 1 and set(weights) == {onnx.TensorProto.BFLOAT16}, weights
    _assert_exact(tmp_path / "eng", model, _prompts())
    _assert_gates(man)


def test_qwen25_layout_eos_ids_template_and_vocab(tmp_path, tok_json):
    """Qwen2.5 as published: 151,936-row (tied) embedding, q/k/v biases, several EOS ids in generation_config.json,
    the chat template in tokenizer_config.json (transformers 4) or chat_template.jinja (transformers 5)."""
    from hetserve.model.checkpoint import load_checkpoint

    model = zoo.make_hf(tmp_path / "hf", "qwen2", tok_json=tok_json, vocab_size=151936)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 0]
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(gen))
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    ck = load_checkpoint(str(tmp_path / "hf"))
    assert ck.config.eos_token_ids == (2, 0) and ck.config.vocab_size == 151936 and ck.config.qkv_bias
    assert ck.chat_template == template
    (tmp_path / "hf" / "chat_template.jinja").write_text(template + "{# v5 #}")
    assert load_checkpoint(str(tmp_path / "hf")).chat_template.endswith("{# v5 #}")
    (tmp_path / "hf" / "chat_template.jinja").unlink()
    _build(tmp_path / "hf", tmp_path / "eng")
    _assert_exact(tmp_path / "eng", model, _prompts())


# ---- GGUF as llama.cpp's converter writes it ----------------------------------------------------------------------
def test_llama3_gguf_kquants_rope_freqs_several_eos(tmp_path, tok_json):
    """A published Llama 3.x GGUF layout: K-quant weights (Q4_K/Q5_K/Q6_K next to Q8_0/Q4_0/Q4_1/F16), permuted
    q/k rows, the `rope_freqs` tensor instead of rope_scaling keys, eos + eot ids."""
    import gguf

    from hetserve.model.checkpoint import load_checkpoint

    T = gguf.GGMLQuantizationType
    kw = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    model = zoo.make_hf(tmp_path / "hf", "llama3_rope", tok_json=tok_json, **kw)
    rs = zoo.VARIANTS["llama3_rope"][1]["rope_scaling"]
    freqs = zoo.llama3_rope_freqs(500000.0, 64, rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                                  rs["original_max_position_embeddings"])
    qtypes = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q5_K, "ffn_down.weight": T.Q6_K, "output.weight": T.Q6_K,
              "attn_v.weight": T.Q8_0, "token_embd.weight": T.Q8_0, "attn_output.weight": T.Q4_0,
              "ffn_gate.weight": T.Q4_1, "ffn_up.weight": T.F16}
    path = tmp_path / "llama3.gguf"
    model = zoo.write_gguf(path, tmp_path / "hf", model, "llama", qtypes, rope_freqs=freqs, eos_ids=(2, 0))
    ck = load_checkpoint(str(path))
    assert ck.config.eos_token_ids == (2, 0)
    assert ck.config.rope["type"] == "freq_factors"
    _build(path, tmp_path / "eng")
    _assert_exact(tmp_path / "eng", model, _prompts())


def test_qwen2_gguf_split_files_biases_tied(tmp_path, tok_json):
    """Qwen2 GGUF (q/k/v biases, tied embedding, no q/k permutation) in split files, BF16 and Q8_0 weights."""
    import gguf

    T = gguf.GGMLQuantizationType
    model = zoo.make_hf(tmp_path / "hf", "qwen2", tok_json=tok_json)
    path = tmp_path / "qwen2.gguf"
    model = zoo.write_gguf(path, tmp_path / "hf", model, "qwen2", {"attn_q.weight": T.BF16, "ffn_down.weight": T.Q8_0},
                           split_max_tensors=12)
    parts = sorted(tmp_path.glob("qwen2-*-of-*.gguf"))
    assert len(parts) > 1
    man = _build(parts[0], tmp_path / "eng")
    assert man["config"]["arch"] == "qwen2" and man["config"]["qkv_bias"]
    _assert_exact(tmp_path / "eng", model, _prompts())


def test_split_gguf_with_a_missing_part_is_refused(tmp_path, tok_json):
    from hetserve.model.checkpoint import CheckpointError, load_checkpoint

    model = zoo.make_hf(tmp_path / "hf", "qwen2", tok_json=tok_json)
    zoo.write_gguf(tmp_path / "q.gguf", tmp_path / "hf", model, "qwen2", split_max_tensors=12)
    parts = sorted(tmp_path.glob("q-*-of-*.gguf"))
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=parts[-1].name):
        load_checkpoint(str(parts[0]))


# ---- refusals: the message names the key and its value ------------------------------------------------------------
REFUSED_HF = {
    "longrope rope type": ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8,
                                             "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}},
                           "longrope"),
    "unknown key": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    "gelu activation": ({"hidden_act": "gelu"}, "hidden_act"),
    "quantized checkpoint": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    "partial rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "other architecture": ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "gemma2"),
}


@pytest.fixture(scope="module")
def plain_hf(tmp_path_factory, tok_json):
    d = tmp_path_factory.mktemp("plain")
    zoo.make_hf(d, "plain", tok_json=tok_json)
    return d


@pytest.mark.parametrize("case", sorted(REFUSED_HF))
def test_unimplemented_hf_config_refused_by_name(case, plain_hf, tmp_path):
    from hetserve.model.checkpoint import CheckpointError, load_checkpoint

    replace, key = REFUSED_HF[case]
    shutil.copytree(plain_hf, tmp_path / "ck")
    zoo.write_hf_config_v4(tmp_path / "ck", **replace)
    with pytest.raises(CheckpointError, match=key):
        load_checkpoint(str(tmp_path / "ck"))


@pytest.mark.parametrize("case", ["unknown arch", "unknown key", "unknown tensor"])
def test_unimplemented_gguf_refused_by_name(case, plain_hf, tmp_path):
    import transformers

    from hetserve.model.checkpoint import CheckpointError, load_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(str(plain_hf)).eval()
    path = tmp_path / "m.gguf"
    if case == "unknown arch":
        zoo.write_gguf(path, plain_hf, model, "gemma2")
        key = "gemma2"
    elif case == "unknown key":
        zoo.write_gguf(path, plain_hf, model, "llama", extra_kv={"add_logit_scale": 0.5})
        key = "llama.logit_scale"
    else:
        zoo.write_gguf(path, plain_hf, model, "llama", extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16)})
        key = "blk.0.attn_q_norm.weight"
    with pytest.raises(CheckpointError, match=key):
        load_checkpoint(str(path))


# ---- an engine this checkpoint cannot have: served on its fallback, or refused before any server starts -----------
def test_native_unbuilt_checkpoint_serves_on_the_fallback(tmp_path, tok_json):
    """intermediate_size 136 is not a shape the native engine runs: the build records it under `unbuilt` with the
    engine served instead, and `hetserve up` with the default engines (decode_int8_native among them) serves."""
    import os
    import subprocess
    import sys

    from hetserve.cli import _unservable_engines
    from hetserve.engines.runtime import load_engine

    zoo.make_hf(tmp_path / "hf", "plain", tok_json=tok_json, intermediate_size=136)
    man = _build(tmp_path / "hf", tmp_path / "eng")
    assert "decode_int8_native" not in man["engines"]
    assert man["unbuilt"]["decode_int8_native"]["fallback"] == "decode_int8"
    assert "136" in man["unbuilt"]["decode_int8_native"]["reason"]
    assert load_engine(str(tmp_path / "eng"), "decode_int8_native").name == "decode_int8"
    assert load_engine(str(tmp_path / "eng"), "prefill_int8_native").name == "prefill_fp32"
    assert _unservable_engines(man, str(tmp_path / "eng")) == []
    no_fallback = dict(man, unbuilt={})
    assert any("decode_int8_native" in p for p in _unservable_engines(no_fallback, str(tmp_path / "eng")))

    base = int(os.environ.get("HETSERVE_ZOO_BASE_PORT", "25500"))
    env = {**os.environ, "HETSERVE_DECODE_ENGINES": "decode_fp32,decode_int8_native"}
    r = subprocess.run([sys.executable, "-m", "hetserve", "up", "--checkpoint", str(tmp_path / "hf"),
                        "--engine-dir", str(tmp_path / "eng"), "--base-port", str(base), "--no-openai",
                        "--exit-after-prompt", "--prompt", "Hello", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=600, env=env,
                       cwd=str(zoo.Path(__file__).resolve().parents[1] / "python_backends"))
    assert r.returncode == 0, r.stderr[-3000:]
    # a configured engine with neither a build nor a fallback: refused before any server starts
    env["HETSERVE_DECODE_ENGINES"] = "decode_fp32,decode_bogus"
    r = subprocess.run([sys.executable, "-m", "hetserve", "up", "--checkpoint", str(tmp_path / "hf"),
                        "--engine-dir", str(tmp_path / "eng"), "--base-port", str(base), "--no-openai",
                        "--exit-after-prompt"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(zoo.Path(__file__).resolve().parents[1] / "python_backends"))
    assert r.returncode == 1 and "decode_bogus" in r.stderr and "starting" not in r.stderr, r.stderr[-2000:]


def test_readme_supported_models_table_is_current():
    from hetserve.model.support import BEGIN, END, table

    readme = (zoo.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert BEGIN in readme and END in readme
    have = readme[readme.index(BEGIN):readme.index(END) + len(END)]
    assert have == table(), "README's Supported models table is stale: python3 -m hetserve.model.support"
