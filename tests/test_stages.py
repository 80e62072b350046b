"""Unit tests of the stages (hetserve/stages/) WITHOUT tritonserver: the orchestrator's migration, breaker and
pool handling, transfer_ok handling; the decode stage's KV rendezvous, bounds and op dispatch.

FAKES (unit tests only, labelled as such): FakePrefill, FakeDecodeClient/FakeDecodeStream, FakePool, FakeSink,
FakeEngine, FakeScheduler, FakeReply stand in for the prefill model, decode servers, the decode pool, the
client's response sender, the ONNX engine and the batching scheduler. Real components used as they are: the
CircuitBreaker, PendingKV, BoundedExecutor, the KV wire format, the schema and error kinds. The same paths run
against real tritonservers in test_e2e.py, test_reliability.py, test_hardening.py and test_openai.py.
"""
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from hetserve import errors, schema
from hetserve.bounded import BoundedExecutor
from hetserve.kv import wire
from hetserve.reliability import BreakerOpen, CircuitBreaker, NoDecodeServer
from hetserve.sampling import SamplingParams, TokenLogprobs
from hetserve.scheduler import Overloaded
from hetserve.stages.decode import (
    DecodeConfig,
    DecodeStage,
    LiveGenerates,
    LiveReply,
    PacedReply,
    PendingKV,
    call_from_tensors,
)
from hetserve.stages.grpc_decode import stream_error
from hetserve.stages.orchestrator import REQUEST_ERRORS_METRIC, TRANSFER_FAILED_METRIC, Orchestrator, OrchestratorConfig
from hetserve.stages.types import DecodeCall, DecodeFailed, GenerateRequest, PrefillResult, TokenChunk

EOS = 2


# ---- fakes for the orchestrator (unit only) ------------------------------------------------------------------
class FakeMetrics:
    def __init__(self):
        self.counts = {}

    def inc(self, name, value=1.0, **labels):
        key = (name, tuple(sorted(labels.items())))
        self.counts[key] = self.counts.get(key, 0) + value

    def get(self, name, **labels):
        return self.counts.get((name, tuple(sorted(labels.items()))), 0)


class FakePrefill:
    """FAKE prefill model: returns `first` and the transfer outcome, records the jobs."""

    def __init__(self, first=10, transfer_ok=True):
        self.first, self.transfer_ok, self.jobs = first, transfer_ok, []

    def prefill(self, job):
        self.jobs.append(job)
        return PrefillResult(self.first, self.transfer_ok, "grpc")


class FakeDecodeStream:
    """FAKE decode server stream: yields the scripted chunks, then raises `fail` (if any) instead of ending."""

    def __init__(self, script):
        self.chunks, self.fail = script
        self.started, self.closed = None, None

    def start(self, req):
        self.started = SimpleNamespace(**{**req.__dict__, "output_ids": list(req.output_ids)})

    def responses(self, timeout_s):
        for c in self.chunks:
            yield c
        if self.fail is not None:
            raise self.fail

    def close(self, cancel=False):
        self.closed = cancel


class FakeDecodeClient:
    """FAKE decode servers: url -> list of scripts (one per stream opened there)."""

    def __init__(self, scripts):
        self.scripts, self.opened, self.released = scripts, [], []

    def open(self, url):
        s = FakeDecodeStream(self.scripts[url].pop(0))
        self.opened.append((url, s))
        return s

    def release(self, url, rid):
        self.released.append((url, rid))


class FakePool:
    """FAKE decode pool: picks the first healthy url not excluded, counts leases."""

    def __init__(self, urls):
        self.urls, self.down, self.leases = list(urls), set(), {u: 0 for u in urls}

    def pick(self, exclude=(), cost=None):  # FAKE: first healthy member; the router's cost is not consulted
        for u in self.urls:
            if u not in self.down and u not in exclude:
                self.leases[u] += 1
                return u
        raise NoDecodeServer("no healthy decode server")

    def release(self, url):
        self.leases[url] -= 1

    def hold(self, url):
        self.leases[url] += 1

    def transport_for(self, url, requested):
        return requested or "grpc"  # FAKE: every member negotiated every transport

    def mark_down(self, url, why):
        self.down.add(url)


class FakeSink:
    """FAKE response sender + detokeniser: records token pushes; stops on a reason."""

    def __init__(self, cancel_after=None, streaming=True):
        self.ids, self.finish_reason, self.cancel_after = [], None, cancel_after
        self.streaming = streaming

    def push(self, ids, reason=None, logprobs=None):
        self.ids += ids
        if reason:
            self.finish_reason = reason
        return reason is None

    def finish(self, reason):
        self.finish_reason = self.finish_reason or reason

    def cancelled(self):
        return self.cancel_after is not None and len(self.ids) >= self.cancel_after

    def choice(self, i):
        self.choices = getattr(self, "choices", {})
        return self.choices.setdefault(i, FakeSink())


def _orch(prefill, decode, pool, **cfg):
    m = FakeMetrics()
    breaker = CircuitBreaker(p99_threshold_s=10.0)
    return Orchestrator(prefill, decode, pool, breaker, [EOS], OrchestratorConfig(**cfg), metrics=m), m, breaker


def _req(max_tokens=8):
    return GenerateRequest([1, 5, 6], SamplingParams(max_tokens=max_tokens), "fp32")


def test_orchestrator_streams_prefill_then_decode_and_settles_the_lease():
    pool = FakePool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11, 12]), TokenChunk([13], "length")], None)]})
    orch, m, _ = _orch(FakePrefill(), dec, pool)
    sink = FakeSink()
    orch.run(_req(4), sink)
    assert sink.ids == [10, 11, 12, 13] and sink.finish_reason == "length"
    started = dec.opened[0][1].started
    assert started.output_ids == [10] and started.kv_sent is True and started.prompt == [1, 5, 6]
    assert pool.leases == {"a": 0} and dec.opened[0][1].closed is False


def test_whole_answer_sinks_ask_decode_for_paced_tokens():
    """A client that wants one final answer (sink.streaming False): decode is asked to send tokens at most every
    whole_answer_send_interval_s; a streaming client gets every step (interval 0)."""
    for streaming, want in ((True, 0.0), (False, 0.2)):
        dec = FakeDecodeClient({"a": [([TokenChunk([11, 12, 13], "length")], None)]})
        orch, _, _ = _orch(FakePrefill(), dec, FakePool(["a"]), whole_answer_send_interval_s=0.2)
        sink = FakeSink(streaming=streaming)
        orch.run(_req(4), sink)
        assert sink.ids == [10, 11, 12, 13] and dec.opened[0][1].started.send_interval_s == want


def test_n_choices_share_one_prefill_and_fork_its_kv_on_one_member():
    """n = 3: one prefill job asks for 3 first tokens; the choices that go on decode on the member holding the
    KV, each naming the KV key and how many fork it; a choice that stopped at its first token decodes nothing."""
    pool = FakePool(["a", "b"])
    dec = FakeDecodeClient({"a": [([TokenChunk([30], "length")], None), ([TokenChunk([30], "length")], None)]})

    class Prefill3(FakePrefill):
        def prefill(self, job):
            self.jobs.append(job)
            return PrefillResult(10, True, "grpc", first_tokens=[10, EOS, 20])

    pre = Prefill3()
    orch, _, _ = _orch(pre, dec, pool)
    sink = FakeSink()
    req = _req(2)
    req.n = 3
    orch.run(req, sink)
    assert len(pre.jobs) == 1 and pre.jobs[0].n == 3
    assert sink.choices[0].ids == [10, 30] and sink.choices[1].ids == [EOS] and sink.choices[2].ids == [20, 30]
    assert sink.choices[1].finish_reason == "stop"
    started = sorted((s.started for _, s in dec.opened), key=lambda r: r.request_id)
    assert [u for u, _ in dec.opened] == ["a", "a"]
    assert {r.kv_key for r in started} == {started[0].request_id.rsplit(".", 1)[0]}
    assert [r.kv_shares for r in started] == [2, 2] and [r.output_ids for r in started] == [[10], [20]]
    assert [r.params.choice for r in started] == [0, 2]
    assert pool.leases == {"a": 0, "b": 0}


def test_migration_resumes_on_another_member_with_the_tokens_so_far():
    pool = FakePool(["a", "b"])
    dec = FakeDecodeClient({
        "a": [([TokenChunk([11]), TokenChunk([12])], DecodeFailed("UNAVAILABLE: socket closed"))],
        "b": [([TokenChunk([13]), TokenChunk([14], "length")], None)]})
    orch, m, _ = _orch(FakePrefill(), dec, pool)
    sink = FakeSink()
    orch.run(_req(5), sink)
    assert sink.ids == [10, 11, 12, 13, 14] and sink.finish_reason == "length"  # one uninterrupted stream
    (ua, sa), (ub, sb) = dec.opened
    assert (ua, ub) == ("a", "b") and "a" in pool.down
    assert sb.started.output_ids == [10, 11, 12] and sb.started.request_id == sa.started.request_id
    assert sb.started.kv_sent is False  # the KV went to a: b must not wait for it
    assert sa.closed is True  # the dead stream is cancelled
    assert m.get("hetserve_migrations_total") == 1 and pool.leases == {"a": 0, "b": 0}


def test_migration_gives_up_after_max_migrations():
    fail = DecodeFailed("UNAVAILABLE: gone")
    pool = FakePool(["a", "b", "c"])
    dec = FakeDecodeClient({u: [([], fail)] for u in "abc"})
    orch, _, breaker = _orch(FakePrefill(), dec, pool, max_migrations=1)
    with pytest.raises(DecodeFailed):
        orch.run(_req(), FakeSink())
    assert [u for u, _ in dec.opened] == ["a", "b"] and sum(pool.leases.values()) == 0


def test_overloaded_decode_moves_on_without_marking_it_down():
    pool = FakePool(["a", "b"])
    dec = FakeDecodeClient({"a": [([], Overloaded("pending KV full"))],
                            "b": [([TokenChunk([11], "stop")], None)]})
    orch, _, _ = _orch(FakePrefill(), dec, pool)
    sink = FakeSink()
    orch.run(_req(), sink)
    assert sink.ids == [10, 11] and not pool.down


def test_overload_everywhere_surfaces_as_overload():
    pool = FakePool(["a"])
    dec = FakeDecodeClient({"a": [([], Overloaded("queue full"))]})
    orch, _, _ = _orch(FakePrefill(), dec, pool)
    with pytest.raises(Overloaded):
        orch.run(_req(), FakeSink())
    assert pool.leases == {"a": 0}


def test_bad_input_from_decode_stands_no_migration():
    pool = FakePool(["a", "b"])
    dec = FakeDecodeClient({"a": [([], errors.RequestError("decode precision 'fp8' not loaded"))]})
    orch, _, _ = _orch(FakePrefill(), dec, pool)
    with pytest.raises(errors.RequestError):
        orch.run(_req(), FakeSink())
    assert len(dec.opened) == 1 and not pool.down


def test_transfer_not_ok_makes_decode_recompute_at_once_and_is_counted(caplog):
    pool = FakePool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11], "stop")], None)]})
    orch, m, _ = _orch(FakePrefill(transfer_ok=False), dec, pool)
    import logging

    lg = logging.getLogger("hetserve.orchestrator")  # logs.setup (the CLI tests) stops propagation to the root
    lg.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="hetserve.orchestrator"):
            orch.run(_req(), FakeSink())
    finally:
        lg.removeHandler(caplog.handler)
    assert dec.opened[0][1].started.kv_sent is False
    assert m.get(TRANSFER_FAILED_METRIC, reason="transfer_failed", transport="grpc") == 1
    assert "could not send the KV" in caplog.text


def test_first_token_ends_it_releases_the_pushed_kv():
    pool = FakePool(["a"])
    dec = FakeDecodeClient({})
    orch, _, _ = _orch(FakePrefill(first=EOS), dec, pool)
    sink = FakeSink()
    orch.run(_req(), sink)
    assert sink.finish_reason == "stop" and not dec.opened and dec.released == [("a", dec.released[0][1])]


def test_breaker_open_refuses_before_prefill():
    prefill = FakePrefill()
    orch, m, breaker = _orch(prefill, FakeDecodeClient({}), FakePool(["a"]))
    for _ in range(breaker.overload_trips):
        breaker.record_failure(overloaded=True)
    with pytest.raises(BreakerOpen):
        orch.run(_req(), FakeSink())
    assert not prefill.jobs and m.get("hetserve_breaker_rejections_total") == 1


def test_cancelled_client_cancels_the_decode_stream():
    pool = FakePool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11]), TokenChunk([12]), TokenChunk([13])], None)]})
    orch, _, _ = _orch(FakePrefill(), dec, pool)
    orch.run(_req(), FakeSink(cancel_after=2))
    assert dec.opened[0][1].closed is True and pool.leases == {"a": 0}


@pytest.mark.parametrize("status,msg", [("StatusCode.UNAVAILABLE", "Socket closed"),
                                        ("", "Request for unknown model: 'decode' is not found")])
def test_decode_stream_error_without_typed_data_migrates(status, msg):
    """An error the decode model did not send as data (the call failed, Triton refused) means that server
    cannot serve: DecodeFailed, which migrates; a typed one is raised as itself (next test)."""
    got = stream_error(SimpleNamespace(status=lambda: status, message=lambda: msg))
    assert type(got) is DecodeFailed and got.migrate and msg in str(got)


def test_typed_decode_errors_migrate_or_stand_by_their_data():
    """The decode model's typed errors (as data): an engine failure and an overload refusal move the request
    (the breaker and the error counter see the failure), bad input ends it at once with the client's fault, and
    with no other server the engine failure reaches the client as itself (internal), not "unavailable"."""
    engine_failed = errors.from_wire(errors.EngineFailed("decode step failed: boom", where="decode step").to_wire())
    assert type(engine_failed) is errors.InternalError and engine_failed.migrate
    for err, migrates in ((engine_failed, True), (errors.from_wire(Overloaded("queue full").to_wire()), True),
                          (errors.from_wire(errors.RequestError("bad token").to_wire()), False)):
        pool = FakePool(["a", "b"])
        dec = FakeDecodeClient({"a": [([TokenChunk([11])], err)], "b": [([TokenChunk([12], "length")], None)]})
        orch, _, _ = _orch(FakePrefill(), dec, pool)
        sink = FakeSink()
        if migrates:
            orch.run(_req(), sink)
            assert [u for u, _ in dec.opened] == ["a", "b"] and sink.finish_reason == "length"
        else:
            with pytest.raises(errors.RequestError):
                orch.run(_req(), sink)
            assert [u for u, _ in dec.opened] == ["a"]
    pool = FakePool(["a"])
    dec = FakeDecodeClient({"a": [([TokenChunk([11])], engine_failed)]})
    orch, m, _ = _orch(FakePrefill(), dec, pool)
    with pytest.raises(errors.InternalError, match="decode step failed"):
        orch.run(_req(), FakeSink())
    assert m.get(REQUEST_ERRORS_METRIC, kind=errors.INTERNAL) == 1 and pool.leases == {"a": 0}


# ---- fakes for the decode stage (unit only) ------------------------------------------------------------------
CFG = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4, max_position=64, vocab_size=100,
                      eos_token_ids=[EOS], bos_token_id=1)
COMPAT = "unit-compat"


def _kv(n):
    k = np.arange(CFG.num_layers * CFG.num_kv_heads * n * CFG.head_dim, dtype=np.float32).reshape(
        CFG.num_layers, CFG.num_kv_heads, n, CFG.head_dim)
    return k, k + 1


class FakeEngine:
    """FAKE engine: prefill returns logits favouring token 7 and KV of the right shape, counts calls."""
    precision, name, manifest = "fp32", "decode_fp32", {}

    def __init__(self):
        self.calls = []

    def prefill(self, ids, past_k=None, past_v=None):
        self.calls.append(list(ids))
        logits = np.zeros(CFG.vocab_size, np.float32)
        logits[7] = 1.0
        return (logits, *_kv(len(ids)))


class FakeScheduler:
    """FAKE scheduler: records admitted sequences and emits one final token for each."""

    def __init__(self):
        self.cv, self.waiting, self.stats, self.seqs = threading.Condition(), [], {}, []

    def n_running(self):
        return len(self.seqs)

    def new_sampler(self, params, prompt, tokens):
        from hetserve.sampling import TokenSampler

        return TokenSampler(params, prompt, tokens)

    def submit(self, seq):
        self.seqs.append(seq)
        seq.on_tokens([42], "length")


class FakeReply:
    """FAKE response sender: records answers, `done` is set on the final one."""

    def __init__(self):
        self.sent, self.done = [], threading.Event()

    def tokens(self, ids, finish_reason=None, final=False, logprobs=None):
        self.sent.append(("tokens", list(ids), finish_reason))
        if final:
            self.done.set()

    def json(self, obj):
        self.sent.append(("json", obj))
        self.done.set()

    def error(self, exc):
        self.sent.append(("error", exc))
        self.done.set()

    def cancelled(self):
        return False


@pytest.fixture
def stage():
    ex = BoundedExecutor(2, 4, "unit-admit")
    st = DecodeStage({"fp32": FakeEngine()}, CFG, COMPAT, FakeScheduler(), ex, PendingKV(4, 1 << 20),
                     DecodeConfig(kv_timeout_s=0.5), metrics=FakeMetrics())
    yield st
    ex.shutdown()


def _generate(stage, rid="r1", out=(10,), kv_sent=True, max_tokens=8):
    reply = FakeReply()
    stage.handle(DecodeCall("generate", rid, [1, 5, 6], list(out), SamplingParams(max_tokens=max_tokens),
                            kv_sent=kv_sent), reply)
    assert reply.done.wait(5)
    return reply


def _recomputes(stage, reason):
    return stage.metrics.get("hetserve_kv_recompute_total", reason=reason)


def test_rendezvous_kv_before_generate_is_used(stage):
    k, v = _kv(3)
    stage.pending.put("r1", k, v)
    reply = _generate(stage)
    assert reply.sent == [("tokens", [42], "length")]
    seq = stage.sched.seqs[0]
    assert np.array_equal(seq.k, k) and seq.tokens == [10] and len(stage.pending) == 0
    assert stage.counters["recompute"] == 0 and not stage.engines["fp32"].calls


def test_rendezvous_kv_after_generate_within_the_timeout_is_used(stage):
    k, v = _kv(3)
    threading.Timer(0.1, stage.pending.put, ("r1", k, v)).start()
    _generate(stage)
    assert np.array_equal(stage.sched.seqs[0].k, k) and stage.counters["recompute"] == 0


def test_rendezvous_timeout_recomputes(stage):
    t = time.monotonic()
    _generate(stage)
    assert time.monotonic() - t >= 0.45  # waited the receive timeout
    assert _recomputes(stage, "timeout") == 1 and stage.engines["fp32"].calls == [[1, 5, 6]]


def test_kv_not_sent_recomputes_at_once_and_drops_a_partial_one(stage):
    stage.pending.put("r1", *_kv(3))
    t = time.monotonic()
    _generate(stage, kv_sent=False)
    assert time.monotonic() - t < 0.4 and _recomputes(stage, "transfer_failed") == 1 and len(stage.pending) == 0


def test_kv_of_the_wrong_length_recomputes(stage):
    stage.pending.put("r1", *_kv(2))
    _generate(stage)
    assert _recomputes(stage, "mismatch") == 1


def test_resume_after_migration_recomputes_prompt_and_tokens_without_waiting(stage):
    t = time.monotonic()
    _generate(stage, out=(10, 11, 12))
    assert time.monotonic() - t < 0.4 and _recomputes(stage, "resume") == 1
    assert stage.engines["fp32"].calls == [[1, 5, 6, 10, 11]]  # KV of prompt + tokens so far but the last
    assert stage.sched.seqs[0].tokens == [10, 11, 12]


def test_pending_kv_bounds_and_ttl():
    now = [0.0]
    p = PendingKV(max_entries=2, max_bytes=3 * 800, ttl_s=10.0, clock=lambda: now[0])
    a = np.zeros(100, np.float32)  # 400 B each of k, v: 800 B an entry
    p.put("a", a, a)
    p.put("b", a, a)
    with pytest.raises(Overloaded, match="pending KV full"):
        p.put("c", a, a)
    big = np.zeros(1000, np.float32)
    now[0] = 11.0  # a and b expired: they go first
    p.put("c", a, a)
    assert len(p) == 1 and p.nbytes == 800
    with pytest.raises(Overloaded):
        p.put("d", big, big)  # over the byte bound on its own
    assert p.take("c", 0) is not None and p.nbytes == 0 and p.take("c", 0) is None


def test_ops_dispatch(stage):
    r = FakeReply()
    stage.handle(DecodeCall("bogus"), r)
    assert r.sent[0][0] == "error" and "unknown op 'bogus'" in str(r.sent[0][1])
    r = FakeReply()
    stage.handle(DecodeCall("info"), r)  # an admin op: not on the data plane at all
    assert isinstance(r.sent[0][1], errors.RequestError) and "admin side channel" in str(r.sent[0][1])
    r = FakeReply()
    stage.handle(DecodeCall("canary"), r)
    assert r.sent == [("tokens", [7], None)]
    stage.pending.put("x", *_kv(3))
    r = FakeReply()
    stage.handle(DecodeCall("release", "x"), r)
    assert r.sent == [("tokens", [], None)] and len(stage.pending) == 0
    r = FakeReply()
    stage.handle(DecodeCall("release"), r)
    assert "needs 'request_id'" in str(r.sent[0][1])
    r = FakeReply()
    stage.handle(DecodeCall("stats"), r)
    assert r.sent[0][0] == "json" and r.sent[0][1]["pending_kv"] == 0


def test_op_ingest_verifies_unproven_kv(stage, monkeypatch):
    monkeypatch.setenv("HETSERVE_KV_KEY", "unit-key")
    k, v = _kv(3)
    hdr, payload = wire.encode(k, v, COMPAT, "fp32")
    r = FakeReply()
    stage.handle(DecodeCall("ingest", "r9", kv_header=hdr.to_json(), kv_payload=payload), r)
    assert r.sent == [("tokens", [], None)] and np.array_equal(stage.pending.take("r9", 0)[0], k)
    bad = payload.copy()
    bad[-1] ^= 0xFF
    r = FakeReply()
    stage.handle(DecodeCall("ingest", "r9", kv_header=hdr.to_json(), kv_payload=bad), r)
    assert isinstance(r.sent[0][1], errors.RequestError) and "KV refused" in str(r.sent[0][1])
    assert len(stage.pending) == 0


def test_generate_already_done_or_refused_frees_its_pending_kv(stage):
    stage.pending.put("r1", *_kv(3))
    r = _generate(stage, out=(10, 11), max_tokens=2)
    assert r.sent == [("tokens", [], "length")] and len(stage.pending) == 0
    stage.pending.put("r2", *_kv(3))
    r = FakeReply()
    stage.handle(DecodeCall("generate", "r2", [1, 5, 6], [10], SamplingParams(max_tokens=4), precision="int8"), r)
    assert "not loaded" in str(r.sent[0][1]) and len(stage.pending) == 0


def test_malformed_tensors_are_refused_and_free_pending_kv(stage):
    stage.pending.put("r3", *_kv(3))
    r = FakeReply()
    t = {"request_id": schema.array("request_id", "r3"), "input_ids": schema.array("input_ids", [1, 5, 6]),
         "output_ids": schema.array("output_ids", [10]), "max_tokens": schema.array("max_tokens", [1, 2])}
    stage.handle_tensors(t, r)
    assert isinstance(r.sent[0][1], errors.RequestError) and len(stage.pending) == 0


def test_admin_ops_are_plain_callables_for_the_side_channel(stage):
    ops = stage.admin_ops()
    assert sorted(ops) == ["info", "verify"]
    for bad in ({}, {"request_id": "x"}, {"request_id": "x", "input_ids": [1]}, {"request_id": 3, "input_ids": [1, 2]},
                {"request_id": "x", "input_ids": ["a", "b"]}):
        with pytest.raises(errors.RequestError, match="verify needs"):
            ops["verify"](bad)
    t0 = time.monotonic()
    with pytest.raises(errors.RequestError, match="no KV arrived for request 'x' within 0.05s"):
        ops["verify"]({"request_id": "x", "input_ids": [1, 2], "timeout_s": 0.05})
    assert time.monotonic() - t0 < 2
    with pytest.raises(errors.RequestError, match="not loaded"):
        ops["verify"]({"request_id": "x", "input_ids": [1, 2], "precision": "int8"})


def test_call_from_tensors_reads_the_schema():
    t = {"op": schema.array("op", "generate"), "request_id": schema.array("request_id", "q"),
         "input_ids": schema.array("input_ids", [1, 2]), "output_ids": schema.array("output_ids", [3]),
         "kv_sent": schema.array("kv_sent", False), "stop_token_ids": schema.array("stop_token_ids", [-1])}
    c = call_from_tensors(t)
    assert (c.op, c.request_id, c.prompt, c.output_ids, c.kv_sent) == ("generate", "q", [1, 2], [3], False)
    assert c.params.max_tokens == schema.INPUTS["max_tokens"].default
    assert call_from_tensors({}).op == "generate"
    assert call_from_tensors({"op": schema.array("op", "stats")}).params is None


def test_paced_reply_gathers_tokens_between_sends_and_asks_cancellation_at_its_pace():
    """PacedReply (send_interval_ms): tokens within an interval go out together with the next send, the final
    ones at once, in order, logprobs aligned; cancellation reaches the inner reply once per interval and sticks;
    an error sends the held tokens first (a migration resumes after them)."""
    now = [0.0]
    inner = FakeReply()
    asked = []
    inner.cancelled = lambda: asked.append(now[0]) or len(asked) >= 3
    r = PacedReply(inner, 0.2, clock=lambda: now[0])
    lp = lambda *v: TokenLogprobs(list(v), [[] for _ in v], [[] for _ in v])  # noqa: E731
    for t in range(5):  # 5 steps 0.04 s apart: nothing sent yet
        now[0] += 0.04 if t else 0.0
        r.tokens([t], logprobs=lp(-t))
        assert not r.cancelled()
    assert inner.sent == [] and asked == []
    now[0] = 0.25
    r.tokens([5], logprobs=lp(-5))  # the interval has passed: 0..5 in one send
    assert inner.sent == [("tokens", [0, 1, 2, 3, 4, 5], None)]
    r.tokens([6])
    r.tokens([7], "length", final=True)  # the final one goes at once, with what was held
    assert inner.sent[-1] == ("tokens", [6, 7], "length") and inner.done.is_set()
    assert not r.cancelled() and asked == [0.25]  # first ask: the interval since construction had passed
    now[0] = 0.3
    assert not r.cancelled() and asked == [0.25]  # within the interval: not asked
    now[0] = 0.5
    assert not r.cancelled() and len(asked) == 2
    now[0] = 0.75
    assert r.cancelled() and r.cancelled() and len(asked) == 3  # true sticks without asking again
    inner2 = FakeReply()
    r2 = PacedReply(inner2, 0.2, clock=lambda: now[0])
    r2.tokens([1, 2])
    r2.error(RuntimeError("engine"))
    assert inner2.sent[0] == ("tokens", [1, 2], None) and inner2.sent[1][0] == "error"


def test_paced_decode_request_bounds_and_schema():
    t = {"op": schema.array("op", "generate"), "send_interval_ms": schema.array("send_interval_ms", 250)}
    assert call_from_tensors(t).send_interval_s == 0.25
    assert call_from_tensors({}).send_interval_s == 0.0


def test_paced_generate_wraps_its_reply_and_refuses_out_of_bounds(stage):
    reply = FakeReply()
    stage.handle(DecodeCall("generate", "p1", [1, 5, 6], [10], SamplingParams(max_tokens=8), kv_sent=False,
                            send_interval_s=0.2), reply)
    assert reply.done.wait(5) and reply.sent[-1] == ("tokens", [42], "length")
    live = stage.sched.seqs[-1].is_cancelled.__self__
    assert isinstance(live, LiveReply) and isinstance(live.inner, PacedReply)  # op=cancel reaches it at once
    assert len(stage.live) == 0  # it left the live set at its final answer
    bad = FakeReply()
    stage.handle(DecodeCall("generate", "p2", [1, 5, 6], [10], SamplingParams(max_tokens=8),
                            send_interval_s=60.0), bad)
    assert bad.sent[0][0] == "error" and "send_interval_ms" in str(bad.sent[0][1])


def test_stages_import_no_triton_binding():
    """The stages, schema and error kinds load without the Triton Python-backend stub (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, hetserve.stages.orchestrator, hetserve.stages.decode, hetserve.stages.grpc_decode, "
            "hetserve.schema, hetserve.errors; "
            "assert 'triton_python_backend_utils' not in sys.modules, 'a stage imports the Triton binding'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_op_cancel_ends_the_live_generate_of_that_id_only():
    """op=cancel (what a client sharing one gRPC stream sends): the generates of that request id see cancelled()
    at once, others do not; a generate leaves the live set at its final answer or error; an id with no generate
    in progress is answered, not refused. Unit test: FakeReply-style inner replies, no Triton."""
    class Inner:
        def __init__(self):
            self.sent = []

        def tokens(self, ids, finish_reason=None, final=False, logprobs=None):
            self.sent.append(("tokens", list(ids), finish_reason, final))

        def error(self, exc):
            self.sent.append(("error", exc))

        def json(self, obj):
            self.sent.append(("json", obj))

        def cancelled(self):
            return False

    live = LiveGenerates()
    a, b, a2 = live.add(Inner(), "a"), live.add(Inner(), "b"), live.add(Inner(), "a")
    assert len(live) == 3 and not a.cancelled()
    assert live.cancel("a") == 2 and a.cancelled() and a2.cancelled() and not b.cancelled()
    assert live.cancel("nobody") == 0
    a.tokens([1], "cancelled", final=True)
    a2.error(RuntimeError("x"))
    b.tokens([2], None, final=False)
    assert len(live) == 1
    b.tokens([], "stop", final=True)
    assert len(live) == 0 and b.inner.sent[-1] == ("tokens", [], "stop", True)
