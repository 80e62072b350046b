"""KV wire v3: per-token int8 / fp8 scales, HMAC tag, version + scheme refusal, and KV handoff between precisions.

The unit tests use synthetic KV; the handoff tests use the real built engines (FP32 prefill graph, INT8 decode
graph) and compare the next-token logits from handed-off KV with a full recompute.
"""
import numpy as np
import pytest

from hetserve.engines import manifest
from hetserve.engines.quality import compare
from hetserve.kv import wire

SHAPE = (30, 3, 64)


def _kv(T=9, seed=0):
    r = np.random.default_rng(seed)
    k = r.standard_normal((30, 3, T, 64)).astype(np.float32) * 3
    k[:, :, 0] *= 40  # an outlier token (attention sinks look like this): per-token scales keep the rest fine
    return k, r.standard_normal((30, 3, T, 64)).astype(np.float32)


def test_int8_per_token_error_bound_and_bytes():
    k, v = _kv()
    h8, p8 = wire.encode(k, v, "abc", "int8")
    assert (h8.version, h8.scale_scheme, h8.integrity) == (3, "per-token-symmetric", "hmac-sha256")
    assert p8.nbytes == wire.payload_nbytes("int8", 30, 3, 9, 64) == 2 * 30 * 3 * 9 * (64 + 4)
    k8, v8 = wire.decode(h8, p8)
    for x, y in ((k, k8), (v, v8)):
        step = np.abs(x).max(axis=-1, keepdims=True) / 127  # per token of each layer and head
        assert np.all(np.abs(y - x) <= step / 2 + 1e-6)
    # the outlier token does not coarsen the others (v1's one scale per layer x head would: 40x the step)
    assert np.abs(k8[:, :, 1:] - k[:, :, 1:]).max() < 3 * 4.5 / 127


def test_fp8_e4m3_error_bound():
    k, v = _kv(seed=1)
    h, p = wire.encode(k, v, "abc", "fp8")
    assert h.scale_scheme == "per-token-e4m3" and p.nbytes == wire.payload_nbytes("int8", 30, 3, 9, 64)
    wire.verify(wire.KVHeader.from_json(h.to_json()), p, "abc", SHAPE)
    k8, v8 = wire.decode(h, p)
    for x, y in ((k, k8), (v, v8)):
        s = np.abs(x).max(axis=-1, keepdims=True) / 448
        # E4M3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 (x s)
        assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) / 16, s * 2.0 ** -10) + 1e-6)
        assert np.abs(y - x).max() > 0  # it is lossy: the test would notice a silent fp16 path


@pytest.mark.parametrize("dt", ["int8", "fp8"])
def test_zero_kv_roundtrips(dt):
    z = np.zeros((30, 3, 2, 64), np.float32)
    h, p = wire.encode(z, z, "abc", dt)
    k, v = wire.decode(h, p)
    assert not k.any() and not v.any()


def test_older_peers_refused_clearly():
    k, v = _kv()
    h, p = wire.encode(k, v, "abc", "int8")
    h.version = 1
    with pytest.raises(wire.KVWireError, match=r"wire version 1 from the sender != 3 here.*same hetserve"):
        wire.verify(h, p, "abc", SHAPE)
    # what a v2 sender put on the wire (crc32, no tag): refused by version, not as a confusing field error
    v2 = {k_: v_ for k_, v_ in wire.encode(k, v, "abc", "int8")[0].__dict__.items() if k_ not in ("mac", "integrity")}
    v2.update(version=2, checksum=123)
    import json
    with pytest.raises(wire.KVWireError, match=r"wire version 2 from the sender != 3"):
        wire.KVHeader.from_json(json.dumps(v2))


def test_kv_without_the_deployment_key_is_refused(monkeypatch):
    """A sender that does not hold the deployment's KV key cannot produce KV that verifies; a header field
    changed after signing (a forged token count with a payload to match) fails the tag too."""
    monkeypatch.setenv("HETSERVE_KV_KEY", "deployment-a")
    k, v = _kv()
    h, p = wire.encode(k, v, "abc", "fp16")
    wire.verify(wire.KVHeader.from_json(h.to_json()), p, "abc", SHAPE)  # same key: accepted
    monkeypatch.setenv("HETSERVE_KV_KEY", "deployment-b")
    with pytest.raises(wire.KVWireError, match="checksum mismatch.*deployment's KV key"):
        wire.verify(h, p, "abc", SHAPE)
    h2, p2 = wire.encode(k, v, "abc", "fp16", key=b"attacker")
    with pytest.raises(wire.KVWireError, match="checksum mismatch"):
        wire.verify(h2, p2, "abc", SHAPE)
    monkeypatch.setenv("HETSERVE_KV_KEY", "deployment-a")
    h3, p3 = wire.encode(k[:, :, :4], v[:, :, :4], "abc", "fp16")
    h3.num_tokens, h3.nbytes = h.num_tokens, h.nbytes  # claim the longer KV, send its bytes, keep the old tag
    with pytest.raises(wire.KVWireError, match="checksum mismatch"):
        wire.verify(h3, p, "abc", SHAPE)


def test_kv_key_derives_from_the_admin_key(monkeypatch):
    monkeypatch.delenv("HETSERVE_KV_KEY", raising=False)
    monkeypatch.setenv("HETSERVE_ADMIN_KEY", "one")
    a = wire.kv_key()
    monkeypatch.setenv("HETSERVE_ADMIN_KEY", "two")
    assert wire.kv_key() != a and len(a) == 32 and a != b"one"  # derived, not the admin key itself


def test_wrong_scale_scheme_refused():
    k, v = _kv()
    h, p = wire.encode(k, v, "abc", "int8")
    h.scale_scheme = "per-head-symmetric"  # what a v1 sender writes
    with pytest.raises(wire.KVWireError, match="scale scheme 'per-head-symmetric' for int8"):
        wire.verify(h, p, "abc", SHAPE)


def test_compat_hash_carries_wire_version(monkeypatch):
    from hetserve.model.checkpoint import LlamaConfig

    cfg = LlamaConfig(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4,
                      vocab_size=10, rope={"type": "default", "theta": 1e4}, rms_norm_eps=1e-5, max_position=64,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(), name="t")
    a = manifest.compat_hash("src", cfg)
    monkeypatch.setattr(manifest, "KV_WIRE_VERSION", 1)
    assert manifest.compat_hash("src", cfg) != a  # an old build's hash differs: doctor/kv_ingest refuse it


# --- handoff between precisions, real engines -------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(engine_dir):
    from hetserve.engines.runtime import Engine

    return {n: Engine(engine_dir, n, threads=1) for n in ("prefill_fp32", "decode_int8")}


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("The quick brown fox jumps over the lazy dog because it wanted to see the river.")


def _next_logits(eng, ids, k, v):
    lo, _, _ = eng.prefill(ids[-1:], k, v)
    return lo


# Mean KLD over several split points (one next-token distribution is too noisy for the INT8-compute engine:
# its activation quantization amplifies small KV differences). Bounds are ~3x what this build measured.
SPLITS = 8


@pytest.mark.parametrize("wire_dtype,tol", [("int8", {"prefill_fp32": 1.2e-3, "decode_int8": 8e-3}),
                                            ("fp8", {"prefill_fp32": 4e-3, "decode_int8": 1.5e-2})])
def test_fp16_prefill_kv_to_8bit_decode(engines, prompt, wire_dtype, tol):
    """High -> low: FP16 KV (what an FP16 prefill engine emits) -> int8/fp8 wire -> INT8 and FP32 decode.
    Reference: the same decode engine given the FP16 KV unchanged (the FP32 engine: also its full recompute).
    Measured at the last SPLITS positions of the prompt (KV of prompt[:s], next token prompt[s])."""
    pre = engines["prefill_fp32"]
    want = {n: [] for n in engines}
    got = {n: [] for n in engines}
    for s in range(len(prompt) - SPLITS, len(prompt)):
        ids = prompt[:s + 1]
        _, k, v = pre.prefill(ids[:-1])
        k16, v16 = (x.astype(np.float16).astype(np.float32) for x in (k, v))
        h, p = wire.encode(k16, v16, pre.compat_hash, wire_dtype)
        wire.verify(wire.KVHeader.from_json(h.to_json()), p, pre.compat_hash, SHAPE)
        kq, vq = wire.decode(h, p)
        if s == len(prompt) - 1:
            full, _, _ = pre.prefill(ids)
            assert np.abs(_next_logits(pre, ids, k16, v16) - full).max() < 1e-2  # fp16 KV itself is ~lossless
        for name, eng in engines.items():
            want[name].append(_next_logits(eng, ids, k16, v16))
            got[name].append(_next_logits(eng, ids, kq, vq))
    for name in engines:
        w, g = np.stack(want[name]), np.stack(got[name])
        q = compare(w, g, "t")
        print(name, wire_dtype, "mean KLD", q.mean_kld, "same top-1", q.same_top_pct)
        assert q.mean_kld < tol[name], (name, wire_dtype, q.mean_kld)
        assert q.same_top_pct >= 75.0, (name, wire_dtype, q.same_top_pct)


def test_int8_decode_kv_back_to_fp16_and_fp32(engines, prompt):
    """Low -> high: KV an INT8 decode engine produced (a sequence moving off an INT8 decode server, or its
    snapshot) re-sent as fp16 / fp32 and continued by the FP32 engine."""
    dec, ref = engines["decode_int8"], engines["prefill_fp32"]
    _, k8, v8 = dec.prefill(prompt[:-1])
    full, _, _ = ref.prefill(prompt)
    for dt, tol in (("fp32", 0.6), ("fp16", 0.6)):
        h, p = wire.encode(k8, v8, ref.compat_hash, dt)
        wire.verify(h, p, ref.compat_hash, SHAPE)
        k, v = wire.decode(h, p)
        if dt == "fp32":
            assert np.array_equal(k, k8) and np.array_equal(v, v8)
        got = _next_logits(ref, prompt, k, v)
        print(dt, "max |dlogit|", np.abs(got - full).max())
        assert np.abs(got - full).max() < tol, (dt, np.abs(got - full).max())
        assert int(np.argmax(got)) == int(np.argmax(full))
