"""The fused decode graph (GroupQueryAttention, in-place KV) against the standard-op graph and transformers.

Real engines built by the builder (no fakes). Fast: batch 1-4, a few steps each.
"""

import numpy as np
import pytest

from conftest import run_scheduler


@pytest.fixture(scope="module")
def eng(engine_dir):
    from hetserve.engines.runtime import Engine

    return {n: Engine(engine_dir, n, threads=2) for n in
            ("prefill_fp32", "decode_fp32", "decode_fp32_standard", "decode_int8", "decode_int8_standard")}


def test_manifest_says_which_attention_and_graph_is_fused(engine_dir, eng):
    import onnx

    from hetserve.engines.manifest import read_manifest

    man = read_manifest(engine_dir)["engines"]
    assert man["decode_fp32"]["attention"] == man["decode_int8"]["attention"] == "gqa"
    assert man["prefill_fp32"]["attention"] == man["decode_int8_standard"]["attention"] == "standard"
    L = eng["decode_fp32"].config.num_layers
    for name in ("decode_fp32", "decode_int8"):
        m = onnx.load(f"{engine_dir}/{man[name]['file']}", load_external_data=False)
        ops = [n.op_type for n in m.graph.node]
        assert ops.count("GroupQueryAttention") == L
        assert "Concat" not in ops and "Softmax" not in ops  # no KV concat, attention inside GQA
        assert len(ops) <= 11 * L + 12, len(ops)  # the standard graph: ~40 per layer
        if name == "decode_int8":
            assert ops.count("MatMulNBits") == 4 * L + 1 and "MatMul" not in ops  # qkv, o, gate_up, down, lm_head


def test_prefill_and_forward_match_standard_graph(eng):
    from hetserve.engines.runtime import EngineError, causal_mask

    std, gqa = eng["decode_fp32_standard"], eng["decode_fp32"]
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(0, std.config.vocab_size, 21)]
    lo_s, k_s, v_s = std.prefill(ids)
    lo_g, k_g, v_g = gqa.prefill(ids)
    assert np.abs(lo_s - lo_g).max() < 2e-3 and lo_s.argmax() == lo_g.argmax()
    assert np.abs(k_s - k_g).max() < 1e-3 and np.abs(v_s - v_g).max() < 1e-3 and k_g.shape == k_s.shape
    # continuing from a cached prefix (snapshot resume / KV recompute of a tail)
    lo_s2, k_s2, _ = std.prefill(ids[15:], k_s[:, :, :15], v_s[:, :, :15])
    lo_g2, k_g2, _ = gqa.prefill(ids[15:], k_s[:, :, :15], v_s[:, :, :15])
    assert np.abs(lo_s2 - lo_g2).max() < 2e-3 and np.abs(k_s2 - k_g2).max() < 1e-3
    # forward() over a right-padded ragged past, as tools call it
    B, P = 3, 21
    lens = np.array([21, 9, 14])
    pk, pv = np.stack([k_s] * B), np.stack([v_s] * B)
    for T in (1, 2):
        x = rng.integers(0, std.config.vocab_size, (B, T))
        args = (x, lens[:, None] + np.arange(T), causal_mask(lens, [T] * B, P, T), pk, pv, np.full(B, T - 1))
        for a, b in zip(std.forward(*args), gqa.forward(*args)):
            assert a.shape == b.shape and np.abs(a - b).max() < 2e-3
    with pytest.raises(EngineError, match="causal masks"):  # padded new tokens: refused, not wrong
        gqa.forward(x, lens[:, None] + np.arange(2), causal_mask(lens, [2, 1, 2], P, 2), pk, pv, np.ones(B, int))


@pytest.mark.parametrize("prec", ["fp32", "int8"])
def test_batch_steps_match_standard_ragged_retire_refill(eng, prec):
    """Both back ends' decode batches, same inputs: ragged lengths, a retired row refilled by the last one, a
    late joiner; logits close and greedy tokens equal at every step."""
    std_b, gqa_b = eng[f"decode_{prec}_standard"].new_batch(4), eng[f"decode_{prec}"].new_batch(4)
    pre = eng["prefill_fp32"]
    rng = np.random.default_rng(1)
    V = pre.config.vocab_size

    def join(n):
        _, k, v = pre.prefill([int(x) for x in rng.integers(0, V, n)])
        assert std_b.add(k, v) == gqa_b.add(k, v)

    for n in (5, 40, 3):
        join(n)
    toks = np.array([11, 22, 33])
    # INT8: both graphs quantize the same weights the same way, but activations are quantized per block of
    # differently-fused ops, so logits differ slightly and a near-tie top-1 may flip
    tol = 2e-3 if prec == "fp32" else 2.0
    same = total = 0
    for step in range(8):
        ls, lg = std_b.step(toks).copy(), gqa_b.step(toks).copy()
        assert np.abs(ls - lg).max() < tol, (step, np.abs(ls - lg).max())
        same += int((ls.argmax(1) == lg.argmax(1)).sum())
        total += len(toks)
        assert prec != "fp32" or same == total, step
        toks = ls.argmax(1)  # both continue from the same tokens
        if step == 2:  # retire row 0: the last row moves into it
            assert std_b.remove(0) == gqa_b.remove(0) == 2
            toks = toks[[2, 1]]
        if step == 4:
            join(17)
            toks = np.append(toks, 7)
    assert same >= 0.9 * total, (same, total)
    assert list(std_b.lens[:std_b.n]) == list(gqa_b.lens[:gqa_b.n])
    for r in range(gqa_b.n):
        (ks, _), (kg, _) = std_b.row_kv(r), gqa_b.row_kv(r)
        assert ks.shape == kg.shape and np.abs(ks - kg).max() < (1e-3 if prec == "fp32" else 0.5)


def test_gqa_batch_reads_and_writes_kv_in_place(eng):
    """The step writes the new token's K/V straight into the batch buffer (no present copy) and the next step
    reads the buffer itself: corrupting a row there changes that row's logits only."""
    pre, gqa = eng["prefill_fp32"], eng["decode_fp32"]
    b = gqa.new_batch(2)
    _, k, v = pre.prefill([1, 2, 3, 4, 5, 6])
    b.add(k, v)
    b.add(k, v)
    before = b._kb.ctypes.data
    lo1 = b.step(np.array([7, 7])).copy()
    assert b._kb.ctypes.data == before and b._bound[2] == before  # bound by pointer, no reallocation
    _, k7, _ = pre.prefill([7], k, v)
    assert np.abs(b.k[0, :, :, 6] - k7[:, :, 0]).max() < 1e-3  # token 7's K landed at offset 6 of row 0
    assert list(b.lens[:2]) == [7, 7]
    b._kb[:, 1, :, :3] = 0.0  # corrupt row 1's first three keys in the buffer
    lo2 = b.step(np.array([8, 8])).copy()
    assert np.abs(lo1[0] - lo1[1]).max() == 0
    ref = gqa.new_batch(1)
    ref.add(*pre.prefill([1, 2, 3, 4, 5, 6, 7])[1:])
    assert np.abs(lo2[0] - ref.step(np.array([8]))[0]).max() < 2e-3
    assert np.abs(lo2[1] - lo2[0]).max() > 1e-2


def test_pool_attach_detach_accounts_without_holding_kv():
    from hetserve.kv.blocks import ENGINE, BlockPool, PoolFull

    bt = 4
    bb = 2 * 2 * 1 * bt * 8 * 4
    pool = BlockPool.create(2, 1, 8, block_tokens=bt, device_bytes=6 * bb, host_bytes=6 * bb, device="cpu")
    try:
        rng = np.random.default_rng(0)
        k, v = rng.standard_normal((2, 2, 1, 10, 8)).astype(np.float32)
        pool.add("a", k, v)
        pool.activate("a", 11)
        k2, v2 = pool.attach("a")
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
        dev = pool.tiers[0]
        st = pool.stats()
        assert st["engine_blocks"] == 3 and dev.used == 3 and len(dev._free) == 6  # counted, no slots held
        assert pool.reserve("a", 20)  # growth while attached: counted blocks, still no slot
        assert dev.used == 5 and len(dev._free) == 6 and pool.stats()["engine_blocks"] == 5
        with pytest.raises(ValueError, match="attached"):
            pool.read("a")
        with pytest.raises(ValueError, match="attached"):
            pool.deactivate("a")
        pool.add("b", k[:, :, :4], v[:, :, :4])  # the 6th device block; no room for a 7th
        with pytest.raises(PoolFull):
            dev.alloc(1)
        kk, vv = rng.standard_normal((2, 2, 1, 19, 8)).astype(np.float32)  # the engine's KV at preemption
        pool.detach("a", kk, vv)
        assert pool.stats()["engine_blocks"] == 0 and all(
            pool._blocks[b].slot != ENGINE for b in pool._seqs["a"].blocks)
        pool.deactivate("a")
        pool.demote("a")
        assert pool.placement("a") == {"host": 5}
        r = pool.read("a")
        assert np.array_equal(r[0], kk) and np.array_equal(r[1], vv)  # bit-exact through the swap
        pool.activate("a", 20)
        pool.attach("a")
        pool.free("a")
        pool.free("b")
        assert dev.used == 0 and len(dev._free) == 6 and pool.stats()["used_blocks"] == 0
    finally:
        pool.close()


def test_scheduler_on_fused_engine_equals_transformers(eng, prompt_ids, reference_tokens):
    """Greedy FP32 decode through the scheduler on the fused graph (joins mid-flight, ragged, rows retiring)
    equals the transformers reference token for token."""
    items = list(prompt_ids.items())[:4]
    out, st = run_scheduler(eng["prefill_fp32"], eng["decode_fp32"], items, 32, stagger=0.05)
    assert st["admitted"] == 4
    for p, _ in items:
        assert out[p] == reference_tokens[p], p


def test_scheduler_preempt_resume_on_fused_engine_keeps_tokens(eng, prompt_ids):
    """A device tier too small for all sequences: preemption copies KV out of the engine batch into blocks,
    swaps them to host and back; tokens equal an unpressured run of the standard-op engine."""
    from hetserve.kv.blocks import BlockPool

    items = list(prompt_ids.items())[:3]
    ref, _ = run_scheduler(eng["prefill_fp32"], eng["decode_fp32_standard"], items, 24)
    bt = 8
    bb = 2 * 30 * 3 * bt * 64 * 4
    pool = BlockPool.create(30, 3, 64, block_tokens=bt, device_bytes=14 * bb, host_bytes=64 * bb, device="cpu")
    out, st = run_scheduler(eng["prefill_fp32"], eng["decode_fp32"], items, 24, pool=pool)
    assert st["preempted"] >= 1 and st["resumed"] >= 1 and st["kv_recomputed"] == 0
    assert out == ref
