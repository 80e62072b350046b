"""Locust load test for the hetserve client-facing ``llm`` model.

Three users stream generations from the prefill server (or the nginx ``lb``):

* ``TritonGrpcStreamUser`` -- tritonclient.grpc bidirectional stream
  (``start_stream`` + ``async_stream_infer(enable_empty_final_response=True)``).
* ``TritonHttpStreamUser`` -- ``POST /v2/models/llm/generate_stream`` (SSE).
* ``OpenAIChatStreamUser`` -- ``POST /v1/chat/completions`` with ``stream: true``
  on the OpenAI-compatible frontend (HETSERVE_OPENAI_URL, default
  http://127.0.0.1:8080/v1); token count from ``usage`` in the last chunk.

The Triton users send ``stream=true`` (``llm`` answers in one response otherwise).
Every user backs off on an overload refusal (HTTP 503, or an UNAVAILABLE
"circuit breaker open / overloaded ... retry after N s" message): its next
request waits the Retry-After / hinted time instead of retrying at once.

For every generation both fire Locust request events:

* ``ttft``    -- time to the first streamed token,
* ``tpot``    -- mean time per output token after the first (>= 2 tokens),
* ``request`` -- end-to-end latency; response_length is the token count.

and, when ``HETSERVE_LATENCY_CSV`` is set, append one row per generation to that
CSV (see ``LATENCY_FIELDS``), which ``loadtest/plot.py`` turns into a PNG.

Scenario (``HETSERVE_SCENARIO``): steady | burst | long_prompts | mixed.  Every
scenario is bounded: ``burst`` through ``BurstShape`` (a LoadTestShape that
stops on its own), the others through ``-t`` and, as a backstop, a timer that
quits the runner after the scenario's duration (+ HETSERVE_STOP_GRACE).

Run it through ``loadtest/run.sh`` or e.g.::

    HETSERVE_SCENARIO=steady locust -f loadtest/locustfile.py --headless \
        -u 8 -r 2 -t 60s --csv /tmp/lt/locust TritonGrpcStreamUser

Only loopback targets are accepted unless HETSERVE_ALLOW_REMOTE=1.
"""

from __future__ import annotations

import csv
import ipaddress
import itertools
import json
import os
import queue
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import gevent
from locust import LoadTestShape, User, between, constant, events, task

# grpcio needs to cooperate with gevent (Locust monkey-patches on import).
try:  # pragma: no cover - depends on grpcio build
    import grpc.experimental.gevent as _grpc_gevent

    _grpc_gevent.init_gevent()
except Exception:  # noqa: BLE001
    pass

try:
    import numpy as np
    import tritonclient.grpc as grpcclient
except Exception:  # noqa: BLE001 - the HTTP user still works without it
    np = None
    grpcclient = None

import requests

try:  # the one definition of the overload vocabulary and hint format
    from hetserve import retry as _retry
except Exception:  # noqa: BLE001 - a load box without hetserve installed: HTTP 503s still back off
    _retry = None


# --------------------------------------------------------------------------- config
def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value.strip() else default


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: int  # hard bound of the run
    users: int  # suggested -u for run.sh (burst: the shape decides)
    spawn_rate: float  # suggested -r
    max_tokens: int
    description: str


SCENARIOS: dict[str, Scenario] = {
    "steady": Scenario("steady", 60, 8, 2, 32, "constant concurrency, short prompts"),
    "burst": Scenario("burst", 90, 32, 32, 32, "idle baseline with two traffic spikes (LoadTestShape)"),
    "long_prompts": Scenario("long_prompts", 60, 4, 1, 16, "long prompts that stress prefill and KV transfer"),
    "mixed": Scenario("mixed", 60, 8, 2, 64, "short/medium/long prompts, varied max_tokens, shared prefixes"),
}

SCENARIO_NAME = os.environ.get("HETSERVE_SCENARIO", "steady").strip() or "steady"
if SCENARIO_NAME not in SCENARIOS:
    raise ValueError(f"HETSERVE_SCENARIO={SCENARIO_NAME!r}: expected one of {sorted(SCENARIOS)}")
SCENARIO = SCENARIOS[SCENARIO_NAME]
DURATION_S = _env_int("HETSERVE_DURATION", SCENARIO.duration_s)
STOP_GRACE_S = _env_int("HETSERVE_STOP_GRACE", 15)

MODEL_NAME = os.environ.get("HETSERVE_MODEL", "llm")
DEFAULT_HOST = os.environ.get("HETSERVE_HOST", "127.0.0.1")
HTTP_PORT = _env_int("HETSERVE_HTTP_PORT", 8000)
GRPC_PORT = _env_int("HETSERVE_GRPC_PORT", 8001)
REQUEST_TIMEOUT_S = _env_float("HETSERVE_REQUEST_TIMEOUT", 120.0)
MAX_TOKENS = _env_int("HETSERVE_MAX_TOKENS", SCENARIO.max_tokens)
TEMPERATURE = _env_float("HETSERVE_TEMPERATURE", 0.0)
IGNORE_EOS = _env_bool("HETSERVE_IGNORE_EOS", True)
# Sent only when set (the model's defaults apply otherwise).
TOP_K = _env_int("HETSERVE_TOP_K", 0)
TOP_P = _env_float("HETSERVE_TOP_P", 0.0)
# Prepend a batch dimension ([1, 1] instead of [1]) for a model with max_batch_size > 0.
BATCH_DIM = _env_bool("HETSERVE_INPUT_BATCH_DIM", False)
LONG_PROMPT_WORDS = _env_int("HETSERVE_LONG_PROMPT_WORDS", 1500)
SEED = _env_int("HETSERVE_SEED", 1234)
LATENCY_CSV = os.environ.get("HETSERVE_LATENCY_CSV", "").strip()
THINK_MIN_S = _env_float("HETSERVE_THINK_MIN", 0.1)
THINK_MAX_S = _env_float("HETSERVE_THINK_MAX", 0.5)
OPENAI_URL = os.environ.get("HETSERVE_OPENAI_URL", f"http://{DEFAULT_HOST}:8080/v1").rstrip("/")
OPENAI_MODEL = os.environ.get("HETSERVE_OPENAI_MODEL", "SmolLM2-135M-Instruct.Q4_1")
MAX_BACKOFF_S = _env_float("HETSERVE_MAX_BACKOFF", 30.0)


def backoff_s(message: str | None, status: int | None = None, retry_after: str | None = None) -> float:
    """Seconds to wait before the next request after this failure (0 = not an overload refusal)."""
    if retry_after:
        try:
            return min(MAX_BACKOFF_S, max(0.0, float(retry_after)))
        except ValueError:
            pass
    msg = message or ""
    if _retry is not None and _retry.is_overload(msg):
        return min(MAX_BACKOFF_S, _retry.after_s(msg) or _retry.DEFAULT_S)
    return 1.0 if status == 503 else 0.0


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def _check_target(host: str) -> None:
    if not _is_loopback(host) and not _env_bool("HETSERVE_ALLOW_REMOTE", False):
        raise RuntimeError(
            f"refusing to load-test non-loopback host {host!r}; set HETSERVE_ALLOW_REMOTE=1 "
            "to target a deployment you own"
        )


def _split_host(host: str | None, default_port: int) -> tuple[str, int]:
    """'http://h:p', 'h:p' or 'h' -> (h, p)."""
    host = (host or DEFAULT_HOST).strip()
    parts = urlsplit(host if "://" in host else f"//{host}")
    return parts.hostname or DEFAULT_HOST, parts.port or default_port


# ------------------------------------------------------------------------ prompts
_TOPICS = [
    "the history of the printing press", "how transformers use attention", "tide pools",
    "the rules of chess", "volcanoes on Mars", "sourdough bread", "the water cycle",
    "binary search trees", "the Silk Road", "how vaccines work", "black holes",
    "the French Revolution", "photosynthesis", "compilers", "coral reefs", "jazz harmony",
]
_SHORT_TEMPLATES = [
    "Explain {t} in two sentences.",
    "Write a short poem about {t}.",
    "Give three facts about {t}.",
    "Summarize {t} for a ten-year-old.",
    "What is the most surprising thing about {t}?",
]
# Shared system-style prefixes exercise the prefix cache (hetserve_kv_prefix_*).
_SHARED_PREFIXES = [
    "You are a concise assistant. Answer in plain English without lists. ",
    "You are a helpful tutor. Think about the question, then answer briefly. ",
]
_FILLER = (
    "the quick brown fox jumps over the lazy dog while a distant bell rings and "
    "the river carries leaves past the old mill toward the sea under a grey sky"
).split()


@dataclass
class Prompt:
    text: str
    max_tokens: int
    kind: str


def short_prompt(rng: random.Random, max_tokens: int = MAX_TOKENS) -> Prompt:
    text = rng.choice(_SHORT_TEMPLATES).format(t=rng.choice(_TOPICS))
    return Prompt(text, max_tokens, "short")


def long_prompt(rng: random.Random, words: int = LONG_PROMPT_WORDS, max_tokens: int = MAX_TOKENS) -> Prompt:
    """A long document (about ``words`` words) followed by a question."""
    start = rng.randrange(len(_FILLER))
    body = " ".join(_FILLER[(start + i) % len(_FILLER)] for i in range(words))
    topic = rng.choice(_TOPICS)
    text = f"Document:\n{body}\n\nQuestion: how does the document relate to {topic}? Answer briefly."
    return Prompt(text, max_tokens, "long")


def mixed_prompt(rng: random.Random) -> Prompt:
    """70% short, 20% medium, 10% long; half share a common prefix; varied max_tokens."""
    roll = rng.random()
    if roll < 0.7:
        prompt = short_prompt(rng, max_tokens=rng.choice([8, 16, 32, 64]))
    elif roll < 0.9:
        prompt = long_prompt(rng, words=max(16, LONG_PROMPT_WORDS // 8), max_tokens=rng.choice([16, 32, 64]))
        prompt.kind = "medium"
    else:
        prompt = long_prompt(rng, words=LONG_PROMPT_WORDS, max_tokens=rng.choice([8, 16]))
    if rng.random() < 0.5:
        prompt.text = rng.choice(_SHARED_PREFIXES) + prompt.text
        prompt.kind += "+prefix"
    prompt.max_tokens = min(prompt.max_tokens, max(1, MAX_TOKENS))
    return prompt


def next_prompt(rng: random.Random, scenario: str = SCENARIO_NAME) -> Prompt:
    if scenario == "long_prompts":
        return long_prompt(rng)
    if scenario == "mixed":
        return mixed_prompt(rng)
    return short_prompt(rng)  # steady, burst


# ------------------------------------------------------------ per-request results
LATENCY_FIELDS = [
    "start_time", "user", "protocol", "scenario", "prompt_kind", "prompt_chars",
    "max_tokens", "n_tokens", "n_responses", "ttft_s", "tpot_s", "e2e_s", "ok", "error",
]


@dataclass
class Generation:
    start_time: float  # wall clock (time.time()) at send
    t0: float  # perf_counter at send
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    n_tokens: int = 0
    n_responses: int = 0
    text: list[str] = field(default_factory=list)
    error: str | None = None

    def on_tokens(self, n: int, text: str | None) -> None:
        now = time.perf_counter()
        self.n_responses += 1
        if text:
            self.text.append(text)
        if n > 0:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.n_tokens += n

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.t0

    @property
    def tpot_s(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.n_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.n_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return (self.end or time.perf_counter()) - self.t0


class _LatencyWriter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file = None
        self._writer = None

    def open(self, path: str) -> None:
        with self._lock:
            if self._file is not None or not path:
                return
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            self._file = open(path, "a", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._file, fieldnames=LATENCY_FIELDS)
            if new:
                self._writer.writeheader()
                self._file.flush()

    def write(self, row: dict) -> None:
        with self._lock:
            if self._writer is None:
                return
            self._writer.writerow(row)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = None
            self._writer = None


LATENCY_WRITER = _LatencyWriter()


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def report(user: User, protocol: str, prompt: Prompt, gen: Generation) -> None:
    """Fire Locust events for one generation and log it to the latency CSV."""
    fire = user.environment.events.request.fire
    exc = RuntimeError(gen.error) if gen.error else None
    if gen.ttft_s is not None:
        fire(request_type=protocol, name="ttft", response_time=gen.ttft_s * 1000.0,
             response_length=0, exception=None, context={"prompt_kind": prompt.kind})
    elif exc is None:
        exc = RuntimeError("stream finished without any token")
    if gen.tpot_s is not None:
        fire(request_type=protocol, name="tpot", response_time=gen.tpot_s * 1000.0,
             response_length=gen.n_tokens, exception=None, context={"prompt_kind": prompt.kind})
    fire(request_type=protocol, name="request", response_time=gen.e2e_s * 1000.0,
         response_length=gen.n_tokens, exception=exc, context={"prompt_kind": prompt.kind})
    LATENCY_WRITER.write({
        "start_time": f"{gen.start_time:.6f}",
        "user": type(user).__name__,
        "protocol": protocol,
        "scenario": SCENARIO_NAME,
        "prompt_kind": prompt.kind,
        "prompt_chars": len(prompt.text),
        "max_tokens": prompt.max_tokens,
        "n_tokens": gen.n_tokens,
        "n_responses": gen.n_responses,
        "ttft_s": _fmt(gen.ttft_s),
        "tpot_s": _fmt(gen.tpot_s),
        "e2e_s": _fmt(gen.e2e_s),
        "ok": int(exc is None),
        "error": "" if exc is None else str(exc)[:300],
    })


# --------------------------------------------------------------------------- users
class _LLMUser(User):
    abstract = True
    think = between(THINK_MIN_S, THINK_MAX_S) if THINK_MAX_S > 0 else constant(0)
    backoff = 0.0  # set by an overload refusal, spent by the next wait

    _ids = itertools.count()

    def on_start(self) -> None:
        # Reproducible per-user prompt/seed streams.
        self.rng = random.Random(SEED * 1_000_003 + next(_LLMUser._ids))

    def wait_time(self) -> float:
        wait, self.backoff = max(self.backoff, type(self).think(self)), 0.0
        return wait

    def note_failure(self, gen: "Generation", status: int | None = None, retry_after: str | None = None) -> None:
        self.backoff = max(self.backoff, backoff_s(gen.error, status, retry_after))


class TritonGrpcStreamUser(_LLMUser):
    """Streams from the decoupled ``llm`` model over Triton's gRPC ModelStreamInfer."""

    host = f"{DEFAULT_HOST}:{GRPC_PORT}"
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        if grpcclient is None:
            raise RuntimeError("tritonclient[grpc] is not installed")
        explicit = os.environ.get("HETSERVE_GRPC_URL")
        host, port = _split_host(explicit or self.host, GRPC_PORT)
        if not explicit and "://" in (self.host or ""):
            # `locust --host http://h:8000` is meant for the HTTP user: keep h, use the gRPC port.
            port = GRPC_PORT
        _check_target(host)
        self.url = f"{host}:{port}"
        self.client = grpcclient.InferenceServerClient(url=self.url)

    def on_stop(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            try:
                client.stop_stream(cancel_requests=True)
            except Exception:  # noqa: BLE001
                pass
            client.close()

    def _inputs(self, prompt: Prompt) -> list:
        shape = [1, 1] if BATCH_DIM else [1]

        def tensor(name: str, dtype: str, value, np_dtype):
            inp = grpcclient.InferInput(name, shape, dtype)
            inp.set_data_from_numpy(np.array([value], dtype=np_dtype).reshape(shape))
            return inp

        inputs = [
            tensor("text_input", "BYTES", prompt.text.encode("utf-8"), np.object_),
            tensor("max_tokens", "INT32", prompt.max_tokens, np.int32),
            tensor("temperature", "FP32", TEMPERATURE, np.float32),
            tensor("seed", "UINT64", self.rng.getrandbits(63), np.uint64),
            tensor("ignore_eos", "BOOL", IGNORE_EOS, np.bool_),
            tensor("stream", "BOOL", True, np.bool_),
        ]
        if TOP_K > 0:
            inputs.append(tensor("top_k", "INT32", TOP_K, np.int32))
        if TOP_P > 0:
            inputs.append(tensor("top_p", "FP32", TOP_P, np.float32))
        return inputs

    @task
    def generate(self) -> None:
        prompt = next_prompt(self.rng)
        events_q: queue.Queue = queue.Queue()

        def callback(result, error):
            events_q.put((time.perf_counter(), result, error))

        outputs = [grpcclient.InferRequestedOutput("text_output"), grpcclient.InferRequestedOutput("token_ids")]
        gen = Generation(start_time=time.time(), t0=time.perf_counter())
        try:
            self.client.start_stream(callback=callback)
            self.client.async_stream_infer(
                MODEL_NAME, self._inputs(prompt), outputs=outputs,
                request_id=uuid.uuid4().hex, enable_empty_final_response=True,
            )
            deadline = gen.t0 + REQUEST_TIMEOUT_S
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    gen.error = f"timeout after {REQUEST_TIMEOUT_S:.0f}s"
                    break
                try:
                    _, result, error = events_q.get(timeout=remaining)
                except queue.Empty:
                    continue
                if error is not None:
                    gen.error = f"grpc: {error}"
                    break
                ids = result.as_numpy("token_ids")
                text = result.as_numpy("text_output")
                delta = None
                if text is not None and text.size:
                    raw = text.reshape(-1)[0]
                    delta = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                gen.on_tokens(0 if ids is None else int(ids.size), delta)
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    break
        except Exception as e:  # noqa: BLE001
            gen.error = f"{type(e).__name__}: {e}"
        finally:
            gen.end = time.perf_counter()
            try:
                self.client.stop_stream(cancel_requests=gen.error is not None)
            except Exception:  # noqa: BLE001
                pass
        if gen.error:
            self.note_failure(gen)
        report(self, "grpc", prompt, gen)


class TritonHttpStreamUser(_LLMUser):
    """Streams from ``POST /v2/models/llm/generate_stream`` (Server-Sent Events)."""

    host = f"http://{DEFAULT_HOST}:{HTTP_PORT}"
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        host, port = _split_host(os.environ.get("HETSERVE_HTTP_URL") or self.host, HTTP_PORT)
        _check_target(host)
        self.url = f"http://{host}:{port}/v2/models/{MODEL_NAME}/generate_stream"
        self.session = requests.Session()

    def on_stop(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            session.close()

    @task
    def generate(self) -> None:
        prompt = next_prompt(self.rng)
        payload = {
            "text_input": prompt.text,
            "max_tokens": prompt.max_tokens,
            "temperature": TEMPERATURE,
            "seed": self.rng.getrandbits(63),
            "ignore_eos": IGNORE_EOS,
            "stream": True,
        }
        if TOP_K > 0:
            payload["top_k"] = TOP_K
        if TOP_P > 0:
            payload["top_p"] = TOP_P
        gen = Generation(start_time=time.time(), t0=time.perf_counter())
        status = None
        try:
            with self.session.post(
                self.url, json=payload, stream=True,
                headers={"Accept": "text/event-stream"},
                timeout=(5.0, REQUEST_TIMEOUT_S),
            ) as resp:
                status = resp.status_code
                if resp.status_code != 200:
                    gen.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                else:
                    for line in resp.iter_lines(decode_unicode=False):
                        if time.perf_counter() - gen.t0 > REQUEST_TIMEOUT_S:
                            gen.error = f"timeout after {REQUEST_TIMEOUT_S:.0f}s"
                            break
                        if not line or not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if not data or data == b"[DONE]":
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            gen.error = f"server: {event['error']}"
                            break
                        ids = event.get("token_ids")
                        n = len(ids) if isinstance(ids, list) else (0 if ids is None else 1)
                        text = event.get("text_output")
                        if isinstance(text, list):
                            text = "".join(map(str, text))
                        gen.on_tokens(n, text)
        except Exception as e:  # noqa: BLE001
            gen.error = f"{type(e).__name__}: {e}"
        finally:
            gen.end = time.perf_counter()
        if gen.error:
            self.note_failure(gen, status)
        report(self, "http", prompt, gen)


class OpenAIChatStreamUser(_LLMUser):
    """Streams ``POST /v1/chat/completions`` (SSE) from the OpenAI-compatible frontend."""

    host = OPENAI_URL
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        base = (self.host or OPENAI_URL).rstrip("/")
        host, _ = _split_host(base, 8080)
        _check_target(host)
        self.url = (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"
        self.session = requests.Session()

    def on_stop(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            session.close()

    @task
    def generate(self) -> None:
        prompt = next_prompt(self.rng)
        payload = {
            "model": OPENAI_MODEL,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": prompt.max_tokens,
            "temperature": TEMPERATURE,
            "seed": self.rng.getrandbits(63),
            "ignore_eos": IGNORE_EOS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if TOP_P > 0:
            payload["top_p"] = TOP_P
        gen = Generation(start_time=time.time(), t0=time.perf_counter())
        status = retry_after = None
        usage = None
        try:
            with self.session.post(self.url, json=payload, stream=True, timeout=(5.0, REQUEST_TIMEOUT_S)) as resp:
                status, retry_after = resp.status_code, resp.headers.get("Retry-After")
                if resp.status_code != 200:
                    gen.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                else:
                    for line in resp.iter_lines(decode_unicode=False):
                        if time.perf_counter() - gen.t0 > REQUEST_TIMEOUT_S:
                            gen.error = f"timeout after {REQUEST_TIMEOUT_S:.0f}s"
                            break
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        event = json.loads(data)
                        if "error" in event:
                            gen.error = f"server: {event['error'].get('message', event['error'])}"
                            break
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or []:
                            text = (choice.get("delta") or {}).get("content")
                            if text:  # the frontend sends one chunk per decode step
                                gen.on_tokens(1, text)
        except Exception as e:  # noqa: BLE001
            gen.error = f"{type(e).__name__}: {e}"
        finally:
            gen.end = time.perf_counter()
        if usage and not gen.error:
            gen.n_tokens = int(usage.get("completion_tokens", gen.n_tokens))
        if gen.error:
            self.note_failure(gen, status, retry_after)
        report(self, "openai", prompt, gen)


# --------------------------------------------------------------------------- shape
@dataclass(frozen=True)
class Stage:
    until_s: float  # stage ends at this run time
    users: int
    spawn_rate: float


def burst_stages(base: int | None = None, peak: int | None = None) -> list[Stage]:
    """Idle baseline, two spikes, cool-down; ends at SCENARIOS['burst'].duration_s."""
    base = _env_int("HETSERVE_BURST_BASE_USERS", 2) if base is None else base
    peak = _env_int("HETSERVE_BURST_PEAK_USERS", SCENARIOS["burst"].users) if peak is None else peak
    total = DURATION_S if SCENARIO_NAME == "burst" else SCENARIOS["burst"].duration_s
    fractions = [(1 / 6, base), (2 / 6, peak), (3 / 6, base), (4 / 6, peak), (1.0, base)]
    return [Stage(round(total * f, 3), users, float(max(users, 1))) for f, users in fractions]


if SCENARIO_NAME == "burst":
    # Defined only for the burst scenario: Locust picks up any LoadTestShape in
    # the locustfile, and it would override -u/-r/-t for the other scenarios.

    class BurstShape(LoadTestShape):
        """Step load: base users, jump to peak, back, again, then stop (returns None)."""

        stages = burst_stages()

        def tick(self):
            run_time = self.get_run_time()
            for stage in self.stages:
                if run_time < stage.until_s:
                    return stage.users, stage.spawn_rate
            return None


# -------------------------------------------------------------------------- events
@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    if LATENCY_CSV:
        LATENCY_WRITER.open(LATENCY_CSV)
    runner = environment.runner
    if runner is None or getattr(environment.parsed_options, "worker", False):
        return
    # Backstop so that every scenario is bounded even without -t.
    limit = DURATION_S + STOP_GRACE_S

    def _stop_after() -> None:
        gevent.sleep(limit)
        if environment.runner is not None and environment.runner.state not in ("stopped", "cleanup"):
            print(f"[hetserve] scenario {SCENARIO_NAME}: {limit}s bound reached, quitting", flush=True)
            environment.runner.quit()

    gevent.spawn(_stop_after)


@events.quitting.add_listener
def _on_quitting(environment, **_kwargs) -> None:
    LATENCY_WRITER.close()
