"""Live (real prefill + decode tritonservers): when prefill reports transfer_ok=false the orchestrator tells
decode to recompute at once (kv_sent=false) instead of waiting for KV that will not come, counts it and the
answer is unchanged.

The decode server's pending-KV budget is 0 bytes, so every transfer is refused there (a real refusal through
kv_ingest -> decode op=ingest), and its KV receive timeout is 5 s: a decode that waited for the KV would take
that long per request.
"""
import os
import time

import pytest

from conftest import scrape, total

KV_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def refusing_topology(engine_dir, tmp_path_factory):
    from hetserve.topology import Topology

    base = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000")) + 200
    topo = Topology(engine_dir, base_port=base, env={
        "HETSERVE_PENDING_KV_MB": "0", "HETSERVE_KV_TIMEOUT_MS": str(int(KV_TIMEOUT_S * 1000)),
        "HETSERVE_BREAKER_P99_MS": "60000", "HETSERVE_SNAPSHOT_DIR": str(tmp_path_factory.mktemp("snapshots"))})
    topo.start()
    yield topo
    topo.stop()


def test_transfer_not_ok_recomputes_at_once_same_tokens(refusing_topology):
    from hetserve.client import generate

    topo = refusing_topology
    prefill_metrics, decode_metrics = topo.base_port + 2, topo.base_port + 1002
    prompt = "What is the capital of France?"
    want = generate(topo.prefill_grpc, prompt, model="aggregated", max_tokens=8, ignore_eos=True)
    for transport in ("grpc", "shm"):
        t0 = time.perf_counter()
        got = generate(topo.prefill_grpc, prompt, model="llm", max_tokens=8, ignore_eos=True, transport=transport)
        took = time.perf_counter() - t0
        assert got.token_ids == want.token_ids and got.text == want.text, transport
        assert took < KV_TIMEOUT_S * 0.8, f"{transport}: {took:.1f}s: decode waited for KV that was refused"
    d, p = scrape(decode_metrics), scrape(prefill_metrics)
    assert total(d, "hetserve_kv_recompute_total", reason="transfer_failed") >= 2
    assert total(d, "hetserve_kv_recompute_total", reason="timeout") == 0
    assert total(p, "hetserve_kv_transfer_not_ok_total", reason="transfer_failed") >= 2
    assert total(p, "hetserve_kv_transfer_not_ok_total", reason="transfer_failed", transport="shm") >= 1


def test_decode_paces_a_whole_answer_into_one_response_same_tokens(topology):
    """send_interval_ms (what llm asks for when its client wants one final answer): the decode server sends the
    stream's tokens together instead of one response per step; the tokens are the same."""
    from hetserve.client import generate

    base = dict(op="generate", input_ids=[1, 100, 200, 300, 400], output_ids=[42], kv_sent=False, max_tokens=24,
                ignore_eos=True)
    every = generate(topology.decode_grpc, None, model="decode", request_id="pace-every", **base)
    paced = generate(topology.decode_grpc, None, model="decode", request_id="pace-paced", send_interval_ms=10000,
                     **base)
    assert len(every.token_ids) == 23 and paced.token_ids == every.token_ids
    assert paced.finish_reason == every.finish_reason == "length"
    assert paced.chunks == 1 and every.chunks >= 3, (paced.chunks, every.chunks)


def test_one_stream_carries_several_generates_and_op_cancel_ends_one(topology):
    """What the llm's SharedStream relies on, on a real decode server: two generates on ONE gRPC stream answer
    under their own request ids (the short one's tokens as when it runs alone), and op=cancel on that stream ends
    the long one early with finish_reason "cancelled" (its sequence freed: the scheduler counts it), while the
    stream stays usable for the next request."""
    import json
    import queue

    import tritonclient.grpc as grpcclient

    from hetserve.client import build_inputs, generate, stream_once

    url = topology.decode_grpc
    base = dict(op="generate", input_ids=[1, 100, 200, 300, 400], output_ids=[42], kv_sent=False, ignore_eos=True)
    alone = generate(url, None, model="decode", request_id="share-alone", max_tokens=12, **base)

    def stats() -> dict:
        got = stream_once(url, "decode", build_inputs(None, op="stats"), 30)
        return json.loads(bytes(got.as_numpy("op_json").reshape(-1)[0]))

    before = stats()
    c = grpcclient.InferenceServerClient(url)
    q: "queue.Queue" = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer("decode", build_inputs(None, request_id="share-long", max_tokens=400, **base),
                             request_id="share-long", enable_empty_final_response=True)
        c.async_stream_infer("decode", build_inputs(None, request_id="share-short", max_tokens=12, **base),
                             request_id="share-short", enable_empty_final_response=True)
        got: dict = {"share-long": [], "share-short": []}
        reasons: dict = {}
        cancelled = False
        deadline = time.time() + 60
        while len(reasons) < 2 and time.time() < deadline:
            result, error = q.get(timeout=30)
            assert error is None, error
            resp = result.get_response()
            if resp.id not in got:  # op=cancel's own (empty, final) answer
                continue
            toks = result.as_numpy("token_ids")
            got[resp.id] += [] if toks is None else toks.reshape(-1).tolist()
            fr = result.as_numpy("finish_reason")
            if fr is not None and fr.size:
                reasons[resp.id] = fr.reshape(-1)[0].decode()
            if not cancelled and len(got["share-long"]) >= 3:
                c.async_stream_infer("decode", build_inputs(None, op="cancel", request_id="share-long"),
                                     request_id="", enable_empty_final_response=True)
                cancelled = True
        assert reasons == {"share-long": "cancelled", "share-short": "length"}, reasons
        assert got["share-short"] == alone.token_ids and len(alone.token_ids) == 11
        assert 3 <= len(got["share-long"]) < 399
        c.async_stream_infer("decode", build_inputs(None, request_id="share-after", max_tokens=12, **base),
                             request_id="share-after", enable_empty_final_response=True)
        after: list = []
        while True:
            result, error = q.get(timeout=30)
            assert error is None, error
            if result.get_response().id == "share-after":
                toks = result.as_numpy("token_ids")
                after += [] if toks is None else toks.reshape(-1).tolist()
                fp = result.get_response().parameters.get("triton_final_response")
                if fp is not None and fp.bool_param:
                    break
        assert after == alone.token_ids
    finally:
        c.stop_stream()
    assert stats()["scheduler"]["cancelled"] == before["scheduler"]["cancelled"] + 1
