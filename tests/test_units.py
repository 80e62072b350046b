"""Fast unit tests: wire format, sampling, masks, tokenizer, allocator, batching (engine-level, no servers)."""
import threading

import numpy as np
import pytest

from conftest import run_scheduler
from hetserve.kv import wire
from hetserve.kv.transport.shm import RangeAllocator
from hetserve.sampling import SamplingError, SamplingParams, sample


def _kv(T=7, L=30, H=3, D=64, seed=0):
    r = np.random.default_rng(seed)
    return (r.standard_normal((L, H, T, D)) * 3).astype(np.float32), r.standard_normal((L, H, T, D)).astype(np.float32)


def test_wire_fp32_roundtrip_exact():
    k, v = _kv()
    hdr, payload = wire.encode(k, v, "abc", "fp32")
    wire.verify(hdr, payload, "abc", (30, 3, 64))
    k2, v2 = wire.decode(wire.KVHeader.from_json(hdr.to_json()), payload)
    assert np.array_equal(k, k2) and np.array_equal(v, v2)


def test_wire_int8_halves_fp16_bytes_and_is_close():
    k, v = _kv(T=128)
    h16, p16 = wire.encode(k, v, "abc", "fp16")
    h8, p8 = wire.encode(k, v, "abc", "int8")
    assert p8.nbytes < 0.54 * p16.nbytes  # 2x fewer bytes (+ per-token fp32 scales: 2/head_dim)
    assert h8.scale_scheme == "per-token-symmetric"
    k8, v8 = wire.decode(h8, p8)
    k16, _ = wire.decode(h16, p16)
    # symmetric int8 error bound: half a quantisation step of each token (tests/test_kv_wire.py has more)
    step = np.abs(k).max(axis=3, keepdims=True) / 127
    assert np.all(np.abs(k8 - k) <= step / 2 + 1e-6)
    assert np.max(np.abs(k16 - k)) < 1e-2


@pytest.mark.parametrize("mutate,match", [
    (lambda h, p: setattr(h, "compat_hash", "other"), "model hash mismatch"),
    (lambda h, p: p.__setitem__(10, p[10] ^ 0xFF), "checksum mismatch"),
    (lambda h, p: setattr(h, "layout", "T,L,KVH,D"), "layout mismatch"),
    (lambda h, p: setattr(h, "num_kv_heads", 9), "shape mismatch"),
    (lambda h, p: setattr(h, "num_tokens", 8), "payload size"),
])
def test_wire_refuses_mismatch(mutate, match):
    k, v = _kv()
    hdr, payload = wire.encode(k, v, "abc", "fp32")
    mutate(hdr, payload)
    with pytest.raises(wire.KVWireError, match=match):
        wire.verify(hdr, payload, "abc", (30, 3, 64))


def test_wire_malformed_header():
    with pytest.raises(wire.KVWireError, match="malformed"):
        wire.KVHeader.from_json(b"{not json")


def test_sampling_greedy_and_seeded():
    logits = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert sample(logits, SamplingParams(), 0) == int(np.argmax(logits))
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=42)
    a = [sample(logits, p, i) for i in range(20)]
    assert a == [sample(logits, p, i) for i in range(20)]  # reproducible
    assert len(set(a)) > 1
    top50 = set(np.argsort(-logits)[:50].tolist())
    assert set(a) <= top50
    q = SamplingParams(temperature=0.8, seed=43)
    assert [sample(logits, q, i) for i in range(20)] != [sample(logits, SamplingParams(temperature=0.8, seed=42), i)
                                                          for i in range(20)]


def test_sampler_penalties_bias_min_p_and_logprobs():
    """The logit processors against hand-computed expectations (vLLM / OpenAI semantics)."""
    from hetserve.sampling import TokenSampler, log_softmax

    logits = np.array([3.0, 2.9, 1.0, -1.0, 0.5], np.float32)
    # logit_bias: a large bias makes token 3 the greedy choice; -100 bans token 0
    tok, _ = TokenSampler(SamplingParams(logit_bias={3: 10.0})).next(logits, 0)
    assert tok == 3
    assert TokenSampler(SamplingParams(logit_bias={0: -100.0})).next(logits, 0)[0] == 1
    # presence / frequency: counts of the output only; token 0 seen twice loses 0.5 + 2 * 0.1 = 0.7 -> token 1 wins
    s = TokenSampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.1), prompt=[0, 0, 0], output=[0, 0])
    x = s.process(logits)
    assert np.isclose(x[0], 3.0 - 0.7) and np.isclose(x[1], 2.9) and s.next(logits, 2)[0] == 1
    # repetition penalty: prompt + output ids, positive logits divided, negative multiplied
    x = TokenSampler(SamplingParams(repetition_penalty=2.0), prompt=[0, 3], output=[4]).process(logits)
    assert np.allclose(x, [1.5, 2.9, 1.0, -2.0, 0.25])
    # min_p: with temperature 1 only tokens with p >= 0.5 * p_max survive (tokens 0 and 1 here)
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    assert {TokenSampler(p).next(logits, i)[0] for i in range(200)} == {0, 1}
    # logprobs: the raw log-softmax, top-N sorted, whatever the processors did
    tok, lp = TokenSampler(SamplingParams(top_logprobs=3, logit_bias={4: 50.0})).next(logits, 0)
    ref = log_softmax(logits)
    assert tok == 4 and np.isclose(lp.logprob[0], ref[4]) and lp.top_ids[0] == [0, 1, 2]
    assert np.allclose(lp.top_values[0], ref[[0, 1, 2]])


def test_choices_draw_their_own_streams_and_choice_0_matches_n_1():
    logits = np.random.default_rng(2).standard_normal(500).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=7)
    one = [sample(logits, p, i) for i in range(30)]
    assert [sample(logits, p.for_choice(0), i) for i in range(30)] == one
    assert [sample(logits, p.for_choice(1), i) for i in range(30)] != one


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(max_tokens=10**9), dict(temperature=-1.0),
                                dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(seed=-2),
                                dict(temperature=float("nan")), dict(min_p=1.5), dict(presence_penalty=3.0),
                                dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0), dict(top_logprobs=21),
                                dict(logit_bias={5: 200.0}), dict(logit_bias={-1: 1.0})])
def test_sampling_validation(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw).validate(4096)


def test_causal_mask():
    from hetserve.engines.runtime import causal_mask

    m = causal_mask([2], [3], 2, 3)[0, 0] == 0
    assert m.tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                          [True, True, True, True, True]]


def test_range_allocator():
    a = RangeAllocator(1024)
    x, y = a.alloc(100), a.alloc(200)
    assert x == 0 and y == 128
    assert a.alloc(2000) is None
    from hetserve.kv.transport import CapacityExhausted
    with pytest.raises(CapacityExhausted, match=r"shm region full \(640 B free of 1024, need 2000; HETSERVE_SHM_BYTES"):
        a.reserve(2000, "shm region", "HETSERVE_SHM_BYTES")
    a.release(x, 100)
    a.release(y, 200)
    assert a.free == [(0, 1024)]

    def worker():
        for _ in range(200):
            o = a.alloc(64)
            if o is not None:
                a.release(o, 64)
    ts = [threading.Thread(target=worker) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert a.free_bytes() == 1024


def test_tokenizer_matches_transformers(tokenizer):
    transformers = pytest.importorskip("transformers")
    import os

    from hetserve.model import default_checkpoint_path

    ck = default_checkpoint_path()
    ht = transformers.AutoTokenizer.from_pretrained(os.path.dirname(ck), gguf_file=os.path.basename(ck))
    for s in ["Hello world!", "12345 apples cost $3.50", "  spaces\n\nnewlines\ttabs", "Ünïcödé 日本語 🚀",
              "<|im_start|>user\nhi<|im_end|>\n", "don't won't I'm", "def f(x):\n    return x**2\n"]:
        assert tokenizer.encode(s) == ht.encode(s, add_special_tokens=False), s
        assert tokenizer.decode(tokenizer.encode(s), skip_special_tokens=False) == s
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(msgs) == ht.apply_chat_template(msgs, tokenize=False,
                                                                        add_generation_prompt=True)


def test_incremental_detokenizer_utf8(tokenizer):
    from hetserve.tokenizer import text_delta

    text = "Café 日本語 🚀 done"
    ids = tokenizer.encode(text)
    out = "".join(text_delta(tokenizer, ids[:i + 1], 1) for i in range(len(ids)))
    assert out == text
    assert all("\ufffd" not in text_delta(tokenizer, ids[:i + 1], 1) for i in range(len(ids)))


def test_batched_decode_equals_unbatched(engine_dir, prompt_ids):
    """Continuous batching: sequences joining at different steps give the same greedy tokens as one-by-one."""
    from hetserve.engines.runtime import Engine

    pre = Engine(engine_dir, "prefill_fp32", threads=2)
    dec = Engine(engine_dir, "decode_fp32", threads=2)
    prompts = list(prompt_ids.items())[:5]
    n = 16

    def unbatched(ids):
        lo, k, v = pre.prefill(ids)
        out = [int(lo.argmax())]
        for _ in range(n - 1):
            lo, k2, v2 = pre.prefill([out[-1]], k, v)
            k, v = np.concatenate([k, k2], 2), np.concatenate([v, v2], 2)
            out.append(int(lo.argmax()))
        return out

    results, st = run_scheduler(pre, dec, prompts, n, stagger=0.05, timeout_s=120)  # joins mid-flight
    assert st["admitted"] == len(prompts)
    for p, ids in prompts:
        assert results[p] == unbatched(ids), p


def _teacher_forced_agreement(engine_dir, name, prompt_ids, reference_tokens):
    from hetserve.engines.runtime import Engine

    pre = Engine(engine_dir, "prefill_fp32", threads=2)
    dec = Engine(engine_dir, name, threads=2)
    agree = total = 0
    for p, ids in prompt_ids.items():
        ref = reference_tokens[p]
        _, k, v = pre.prefill(ids)
        preds = []
        for i in range(1, 32):  # INT8 decode continues from FP32-prefill KV, fed the reference's tokens
            lo, k2, v2 = dec.prefill([ref[i - 1]], k, v)
            k, v = np.concatenate([k, k2], 2), np.concatenate([v, v2], 2)
            preds.append(int(lo.argmax()))
        agree += sum(int(a == b) for a, b in zip(preds, ref[1:]))
        total += 31
    return agree, total


def test_int8_decode_teacher_forced_agreement(engine_dir, prompt_ids, reference_tokens):
    """Both INT8 decode engines vs the transformers reference, teacher-forced over 10 prompts x 31 tokens. The
    native engine (the decode server's default INT8 engine since issue 11) stays within 1% (3 tokens) of the ONNX
    Runtime one it replaced: on this small set the two differ by near-tie flips (measured 303 vs 305 of 310 on a
    Zen 4 box); the held-out quality gate (600 tokens, tests/test_quality.py) has the native one ahead on KLD
    (0.00251 vs 0.00267) and the same top-1 (95.8%)."""
    got = {n: _teacher_forced_agreement(engine_dir, n, prompt_ids, reference_tokens)
           for n in ("decode_int8", "decode_int8_native")}
    for n, (agree, total) in got.items():
        print(f"\n{n} teacher-forced agreement with reference: {agree / total:.3f} ({agree}/{total})")
        assert agree / total >= 0.90
    assert got["decode_int8_native"][0] >= got["decode_int8"][0] - 3


def test_python_env_dirs_left_by_killed_servers_are_swept_only_when_no_tritonserver_runs(tmp_path):
    """Triton's python backend leaves /tmp/python_env_XXXXXX behind a killed server; the launcher removes the
    empty ones once no tritonserver runs on the machine, never a non-empty one or anything else."""
    from hetserve.server import sweep_python_envs

    (tmp_path / "python_env_aaaaaa").mkdir()
    (tmp_path / "python_env_bbbbbb").mkdir()
    (tmp_path / "python_env_bbbbbb" / "env.tar.gz").write_bytes(b"x")
    (tmp_path / "other_dir").mkdir()
    assert sweep_python_envs(tmp_path, alive=lambda: True) == []
    assert (tmp_path / "python_env_aaaaaa").exists()
    assert sweep_python_envs(tmp_path, alive=lambda: False) == ["python_env_aaaaaa"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_dir", "python_env_bbbbbb"]


def test_engine_cpu_clock_counts_the_calling_threads_cpu_not_its_waiting():
    """engines/cpu_clock.py: CPU work inside timed() is counted, sleeping inside it is not."""
    import time

    from hetserve.engines.cpu_clock import EngineCpuClock

    clock = EngineCpuClock()
    with clock.timed():
        time.sleep(0.2)
    assert clock.seconds() < 0.05
    with clock.timed():
        t = time.thread_time()
        while time.thread_time() - t < 0.1:
            pass
    assert 0.1 <= clock.seconds() < 0.3


def test_stub_watch_leaves_a_model_alone_unless_it_reports_ready():
    """stub_watch.StubWatch (unit, with a fake process table): a model with fewer stubs than at start is reloaded
    only when Triton says it is READY; here nothing answers, as when the model is loading or was unloaded on
    purpose, so nothing is reloaded. The reload itself is tested live (test_reliability.py)."""
    from hetserve.stub_watch import StubWatch

    table = [{"prefill": 1, "llm": 1}, {"llm": 1}]
    w = StubWatch(0, "127.0.0.1:9", "h", "k", 3600.0, counts=lambda pid: table[0])
    w.start()
    try:
        assert w.baseline == {"prefill": 1, "llm": 1}
        table[0] = table[1]
        assert w.check() == [] and not w.reloads
    finally:
        w.close()
