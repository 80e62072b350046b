"""KV-aware routing (stages/router.py) and the decode server's side of it, WITHOUT tritonserver: the router's
index and choice, the orchestrator's conditional disaggregation (prefill on the decode server), the decode stage
prefilling a prompt from its prefix cache and sampling the first token, the scheduler keeping an ended
sequence's KV. Uses the FAKES of tests/test_stages.py (labelled there: unit only) for the prefill model, decode
servers and engine; the PrefixCache, PrefixRouter, DecodeScheduler and a real engine are the real ones. The
real-server counterpart is tests/test_reliability.py::test_kv_router_follow_up_prefills_on_the_decode_server."""
import numpy as np
import pytest

from hetserve.bounded import BoundedExecutor
from hetserve.kv.prefix import PrefixCache
from hetserve.sampling import SamplingParams
from hetserve.stages.decode import DecodeConfig, DecodeStage, PendingKV
from hetserve.stages.router import PREFILL_PLACEMENT_METRIC, PrefixRouter, Refresher, RouterConfig
from hetserve.stages.types import DecodeCall, DecodeFailed, GenerateRequest, TokenChunk
from test_stages import (
    CFG,
    COMPAT,
    FakeDecodeClient,
    FakeEngine,
    FakeMetrics,
    FakePool,
    FakePrefill,
    FakeReply,
    FakeScheduler,
    FakeSink,
    _orch,
)

BT = 8


# ---- the router's index and choice ----------------------------------------------------------------------------
def test_router_counts_leading_blocks_and_weighs_load():
    r = PrefixRouter(BT, "seed", RouterConfig(load_tokens=100))
    conv = list(range(1000, 1200))  # 25 blocks
    r.routed("a", conv[:160])
    hs = r.hashes(conv)
    assert r.hit_tokens("a", hs) == 160 and r.hit_tokens("b", hs) == 0
    assert r.hit_tokens("a", r.hashes([7] + conv[1:])) == 0  # a chain: a different first block matches nothing
    cost = r.cost(hs, len(conv))
    assert cost("a", 0) == 40 and cost("b", 0) == 200
    assert cost("a", 2) == 240 > cost("b", 0)  # the holder loses to an idle server once it is loaded enough
    assert PrefixRouter(BT, "other-model").hashes(conv) != hs  # hashes are per build (compat hash seed)


def _route(r, url, ids, streams=0, queued=0):
    """route() for `url` as if the pool priced it with `streams` in flight."""
    costing = r.cost(r.hashes(ids), len(ids))
    costing(url, streams)
    return r.route(url, costing, queued)


def test_route_prefills_on_the_decode_server_only_for_a_short_uncached_suffix_of_a_real_hit():
    r = PrefixRouter(BT, "s", RouterConfig(local_prefill_max_tokens=96, local_prefill_min_hit_tokens=64))
    conv = list(range(400))
    r.routed("a", conv[:320])
    assert _route(r, "a", conv).local is True and _route(r, "a", conv).hit_tokens == 320
    assert _route(r, "a", conv + list(range(100))).local is False  # 180 uncached > 96
    assert _route(r, "b", conv).local is False  # nothing held: the prefill server does it
    short = list(range(40))
    r.routed("a", short)
    assert _route(r, "a", short + [1, 2]).local is False  # 40 held < 64: not a history worth it
    # the whole prompt held: at most len - 1 counts (the last token's logits must be computed)
    assert _route(r, "a", conv[:320]).hit_tokens == 319
    # a member the costing never priced is looked up (and counted idle)
    assert r.route("a", r.cost(r.hashes(conv), 400)).hit_tokens == 320


def test_a_miss_is_worth_a_lookup_only_when_no_known_holder_makes_the_prompt_local_and_learn_records_it():
    """should_look_up: a prompt longer than the hit floor that no server is known to hold enough of; learn():
    what a server says it holds counts like a routed sequence, and the block it says it lacks is dropped."""
    r = PrefixRouter(BT, "s", RouterConfig(local_prefill_max_tokens=96, local_prefill_min_hit_tokens=64))
    conv = list(range(400))

    def miss(ids):
        return r.should_look_up(r.cost(r.hashes(ids), len(ids)))
    assert miss(conv) and not miss(conv[:64])  # 64 tokens can never hold >= 64 and leave one to compute
    r.routed("a", conv[:320])
    assert not miss(conv) and miss(conv + list(range(100)))  # known holder enough / 180 uncached: ask
    hs = r.hashes(conv)
    r.learn("b", hs, 45)  # b says it holds 360 tokens of it
    assert r.hit_tokens("b", hs) == 360 and not miss(conv)
    r.learn("a", hs, 10)  # a lost blocks 10.. (evicted): its view stops at 80
    assert r.hit_tokens("a", hs) == 80
    assert not PrefixRouter(BT, "s", RouterConfig(local_prefill_max_tokens=0)).should_look_up(
        r.cost(hs, len(conv)))  # no local prefill at all: nothing a lookup could change


def test_local_prefill_is_refused_when_it_would_stall_a_busy_decode_server_unless_prefill_is_backed_up():
    r = PrefixRouter(BT, "s", RouterConfig(local_prefill_max_tokens=512, local_prefill_min_hit_tokens=64,
                                           local_prefill_stall_tokens=256))
    conv = list(range(600))
    r.routed("a", conv[:400])  # 200 uncached
    assert _route(r, "a", conv, streams=0).local is True  # idle: nothing to stall
    assert _route(r, "a", conv, streams=1).local is True  # 200 x 1 <= 256
    assert _route(r, "a", conv, streams=2).local is False  # 400 token-times of stall > 256: the prefill server
    assert _route(r, "a", conv, streams=2).whole_blocks == 400  # ... which sends only the KV after the held blocks
    assert _route(r, "a", conv, streams=2, queued=1200).local is True  # it would wait behind 1,200 tokens there
    follow_up = conv[:400] + list(range(40))  # a short follow-up stays local on a busy server
    assert _route(r, "a", follow_up, streams=6).local is True
    # a new prompt that shares only a held system prompt (120 of 300 tokens) is no follow-up: the prefill side
    system = list(range(900, 1020))
    r.routed("a", system)
    assert _route(r, "a", system + list(range(180))).local is False
    assert _route(r, "a", system + list(range(100))).local is True  # 120 of 220 held: over half
    off = PrefixRouter(BT, "s", RouterConfig(local_prefill_stall_tokens=0))
    off.routed("a", conv[:400])
    assert _route(off, "a", conv, streams=1).local is False and _route(off, "a", conv, streams=0).local is True


def test_costing_remembers_what_it_saw_of_each_member():
    r = PrefixRouter(BT, "s", RouterConfig(load_tokens=100))
    conv = list(range(200))
    r.routed("a", conv[:160])
    costing = r.cost(r.hashes(conv), 200)
    assert costing("a", 3) == 40 + 300 and costing("b", 0) == 200
    assert costing.seen == {"a": (160, 3), "b": (0, 0)}


def test_refresh_replaces_the_view_but_keeps_recently_routed_blocks():
    now = [100.0]
    r = PrefixRouter(BT, "s", RouterConfig(recent_s=30.0), clock=lambda: now[0])
    old, new = list(range(64)), list(range(500, 564))
    r.routed("a", old)
    now[0] += 60  # old is no longer recent
    r.routed("a", new)
    published = r.hashes(list(range(900, 964)))
    r.refresh("a", published)
    assert r.hit_tokens("a", r.hashes(old)) == 0  # the server no longer lists it: evicted there
    assert r.hit_tokens("a", r.hashes(new)) == 64  # routed 0 s ago: its sequence may still be running
    assert r.hit_tokens("a", published) == 64
    r.forget("a")
    assert r.hit_tokens("a", r.hashes(new)) == 0 and r.servers() == {}


def test_index_is_bounded_per_server():
    r = PrefixRouter(BT, "s", RouterConfig(max_blocks_per_server=10))
    r.routed("a", list(range(800)))  # 100 blocks
    assert r.servers() == {"a": 10}
    r.refresh("b", r.hashes(list(range(800))))
    assert r.servers()["b"] == 10


def test_refresher_reads_healthy_servers_and_forgets_down_or_mismatched_ones():
    r = PrefixRouter(BT, "s")
    ids = list(range(64))
    hexes = [h.hex() for h in r.hashes(ids)]
    answers = {"a": {"block_tokens": BT, "blocks": hexes}, "b": {"block_tokens": 16, "blocks": hexes},
               "c": RuntimeError("unreachable")}
    r.routed("b", ids)
    r.routed("c", ids)
    r.routed("d", ids)

    def fetch(url):
        a = answers[url]
        if isinstance(a, Exception):
            raise a
        return a

    ref = Refresher(r, lambda: {"a": True, "b": True, "c": True, "d": False}, fetch, 1.0, start=False)
    ref.refresh_once()
    hs = r.hashes(ids)
    assert r.hit_tokens("a", hs) == 64  # published
    assert r.hit_tokens("b", hs) == 0  # another block size: nothing it says can match
    assert r.hit_tokens("c", hs) == 64  # unreachable this round: the last view stays (the health check decides)
    assert r.hit_tokens("d", hs) == 0  # down: forgotten


# ---- the orchestrator with a router ---------------------------------------------------------------------------
class CostPool(FakePool):
    """FAKE pool that honours the router's cost (the real DecodePool's pick(cost=...) is tested below)."""

    def pick(self, exclude=(), cost=None):
        ok = [u for u in self.urls if u not in self.down and u not in exclude]
        if not ok or cost is None:
            return super().pick(exclude)
        u = min(ok, key=lambda u: cost(u, self.leases[u]))
        self.leases[u] += 1
        return u


def _routed_orch(dec, pool, prefill=None, **rc):
    router = PrefixRouter(BT, COMPAT, RouterConfig(**{"local_prefill_max_tokens": 64,
                                                      "local_prefill_min_hit_tokens": 16, **rc}))
    orch, m, breaker = _orch(prefill or FakePrefill(), dec, pool)
    orch.router = router
    return orch, m, router


def test_follow_up_goes_to_the_holder_and_is_prefilled_there():
    """Turn 1 (nothing held) is prefilled on the prefill server and decoded on the least-cost member; when it
    ends, that member holds prompt + answer; turn 2 (history + a short question) goes to the same member with
    no output_ids and kv_sent=false (prefilled there), no prefill job, and the first token comes from decode."""
    history = list(range(100, 180))
    pool = CostPool(["a", "b"])
    dec = FakeDecodeClient({"b": [([TokenChunk([11, 12]), TokenChunk([13], "length")], None),
                                  ([TokenChunk([21]), TokenChunk([22, 23], "length")], None)]})
    pool.leases["a"] = 1  # a is busy: turn 1 lands on b
    pre = FakePrefill()
    orch, m, router = _routed_orch(dec, pool, pre)
    s1 = FakeSink()
    orch.run(GenerateRequest(history, SamplingParams(max_tokens=4), "fp32"), s1)
    assert s1.ids == [10, 11, 12, 13] and len(pre.jobs) == 1 and pre.jobs[0].decode_url == "b"
    assert m.get(PREFILL_PLACEMENT_METRIC, where="prefill") == 1
    turn2 = history + [10, 11, 12, 13] + [5, 6, 7]
    assert router.hit_tokens("b", router.hashes(turn2)) == 80  # history + answer but its last token: 83 -> 10 blocks
    pool.leases["a"] = 0
    s2 = FakeSink()
    orch.run(GenerateRequest(turn2, SamplingParams(max_tokens=3), "fp32"), s2)
    assert len(pre.jobs) == 1, "the follow-up must not be prefilled on the prefill server"
    started = dec.opened[1][1].started
    assert dec.opened[1][0] == "b" and started.output_ids == [] and started.kv_sent is False
    assert s2.ids == [21, 22, 23] and s2.finish_reason == "length"
    assert m.get(PREFILL_PLACEMENT_METRIC, where="decode") == 1
    assert pool.leases == {"a": 0, "b": 0}


def test_holder_dies_the_stream_moves_and_the_router_forgets_it():
    """The member holding the history fails before its first token: it is marked down and forgotten, the stream
    resumes on the other member from nothing (prefilled there: its own cache decides what it can reuse)."""
    history = list(range(100, 180))
    pool = CostPool(["a", "b"])
    dec = FakeDecodeClient({"a": [([], DecodeFailed("UNAVAILABLE: socket closed"))],
                            "b": [([TokenChunk([21]), TokenChunk([22], "length")], None)]})
    orch, m, router = _routed_orch(dec, pool)
    router.routed("a", history)
    sink = FakeSink()
    orch.run(GenerateRequest(history + [1, 2], SamplingParams(max_tokens=2), "fp32"), sink)
    assert [u for u, _ in dec.opened] == ["a", "b"] and "a" in pool.down
    assert dec.opened[1][1].started.output_ids == [] and dec.opened[1][1].started.kv_sent is False
    assert sink.ids == [21, 22] and router.hit_tokens("a", router.hashes(history)) == 0
    assert m.get("hetserve_migrations_total") == 1


def test_busy_holder_prefills_locally_only_while_the_prefill_side_is_backed_up():
    """The holder decodes 3 streams: a 40-token suffix would stall them 120 token-times > 32, so with nothing
    queued at the prefill server it goes there (only the KV after the held blocks moves). While another
    request's 1,000 uncached tokens are at the prefill server, the same prompt is prefilled on the holder. The
    backlog count returns to 0 after each prefill, failed ones included."""
    history = list(range(100, 180))
    prompt = history + list(range(40))
    pool = CostPool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11], "length")], None), ([TokenChunk([12], "length")], None)]})
    pre = FakePrefill()
    orch, m, router = _routed_orch(dec, pool, pre, local_prefill_stall_tokens=32)
    router.routed("a", history)
    pool.leases["a"] = 3
    orch.run(GenerateRequest(prompt, SamplingParams(max_tokens=2), "fp32"), FakeSink())
    assert len(pre.jobs) == 1 and pre.jobs[0].kv_skip_tokens == 80 and orch._prefill_queued == 0
    orch._prefill_queued = 1000  # as while a long prompt is being prefilled for another request
    orch.run(GenerateRequest(prompt, SamplingParams(max_tokens=2), "fp32"), FakeSink())
    assert len(pre.jobs) == 1 and dec.opened[1][1].started.output_ids == []
    assert m.get(PREFILL_PLACEMENT_METRIC, where="decode") == 1
    orch._prefill_queued = 0

    class Failing(FakePrefill):
        def prefill(self, job):
            assert orch._prefill_queued == len(job.prompt) - job.kv_skip_tokens
            raise RuntimeError("unit: prefill server gone")
    orch.prefill = Failing()
    with pytest.raises(RuntimeError):  # another 40-token suffix (the first two prompts are held whole by now)
        orch.run(GenerateRequest(history + list(range(200, 240)), SamplingParams(max_tokens=2), "fp32"), FakeSink())
    assert orch._prefill_queued == 0


def test_a_turn_another_replica_routed_is_found_by_asking_the_decode_servers():
    """Two prefill replicas, each its own orchestrator and router (as behind a load balancer). Replica 1 routes
    turn 1 to b; turn 2 reaches replica 2 at once (its view has not been refreshed): without a lookup it goes to
    the prefill server; with one (a FAKE lookup answering what b's prefix cache holds, as decode op=prefix does)
    it goes to b and is prefilled there, counted as found. A lookup nobody answers changes nothing."""
    from hetserve.stages.router import ROUTER_LOOKUP_METRIC

    history = list(range(100, 180))
    chunks = [([TokenChunk([11, 12]), TokenChunk([13], "length")], None)]
    pool = CostPool(["a", "b"])
    pool.leases["a"] = 1
    dec = FakeDecodeClient({"a": chunks, "b": chunks * 3})
    one, _, r1 = _routed_orch(dec, pool)
    one.run(GenerateRequest(history, SamplingParams(max_tokens=4), "fp32"), FakeSink())
    pool.leases["a"] = 0
    turn2 = history + [10, 11, 12, 13] + [5, 6, 7]
    held = r1.hit_tokens("b", r1.hashes(turn2))  # what b's cache holds of it (80 tokens: the router's own count)
    asked = []

    def lookup(prompt):  # FAKE: the decode servers' answers to op=prefix
        asked.append(list(prompt))
        return {"a": 0, "b": held}

    pre2 = FakePrefill()
    two, m2, r2 = _routed_orch(dec, pool, pre2)
    two.lookup = lambda prompt: {}  # nobody answered in time
    two.run(GenerateRequest(turn2, SamplingParams(max_tokens=3), "fp32"), FakeSink())
    assert len(pre2.jobs) == 1 and m2.get(ROUTER_LOOKUP_METRIC, result="none") == 1
    three, m3, r3 = _routed_orch(dec, pool, pre2)
    three.lookup = lookup
    three.run(GenerateRequest(turn2, SamplingParams(max_tokens=3), "fp32"), FakeSink())
    assert asked == [turn2] and len(pre2.jobs) == 1, "the follow-up must be prefilled on its holder"
    assert dec.opened[-1][0] == "b" and dec.opened[-1][1].started.kv_sent is False
    assert m3.get(ROUTER_LOOKUP_METRIC, result="found") == 1 and m3.get(PREFILL_PLACEMENT_METRIC, where="decode") == 1
    three.run(GenerateRequest(turn2, SamplingParams(max_tokens=3), "fp32"), FakeSink())
    assert len(asked) == 1, "a prompt the view already places locally is not looked up again"


def test_n_choices_and_prompt_logprobs_always_use_the_prefill_server():
    history = list(range(100, 180))
    pool = CostPool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11], "length")], None)]})
    pre = FakePrefill()
    orch, m, router = _routed_orch(dec, pool, pre)
    router.routed("a", history)
    req = GenerateRequest(history + [1], SamplingParams(max_tokens=2), "fp32", prompt_logprobs=True)
    orch.run(req, FakeSink())
    assert len(pre.jobs) == 1 and dec.opened[0][1].started.output_ids == [10]


def test_real_pool_picks_the_cheapest_member():
    from hetserve.reliability import DecodePool

    pool = DecodePool(["a:1", "b:1"], check=lambda u, t: 1.0, start=False,
                      negotiate=lambda u, t: (_ for _ in ()).throw(RuntimeError("unit")))
    pool.check_all()
    costs = {"a:1": 5.0, "b:1": 1.0}
    assert pool.pick(cost=lambda url, inflight: costs[url] + 10 * inflight) == "b:1"
    assert pool.pick(cost=lambda url, inflight: costs[url] + 10 * inflight) == "a:1"  # b now has 1 in flight
    pool.close()


# ---- the decode server: prefill here, first token here ----------------------------------------------------------
class PrefixEngine(FakeEngine):
    """FAKE engine that also records the past it was given (the prefix cache's KV)."""

    def prefill(self, ids, past_k=None, past_v=None):
        self.past = None if past_k is None else past_k.shape[2]
        return super().prefill(ids, past_k, past_v)


@pytest.fixture
def routed_stage():
    ex = BoundedExecutor(2, 4, "unit-admit")
    prefix = PrefixCache(1 << 20, block=BT, seed=COMPAT)
    st = DecodeStage({"fp32": PrefixEngine()}, CFG, COMPAT, FakeScheduler(), ex, PendingKV(4, 1 << 20),
                     DecodeConfig(kv_timeout_s=0.5), metrics=FakeMetrics(), prefix=prefix)
    yield st
    ex.shutdown()


def _local(stage, prompt, max_tokens=8):
    reply = FakeReply()
    stage.handle(DecodeCall("generate", "r1", list(prompt), [], SamplingParams(max_tokens=max_tokens),
                            kv_sent=False), reply)
    assert reply.done.wait(5)
    return reply


def test_decode_prefills_from_its_prefix_cache_and_samples_the_first_token(routed_stage):
    from test_stages import _kv

    history = list(range(10, 42))  # 32 tokens: 4 blocks
    routed_stage.prefix.insert(history, *_kv(32))
    reply = _local(routed_stage, history + [50, 51, 52])
    eng = routed_stage.engines["fp32"]
    assert eng.calls[-1] == [50, 51, 52] and eng.past == 32, "only the uncached suffix is computed"
    # the first token (the fake engine favours 7) goes out first, then the scheduler's
    assert reply.sent[0] == ("tokens", [7], None) and reply.sent[-1] == ("tokens", [42], "length")
    seq = routed_stage.sched.seqs[-1]
    assert seq.tokens == [7] and seq.k.shape[2] == 35 and seq.sampler is not None
    assert routed_stage.counters["prefix_hit_tokens"] == 32 and routed_stage.counters["local_prefill"] == 1
    assert routed_stage.metrics.get("hetserve_kv_recompute_total", reason="local_prefill") == 1


def test_decode_local_prefill_that_ends_at_the_first_token(routed_stage):
    reply = _local(routed_stage, list(range(10, 30)), max_tokens=1)
    assert reply.sent == [("tokens", [7], "length")] and not routed_stage.sched.seqs
    assert routed_stage.prefix.cached_blocks(list(range(10, 30))) == 2  # its prompt is kept for reuse


def test_decode_refuses_no_output_ids_when_kv_is_sent(routed_stage):
    reply = FakeReply()
    routed_stage.handle(DecodeCall("generate", "r1", [1, 2, 3], [], SamplingParams(max_tokens=4)), reply)
    assert reply.sent[0][0] == "error" and "output_ids" in str(reply.sent[0][1])


def test_decode_publishes_its_blocks(routed_stage):
    from test_stages import _kv

    routed_stage.prefix.insert(list(range(16)), *_kv(16))
    reply = FakeReply()
    routed_stage.handle(DecodeCall("prefix"), reply)
    kind, obj = reply.sent[0]
    assert kind == "json" and obj["block_tokens"] == BT
    r = PrefixRouter(BT, COMPAT)
    assert set(obj["blocks"]) == {h.hex() for h in r.hashes(list(range(16)))}  # the router's own hashes
    reply = FakeReply()  # with the prompt: how many of its leading tokens it holds (token-compared chain)
    routed_stage.handle(DecodeCall("prefix", prompt=list(range(20))), reply)
    assert reply.sent[0] == ("json", {"block_tokens": BT, "held_tokens": 16})
    reply = FakeReply()
    routed_stage.handle(DecodeCall("prefix", prompt=[5] + list(range(1, 20))), reply)
    assert reply.sent[0][1]["held_tokens"] == 0


# ---- the scheduler keeps an ended sequence's KV (real engine, real scheduler) -----------------------------------
def test_scheduler_keeps_prompt_and_answer_and_the_next_turn_reuses_it_exactly(engine_dir):
    """A real DecodeScheduler on the real FP32 engine: a sequence that ends leaves prompt + answer (but its last
    token) in the prefix cache, copying only blocks not held yet; prefilling the next turn from that cache gives
    the same logits as prefilling it whole."""
    from hetserve.engines.runtime import load_engine
    from hetserve.scheduler import DecodeScheduler, Sequence

    eng = load_engine(engine_dir, "decode_fp32")
    sched = DecodeScheduler({"fp32": eng}, max_batch=2)
    prefix = PrefixCache(64 << 20, block=BT, seed="x")
    sched.prefix_cache = prefix
    try:
        prompt = [1] + list(range(200, 260))
        logits, k, v = eng.prefill(prompt)
        first = int(np.argmax(logits))
        import threading

        done = threading.Event()
        out = []

        def on_tokens(toks, reason, lp=None):
            out.extend(toks)
            if reason:
                done.set()
        sched.submit(Sequence("s1", len(prompt), [first], SamplingParams(max_tokens=12, ignore_eos=True), "fp32",
                              on_tokens, k=k, v=v, prompt_ids=list(prompt)))
        assert done.wait(60)
        answer = [first] + out
        kept = prompt + answer[:-1]
        assert prefix.cached_blocks(kept) == len(kept) // BT
        turn2 = kept + [answer[-1], 300, 301, 302, 303]
        n, pk, pv = prefix.lookup(turn2)
        assert n == len(kept) // BT * BT
        lg_cached, _, _ = eng.prefill(turn2[n:], past_k=pk, past_v=pv)
        lg_whole, _, _ = eng.prefill(turn2)
        assert int(np.argmax(lg_cached)) == int(np.argmax(lg_whole))
        np.testing.assert_allclose(lg_cached, lg_whole, rtol=1e-3, atol=1e-3)
    finally:
        sched.close()


def test_orchestrator_without_router_is_unchanged():
    pool = FakePool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11], "length")], None)]})
    orch, m, _ = _orch(FakePrefill(), dec, pool)
    sink = FakeSink()
    orch.run(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2), "fp32"), sink)
    assert sink.ids == [10, 11] and dec.opened[0][1].started.output_ids == [10]
    assert m.get(PREFILL_PLACEMENT_METRIC, where="prefill") == 1
    assert m.get(PREFILL_PLACEMENT_METRIC, where="decode") == 0


# ---- only the KV the chosen decode server lacks moves ------------------------------------------------------------
def test_wire_header_carries_start_only_when_it_is_not_zero(monkeypatch):
    import json

    from hetserve import schema
    from hetserve.errors import RequestError
    from hetserve.kv import wire
    from test_stages import _kv

    monkeypatch.setenv("HETSERVE_KV_KEY", "unit-key")
    k, v = _kv(5)
    whole, _ = wire.encode(k, v, COMPAT)
    assert "start" not in json.loads(whole.to_json())  # byte-identical to what every v3 peer sends
    part, payload = wire.encode(k, v, COMPAT, start=16)
    back = wire.KVHeader.from_json(part.to_json())
    assert back.start == 16 and back.num_tokens == 5
    wire.verify(back, payload, COMPAT, (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim))
    forged = wire.KVHeader.from_json(part.to_json())
    forged.start = 8  # start is signed: moving the KV to other positions breaks the tag
    with pytest.raises(wire.KVWireError, match="checksum"):
        wire.verify(forged, payload, COMPAT, (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim))
    forged.start = -1
    with pytest.raises(wire.KVWireError, match="start"):
        wire.verify(forged, payload, COMPAT, (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim))
    schema.check_kv_tokens(back, 21)
    with pytest.raises(RequestError, match="from position 16"):
        schema.check_kv_tokens(back, 20)


def test_remote_prefill_leaves_out_the_blocks_the_member_holds():
    """A follow-up whose new part is too long to prefill on the decode server: the prefill server prefills it,
    and the job says how many leading tokens (whole blocks) the chosen member already holds."""
    history = list(range(100, 181))  # 81 tokens: 10 whole blocks
    pool = CostPool(["a", "b"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11], "length")], None)]})
    pre = FakePrefill()
    orch, m, router = _routed_orch(dec, pool, pre, local_prefill_max_tokens=64)
    router.routed("a", history)
    orch.run(GenerateRequest(history + list(range(500, 600)), SamplingParams(max_tokens=2), "fp32"), FakeSink())
    assert len(pre.jobs) == 1 and pre.jobs[0].decode_url == "a" and pre.jobs[0].kv_skip_tokens == 80
    assert m.get(PREFILL_PLACEMENT_METRIC, where="prefill") == 1


def _ingest(stage, rid, k, v, start, monkeypatch):
    from hetserve.kv import wire

    monkeypatch.setenv("HETSERVE_KV_KEY", "unit-key")
    hdr, payload = wire.encode(k, v, COMPAT, "fp32", start=start)
    r = FakeReply()
    stage.handle(DecodeCall("ingest", rid, kv_header=hdr.to_json(), kv_payload=payload), r)
    assert r.sent == [("tokens", [], None)], r.sent


def test_decode_joins_its_cached_blocks_with_the_transferred_rest(routed_stage, monkeypatch):
    from test_stages import _kv

    prompt = list(range(10, 45))  # 35 tokens; the server holds the first 32
    k, v = _kv(35)
    routed_stage.prefix.insert(prompt[:32], k[:, :, :32], v[:, :, :32])
    _ingest(routed_stage, "r1", k[:, :, 32:], v[:, :, 32:], 32, monkeypatch)
    reply = FakeReply()
    routed_stage.handle(DecodeCall("generate", "r1", prompt, [9], SamplingParams(max_tokens=4)), reply)
    assert reply.done.wait(5)
    seq = routed_stage.sched.seqs[-1]
    assert np.array_equal(seq.k, k) and np.array_equal(seq.v, v), "cached blocks + transferred rest == whole KV"
    assert routed_stage.engines["fp32"].calls == [], "nothing recomputed"
    assert routed_stage.metrics.get("hetserve_kv_recompute_total", reason="prefix_evicted") == 0


def test_decode_recomputes_blocks_its_cache_lost_before_the_transfer_came(routed_stage, monkeypatch):
    from test_stages import _kv

    prompt = list(range(10, 45))
    k, v = _kv(35)
    routed_stage.prefix.insert(prompt[:16], k[:, :, :16], v[:, :, :16])  # blocks 3 and 4 were evicted meanwhile
    _ingest(routed_stage, "r2", k[:, :, 32:], v[:, :, 32:], 32, monkeypatch)
    reply = FakeReply()
    routed_stage.handle(DecodeCall("generate", "r2", prompt, [9], SamplingParams(max_tokens=4)), reply)
    assert reply.done.wait(5)
    eng = routed_stage.engines["fp32"]
    assert eng.calls == [prompt[16:32]] and eng.past == 16, "the gap (tokens 16..31) recomputed on the cached 16"
    seq = routed_stage.sched.seqs[-1]
    assert seq.k.shape[2] == 35 and np.array_equal(seq.k[:, :, 32:], k[:, :, 32:])
    assert routed_stage.metrics.get("hetserve_kv_recompute_total", reason="prefix_evicted") == 1


def test_admission_threads_run_at_a_lower_priority():
    """HETSERVE_DECODE_PREFILL_NICE > 0: the decode server's admission pool (local prefill, recompute) runs niced
    so the decode steps of running streams keep the core; other threads keep their priority."""
    import os
    import threading

    from hetserve.bounded import BoundedExecutor, nice_this_thread

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ex = BoundedExecutor(1, 1, "unit-nice", initializer=lambda: nice_this_thread(10))
    try:
        got = ex.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(5)
    finally:
        ex.shutdown()
    assert got == min(19, mine + 10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
