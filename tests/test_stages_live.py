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
