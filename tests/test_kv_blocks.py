"""Paged KV block pool (kv/blocks.py): exact round trips through device/host/disk/Redis, demotion under
pressure and promotion back, refcounts, and the decode scheduler preempting + resuming with unchanged tokens."""
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hetserve.kv.blocks import BlockPool, KVLost, PoolFull
from hetserve.kv.tiers import ArenaTier, TorchArenaTier
from hetserve.sampling import SamplingParams

L, H, D, BT = 3, 2, 8, 4  # small layout for the pool unit tests


def kv(T, seed=0):
    """fp32 KV with awkward bit patterns (signed zeros, denormals, inf, NaN payloads) as well as randoms."""
    r = np.random.default_rng(seed)
    k = r.standard_normal((L, H, T, D)).astype(np.float32)
    v = r.standard_normal((L, H, T, D)).astype(np.float32)
    special = np.array([-0.0, 1e-45, -1e-40, np.inf, -np.inf, 3.4e38], np.float32)
    k.reshape(-1)[:special.size] = special
    v.reshape(-1)[-4:] = np.frombuffer(np.array([0x7FC00001, 0x7F800ABC, 0xFFC12345, 1], np.uint32).tobytes(),
                                       np.float32)
    return k, v


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def make_pool(device=4, host=0, disk=0, tmp_path=None, redis_url=None, bt=BT, **kw):
    bb = 2 * L * H * bt * D * 4
    return BlockPool.create(L, H, D, block_tokens=bt, device_bytes=device * bb, host_bytes=host * bb,
                            disk_dir=str(tmp_path) if disk else None, disk_bytes=disk * bb, redis_url=redis_url,
                            device="cpu", **kw)


# ---- the pool ------------------------------------------------------------------------------------
def test_round_trip_exact_through_every_tier(tmp_path, redis_url):
    pool = make_pool(device=4, host=4, disk=4, tmp_path=tmp_path, redis_url=redis_url)
    try:
        assert [t.name for t in pool.tiers] == ["device", "host", "disk", "redis"]
        k, v = kv(11)  # 3 blocks, the last one partial
        pool.add("s", k, v)
        assert pool.placement("s") == {"device": 3}
        for tier in ("host", "disk", "redis"):
            assert pool.demote("s", to=tier) == 3
            assert pool.placement("s") == {tier: 3}
            k2, v2 = pool.read("s")
            assert same_bytes(k2, k) and same_bytes(v2, v), tier
        pool.activate("s")  # redis -> device
        assert pool.placement("s") == {"device": 3}
        k2, v2 = pool.read("s")
        assert same_bytes(k2, k) and same_bytes(v2, v)
        st = pool.stats()
        assert st["demoted_blocks"] == 9 and st["promoted_blocks"] == 3
        assert st["tier_blocks"] == {"device": 3, "host": 0, "disk": 0, "redis": 0}
    finally:
        pool.close()


def test_redis_blocks_namespaced_with_ttl_and_deleted_on_free(redis_url):
    import redis

    pool = make_pool(device=2, redis_url=redis_url, redis_ttl_s=600)
    r = redis.Redis.from_url(redis_url)
    try:
        tier = pool.tiers[-1]
        pool.add("s", *kv(8))
        pool.demote("s")
        keys = r.keys(tier.ns + ":*")
        assert len(keys) == 2 and all(0 < r.ttl(key) <= 600 for key in keys)
        assert pool.free("s") and r.keys(tier.ns + ":*") == []
        # a block that Redis dropped (TTL expiry / maxmemory eviction) is reported, not invented
        pool.add("t", *kv(8))
        pool.demote("t")
        r.delete(r.keys(tier.ns + ":*")[0])
        with pytest.raises(KVLost, match="expired or evicted"):
            pool.read("t")
        with pytest.raises(KVLost):
            pool.activate("t")
        assert pool.stats()["lost_blocks"] >= 1
    finally:
        pool.close()
    assert r.keys(tier.ns + ":*") == []


def test_torch_arena_same_api_exact():
    pytest.importorskip("torch")
    shape = (2, L, H, BT, D)
    pool = BlockPool(L, H, D, [TorchArenaTier("device", 3, shape, np.float32, "cpu"),
                               ArenaTier("host", 3, shape, np.float32)], block_tokens=BT)
    try:
        k, v = kv(6)
        pool.add("s", k, v)
        pool.activate("s", 7)
        pool.append(["s"], k[None, :, :, 0], v[None, :, :, 0])
        pool.deactivate("s")
        pool.demote("s")
        assert pool.placement("s") == {"host": 2}
        pool.activate("s")
        k2, v2 = pool.read("s")
        assert same_bytes(k2, np.concatenate([k, k[:, :, :1]], 2))
        assert same_bytes(v2, np.concatenate([v, v[:, :, :1]], 2))
    finally:
        pool.close()


def test_demotion_under_pressure_cascades_and_promotion_restores(tmp_path, redis_url):
    pool = make_pool(device=4, host=2, disk=2, tmp_path=tmp_path, redis_url=redis_url)
    try:
        data = {s: kv(8, seed=i) for i, s in enumerate("abcd")}  # 2 blocks each
        for s in "ab":
            pool.add(s, *data[s])
        pool.add("c", *data["c"])  # device full: a new sequence lands on the next tier, nothing evicted
        assert pool.placement("c") == {"host": 2} and pool.placement("a") == {"device": 2}
        pool.activate("c")  # needs 2 device blocks: LRU 'a' goes down to host (full) -> cascade
        assert pool.placement("c") == {"device": 2}
        assert pool.placement("a") == {"host": 2} and pool.placement("b") == {"device": 2}
        pool.add("d", *data["d"])  # host full -> disk
        assert pool.placement("d") == {"disk": 2}
        pool.activate("d")  # b (unpinned) -> host, a host -> disk, the disk blocks of d move up
        assert pool.placement("d") == {"device": 2} and pool.placement("c") == {"device": 2}
        assert pool.placement("b") == {"host": 2} and pool.placement("a") == {"disk": 2}
        pool.demote("a")  # disk -> redis
        assert pool.placement("a") == {"redis": 2}
        # both device sequences are pinned: nothing can make room for 'a'
        assert not pool.can_activate("a")
        with pytest.raises(PoolFull, match="device tier full"):
            pool.activate("a")
        assert not pool.reserve("c", 9)
        pool.deactivate("c")
        pool.activate("a")  # c (now LRU, unpinned) goes down instead
        assert pool.placement("a") == {"device": 2} and pool.placement("c") == {"host": 2}
        for s in "abcd":
            k2, v2 = pool.read(s)
            assert same_bytes(k2, data[s][0]) and same_bytes(v2, data[s][1]), s
        for s in "abcd":
            pool.free(s)
        st = pool.stats()
        assert st["used_blocks"] == 0 and set(st["tier_blocks"].values()) == {0}
    finally:
        pool.close()


def test_failed_promotion_loses_blocks_once_never_frees_a_slot_twice():
    """A promotion whose writes fail on every tier cannot put the blocks back: they are marked lost (reads raise
    KVLost, so the scheduler recomputes) and freeing the sequence later must not release their old slots again
    (a slot in the free list twice would let two blocks share it: silent KV corruption)."""
    pool = make_pool(device=2, host=2)
    try:
        pool.add("a", *kv(8))  # 2 blocks on the device
        pool.add("b", *kv(8, seed=1))  # device full: host
        assert pool.placement("b") == {"host": 2}

        def broken(slots, data):
            raise OSError("tier write failed (injected)")

        for t in pool.tiers:
            t.write = broken
        with pytest.raises(KVLost):
            pool.activate("b")  # room is made by moving "a" down, then every write fails
        with pytest.raises(KVLost):
            pool.read("b")
        assert pool.counters["lost_blocks"] >= 2
        pool.free("b")
        pool.free("a")
        for t in pool.tiers:
            free = t._free
            assert len(free) == len(set(free)) == t.capacity, (t.name, free)
            assert t.used == 0, (t.name, t.used)
    finally:
        pool.close()


def test_append_reserve_and_idle_demotion():
    pool = make_pool(device=4, host=4)
    try:
        k, v = kv(3)
        pool.add("s", k, v)
        pool.activate("s", 4)
        ks, vs = [k], [v]
        for i in range(9):
            assert pool.reserve("s", pool.num_tokens("s") + 1)
            kt, vt = kv(1, seed=100 + i)
            pool.append(["s"], kt[None, :, :, 0], vt[None, :, :, 0])
            ks.append(kt)
            vs.append(vt)
        assert pool.num_tokens("s") == 12 and pool.placement("s") == {"device": 3}
        k2, v2 = pool.read("s")
        assert same_bytes(k2, np.concatenate(ks, 2)) and same_bytes(v2, np.concatenate(vs, 2))
        with pytest.raises(PoolFull, match="no block reserved"):
            pool.append(["s"], kt[None, :, :, 0], vt[None, :, :, 0])
        assert pool.demote_idle(0.0) == 0  # active: pinned, never moved
        pool.deactivate("s")
        assert pool.demote_idle(0.0) == 3 and pool.placement("s") == {"host": 3}
        with pytest.raises(ValueError, match="not active"):
            pool.reserve("s", 13)
    finally:
        pool.close()


def test_refcounts_fork_and_free():
    pool = make_pool(device=8)
    try:
        k, v = kv(10)  # blocks: 4 + 4 + 2
        pool.add("a", k, v)
        pool.fork("a", "b")  # shares the 2 full blocks, copies the partial one
        pool.fork("a", "c", n_tokens=8)  # shares exactly the 2 full blocks
        assert pool.stats()["used_blocks"] == 4
        for s, n in (("a", 10), ("b", 10), ("c", 8)):
            k2, v2 = pool.read(s)
            assert same_bytes(k2, k[:, :, :n]) and same_bytes(v2, v[:, :, :n])
        pool.activate("b", 12)  # appends go into b's own copy of the partial block
        kt, vt = kv(1, seed=7)
        pool.append(["b"], kt[None, :, :, 0], vt[None, :, :, 0])
        assert same_bytes(pool.read("a")[0], k)  # a is untouched
        assert pool.free("a") and pool.stats()["used_blocks"] == 3  # a's partial block only
        assert not pool.free("a")
        assert same_bytes(pool.read("c")[0], k[:, :, :8])
        pool.free("b")
        assert pool.stats()["used_blocks"] == 2
        pool.free("c")
        st = pool.stats()
        assert st["used_blocks"] == 0 and st["tier_blocks"]["device"] == 0 and st["sequences"] == 0
    finally:
        pool.close()


def test_pool_bad_input_errors(redis_url):
    with pytest.raises(ValueError, match="smaller than one block"):
        BlockPool.create(L, H, D, block_tokens=BT, device_bytes=10, device="cpu")
    with pytest.raises(ConnectionError, match="cannot reach redis://127.0.0.1:1"):
        make_pool(redis_url="redis://127.0.0.1:1/0")
    pool = make_pool(device=2)
    try:
        with pytest.raises(ValueError, match="does not match pool layout"):
            pool.add("x", np.zeros((L, H, 4, D + 1), np.float32), np.zeros((L, H, 4, D + 1), np.float32))
        pool.add("x", *kv(4))
        with pytest.raises(ValueError, match="already in the KV pool"):
            pool.add("x", *kv(4))
        with pytest.raises(PoolFull, match="KV pool full"):
            pool.add("y", *kv(9))
        with pytest.raises(KeyError, match="not in the KV pool"):
            pool.read("nope")
        with pytest.raises(ValueError, match="no KV tier"):
            pool.demote("x", to="tape")
    finally:
        pool.close()


def test_pool_from_env_sizes(tmp_path, redis_url):
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_layers=L, num_kv_heads=H, head_dim=D)
    bb = 2 * L * H * 16 * D * 4
    env = {"HETSERVE_KV_BUDGET_MB": str(10 * bb / 2**20), "HETSERVE_KV_HOST_MB": str(20 * bb / 2**20),
           "HETSERVE_KV_DISK_DIR": str(tmp_path), "HETSERVE_KV_DISK_MB": str(30 * bb / 2**20),
           "HETSERVE_REDIS_URL": redis_url, "HETSERVE_KV_DEVICE": "cpu"}
    pool = BlockPool.from_env(cfg, env)
    try:
        assert pool.bt == 16 and pool.stats()["tier_capacity"] == {"device": 10, "host": 20, "disk": 30,
                                                                   "redis": None}
        assert len(list(tmp_path.iterdir())) == 1
    finally:
        pool.close()
    assert list(tmp_path.iterdir()) == []  # the disk tier's file goes with the pool
    with pytest.raises(ValueError, match="HETSERVE_KV_HOST_MB='lots': expected a number"):
        BlockPool.from_env(cfg, {**env, "HETSERVE_KV_HOST_MB": "lots", "HETSERVE_REDIS_URL": ""})


# ---- the decode scheduler on real engines --------------------------------------------------------
N_TOKENS = 24
SCHED_BT = 8


@pytest.fixture(scope="module")
def engines(engine_dir):
    from hetserve.engines.runtime import Engine

    return Engine(engine_dir, "prefill_fp32", threads=2), Engine(engine_dir, "decode_fp32", threads=2)


def run_scheduler(engines, prompt_ids, pool=None, prompts=3, n=N_TOKENS, with_prompt_ids=True, cancel_when=None,
                  **kw):
    """Submit `prompts` prompts at once; returns (tokens per prompt, finish reasons, scheduler stats, pool stats)."""
    from hetserve.scheduler import DecodeScheduler, Sequence

    pre, dec = engines
    sched = DecodeScheduler({"fp32": dec}, max_batch=8, pool=pool, **kw)
    cancel = threading.Event()
    try:
        results, reasons, done = {}, {}, {}
        items = list(prompt_ids.items())[:prompts]
        kvs = {p: pre.prefill(ids) for p, ids in items}  # all prefills first, then submit together
        for p, ids in items:
            lo, k, v = kvs[p]
            results[p] = [int(lo.argmax())]
            done[p] = threading.Event()

            def cb(toks, reason, p=p):
                results[p].extend(toks)
                if reason:
                    reasons[p] = reason
                    done[p].set()
            sched.submit(Sequence(p, len(ids), list(results[p]), SamplingParams(max_tokens=n, ignore_eos=True),
                                  "fp32", cb, cancel.is_set, k=k, v=v,
                                  prompt_ids=list(ids) if with_prompt_ids else None))
        if cancel_when is not None:
            deadline = time.monotonic() + 120
            while not cancel_when(sched) and time.monotonic() < deadline:
                time.sleep(0.01)
            cancel.set()
        for e in done.values():
            assert e.wait(180)
        time.sleep(0.05)  # let the loop finish its bookkeeping
        assert sched.batches["fp32"].n == 0
        return results, reasons, dict(sched.stats), sched.kv_pool.stats()
    finally:
        sched.close()


def sched_pool(device, host=0, disk=0, tmp_path=None, redis_url=None):
    bb = 2 * 30 * 3 * SCHED_BT * 64 * 4
    return BlockPool.create(30, 3, 64, block_tokens=SCHED_BT, device_bytes=device * bb, host_bytes=host * bb,
                            disk_dir=str(tmp_path) if disk else None, disk_bytes=disk * bb, redis_url=redis_url,
                            device="cpu")


@pytest.fixture(scope="module")
def unpreempted(engines, prompt_ids):
    results, reasons, stats, _ = run_scheduler(engines, prompt_ids)
    assert stats["preempted"] == 0 and set(reasons.values()) == {"length"}
    return results


@pytest.mark.parametrize("tiers", ["host", "disk+redis", "device-only"])
def test_scheduler_preemption_keeps_greedy_tokens(engines, prompt_ids, unpreempted, tiers, tmp_path, request):
    """A device tier of 12 blocks (96 tokens) for 3 sequences growing to ~61 tokens each: running sequences
    get preempted, swapped down (or, with no lower tier, dropped and recomputed), resumed, same tokens."""
    if tiers == "host":
        pool = sched_pool(12, host=64)
    elif tiers == "disk+redis":
        pool = sched_pool(12, disk=8, tmp_path=tmp_path, redis_url=request.getfixturevalue("redis_url"))
    else:
        pool = sched_pool(15)  # the waiting KV (3 x 5 blocks) must fit somewhere
    results, reasons, stats, pst = run_scheduler(engines, prompt_ids, pool=pool)
    assert stats["preempted"] >= 1 and stats["resumed"] == stats["preempted"], stats
    assert set(reasons.values()) == {"length"}
    assert results == unpreempted
    if tiers == "device-only":
        assert stats["kv_recomputed"] == stats["preempted"] + stats["kv_dropped"] and pst["demoted_blocks"] == 0
    else:
        assert stats["kv_recomputed"] == 0 and pst["demoted_blocks"] > 0 and pst["promoted_blocks"] > 0
    if tiers == "disk+redis":
        assert pst["demoted_blocks"] > 8  # more than the disk holds: the cascade reached Redis
    assert pst["used_blocks"] == 0 and set(pst["tier_blocks"].values()) == {0}  # every block returned


def test_scheduler_cancel_frees_blocks(engines, prompt_ids):
    """Cancel running and preempted (swapped-out) sequences mid-flight: the pool returns to zero used blocks."""
    pool = sched_pool(16, host=64)
    results, reasons, stats, pst = run_scheduler(
        engines, prompt_ids, pool=pool, n=64,
        cancel_when=lambda s: s.stats["preempted"] >= 1 and s.stats["steps"] >= 12)
    assert set(reasons.values()) == {"cancelled"} and stats["cancelled"] == 3
    assert all(len(t) < 64 for t in results.values())
    assert pst["used_blocks"] == 0 and set(pst["tier_blocks"].values()) == {0} and pst["sequences"] == 0


def test_scheduler_asks_for_cancellation_right_before_sending(engines, prompt_ids):
    """A client that cancels while the engine runs its row gets no further token (the scheduler asks right before
    sending, docs/reliability.md "Cancellation"): the sequence ends with a final "cancelled" and frees its blocks."""
    from hetserve.scheduler import DecodeScheduler, Sequence

    pre, dec = engines
    ids = next(iter(prompt_ids.values()))
    lo, k, v = pre.prefill(ids)
    got, done, cancel = [], threading.Event(), threading.Event()
    sched = DecodeScheduler({"fp32": dec}, pool=sched_pool(32))
    engine_step = sched.batches["fp32"].step

    def step_then_cancel(tokens):  # the client cancels while the engine runs the first step
        out = engine_step(tokens)
        cancel.set()
        return out

    sched.batches["fp32"].step = step_then_cancel
    try:
        sched.submit(Sequence("s", len(ids), [int(lo.argmax())], SamplingParams(max_tokens=8), "fp32",
                              lambda t, r: (got.append((list(t), r)), r and done.set()), cancel.is_set, k=k, v=v))
        assert done.wait(60)
        assert got == [([], "cancelled")] and sched.stats["cancelled"] == 1
        assert sched.kv_pool.stats()["used_blocks"] == 0
    finally:
        sched.close()


def test_scheduler_admission_errors(engines, prompt_ids):
    from hetserve.scheduler import DecodeScheduler, Overloaded, Sequence

    pre, dec = engines
    ids = next(iter(prompt_ids.values()))
    lo, k, v = pre.prefill(ids)
    sched = DecodeScheduler({"fp32": dec}, pool=sched_pool(8))
    try:
        big = Sequence("big", len(ids), [1], SamplingParams(max_tokens=64), "fp32", lambda *a: None, k=k, v=v)
        with pytest.raises(Overloaded, match=r"needs 13 KV blocks .* budget is 8 blocks"):
            sched.submit(big)
        assert sched.kv_pool.stats()["used_blocks"] == 0
        done = threading.Event()
        sched.submit(Sequence("a", len(ids), [1], SamplingParams(max_tokens=8), "fp32",
                              lambda t, r: r and done.set(), k=k, v=v))
        with pytest.raises(Overloaded, match="KV pool full"):  # no tier left for a second one's KV
            sched.submit(Sequence("b", len(ids), [1], SamplingParams(max_tokens=8), "fp32", lambda *a: None,
                                  k=k, v=v))
        assert done.wait(60)
        time.sleep(0.05)
        assert sched.kv_pool.stats()["used_blocks"] == 0
    finally:
        sched.close()


# ---- end to end on real servers ------------------------------------------------------------------
def test_e2e_tiny_kv_budget_preempts_with_unchanged_tokens(engine_dir, tmp_path):
    """Real prefill + decode servers with a 12-block (96-token) device KV budget: three concurrent streams of
    ~37 + 48 tokens cannot all stay resident, so decode preempts (swaps to the host tier) and resumes; every
    stream equals the same prompt run alone."""
    import concurrent.futures
    import os

    from conftest import PROMPTS
    from hetserve.client import GenerationError, generate
    from hetserve.topology import Topology

    bb = 2 * 30 * 3 * SCHED_BT * 64 * 4
    env = {"HETSERVE_KV_BUDGET_MB": repr(12 * bb / 2**20), "HETSERVE_KV_BLOCK_TOKENS": str(SCHED_BT),
           "HETSERVE_KV_HOST_MB": "64", "HETSERVE_DECODE_ENGINES": "decode_fp32", "HETSERVE_KV_TIMEOUT_MS": "2000",
           "HETSERVE_BREAKER_P99_MS": "60000", "HETSERVE_HEALTH_INTERVAL_S": "1"}
    base = int(os.environ.get("HETSERVE_KV_E2E_BASE_PORT", "38000"))
    topo = Topology(engine_dir, base_port=base, env=env, log_dir=str(tmp_path))
    prompts = PROMPTS[:3]

    def gen(p):
        return generate(topo.prefill_grpc, p, max_tokens=48, ignore_eos=True, timeout_s=120).token_ids

    with topo:  # starts both servers, stops them on exit
        deadline = time.monotonic() + 30
        while True:  # the prefill server's decode health check may have run before decode was up
            try:
                generate(topo.prefill_grpc, prompts[0], max_tokens=1, timeout_s=60)
                break
            except GenerationError as e:
                if "no healthy decode server" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        alone = {p: gen(p) for p in prompts}
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
            together = dict(zip(prompts, ex.map(gen, prompts)))
    assert all(len(t) == 48 for t in alone.values())
    assert together == alone
    log = Path(topo.servers["decode"].spec.log_file).read_text(errors="replace")
    assert "preempted" in log, "the tiny budget should have forced a preemption"
