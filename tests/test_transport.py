"""KV transport interface without tritonserver: the registry, the capability handshake, typed errors and fallbacks,
and NIXL's data plane with two real NIXL agents (UCX) in this process.

Where a test replaces the kv_ingest gRPC control call by an in-process stand-in (`_LoopbackIngest`) it says so:
the stand-in hands the request to the real receiver and wire.verify, exactly what kv_ingest does with it.
tests/test_transport_live.py runs the same transports between real tritonservers."""
import json
import threading
import time

import numpy as np
import pytest

from hetserve.kv import wire
from hetserve.kv.transport import (
    BASELINE,
    NAMES,
    SPECS,
    CapacityExhausted,
    KVSender,
    PeerRefused,
    SendState,
    TransferError,
    spec,
    to_prepare,
)
from hetserve.kv.transport.negotiate import host_identity, local_offer, usable
from hetserve.reliability import DecodePool

L, H, D = 2, 3, 8
COMPAT = "c" * 32


def _kv(tokens=5, dtype="fp16", seed=0):
    k = np.random.default_rng(seed).standard_normal((L, H, tokens, D)).astype(np.float32)
    return wire.encode(k, -k, COMPAT, dtype)


def test_registry_is_the_one_list_of_names():
    assert NAMES == ("grpc", "shm", "nixl", "cuda_shm") and BASELINE == "grpc"
    assert SPECS["shm"].caps.same_host and not SPECS["nixl"].caps.same_host and SPECS["nixl"].caps.rdma
    assert SPECS["cuda_shm"].caps.same_device and not SPECS["cuda_shm"].caps.verified
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'; use one of grpc, shm, nixl"):
        spec("carrier-pigeon")
    from hetserve import cli, doctor

    assert tuple(cli.TRANSPORTS) == NAMES and "nixl" in doctor.CPU_TRANSPORTS and "cuda_shm" not in cli.CPU_TRANSPORTS
    with pytest.raises(TransferError, match="unknown KV transport"):
        KVSender().send("127.0.0.1:1", "smoke-signals", "r", *_kv())


def test_control_calls_go_straight_to_decode_for_in_band_transports(monkeypatch):
    """Where post() sends a transfer's control message (no server here: which kind of call it made is the
    test): grpc and shm to the decode model on the shared stream, a grpc payload past DIRECT_INLINE_MAX_BYTES and
    the other transports to kv_ingest, everything to kv_ingest with HETSERVE_KV_DIRECT=0."""
    from hetserve.kv.transport.control import (
        DIRECT_INLINE_MAX_BYTES,
        ClientCache,
        ControlTransfer,
        StreamedTransfer,
        post,
    )

    url = "127.0.0.1:1"  # nothing listens: each call fails later, on its own thread
    clients = ClientCache()
    try:
        def kind(transport, nbytes=1024):
            return type(post(clients, url, transport, f"r-{transport}-{nbytes}", [], nbytes))

        assert kind("grpc") is StreamedTransfer and kind("shm") is StreamedTransfer
        assert kind("shm", DIRECT_INLINE_MAX_BYTES + 1) is StreamedTransfer  # by reference: any size
        assert kind("grpc", DIRECT_INLINE_MAX_BYTES + 1) is ControlTransfer
        assert kind("nixl") is ControlTransfer and kind("cuda_shm") is ControlTransfer
        monkeypatch.setenv("HETSERVE_KV_DIRECT", "0")
        assert kind("grpc") is ControlTransfer and kind("shm") is ControlTransfer
        failed = post(clients, url, "grpc", "r-unreachable", [], 8)
        monkeypatch.delenv("HETSERVE_KV_DIRECT")
        streamed = post(clients, url, "grpc", "r-unreachable-2", [], 8)
        for t in (failed, streamed):  # an unreachable decode server: a typed failure, not a hang
            with pytest.raises(TransferError):
                t.wait(20.0)
    finally:
        clients.close()


def test_decode_ops_to_an_unreachable_server_fail_typed_without_hanging():
    """The llm's one-answer ops (GrpcDecodeClient.op: canary, prefix, release) on the shared stream to a server
    that is not there: a typed Unavailable well before the timeout, not a hang; the hub closes promptly."""
    from hetserve import errors
    from hetserve.stages.grpc_decode import GrpcDecodeClient

    client = GrpcDecodeClient()
    url = "127.0.0.1:1"
    try:
        t0 = time.time()
        with pytest.raises(errors.Unavailable, match="127.0.0.1:1"):
            client.op(url, "canary", 20.0)
        assert client.held_tokens([url], [1, 2, 3], 5.0) == {}
        client.release(url, "r-gone")  # not waited on, never raises
        assert time.time() - t0 < 15
    finally:
        t0 = time.time()
        client.close()
        assert time.time() - t0 < 6


def test_transports_started_with_the_server():
    """HETSERVE_KV_PREPARE: which senders/receivers start with the server instead of in their first request."""
    assert to_prepare("default", "grpc") == ()  # the baseline has nothing to start
    assert to_prepare("default", "nixl") == ("nixl",)
    assert to_prepare(" nixl, shm ,nixl", "grpc") == ("nixl", "shm")
    assert to_prepare("none", "nixl") == () and to_prepare("", "nixl") == ()
    assert to_prepare("all", "grpc") == tuple(n for n in NAMES if n != BASELINE and not SPECS[n].available())
    with pytest.raises(ValueError, match="HETSERVE_KV_PREPARE names unknown KV transport 'nixI'"):
        to_prepare("grpc,nixI", "grpc")
    with pytest.raises(ValueError, match="unknown KV transport 'bogus'"):
        to_prepare("default", "bogus")  # a bad default transport stops the server at start, with the reason


def test_offer_and_negotiation_matrix():
    """Offers are plain data: what each end can run, its host identity (boot id + /dev/shm mount) and GPUs."""
    here = local_offer()
    assert here["host"] == host_identity() and {"grpc", "shm", "nixl"} <= set(here["transports"])
    assert "cuda_shm" in here["unavailable"] and "unverified" in here["unavailable"]["cuda_shm"]
    assert usable(here, here).transports == ("grpc", "shm", "nixl")
    remote = {**here, "host": "another-host/1:2"}
    n = usable(here, remote)
    assert n.transports == ("grpc", "nixl") and "same host" in n.reasons["shm"]
    no_nixl = {**here, "transports": {"grpc": {}, "shm": {}}, "unavailable": {"nixl": "nixl is not importable"}}
    n = usable(here, no_nixl)
    assert n.transports == ("grpc", "shm") and "not importable" in n.reasons["nixl"]
    gpu = {**here, "gpus": ["GPU-a"], "transports": {**here["transports"], "cuda_shm": {}}, "unavailable": {}}
    assert usable(gpu, {**gpu, "gpus": ["GPU-a"]}).allows("cuda_shm")
    assert "same GPU" in usable(gpu, {**gpu, "gpus": ["GPU-b"]}).reasons["cuda_shm"]


class _Negotiated:
    def __init__(self, transports):
        self.transports, self.reasons = transports, {"shm": "needs the same host"}


def test_pool_negotiates_once_per_member_and_counts_fallbacks():
    """Unit (stub health check and stub negotiation, no servers): negotiated after the first passing check, not
    again while the member stays up, again after it was down; an unusable transport falls back to grpc through
    on_fallback (the metric) with a reason."""
    calls, health, falls = [], {"ok": True}, []

    def check(url, timeout_s):
        if not health["ok"]:
            raise RuntimeError("down")
        return 1.0

    def negotiate(url, timeout_s):
        calls.append(url)
        return _Negotiated(("grpc", "nixl"))

    pool = DecodePool(["d1:9001"], check=check, negotiate=negotiate, start=False, default_transport="nixl",
                      on_fallback=lambda *a: falls.append(a))
    try:
        assert pool.transport_for("d1:9001", None) == "grpc" and falls[-1] == ("nixl", "grpc", "not_negotiated")
        pool.check_all()
        pool.check_all()
        assert calls == ["d1:9001"] and pool.snapshot()["d1:9001"].transports == ("grpc", "nixl")
        assert pool.transport_for("d1:9001", None) == "nixl" and pool.transport_for("d1:9001", "grpc") == "grpc"
        assert pool.transport_for("d1:9001", "shm") == "grpc" and falls[-1] == ("shm", "grpc", "peer_unsupported")
        assert pool.transport_for("d1:9001", "bogus") == "bogus"  # prefill refuses it with the list of names
        health["ok"] = False
        pool.check_all()
        assert pool.snapshot()["d1:9001"].transports == ()
        health["ok"] = True
        pool.check_all()
        assert calls == ["d1:9001", "d1:9001"]
        pool.mark_down("d1:9001", "stream died")
        assert pool.snapshot()["d1:9001"].transports == ()
    finally:
        pool.close()


def test_pool_keeps_a_member_whose_negotiation_fails_on_grpc_only_and_asks_again_with_backoff():
    calls = []

    def negotiate(url, timeout_s):
        calls.append(time.monotonic())
        raise RuntimeError("kv_ingest has no op=caps")

    pool = DecodePool(["d1:9001"], check=lambda u, t: 1.0, negotiate=negotiate, start=False, interval_s=0.2)
    try:
        m = pool.check_all()["d1:9001"]
        assert m.healthy and m.transports == ("grpc",) and "no op=caps" in m.transport_notes["*"]
        pool.check_all()
        assert len(calls) == 1  # not every round: a retry can cost timeout_s of a health worker
        time.sleep(0.25)
        pool.check_all()
        assert len(calls) == 2 and pool.snapshot()["d1:9001"].negotiation_failures == 2
        time.sleep(0.25)
        pool.check_all()
        assert len(calls) == 2  # second backoff is 2 x interval_s
        time.sleep(0.2)
        pool.negotiate = lambda url, timeout_s: _Negotiated(("grpc", "shm"))  # kv_ingest came up: asked again
        m = pool.check_all()["d1:9001"]
        assert m.transports == ("grpc", "shm") and m.negotiation_failures == 0
    finally:
        pool.close()


# ---- NIXL data plane: real agents, real READs ----------------------------------------------------------------
class _LoopbackIngest:
    """Stand-in for the kv_ingest gRPC call (NOT a tritonserver): runs what kv_ingest runs -- the transport's
    receiver, then wire.verify -- on a thread, and answers the async_infer callback like tritonclient does."""

    def __init__(self, receivers):
        self.receivers = receivers
        self.calls = []

    def get(self, url):
        return self

    def close(self):
        pass

    def async_infer(self, model, inputs, callback, client_timeout=None, parameters=None):
        def run():
            by = {i.name(): i for i in inputs}
            transport = parameters["hetserve_transport"]
            hdr = wire.KVHeader.from_json(by["kv_header"]._raw_content[4:])  # BYTES: 4-byte length prefix
            remote = by["kv_remote"]._raw_content[4:] if "kv_remote" in by else None
            payload = (np.frombuffer(by["kv_payload"]._raw_content, np.uint8)
                       if "kv_payload" in by and by["kv_payload"]._raw_content is not None else None)
            self.calls.append(transport)
            try:
                got = self.receivers[transport].receive(hdr, payload, remote, 10.0)
                wire.verify(hdr, got, COMPAT, (L, H, D))
                callback(object(), None)
            except Exception as e:  # kv_ingest answers INVALID_ARG; the sender types it from the status
                callback(None, _Status("StatusCode.INVALID_ARGUMENT", str(e)))
        threading.Thread(target=run, daemon=True).start()


class _Status(Exception):
    def __init__(self, status, msg):
        super().__init__(msg)
        self._s = status

    def status(self):
        return self._s



def _require_nixl():
    """nixl is part of the install (scripts/install.sh, extra `nixl`): missing is a broken install, not a skip."""
    import importlib.util

    assert importlib.util.find_spec("nixl") is not None, "nixl is not installed: pip install nixl (or .[nixl])"

@pytest.fixture(scope="module")
def nixl_receiver():
    _require_nixl()
    from hetserve.kv.transport.nixl_pull import NixlReceiver

    r = NixlReceiver()
    yield r
    r.close()


def _nixl_sender(ingest, region_bytes=1 << 20, on_fallback=None):
    from hetserve.kv.transport.nixl_pull import NixlSender

    s = KVSender(on_fallback=on_fallback)
    s.clients = ingest
    s._senders["nixl"] = NixlSender(ingest, region_bytes=region_bytes)
    return s


def test_nixl_pull_delivers_the_same_bytes(nixl_receiver):
    from hetserve.kv.transport.grpc_inline import GrpcReceiver

    ingest = _LoopbackIngest({"nixl": nixl_receiver, "grpc": GrpcReceiver()})
    s = _nixl_sender(ingest)
    try:
        for dtype in ("fp32", "fp16", "int8"):
            hdr, payload = _kv(tokens=7, dtype=dtype)
            info = s.send("decode:1", "nixl", f"r-{dtype}", hdr, payload)
            assert info["transport"] == "nixl" and info["bytes"] == payload.nbytes and "fallback" not in info
        assert ingest.calls == ["nixl"] * 3
        # concurrent sends share the staging buffer (ranges), all verified by the receiver
        errs = []

        def one(i):
            try:
                s.send("decode:1", "nixl", f"c{i}", *_kv(tokens=3 + i, seed=i))
            except Exception as e:
                errs.append(e)
        ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert not errs and s._senders["nixl"]._alloc.free_bytes() == 1 << 20  # every range released
    finally:
        s.close()


def test_nixl_full_staging_falls_back_to_grpc_visibly(nixl_receiver, monkeypatch):
    from hetserve.kv.transport.grpc_inline import GrpcReceiver

    monkeypatch.setenv("HETSERVE_KV_DIRECT", "0")  # the grpc fallback then goes through kv_ingest (the stand-in)
    falls = []
    ingest = _LoopbackIngest({"nixl": nixl_receiver, "grpc": GrpcReceiver()})
    s = _nixl_sender(ingest, region_bytes=4096, on_fallback=lambda *a: falls.append(a))
    try:
        hdr, payload = _kv(tokens=64, dtype="fp32")  # 24 KiB > 4 KiB staging
        info = s.send("decode:1", "nixl", "big", hdr, payload)
        assert info["transport"] == "grpc" and info["fallback"] == "capacity"
        assert falls == [("nixl", "grpc", "capacity")] and ingest.calls == ["grpc"]
        with pytest.raises(CapacityExhausted, match="HETSERVE_NIXL_BYTES"):
            s.transport("nixl").start("decode:1", "big2", hdr, payload, 5.0)
    finally:
        s.close()


def test_nixl_refuses_bad_descriptors(nixl_receiver):
    """Malformed, mis-sized, mislabelled or out-of-registration descriptors: a clear PeerRefused, no crash."""
    from hetserve.kv.transport.nixl_pull import NixlSender, parse_remote

    hdr, payload = _kv()
    with pytest.raises(PeerRefused, match="needs a 'kv_remote'"):
        nixl_receiver.receive(hdr, None, None, 1.0)
    with pytest.raises(PeerRefused, match="malformed"):
        nixl_receiver.receive(hdr, None, b"{not json", 1.0)
    sender = NixlSender(_LoopbackIngest({}), region_bytes=1 << 16)
    try:
        agent = sender._ready()
        good = {"agent": agent.name, "meta": sender._meta_b64, "addr": int(sender._buf.ctypes.data), "len": hdr.nbytes}
        assert parse_remote(json.dumps(good).encode(), hdr.nbytes)["len"] == hdr.nbytes
        with pytest.raises(PeerRefused, match="needs"):
            nixl_receiver.receive(hdr, None, json.dumps({**good, "len": hdr.nbytes + 1}).encode(), 1.0)
        with pytest.raises(PeerRefused, match="but its metadata is agent"):
            nixl_receiver.receive(hdr, None, json.dumps({**good, "agent": "someone-else"}).encode(), 1.0)
        outside = {**good, "addr": int(sender._buf.ctypes.data) + (1 << 20)}  # not memory the sender registered
        with pytest.raises(PeerRefused, match="READ .* refused"):
            nixl_receiver.receive(hdr, None, json.dumps(outside).encode(), 1.0)
        assert nixl_receiver.last_state.name == "FAILED"
        sender._buf[:hdr.nbytes] = payload  # and the good descriptor works on the same receiver afterwards
        with sender.in_flight():  # the sender's side progresses only while a transfer is in flight
            got = nixl_receiver.receive(hdr, None, json.dumps(good).encode(), 5.0)
        wire.verify(hdr, got, COMPAT, (L, H, D))
    finally:
        sender.close()


def test_send_states_and_typed_refusal(nixl_receiver):
    """A refused transfer (HMAC tag broken after signing) is PeerRefused from the INVALID_ARG status, not matched
    from the message; poll() goes PENDING -> FAILED and never blocks."""
    ingest = _LoopbackIngest({"nixl": nixl_receiver})
    s = _nixl_sender(ingest)
    try:
        hdr, payload = _kv()
        payload = payload.copy()
        payload[0] ^= 1
        t = s.transport("nixl").start("decode:1", "bad", hdr, payload, 5.0)
        assert t.poll() in (SendState.PENDING, SendState.FAILED)
        with pytest.raises(PeerRefused, match="checksum mismatch"):
            t.wait(5.0)
        assert t.poll() is SendState.FAILED
    finally:
        s.close()


@pytest.mark.parametrize("concurrent_ok", [False, True])
def test_kv_sender_runs_a_non_concurrent_transport_one_send_at_a_time(monkeypatch, concurrent_ok):
    """Unit test with a fake transport (no server): a sender without concurrent_sends never sees two sends at
    once however many threads call KVSender.send; one with it does (the prefill server's send threads)."""
    import concurrent.futures
    import threading
    import time

    from hetserve.kv.transport import KVSender
    from hetserve.kv.transport.base import TransportSender

    live = {"now": 0, "max": 0}
    lock = threading.Lock()

    class Done:
        def wait(self, timeout_s):
            return {"transport": "grpc", "bytes": 0, "seconds": 0.0}

    class Fake(TransportSender):
        name = "grpc"
        concurrent_sends = concurrent_ok

        def start(self, url, request_id, hdr, payload, timeout_s):
            with lock:
                live["now"] += 1
                live["max"] = max(live["max"], live["now"])
            time.sleep(0.02)
            with lock:
                live["now"] -= 1
            return Done()

        def close(self):
            pass

    s = KVSender()
    fake = Fake()
    monkeypatch.setattr(s, "transport", lambda name: fake)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: s.send("u", "grpc", f"r{i}", None, None), range(8)))
    assert live["max"] == (4 if concurrent_ok else 1), live
