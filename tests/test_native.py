"""The native INT8 CPU engine (engines/native.py + engines/native/*.c) on the real packed weights.

- the manifest entries (one file, two roles, fallbacks, quality within the INT8 bound and not worse than the
  ONNX Runtime INT8 engine's);
- the INT8 GEMM alone against a numpy reference that dequantizes the packed file itself, for every ISA build
  this CPU runs;
- bit-exactness by construction: one call == prefix + token by token, a ragged batch == each row alone, a
  prefix continuation == the full prefill, the fp16 decode batch == per-sequence fp16 runs (also across a
  retired row and a preemption round trip), Engine.forward's padded masks == per-row prefill;
- refusals: bad ids / positions / KV buffers give ValueError, masks not of causal_mask's form EngineError;
- unavailable paths: ISA missing (NativeUnavailable naming the flags), load_engine falls back with a warning,
  the compile cache;
- the ragged batched prefill (PrefillBatcher) and the decode scheduler under KV pressure on this engine.

Real engines built by the builder (no fakes); about 15 s.
"""
import json
import logging
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_scheduler
from hetserve.engines import native

# every ISA build this CPU can run (x86 CI always has avx2; this list is fixed at collection)
ISAS = [isa for isa in ("avx512", "avx2") if native.ISA_CPU_FLAGS[isa] <= native.cpu_flags()]


@pytest.fixture(scope="module")
def manifest(engine_dir):
    from hetserve.engines.manifest import read_manifest

    return read_manifest(Path(engine_dir))


@pytest.fixture(scope="module")
def eng(engine_dir):
    from hetserve.engines.runtime import Engine

    e = Engine(engine_dir, "decode_int8_native")
    yield e
    e.native.close()


@pytest.fixture(scope="module")
def pre_eng(engine_dir):
    from hetserve.engines.runtime import Engine

    e = Engine(engine_dir, "prefill_int8_native")
    yield e
    e.native.close()


@pytest.fixture(scope="module")
def models(engine_dir, manifest):
    """{isa: NativeModel} over the same packed file, one per ISA build this CPU runs."""
    from hetserve.model.checkpoint import LlamaConfig

    cfg = LlamaConfig.from_dict(manifest["config"])
    info = manifest["engines"]["decode_int8_native"]
    out = {isa: native.NativeModel(Path(engine_dir), info, cfg, isa=isa) for isa in ISAS}
    yield out
    for m in out.values():
        m.close()


def _kv(model, cap, dtype=np.float32):
    L, H, D = model.kv_shape
    return np.zeros((L, H, cap, D), dtype), np.zeros((L, H, cap, D), dtype)


# ---- 1. manifest ---------------------------------------------------------------------------------------------
def test_manifest_native_entries_fallbacks_and_quality(engine_dir, manifest):
    from hetserve.engines.quality import BOUNDS

    e = manifest["engines"]
    dec, pre = e["decode_int8_native"], e["prefill_int8_native"]
    for x in (dec, pre):
        assert x["backend"] == "native" and x["attention"] == "native" and x["precision"] == "int8"
    assert dec["file"] == pre["file"] and (Path(engine_dir) / dec["file"]).is_file()
    assert dec["index"] == pre["index"] and dec["index"].endswith(".json")
    meta = json.loads((Path(engine_dir) / dec["index"]).read_text())
    assert meta["format"] == native.FORMAT and "lm_head.q" in meta["tensors"] and "layer0.qkv.s" in meta["tensors"]
    assert dec["fallback"] == "decode_int8" and pre["fallback"] == "prefill_fp32"
    assert e["decode_int8"]["backend"] == "onnxruntime" and e["prefill_fp32"]["backend"] == "onnxruntime"
    q, ort_q = dec["quality"], e["decode_int8"]["quality"]
    assert q["reference"] == "prefill_fp32" and q["tokens"] > 0
    assert 0 < q["mean_kld"] <= BOUNDS["int8"], q
    assert q["mean_kld"] <= ort_q["mean_kld"] * 1.05, (q, ort_q)  # not worse than the ORT INT8 engine (+5%)


# ---- 2. the GEMM alone vs numpy --------------------------------------------------------------------------------
_DEQ = {}


def _packed(engine_dir, info, name):
    """(w int [N, K] signed, d float64 [N, K/bs], bs) read from the packed file by the index, not by native.py."""
    key = (engine_dir, name)
    if key not in _DEQ:
        meta = json.loads((Path(engine_dir) / info["index"]).read_text())["tensors"]
        mm = np.memmap(Path(engine_dir) / info["file"], mode="r")

        def arr(k):
            off, dt, shape = meta[k]
            return np.frombuffer(mm, dtype=dt, count=int(np.prod(shape)), offset=off).reshape(shape)

        q, s, rd = arr(name + ".q"), arr(name + ".s"), arr(name + ".d")
        bs = int(meta[name + ".bs"][0])
        G, K4, sixteen, four = q.shape
        assert (sixteen, four) == (16, 4) and s.shape == (G, K4 * 4 // bs, 16) and s.dtype == np.uint8
        N, K = G * 16, K4 * 4
        assert rd.shape == (N,) and rd.dtype == np.float32
        w = q.transpose(0, 2, 1, 3).reshape(N, K).astype(np.int16) - 128  # stored w + 128
        # block scale = uint8 block scale x float32 row scale
        d = s.transpose(0, 2, 1).reshape(N, K // bs).astype(np.float64) * rd.astype(np.float64)[:, None]
        assert np.abs(w).max() <= 127
        _DEQ[key] = (w, d, bs)
    return _DEQ[key]


def _quant_rows(x, bs):
    """hs_quant_rows in numpy: per row and block d = absmax/127, q = rint(x * (127/absmax)) (fp32, half-even)."""
    M, K = x.shape
    b = x.reshape(M, K // bs, bs).astype(np.float32)
    amax = np.abs(b).max(-1)
    d = amax / np.float32(127.0)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.clip(np.rint(b * inv.astype(np.float32)[..., None]), -128, 127)
    return q.astype(np.float64), d.astype(np.float64)


def _gemm_input(rng, M, K, bs):
    x = (rng.standard_normal((M, K)) * rng.uniform(0.05, 20.0, (M, 1))).astype(np.float32)
    # row 0, block 0: absmax 127, so x * (127/absmax) is x exactly: ties that only round-half-even gets right
    x[0, :bs] = np.resize(np.array([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 4.5, -6.5], np.float32), bs)
    x[0, 2 * bs:3 * bs] = 0.0  # an all-zero block: scale 0, q 0
    x[-1, -bs:] *= 1000.0  # an outlier block
    return x


@pytest.mark.parametrize("isa", ISAS)
def test_qgemm_matches_numpy_reference(isa, models, engine_dir, manifest):
    info = manifest["engines"]["decode_int8_native"]
    model = models[isa]
    rng = np.random.default_rng(7)
    for name in ("layer0.qkv", "layer3.down", "lm_head"):
        w, dw, bs = _packed(engine_dir, info, name)
        N, K = w.shape
        wf = w * np.repeat(dw, bs, axis=1)  # float64, exact
        for M in (1, 7, 16):
            x = _gemm_input(rng, M, K, bs)
            xq, dx = _quant_rows(x, bs)
            ref = (xq * dx[..., None]).reshape(M, K) @ wf.T
            y = model.qgemm(name, x)
            assert y.shape == (M, N) and y.dtype == np.float32
            err = np.abs(y - ref).max(axis=1)
            scale = np.abs(ref).max(axis=1)
            assert np.all(err < 1e-5 * scale), (isa, name, M, (err / scale).max())
            for other, m2 in models.items():  # integer dots + the same fp32 block order: identical across ISAs
                if other != isa:
                    assert np.array_equal(m2.qgemm(name, x), y), (isa, other, name, M)
        with pytest.raises(ValueError, match=r"x must be \["):
            model.qgemm(name, np.zeros((2, K + 1), np.float32))


# ---- 3. bit-exactness per ISA --------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
def test_one_call_equals_prefix_then_token_by_token(isa, models, prompt_ids):
    m = models[isa]
    ids = list(prompt_ids.values())[0] + [11, 2024, 7, 345, 9]
    n, n0 = len(ids), 17
    k1, v1 = _kv(m, n)
    lo1 = m.run_sequences([(ids, 0, k1, v1)])
    k2, v2 = _kv(m, n)
    m.run_sequences([(ids[:n0], 0, k2, v2)])
    for p in range(n0, n):
        lo2 = m.run_sequences([([ids[p]], p, k2, v2)])
    assert np.array_equal(lo1, lo2) and np.array_equal(k1, k2) and np.array_equal(v1, v2)
    assert np.abs(k1[:, :, -1]).max() > 0 and np.isfinite(lo1).all()


@pytest.mark.parametrize("isa", ISAS)
def test_ragged_batch_equals_each_row_alone(isa, models, prompt_ids):
    m = models[isa]
    ps = list(prompt_ids.values())
    a, c = ps[1], ps[2][:19]
    past, b_tok = ps[3][:12], ps[3][12]
    pk, pv = _kv(m, 16)  # row b: one token after a 12-token past (a decode row in a prefill batch)
    m.run_sequences([(past, 0, pk, pv)])

    def bufs():
        ka, va = _kv(m, len(a) + 3)
        kc, vc = _kv(m, len(c))
        return [(a, 0, ka, va), ([b_tok], 12, pk.copy(), pv.copy()), (c, 0, kc, vc)]

    together = bufs()
    lo = m.run_sequences(together)
    alone = bufs()
    for r, row in enumerate(alone):
        lo_r = m.run_sequences([row])
        assert np.array_equal(lo[r], lo_r[0]), (isa, r)
        assert np.array_equal(together[r][2], row[2]) and np.array_equal(together[r][3], row[3]), (isa, r)
    assert not together[0][2][:, :, len(a):].any()  # positions past the tokens untouched
    assert not np.array_equal(lo[0], lo[2]) and lo[1].any()  # three different rows, each computed
    # `want` False: that row's logits are left zero, the others the same
    lo_w = m.run_sequences(bufs(), want=[True, False, True])
    assert not lo_w[1].any() and np.array_equal(lo_w[0], lo[0]) and np.array_equal(lo_w[2], lo[2])


def test_engine_prefill_with_past_equals_full_prefill(eng, prompt_ids):
    ids = list(prompt_ids.values())[4]
    lo, k, v = eng.prefill(ids)
    assert k.shape == (eng.config.num_layers, eng.config.num_kv_heads, len(ids), eng.config.head_dim)
    for n0 in (1, 20, len(ids) - 1):
        lo2, k2, v2 = eng.prefill(ids[n0:], k[:, :, :n0], v[:, :, :n0])
        assert np.array_equal(lo2, lo), n0
        assert np.array_equal(k2, k[:, :, n0:]) and np.array_equal(v2, v[:, :, n0:]), n0


# ---- 4. the fp16 decode batch --------------------------------------------------------------------------------
class _Ref:
    """One sequence run alone over its own float16 KV buffer."""

    def __init__(self, model, k, v, tok):
        self.m, self.n, self.tok = model, k.shape[2], tok
        self.k, self.v = _kv(model, 128, np.float16)
        self.k[:, :, :self.n], self.v[:, :, :self.n] = k, v

    def step(self):
        lo = self.m.run_sequences([([self.tok], self.n, self.k, self.v)])[0]
        self.n += 1
        return lo


def test_native_batch_fp16_equals_per_sequence_retire_and_preempt_round_trip(eng, prompt_ids):
    from hetserve.engines.decode_batch import NativeBatch

    ps = list(prompt_ids.values())
    b = eng.new_batch(4)
    assert isinstance(b, NativeBatch)
    refs = []
    for ids in (ps[0], ps[1][:11], ps[2][:25]):
        lo, k, v = eng.prefill(ids)
        refs.append(_Ref(eng.native, k, v, int(lo.argmax())))
        b.add(k, v)
    assert b._kb.dtype == np.float16

    def step_both(batch, rs):
        lb = batch.step(np.array([r.tok for r in rs])).copy()
        for i, r in enumerate(rs):
            lr = r.step()
            assert np.array_equal(lb[i], lr), i
            r.tok = int(lr.argmax())
        return lb

    for _ in range(3):
        step_both(b, refs)
    for i, r in enumerate(refs):  # the batch's rows hold exactly the per-sequence fp16 KV
        ln = int(b.lens[i])
        assert ln == r.n and np.array_equal(b.k[i][:, :, :ln], r.k[:, :, :ln])
        assert np.array_equal(b.v[i][:, :, :ln], r.v[:, :, :ln])
    assert b.remove(0) == 2  # retire row 0: the last row moves into it
    refs = [refs[2], refs[1]]
    for _ in range(3):
        step_both(b, refs)
    # preemption round trip: row 1's KV out as fp32, into a fresh batch, continues with identical logits
    k, v = b.row_kv(1)
    assert k.dtype == v.dtype == np.float32 and k.shape[2] == refs[1].n
    assert np.array_equal(k, refs[1].k[:, :, :refs[1].n].astype(np.float32))
    b2 = eng.new_batch(2)
    b2.add(k, v)
    for _ in range(3):
        tok = refs[1].tok
        lb = step_both(b, refs)
        assert np.array_equal(b2.step(np.array([tok]))[0], lb[1])


# ---- 5. Engine.forward with padded masks ---------------------------------------------------------------------
def test_forward_padded_masks_equal_per_row_prefill(eng, prompt_ids):
    from hetserve.engines.runtime import EngineError, causal_mask

    c = eng.config
    L, H, D = c.num_layers, c.num_kv_heads, c.head_dim
    ps = list(prompt_ids.values())
    past_lens, new_lens = np.array([20, 0, 9]), np.array([3, 1, 2])
    B, P, T = 3, int(past_lens.max()), int(new_lens.max())
    pk = np.full((B, L, H, P, D), 7.0, np.float32)  # padding garbage the engine must not read
    pv = np.full_like(pk, -3.0)
    ids = np.full((B, T), 5, np.int64)
    pos = np.zeros((B, T), np.int64)
    news, pasts = [], []
    for b in range(B):
        pl, nl = int(past_lens[b]), int(new_lens[b])
        ks = vs = None
        if pl:
            _, ks, vs = eng.prefill(ps[b][:pl])
            pk[b, :, :, :pl], pv[b, :, :, :pl] = ks, vs
        pasts.append((ks, vs))
        news.append(ps[b][pl:pl + nl])
        ids[b, :nl] = news[b]
        pos[b, :nl] = pl + np.arange(nl)
    mask = causal_mask(past_lens, new_lens, P, T)

    def fp16_run(tokens, ks, vs, pl):  # a decode step over the fp16 KV cache, as NativeBatch holds it
        k = np.zeros((L, H, pl + len(tokens), D), np.float16)
        v = np.zeros_like(k)
        if pl:
            k[:, :, :pl], v[:, :, :pl] = ks, vs
        lo_ = eng.native.run_sequences([(tokens, pl, k, v)])[0]
        return lo_, k[:, :, pl:].astype(np.float32), v[:, :, pl:].astype(np.float32)

    for last in (new_lens - 1, np.array([0, 0, 1])):  # last_index before the end: the tail's KV still computed
        lo, nk, nv = eng.forward(ids, pos, mask, pk, pv, last)
        assert lo.shape == (B, c.vocab_size) and nk.shape == nv.shape == (B, L, H, T, D)
        for b in range(B):
            nl, ks, vs = int(new_lens[b]), *pasts[b]
            pl = int(past_lens[b])
            lo_r, _, _ = fp16_run(news[b][:int(last[b]) + 1], ks, vs, pl)
            _, k_r, v_r = fp16_run(news[b], ks, vs, pl)
            assert np.array_equal(lo[b], lo_r), b
            assert np.array_equal(nk[b, :, :, :nl], k_r) and np.array_equal(nv[b, :, :, :nl], v_r), b
            assert not nk[b, :, :, nl:].any() and not nv[b, :, :, nl:].any()
    left = mask.copy()  # row 2's 9 past tokens at the end of the padded past instead of the start
    left[2, 0, :, :P] = mask[2, 0, :, :P][:, ::-1]
    bad_masks = {"no causality": np.zeros_like(mask), "left-padded past": left,
                 "extra column": np.concatenate([mask, np.zeros((B, 1, T, 1), np.float32)], axis=-1)}
    for bad in bad_masks.values():  # a wrong shape is named as such, a wrong form as not causal_mask's
        with pytest.raises(EngineError, match="causal|attention_mask must be"):
            eng.forward(ids, pos, bad, pk, pv, new_lens - 1)
    with pytest.raises(EngineError, match="positions"):
        eng.forward(ids, pos + 1, mask, pk, pv, new_lens - 1)
    with pytest.raises(EngineError, match="last_index"):  # row 1 has one real token
        eng.forward(ids, pos, mask, pk, pv, np.array([2, 1, 1]))


def test_forward_mask_of_wrong_shape_is_an_engine_error(eng):
    from hetserve.engines.runtime import EngineError, causal_mask

    ids = np.ones((2, 3), np.int64)
    mask = causal_mask([0, 0], [3, 3], 0, 3)
    with pytest.raises(EngineError, match="attention_mask must be"):
        eng.forward(ids, np.tile(np.arange(3), (2, 1)), mask[:, :, :2], eng.empty_past(2), eng.empty_past(2),
                    np.array([2, 2]))


# ---- 6. bad input: ValueError, never a crash -----------------------------------------------------------------
def test_bad_input_is_refused_with_a_clear_error(eng):
    m, V = eng.native, eng.config.vocab_size
    L, H, D = m.kv_shape
    with pytest.raises(ValueError, match="token id outside the vocabulary"):
        eng.prefill([1, 2, V])
    with pytest.raises(ValueError, match="token id outside the vocabulary"):
        eng.prefill([-1, 2])
    with pytest.raises(ValueError, match="at least one token"):  # no logits to give: refused, not zeros
        eng.prefill([])
    k, v = _kv(m, 4)
    with pytest.raises(ValueError, match="position outside"):
        m.run_sequences([([1, 2, 3, 4, 5], 0, k, v)])
    with pytest.raises(ValueError, match="position outside"):
        m.run_sequences([([1], 4, k, v)])
    with pytest.raises(ValueError, match="token id outside"):  # a bad id after good ones: still nothing written
        m.run_sequences([([1, 2, V + 5], 0, k, v)])
    assert not k.any() and not v.any()  # refused before any KV was written
    kv_errors = {
        "dtype": (k.astype(np.float64), v.astype(np.float64)),
        "shape": (np.zeros((L - 1, H, 4, D), np.float32), np.zeros((L - 1, H, 4, D), np.float32)),
        "non-contiguous": (_kv(m, 8)[0][:, :, ::2], _kv(m, 8)[1][:, :, ::2]),
        "read-only": (np.broadcast_to(k, k.shape), v),
        "head_dim": (np.zeros((L, H, 4, D + 1), np.float32), np.zeros((L, H, 4, D + 1), np.float32)),
    }
    for kb, vb in kv_errors.values():
        with pytest.raises(ValueError, match="KV buffer must be writable C-contiguous float32"):
            m.run_sequences([([1, 2], 0, kb, vb)])
    with pytest.raises(ValueError, match="K and V buffers differ"):
        m.run_sequences([([1, 2], 0, k, np.zeros((L, H, 5, D), np.float32))])
    with pytest.raises(ValueError, match="KV buffer must be writable C-contiguous float16"):  # mixed dtypes
        m.run_sequences([([1], 0, *_kv(m, 4, np.float16)), ([1], 0, k, v)])
    # the raw call's own checks
    one = np.ones(1, np.int32)
    kp, vp = np.array([k.ctypes.data], np.uint64), np.array([v.ctypes.data], np.uint64)
    args = (np.array([1], np.int64), np.zeros(1, np.int32))
    lst, cap, klen = np.array([H * 4 * D], np.int64), np.array([4], np.int32), np.array([k.size], np.int64)
    logits = np.zeros((1, V), np.float32)
    with pytest.raises(ValueError, match="output index outside"):
        m.run(*args, np.zeros(1, np.int32), kp, vp, lst, cap, klen, np.array([1], np.int32), logits)
    with pytest.raises(ValueError, match="row outside"):
        m.run(*args, one, kp, vp, lst, cap, klen, np.zeros(1, np.int32), logits)
    assert not k.any()
    # a refused decode step leaves the batch as it was: the same step afterwards gives the same logits
    _, pk_, pv_ = eng.prefill([1, 2, 3])
    b = eng.new_batch(2)
    b.add(pk_, pv_)
    b.add(pk_, pv_)
    with pytest.raises(ValueError, match="token id outside"):
        b.step(np.array([4, V]))
    assert list(b.lens[:2]) == [3, 3]
    lo = b.step(np.array([4, 4])).copy()
    fresh = eng.new_batch(1)
    fresh.add(pk_, pv_)
    assert np.array_equal(lo[0], lo[1]) and np.array_equal(lo[0], fresh.step(np.array([4]))[0])


def test_buffer_lengths_are_checked_by_the_c_side(eng):
    """hs_engine.h: every buffer goes with its length and hs_forward / hs_qgemm check them before writing; a
    too-short KV buffer (a caller's cap or stride bigger than its allocation), logits array or GEMM input is a
    named refusal with nothing written, never a write past the end."""
    m, V = eng.native, eng.config.vocab_size
    L, H, D = m.kv_shape
    k, v = _kv(m, 4)
    guard_k = np.zeros(k.size + 4096, np.float32)  # the buffer + a guard region behind what it claims to hold
    guard_v = np.zeros_like(guard_k)
    kp, vp = np.array([guard_k.ctypes.data], np.uint64), np.array([guard_v.ctypes.data], np.uint64)
    ids, pos, row = np.array([1, 2], np.int64), np.array([0, 1], np.int32), np.zeros(2, np.int32)
    out = np.array([1], np.int32)
    logits = np.zeros((1, V), np.float32)
    # cap 8 claimed over a buffer sized for cap 4: refused (HS_E_BUFFER), the guard stays zero
    with pytest.raises(native.NativeCallRefused, match="buffer shorter") as ei:
        m.run(ids, pos, row, kp, vp, np.array([H * 8 * D], np.int64), np.array([8], np.int32),
              np.array([k.size], np.int64), out, logits)
    assert ei.value.code == m.lib.HS_E_BUFFER and not guard_k.any() and not guard_v.any()
    with pytest.raises(native.NativeCallRefused, match="buffer shorter"):  # logits for 1 row, 2 asked
        m.run(ids, pos, row, kp, vp, np.array([H * 4 * D], np.int64), np.array([4], np.int32),
              np.array([k.size], np.int64), np.array([0, 1], np.int32), logits)
    with pytest.raises(native.NativeCallRefused, match="lengths disagree"):  # pos shorter than ids
        m.run(ids, pos[:1], row, kp, vp, np.array([H * 4 * D], np.int64), np.array([4], np.int32),
              np.array([k.size], np.int64), out, logits)
    assert not guard_k.any()
    # the same call with honest lengths runs
    m.run(ids, pos, row, kp, vp, np.array([H * 4 * D], np.int64), np.array([4], np.int32),
          np.array([k.size], np.int64), out, logits)
    assert guard_k[:k.size].any() and not guard_k[k.size:].any()
    with pytest.raises(native.NativeCallRefused, match="buffer shorter"):
        x = np.ones((2, eng.config.hidden_size), np.float32)
        y = np.empty(1, np.float32)
        rc = m.lib.hs_qgemm(m._scratch, m.model, m._qmats["layer0.qkv"], 2, native._f32(x),
                            native._ptr("float *", y), y.size)
        raise native.NativeCallRefused("hs_qgemm", rc, native.error_text(m.lib, rc))


def test_packed_file_of_another_model_size_is_refused_by_name(engine_dir, manifest):
    """The packed tensors' lengths are checked against the config's shapes (hs_model_check): loading weights
    with a config of another size is a NativeModelUnsupported naming the misshaped part, not a read past the
    mapped file."""
    from hetserve.model.checkpoint import LlamaConfig

    info = manifest["engines"]["decode_int8_native"]
    base = dict(manifest["config"])
    cases = {"intermediate_size": (base["intermediate_size"] + 64, "layer matrix"),
             "vocab_size": (base["vocab_size"] + 16, "lm_head / embeddings"),
             "hidden_size": (base["hidden_size"] + 64, "")}
    for key, (value, words) in cases.items():
        cfg = LlamaConfig.from_dict(dict(base, **{key: value}))
        with pytest.raises(native.NativeUnavailable) as ei:
            native.NativeModel(Path(engine_dir), info, cfg, isa=ISAS[-1])
        assert words in str(ei.value), (key, str(ei.value))


def test_binding_is_built_from_the_header():
    """One definition: the structs the binding fills are hs_engine.h's, parsed by cffi; the module defines no
    ctypes layout of its own, and the source hash that names the compiled library covers the header."""
    src = (native.SRC_DIR.parent / "native.py").read_text()
    assert "ctypes.Structure" not in src and "_fields_" not in src
    assert "hs_engine.h" in native.SOURCES
    F = native.ffi()
    assert F.sizeof("hs_model") > 0 and F.typeof("hs_batch").kind == "struct"
    lib = native.library(ISAS[-1])
    assert lib.hs_abi() == lib.HS_ABI
    assert native.error_text(lib, lib.HS_E_TOKEN) == "a token id outside the vocabulary"


# ---- 7. unavailable paths and the compile cache --------------------------------------------------------------
def test_pick_isa_names_missing_flags(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("HETSERVE_NATIVE_ISA", "avx512")
    with pytest.raises(native.NativeUnavailable) as ei:
        native.pick_isa()
    msg = str(ei.value)
    for flag in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"):
        assert flag in msg, msg
    assert "'avx2'" not in msg and "HETSERVE_NATIVE_ISA=avx512" in msg
    monkeypatch.setenv("HETSERVE_NATIVE_ISA", "auto")
    assert native.pick_isa() == "avx2"  # auto takes the best build the (patched) CPU runs
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2"})
    with pytest.raises(native.NativeUnavailable, match="avx2"):
        native.pick_isa()


def test_load_engine_falls_back_with_a_warning(engine_dir, monkeypatch, caplog):
    from hetserve.engines import runtime

    def no_native():
        raise native.NativeUnavailable("test")

    monkeypatch.setattr(native, "pick_isa", no_native)
    lg = logging.getLogger("hetserve.engines")  # logs.setup (the CLI tests) stops propagation to the root
    lg.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="hetserve.engines"):
            e = runtime.load_engine(engine_dir, "decode_int8_native", threads=1)
    finally:
        lg.removeHandler(caplog.handler)
    assert e.name == "decode_int8" and e.info["backend"] == "onnxruntime"
    assert "decode_int8_native" in caplog.text and "test" in caplog.text and "loading decode_int8" in caplog.text
    with pytest.raises(native.NativeUnavailable, match="test"):
        runtime.Engine(engine_dir, "decode_int8_native")


def test_library_compiles_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
    isa = ISAS[-1]
    calls = []
    real_run = subprocess.run

    def run(cmd, *a, **kw):
        calls.append(list(cmd))
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(native.subprocess, "run", run)
    p = native.library_path(isa)
    assert p.parent == tmp_path / "cache" and p.is_file() and p.name.startswith(f"hs_engine_{isa}_")
    compiles = [c for c in calls if "-shared" in c]
    assert len(compiles) == 1
    mtime = p.stat().st_mtime_ns
    time.sleep(0.01)
    assert native.library_path(isa) == p and p.stat().st_mtime_ns == mtime
    assert len([c for c in calls if "-shared" in c]) == 1, "a second call must not recompile"
    assert sorted(x.name for x in p.parent.iterdir() if not x.name.startswith(".")) == [p.name]


# ---- 8. ragged batched prefill -------------------------------------------------------------------------------
def test_prefill_batcher_ragged_equals_engine_prefill(pre_eng, prompt_ids):
    from hetserve.stages.prefill_batch import BatchConfig, PrefillBatcher

    assert pre_eng.ragged
    ps = list(prompt_ids.values())
    prompts = [ps[0], ps[1][:9], ps[2] + ps[3], ps[4][:20], ps[5]]
    assert len({len(x) for x in prompts}) == 5
    done, forwards = [], []
    b = PrefillBatcher(pre_eng, BatchConfig(token_budget=64, chunk_tokens=32), done.append,
                       lambda j, e: pytest.fail(str(e)), start=False, on_forward=lambda p, dt: forwards.append(p))
    for x in prompts:
        b.submit(x)
    while b.step():
        pass
    b.close()
    assert max(len(p.rows) for p in forwards) > 1, "prompts must share a forward"
    assert all(p.useful_tokens <= 64 for p in forwards)
    done.sort(key=lambda j: j.seq)
    assert len(done) == 5 and any(j.forwards > 1 for j in done), "a prompt longer than a chunk is chunked"
    for x, j in zip(prompts, done):
        lo, k, v = pre_eng.prefill(x)
        assert j.ids == x and j.finished
        assert np.array_equal(j.logits, lo) and np.array_equal(j.k, k) and np.array_equal(j.v, v), len(x)


# ---- 9. the decode scheduler under KV pressure ---------------------------------------------------------------
def test_scheduler_preempt_resume_on_native_engine_keeps_tokens(eng, prompt_ids):
    from hetserve.kv.blocks import BlockPool

    c = eng.config
    items = list(prompt_ids.items())[:3]
    ref, st0 = run_scheduler(eng, eng, items, 16, timeout_s=60)
    assert st0["preempted"] == 0 and all(len(t) == 16 for t in ref.values())
    bt = 8
    bb = 2 * c.num_layers * c.num_kv_heads * bt * c.head_dim * 4
    pool = BlockPool.create(c.num_layers, c.num_kv_heads, c.head_dim, block_tokens=bt, device_bytes=12 * bb,
                            host_bytes=64 * bb, device="cpu")
    out, st = run_scheduler(eng, eng, items, 16, pool=pool, timeout_s=60)
    assert st["preempted"] >= 1 and st["resumed"] >= 1 and st["kv_recomputed"] == 0, st
    assert out == ref


def test_packing_in_chunks_equals_packing_whole(monkeypatch):
    """quantize_matrix and the QDQ codes run over cache-sized row chunks (build_plan.CHUNK_BYTES): the packed
    bytes are the same whatever the chunk (one chunk of every row vs 16-row chunks), zero rows and blocks included."""
    from hetserve.engines import build_plan

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((112, 256)) * rng.uniform(0.01, 3, (112, 1))).astype(np.float32)
    w[3, :32] = 0
    w[40] = 0
    monkeypatch.setattr(native, "_PACK_LIB", [None])  # the numpy packer (the C one does not chunk)
    monkeypatch.setattr(build_plan, "CHUNK_BYTES", 1 << 30)
    whole = native.quantize_matrix(w, 32)
    monkeypatch.setattr(build_plan, "CHUNK_BYTES", 16 * 256 * 4)
    assert build_plan.chunk_rows(256, 16) == 16
    chunked = native.quantize_matrix(w, 32)
    for a, b in zip(whole, chunked):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("bs", [16, 32])
def test_c_packing_writes_numpy_packings_bytes(bs, monkeypatch):
    """hs_pack_rows (the build's packer when the library runs here) repeats quantize_matrix's numpy arithmetic step
    for step, so both write the same bytes: rows of very different scales, heavy tails, zero rows and blocks, tiny
    and huge values, and rows split over threads (N not a multiple of the thread count's spans)."""
    rng = np.random.default_rng(11 + bs)
    N, K = 400, 512
    w = (rng.standard_normal((N, K)) * rng.uniform(1e-4, 30, (N, 1))).astype(np.float32)
    w[::7] *= rng.standard_t(2, (len(w[::7]), K)).astype(np.float32)  # outliers: the u choice differs per block
    w[5] = 0
    w[9, :bs] = 0
    w[13, 3] = 1e30
    w[17] *= np.float32(1e-30)
    monkeypatch.setattr(native, "PACK_THREADS_MAX", 3)
    monkeypatch.setattr(native.os, "cpu_count", lambda: 3)
    assert native._pack_library() is not None
    c = native.quantize_matrix(w, bs)
    monkeypatch.setattr(native, "_PACK_LIB", [None])
    ref = native.quantize_matrix(w, bs)
    for a, b in zip(c, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b), np.argwhere(a != b)[:5]
