"""The OpenAI-compatible frontend against real servers, driven by the official `openai` client.

A real prefill + decode topology (base port HETSERVE_TEST_BASE_PORT, default 18000) and a real uvicorn frontend
process (`hetserve serve --role openai`, port base+80) on loopback. Nothing here is faked.
"""
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from conftest import wait_for

openai = pytest.importorskip("openai")  # installed by scripts/install.sh (.[test]); a skip is a CI failure

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default GGUF's file name: the name it is served under
# (tests/test_served_model_name.py: where the name comes from, --served-model-name, HETSERVE_OPENAI_MODEL)
Q = "What is the capital of France?"


def _frontend(topology, engine_dir, port, env=None, model_name=None):
    from hetserve.openai_api.process import FrontendProcess, FrontendSpec
    from hetserve.server import REPO_ROOT

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        fe = FrontendProcess(FrontendSpec(topology.prefill_grpc, port, str(engine_dir), model_name=model_name,
                                          log_file=str(REPO_ROOT / ".hetserve" / "logs" / f"openai-{port}.log")))
        fe.start().wait_ready(120)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return fe


@pytest.fixture(scope="module")
def frontend(topology, engine_dir):
    fe = _frontend(topology, engine_dir, topology.base_port + 80)
    yield fe
    fe.stop()
    assert not fe.alive()


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.spec.url, api_key="unused", max_retries=0, timeout=120)


def _idle(topology):
    from hetserve.cluster import decode_op

    s = decode_op(topology.decode_grpc, "stats")
    return s if s["running"] == 0 and s["waiting"] == 0 and s["pending_kv"] == 0 else None


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_non_stream_usage_and_greedy_answer(client, tokenizer, topology):
    from hetserve.client import generate

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}], max_tokens=12,
                                       temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content.startswith("The capital of France is Paris")
    # same greedy answer and token count as `llm` over Triton gRPC for the same templated prompt
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": Q}]))
    g = generate(topology.prefill_grpc, None, input_ids=prompt_ids, max_tokens=12, temperature=0.0)
    assert c.message.content == g.text
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(g.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert c.finish_reason in ("stop", "length")


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": Q}], max_completion_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # really streamed


def test_completions_stream_and_not_length_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    parts = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    word = r.choices[0].text.split()[0]
    s = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  stop=[word])
    assert word not in s.choices[0].text and s.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=1.0, top_p=0.9, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


BAD = [
    (dict(messages=[{"role": "user", "content": "hi"}], n=17), "n"),
    (dict(messages=[{"role": "user", "content": "hi"}], temperature=3.0), "temperature"),
    (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=0), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=10 ** 6), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "hi"}], top_p=0), "top_p"),
    (dict(messages=[{"role": "user", "content": "hi"}], stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    (dict(messages=[{"role": "user", "content": "x" * 70000}]), "characters"),
    (dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "hi"}], response_format={"type": "yaml"}), "response_format"),
]


@pytest.mark.parametrize("kw,match", BAD, ids=[m for _, m in BAD])
def test_bad_input_400_openai_error(client, kw, match):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            r = client.chat.completions.create(model=MODEL, stream=stream, **kw)
            if stream:
                list(r)
        assert ei.value.status_code == 400
        body = ei.value.body
        assert body["type"] == "invalid_request_error" and match in body["message"], body


def test_llm_side_validation_is_400_too(client):
    # the frontend passes these through; `llm` refuses them (INVALID_ARG) and the frontend maps that to 400
    # (llm's max_tokens cap, HETSERVE_MAX_TOKENS_LIMIT=4096, is below the 8192-token context the frontend checks)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be in \[1, 4096\]") as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    assert ei.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(model=MODEL, prompt=[10 ** 7], max_tokens=2)


def test_unknown_model_404_and_raw_http_errors(client, frontend):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["code"] == "model_not_found"
    base = f"http://{frontend.spec.host}:{frontend.spec.port}"

    def post(path, data: bytes):
        req = urllib.request.Request(base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert post("/v1/chat/completions", b"{not json")[0] == 400
    assert post("/v1/chat/completions", b"[1, 2]")[0] == 400
    code, body = post("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode())
    assert code == 413 and body["error"]["code"] == "body_too_large"
    code, body = post("/v1/nothing", b"{}")
    assert code == 404 and "error" in body


def test_client_disconnect_mid_stream_frees_decode(client, topology):
    wait_for(lambda: _idle(topology), 30, "decode idle before the test")
    before = _idle(topology)
    s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to one thousand."}],
                                       max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for c in s:
        if c.choices and c.choices[0].delta.content:
            got += 1
        if got >= 3:
            break
    from hetserve.cluster import decode_op

    assert decode_op(topology.decode_grpc, "stats")["running"] + decode_op(topology.decode_grpc, "stats")[
        "waiting"] >= 1, "the generation should still be running on decode"
    s.close()  # drops the HTTP connection mid-stream
    t0 = time.time()
    after = wait_for(lambda: _idle(topology), 30, "decode to drop the cancelled sequence")
    assert time.time() - t0 < 30
    # it was cancelled, not run to completion: far fewer than 400 tokens were generated for it
    gen = after["scheduler"]["tokens"] - before["scheduler"]["tokens"]
    assert gen < 300, (before["scheduler"], after["scheduler"])
    assert after["scheduler"]["cancelled"] == before["scheduler"]["cancelled"] + 1
    # and the frontend still serves
    r = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_non_stream_disconnect_also_frees_decode(frontend, topology):
    import socket

    wait_for(lambda: _idle(topology), 30, "decode idle before the test")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count to one thousand."}],
                       "max_tokens": 400, "temperature": 0, "ignore_eos": True}).encode()
    sock = socket.create_connection((frontend.spec.host, frontend.spec.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    from hetserve.cluster import decode_op

    wait_for(lambda: decode_op(topology.decode_grpc, "stats")["running"] >= 1, 30, "generation to start")
    sock.close()
    wait_for(lambda: _idle(topology), 30, "decode to drop the sequence of the vanished client")


def test_frontend_overload_is_503_with_retry_after(topology, engine_dir):
    fe = _frontend(topology, engine_dir, topology.base_port + 81, env={"HETSERVE_OPENAI_MAX_CONCURRENT": "1"})
    try:
        c = openai.OpenAI(base_url=fe.spec.url, api_key="unused", max_retries=0, timeout=120)
        hold = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to 100."}],
                                         max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(hold))
        with pytest.raises(openai.APIStatusError) as ei:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        e = ei.value
        assert e.status_code == 503 and e.response.headers["retry-after"] == "1"
        assert e.body["code"] == "overloaded" and "retry after" in e.body["message"]
        hold.close()
        wait_for(lambda: _idle(topology), 30, "decode idle after the held stream was dropped")
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        fe.stop()


def test_breaker_open_is_503_with_retry_after(topology, engine_dir):
    """A second prefill server (same decode server) whose breaker opens after one slow request: the frontend
    answers 503 + Retry-After from the breaker's own hint, with an OpenAI error body, stream or not."""
    from hetserve.server import REPO_ROOT, ServerSpec, TritonProcess

    b = topology.base_port + 200
    env = {"HETSERVE_DECODE_URL": topology.decode_grpc, "HETSERVE_BREAKER_P99_MS": "1",
           "HETSERVE_BREAKER_MIN_SAMPLES": "1", "HETSERVE_BREAKER_OPEN_S": "30"}
    pf = TritonProcess(ServerSpec("prefill", b, b + 1, b + 2, engine_dir, env=env,
                                  log_file=str(REPO_ROOT / ".hetserve" / "logs" / f"prefill-breaker-{b}.log")))
    pf.start()
    fe = None
    try:
        pf.wait_ready(300)

        class _Topo:
            prefill_grpc = pf.spec.grpc_url

        fe = _frontend(_Topo, engine_dir, b + 80)
        c = openai.OpenAI(base_url=fe.spec.url, api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "hi"}]
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # > 1 ms TTFT: the breaker opens
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as ei:
                r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, stream=stream)
                if stream:
                    list(r)
            e = ei.value
            assert e.status_code == 503, e
            assert 1 <= int(e.response.headers["retry-after"]) <= 30
            assert e.body["code"] == "overloaded" and "circuit breaker open" in e.body["message"]
    finally:
        if fe is not None:
            fe.stop()
        pf.stop()


def test_shipped_nginx_allow_list_in_front_of_real_servers(topology, frontend, tmp_path):
    """deploy/nginx/nginx.conf itself (compose host names -> these servers, listen ports -> free ones) in front
    of the real prefill server and frontend: client endpoints pass, admin APIs are refused at the balancer."""
    import re
    import shutil
    import subprocess

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from conftest import ROOT, stop_process

    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    assert os.access(exe, os.X_OK), "nginx is installed by .ci/run (apt-get install nginx)"
    b = topology.base_port + 300
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    conf = conf.replace("prefill:8000", topology.prefill_http).replace("prefill:8001", topology.prefill_grpc)
    conf = conf.replace("openai:8080", f"127.0.0.1:{frontend.spec.port}")
    for port, new in ((8000, b), (8001, b + 1), (8080, b + 80)):
        conf = re.sub(rf"listen {port}\b", f"listen 127.0.0.1:{new}", conf)
    conf = conf.replace("worker_processes auto;", f"worker_processes 1;\npid {tmp_path}/nginx.pid;")
    conf = conf.replace("/dev/stdout", f"{tmp_path}/access.log").replace("/dev/stderr", f"{tmp_path}/error.log")
    (tmp_path / "nginx.conf").write_text(conf)
    (tmp_path / "logs").mkdir()
    proc = subprocess.Popen([exe, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        import socket

        wait_for(lambda: proc.poll() is None and socket.socket().connect_ex(("127.0.0.1", b + 80)) == 0, 15,
                 "nginx listening")
        h = f"http://127.0.0.1:{b}"

        def req(method, path, body=None):
            r = urllib.request.Request(h + path, data=None if body is None else json.dumps(body).encode(),
                                       method=method)
            try:
                with urllib.request.urlopen(r, timeout=60) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        # allowed: health, the client models' generate
        assert req("GET", "/v2/health/ready")[0] == 200
        code, out = req("POST", "/v2/models/llm/generate", {"text_input": Q, "max_tokens": 6})
        assert code == 200 and "Paris" in json.loads(out)["text_output"], out
        # refused at the balancer: repository control, shm registration, trace, logging, other models, metadata
        for method, path in (("POST", "/v2/repository/models/llm/unload"), ("POST", "/v2/repository/index"),
                             ("POST", "/v2/systemsharedmemory/region/x/register"), ("GET", "/v2/trace/setting"),
                             ("POST", "/v2/logging"), ("POST", "/v2/models/prefill/infer"),
                             ("GET", "/v2/models/llm/config"), ("GET", "/metrics")):
            assert req(method, path, {} if method == "POST" else None)[0] == 403, path
        assert req("GET", "/v2/models/llm/generate")[0] == 403  # POST only
        # gRPC: streaming inference passes, admin methods get PERMISSION_DENIED from nginx itself
        from hetserve.client import generate

        g = generate(f"127.0.0.1:{b + 1}", Q, max_tokens=6, temperature=0.0)
        assert "Paris" in g.text, g.text
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{b + 1}")
        assert c.is_server_ready()
        for call in (lambda: c.unload_model("llm"), lambda: c.get_model_repository_index(),
                     lambda: c.register_system_shared_memory("x", "/hetserve_x", 64),
                     lambda: c.get_trace_settings(), lambda: c.get_log_settings()):
            with pytest.raises(InferenceServerException) as ei:
                call()
            assert "PERMISSION_DENIED" in str(ei.value.status()) or "not allowed" in str(ei.value), ei.value
        assert grpcclient.InferenceServerClient(topology.prefill_grpc).is_model_ready("llm")  # still loaded
        # the OpenAI frontend through the balancer, streamed
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{b + 80}/v1", api_key="unused", max_retries=0, timeout=60)
        parts = list(oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}],
                                                max_tokens=8, temperature=0, stream=True))
        assert "Paris" in "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        hc = httpclient.InferenceServerClient(f"127.0.0.1:{b + 80}")
        with pytest.raises(InferenceServerException):
            hc.get_model_repository_index()  # not an OpenAI route: 403
    finally:
        stop_process(proc)
