"""Prefix reuse on the prefill server: block hashing, LRU + byte budget, engine-level exactness, and e2e
(a shared system prompt hits the cache, changes no output, and cuts prefill time)."""
import uuid

import numpy as np
import pytest

from hetserve.kv import prefix as prefix_mod
from hetserve.kv.prefix import BLOCK_TOKENS, PrefixCache, block_hashes

L, H, D = 2, 1, 4
B = 16  # the data-structure tests below are written for 16-token blocks (the servers use BLOCK_TOKENS, 8)
BLK_BYTES = 2 * L * H * B * D * 4  # K + V of one block, fp32


def kv(n, base=0.0):
    k = (np.arange(L * H * n * D, dtype=np.float32).reshape(L, H, n, D) + base)
    return k, -k


# ---- hashing --------------------------------------------------------------------------------------
def test_block_hashes_chain_whole_blocks_only():
    a = list(range(40))
    assert len(block_hashes(a, B)) == 2  # 40 tokens -> 2 whole blocks, the partial third gets no hash
    assert block_hashes(a, B) == block_hashes(a[:32] + [999] * 7, B)  # the tail beyond whole blocks is irrelevant
    b = [7] + a[1:]
    ha, hb = block_hashes(a, B), block_hashes(b, B)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # a change in block 0 changes every later key (chain)
    assert block_hashes(a[:16] + [5] * 16, B)[0] == ha[0]
    assert block_hashes(a, B, seed=b"other-model") != ha
    assert block_hashes(list(range(15)), B) == []


# ---- lookup / insert ------------------------------------------------------------------------------
def test_lookup_longest_prefix_and_leaves_one_token():
    c = PrefixCache(1 << 20, block=B)
    ids = list(range(100, 148))  # 3 blocks
    k, v = kv(48)
    assert c.insert(ids, k, v) == 3
    assert len(c) == 3 and c.nbytes == 3 * BLK_BYTES
    n, pk, pv = c.lookup(ids + [1, 2, 3])
    assert n == 48 and np.array_equal(pk, k) and np.array_equal(pv, v)
    n, pk, _ = c.lookup(ids)  # the whole prompt cached: the last block is recomputed (need its logits)
    assert n == 32 and np.array_equal(pk, k[:, :, :32])
    n, _, _ = c.lookup(ids[:16] + [0] * 40)  # diverges in block 1
    assert n == 16
    assert c.lookup([0] + ids)[0] == 0
    assert c.lookup(ids[:10])[0] == 0
    st = c.stats()
    assert st["lookups"] == 5 and st["hits"] == 3 and st["hit_tokens"] == 48 + 32 + 16
    assert st["blocks"] == 3 and st["bytes"] == 3 * BLK_BYTES
    pk[:] = 0  # returned KV is a copy
    assert c.lookup(ids + [1])[1].any()


def test_insert_is_idempotent_and_copies():
    c = PrefixCache(1 << 20, block=B)
    ids = list(range(32))
    k, v = kv(40)
    assert c.insert(ids + [1] * 8, k, v) == 2
    assert c.insert(ids + [2] * 8, k, v) == 0  # same two blocks already cached
    orig = k[:, :, :32].copy()
    k[:] = -1  # the cache keeps its own copy (no view on the engine output)
    assert np.array_equal(c.lookup(ids + [3])[1], orig)


def test_lru_budget_evicts_leaves_first():
    c = PrefixCache(3 * BLK_BYTES, block=B)
    sys_ids = list(range(16))
    a = sys_ids + [1] * 16 + [2] * 16
    c.insert(a, *kv(48))
    assert len(c) == 3
    b = sys_ids + [3] * 16
    c.insert(b, *kv(32, 1.0))  # adds 1 block: over budget -> evict the LRU leaf (a's last block)
    assert len(c) == 3 and c.nbytes <= c.budget
    assert c.stats()["evicted_blocks"] == 1
    assert c.lookup(a + [0])[0] == 32  # a's first two blocks survive: the parent was never orphaned
    assert c.lookup(b + [0])[0] == 32
    c.insert(list(range(500, 564)), *kv(64))  # 4 new blocks > budget: only 3 can stay, all from this chain
    assert len(c) == 3 and c.lookup(list(range(500, 565)))[0] == 48
    assert c.lookup(sys_ids + [0])[0] == 0


def test_disabled_and_tiny_budget():
    c = PrefixCache(0, block=B)
    assert not c.enabled
    assert c.insert(list(range(32)), *kv(32)) == 0
    assert c.lookup(list(range(40))) == (0, None, None)
    assert c.stats()["lookups"] == 1 and c.stats()["hits"] == 0
    t = PrefixCache(BLK_BYTES - 1, block=B)  # smaller than one block: never stores anything
    assert t.insert(list(range(32)), *kv(32)) == 0 and len(t) == 0


def test_hash_collision_never_returns_foreign_kv(monkeypatch):
    monkeypatch.setattr(prefix_mod, "block_hashes",
                        lambda ids, block=B, seed=b"": [b"same"] * (len(ids) // block))
    c = PrefixCache(1 << 20, block=B)
    c.insert(list(range(16)), *kv(16))
    assert c.lookup(list(range(1, 17)) + [0])[0] == 0  # same key, different tokens -> miss


def test_bad_input():
    c = PrefixCache(1 << 20, block=B)
    with pytest.raises(ValueError):
        c.insert(list(range(32)), *kv(16))  # KV shorter than the tokens
    k, v = kv(32)
    with pytest.raises(ValueError):
        c.insert(list(range(32)), k, v[:, :, :16])
    with pytest.raises(ValueError):
        PrefixCache(1, block=0)


def test_from_env(monkeypatch):
    monkeypatch.setenv("HETSERVE_PREFIX_CACHE_MB", "0")
    assert not PrefixCache.from_env().enabled
    monkeypatch.setenv("HETSERVE_PREFIX_CACHE_MB", "1.5")
    assert PrefixCache.from_env().budget == int(1.5 * (1 << 20))
    monkeypatch.setenv("HETSERVE_PREFIX_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="HETSERVE_PREFIX_CACHE_MB"):
        PrefixCache.from_env()


# ---- engine level ---------------------------------------------------------------------------------
SYSTEM = ("You are the support assistant of a travel company. Answer briefly and politely, never invent "
          "prices, and always point the customer to the booking page for changes. ") * 3
QUESTIONS = ["What is the capital of France?", "Can I change my flight date?", "Write a haiku about the sea."]


def chat_ids(tok, system, question):
    return tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                               {"role": "user", "content": question}]))


def greedy_from(engine, logits, k, v, n):
    toks = [int(np.argmax(logits))]
    for _ in range(n - 1):
        lo, nk, nv = engine.prefill([toks[-1]], k, v)
        k, v = np.concatenate([k, nk], axis=2), np.concatenate([v, nv], axis=2)
        toks.append(int(np.argmax(lo)))
    return toks


@pytest.fixture(scope="module")
def engine(engine_dir):
    from hetserve.engines.runtime import Engine

    e = Engine(engine_dir, "prefill_fp32", threads=1)
    e.warmup()
    return e


def test_suffix_prefill_with_cached_prefix_is_exact(engine, tokenizer):
    cache = PrefixCache(64 << 20, seed=engine.compat_hash)
    first = chat_ids(tokenizer, SYSTEM, "Hello!")
    _, k0, v0 = engine.prefill(first)
    cache.insert(first, k0, v0)
    for q in QUESTIONS:
        ids = chat_ids(tokenizer, SYSTEM, q)
        hit, pk, pv = cache.lookup(ids)
        assert hit >= 64 and hit % BLOCK_TOKENS == 0 and ids[:hit] == first[:hit]
        lo_full, k_full, v_full = engine.prefill(ids)
        lo_suf, k_suf, v_suf = engine.prefill(ids[hit:], pk, pv)
        k_cat, v_cat = np.concatenate([pk, k_suf], axis=2), np.concatenate([pv, v_suf], axis=2)
        np.testing.assert_allclose(lo_suf, lo_full, rtol=0, atol=1e-4)
        np.testing.assert_allclose(k_cat, k_full, rtol=0, atol=1e-5)
        np.testing.assert_allclose(v_cat, v_full, rtol=0, atol=1e-5)
        assert greedy_from(engine, lo_suf, k_cat, v_cat, 12) == greedy_from(engine, lo_full, k_full, v_full, 12)


# ---- e2e on real servers --------------------------------------------------------------------------
def prefill_call(url, ids, **kw):
    import tritonclient.grpc as grpcclient

    from hetserve.client import build_inputs

    use_prefix = kw.pop("prefix_cache", True)
    c = grpcclient.InferenceServerClient(url)
    try:
        ins = build_inputs(None, input_ids=ids, **kw)
        for name, val in (("skip_transfer", True), ("prefix_cache", use_prefix)):
            x = grpcclient.InferInput(name, [1], "BOOL")
            x.set_data_from_numpy(np.array([val], bool))
            ins.append(x)
        r = c.infer("prefill", ins, request_id=f"pc-{uuid.uuid4().hex}")
        return {n: r.as_numpy(n).reshape(-1)[0] for n in ("first_token", "prefix_hit_tokens", "prefill_ms")}
    finally:
        c.close()


def test_e2e_shared_system_prompt_hits_and_changes_no_output(topology, tokenizer):
    from hetserve.client import generate

    url = topology.prefill_grpc
    system = f"[session {uuid.uuid4().hex[:8]}] " + SYSTEM  # fresh prefix: the first request must miss
    ids = [chat_ids(tokenizer, system, q) for q in QUESTIONS]

    miss = prefill_call(url, ids[0])
    assert miss["prefix_hit_tokens"] == 0
    hits = [prefill_call(url, x) for x in ids[1:]]
    offs = [prefill_call(url, x, prefix_cache=False) for x in ids[1:]]
    for x, h, o in zip(ids[1:], hits, offs):
        assert h["prefix_hit_tokens"] >= 64 and h["prefix_hit_tokens"] % BLOCK_TOKENS == 0
        assert h["prefix_hit_tokens"] < len(x)
        assert o["prefix_hit_tokens"] == 0 and h["first_token"] == o["first_token"]

    # streamed greedy tokens through llm (prefill hits the cache) == aggregated (no prefix cache)
    ttft_hit, ttft_miss = [], []
    for i, x in enumerate(ids):
        g = generate(url, None, model="llm", input_ids=x, max_tokens=16, ignore_eos=True, timeout_s=60)
        a = generate(url, None, model="aggregated", input_ids=x, max_tokens=16, ignore_eos=True, timeout_s=60)
        assert g.token_ids == a.token_ids, f"prefix hit changed the output for question {i}"
        ttft_hit.append(g.ttft_s)
        fresh = chat_ids(tokenizer, f"[{uuid.uuid4().hex[:8]}] " + SYSTEM, QUESTIONS[i])  # same length, miss
        ttft_miss.append(generate(url, None, model="llm", input_ids=fresh, max_tokens=2, ignore_eos=True,
                                  timeout_s=60).ttft_s)

    pf_hit = float(np.median([h["prefill_ms"] for h in hits]))
    pf_off = float(np.median([o["prefill_ms"] for o in offs]))
    print(f"\nprefix cache: prompt {len(ids[1])} tokens, hit {hits[0]['prefix_hit_tokens']} tokens; prefill "
          f"{pf_hit:.0f} ms (hit) vs {pf_off:.0f} ms (cache off); llm TTFT p50 {1e3 * np.median(ttft_hit):.0f} ms "
          f"(hit) vs {1e3 * np.median(ttft_miss):.0f} ms (miss)")
    assert pf_hit < pf_off
