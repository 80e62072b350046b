"""Typed errors end to end on real servers (hetserve.errors): a decode engine failure injected mid-stream with
HETSERVE_INJECT_FAULT (faults.py; a RuntimeError in the decode step, the path a real engine bug takes).

One prefill + one decode tritonserver (base port HETSERVE_TEST_BASE_PORT + 600) whose decode step fails from its
4th call on, and a real OpenAI frontend. With a single decode server the request cannot migrate, so the failure
must reach every client as ours: gRPC stream -> typed error (kind internal, Triton INTERNAL, where "decode
step"), Triton HTTP /generate -> 500, OpenAI -> 500 with an error body; never INVALID_ARG/400, never a 200 with
an "error" finish reason; both servers log it with the request id. Nothing faked.
"""
import json
import os
import urllib.error
import urllib.request

import pytest

from hetserve import errors

openai = pytest.importorskip("openai")  # installed by scripts/install.sh (.[test]); a skip is a CI failure

PROMPT = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def faulty(engine_dir):
    from hetserve.topology import Topology

    base = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000")) + 600
    env = {"HETSERVE_BREAKER_P99_MS": "60000", "HETSERVE_BREAKER_OVERLOAD_TRIPS": "1000000"}
    topo = Topology(engine_dir, base_port=base, env=env)
    topo.cluster.decode_env["HETSERVE_INJECT_FAULT"] = "decode_step:4"
    topo.start()
    yield topo
    topo.stop()


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_grpc_stream_gets_the_typed_error_after_its_first_tokens(faulty):
    from hetserve.client import GenerationError, stream

    got = []
    with pytest.raises(GenerationError) as ei:
        for chunk in stream(faulty.prefill_grpc, PROMPT, max_tokens=32, ignore_eos=True,
                            triton_request_id="errtest-grpc"):
            got += chunk.token_ids
    e = ei.value
    assert got, "the failure must come mid-stream, after tokens were sent"
    assert (e.kind, e.status, e.where) == (errors.INTERNAL, "StatusCode.INTERNAL", "decode step"), vars(e)
    assert "injected fault" in str(e) and "decode step failed" in str(e)
    # both servers logged it as ours, with the request id and the traceback
    dec_log = faulty.servers["decode"].log_tail(200_000)
    assert "decode step failed for requests errtest-grpc-" in dec_log and "InjectedFault" in dec_log, dec_log[-3000:]
    pre_log = faulty.servers["prefill"].log_tail(200_000)
    assert "llm failed (request errtest-grpc)" in pre_log and "Traceback" in pre_log, pre_log[-3000:]


def test_a_prefill_refusal_keeps_its_kind_across_the_llm(faulty):
    """The llm reaches prefill over BLS, and Triton 2.51's BLS reports every error code as INTERNAL
    (triton-inference-server/server#7804): prefill answers the llm's hop with the typed error as data, so a
    client's bad input that only prefill can judge (an unknown KV transport) stays the client's fault: the
    Triton status is INVALID_ARGUMENT, the llm does not log it as its own failure, and the circuit breaker does
    counts it as the client's (kind bad_input, which the breaker skips). Without the data path this was an
    internal error (status INTERNAL, logged with a traceback)."""
    from conftest import scrape, total, wait_for
    from hetserve.client import GenerationError, stream

    def refused():
        return total(scrape(faulty.cluster.prefill_metrics), "hetserve_request_errors_total", kind=errors.BAD_INPUT)

    before, n0 = faulty.servers["prefill"].log_tail(200_000).count("llm failed (request errtest-refused"), refused()
    for i in range(3):
        with pytest.raises(GenerationError) as ei:
            for _ in stream(faulty.prefill_grpc, PROMPT, max_tokens=4, transport="carrier-pigeon",
                            triton_request_id=f"errtest-refused-{i}"):
                pass
        e = ei.value
        assert (e.kind, e.status, e.where) == (errors.BAD_INPUT, "StatusCode.INVALID_ARGUMENT", "prefill"), vars(e)
        assert "unknown transport 'carrier-pigeon'" in str(e)
    pre_log = faulty.servers["prefill"].log_tail(200_000)
    assert pre_log.count("llm failed (request errtest-refused") == before, pre_log[-3000:]
    # counted as the client's (kind bad_input), so not a breaker failure (metrics reach /metrics every interval)
    wait_for(lambda: refused() - n0 >= 3, 30, "3 refusals counted as bad input")


def test_triton_http_generate_says_the_failure_is_ours(faulty):
    """Triton 2.51's HTTP /generate answers every model error with 400 whatever its Triton code (INTERNAL here;
    the gRPC test above sees the code): the message must say it is an internal error. Asserting the 400 makes
    a Triton upgrade that maps codes to HTTP statuses visible here."""
    status, body = _post(f"http://{faulty.prefill_http}/v2/models/llm/generate",
                         {"text_input": PROMPT, "max_tokens": 32, "ignore_eos": True})
    assert status in (400, 500), (status, body)
    msg = body.get("error", "")
    assert msg.startswith("internal error in decode step: decode step failed") and "injected fault" in msg, body


def test_openai_endpoint_answers_500_with_an_error_body(faulty, engine_dir):
    """Non-streaming: HTTP 500, OpenAI error body, X-Request-Id naming the request in the decode server's log.
    Streaming (the 200 and the first token are already out): the stream ends with an error event."""
    from test_openai import _frontend

    fe = _frontend(faulty, engine_dir, faulty.base_port + 80)
    try:
        client = openai.OpenAI(base_url=fe.spec.url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        ask = dict(model=model, max_tokens=32, messages=[{"role": "user", "content": PROMPT}],
                   extra_body={"ignore_eos": True})
        with pytest.raises(openai.InternalServerError) as ei:
            client.chat.completions.create(**ask)
        e = ei.value
        err = e.body if isinstance(e.body, dict) else {}
        err = err.get("error", err)
        assert e.status_code == 500 and err.get("code") == "internal_error", e.body
        assert "injected fault" in err.get("message", ""), e.body
        rid = e.response.headers["x-request-id"]
        assert f"decode step failed for requests {rid}-" in faulty.servers["decode"].log_tail(200_000)
        with pytest.raises(openai.APIError, match="injected fault"):
            for _ in client.chat.completions.create(stream=True, **ask):
                pass
    finally:
        fe.stop()
