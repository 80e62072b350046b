"""hetserve's custom Triton metrics (pb_utils.MetricFamily), served on Triton's own /metrics endpoint next to
nv_inference_*.

Every metric carries `server` (prefill|decode|aggregated: the role of the tritonserver process) and, where
useful, `model`. Names are part of the deployment contract (alerts, Grafana, tests):

  hetserve_ttft_seconds            histogram  time to first token as the client sees it (llm, aggregated)
  hetserve_tpot_seconds            histogram  mean time per output token after the first, per request
  hetserve_kv_transfer_bytes_total counter    {transport} KV bytes pushed prefill -> decode
  hetserve_kv_transfer_seconds     histogram  {transport} wall time of one KV transfer
  hetserve_kv_transfer_bandwidth_bytes_per_second gauge {transport} bytes/s of the last transfer
  hetserve_kv_transfer_failures_total counter {transport, reason} failed sends and refused KV
  hetserve_kv_transport_fallbacks_total counter {requested, used, reason} transfers sent over another transport
                                   than requested: staging region full (kv/transport/sender.py, prefill) or
                                   not negotiated with that decode server (reliability.DecodePool, llm)
  hetserve_kv_recompute_total      counter    {reason} decode recomputed KV (timeout, mismatch, resume,
                                              transfer_failed: prefill said the KV will not come,
                                              local_prefill: the router had the prompt prefilled there)
  hetserve_kv_transfer_not_ok_total counter   {reason, transport} orchestrator saw transfer_ok=false
  hetserve_kv_tier_blocks          gauge      {tier} KV blocks resident per tier
  hetserve_kv_prefix_hits_total / hetserve_kv_prefix_lookups_total  counters of the prefill prefix cache
  hetserve_decode_prefix_hit_tokens_total counter  tokens a decode-side prefill/recompute took from the decode
                                   server's prefix cache (the KV of sequences that ended there)
  hetserve_decode_prefill_tokens_total counter tokens a decode server prefilled itself (local prefill, recompute)
  hetserve_decode_prefix_cache_bytes gauge    bytes held by the decode server's prefix cache
  hetserve_prefill_placement_total counter    {where=prefill|decode} where the router had a prompt prefilled (llm)
  hetserve_router_hit_tokens_total counter    prompt tokens the router expected the chosen decode server to hold
  hetserve_router_lookups_total counter       {result=found|none} router misses on which the decode servers were asked
  hetserve_batch_size              gauge      sequences in the last decode step
  hetserve_prefill_batch_size      histogram  prompts per prefill forward (stages/prefill_batch.py)
  hetserve_prefill_requests_total  counter    prompts prefilled (an n > 1 request counts once)
  hetserve_prefill_choices_total   counter    first tokens sampled for n > 1 requests (n each)
  hetserve_queue_depth             gauge      sequences waiting for admission
  hetserve_breaker_state           gauge      0 closed, 1 half-open, 2 open
  hetserve_snapshot_age_seconds    gauge      age of the oldest in-flight KV snapshot
  hetserve_snapshot_restores_total, hetserve_migrations_total, hetserve_breaker_rejections_total  counters
  hetserve_decode_servers          gauge      {state=healthy|down} decode servers in the orchestrator's pool
  hetserve_utilization_ratio       gauge      fraction of wall time the engine was busy (5 s window)
  hetserve_engine_cpu_seconds_total counter   {model} CPU seconds inside engine calls (engines/cpu_clock.py)

Metric updates are IPC calls to the Triton core, so per-request/per-step granularity is fine, per-element is not.
Sampled values (gauges, counters owned by other components) are refreshed by a background poller.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import triton_python_backend_utils as pb_utils

from .. import config
from ..engines.cpu_clock import ENGINE_CPU

log = logging.getLogger("hetserve.metrics")

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0]
TPOT_BUCKETS = [0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0]
TRANSFER_BUCKETS = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]

_SPECS = {
    # name: (kind, description, buckets)
    "hetserve_ttft_seconds": ("histogram", "Time to first token (s), as streamed to the client", LATENCY_BUCKETS),
    "hetserve_tpot_seconds": ("histogram", "Mean time per output token after the first (s), per request",
                              TPOT_BUCKETS),
    "hetserve_kv_transfer_bytes_total": ("counter", "KV cache bytes sent prefill -> decode", None),
    "hetserve_kv_transfer_seconds": ("histogram", "Wall time of one KV cache transfer (s)", TRANSFER_BUCKETS),
    "hetserve_kv_transfer_bandwidth_bytes_per_second": ("gauge", "Bandwidth of the last KV transfer (bytes/s)",
                                                        None),
    "hetserve_kv_transfer_failures_total": ("counter", "KV transfers that failed or were refused", None),
    "hetserve_kv_transport_fallbacks_total": ("counter", "KV transfers sent over another transport than requested "
                                                         "(staging full; transport not negotiated with the peer)",
                                              None),
    "hetserve_kv_recompute_total": ("counter", "Decode-side KV recomputations (receive timeout, refused or "
                                               "missing KV, resume after migration)", None),
    "hetserve_kv_tier_blocks": ("gauge", "KV cache blocks resident per tier", None),
    "hetserve_kv_prefix_hits_total": ("counter", "Prefill prefix-cache lookups that reused cached KV", None),
    "hetserve_kv_prefix_lookups_total": ("counter", "Prefill prefix-cache lookups", None),
    "hetserve_kv_prefix_hit_tokens_total": ("counter", "Prompt tokens served from the prefill prefix cache", None),
    "hetserve_decode_prefix_hit_tokens_total": ("counter", "Tokens a decode-side prefill took from the decode "
                                                           "server's prefix cache", None),
    "hetserve_decode_prefill_tokens_total": ("counter", "Tokens a decode server prefilled itself (local prefill, "
                                                        "recompute)", None),
    "hetserve_decode_prefix_cache_bytes": ("gauge", "Bytes held by the decode server's prefix cache", None),
    "hetserve_prefill_placement_total": ("counter", "Prompts by where they were prefilled (prefill server or "
                                                    "the chosen decode server)", None),
    "hetserve_router_hit_tokens_total": ("counter", "Prompt tokens the KV-aware router expected the chosen "
                                                    "decode server to hold", None),
    "hetserve_router_lookups_total": ("counter", "Router misses on which the decode servers were asked what they "
                                                 "hold of the prompt (found: more than the router's view)", None),
    "hetserve_batch_size": ("gauge", "Sequences in the last decode step", None),
    "hetserve_prefill_requests_total": ("counter", "Prompts prefilled (a request for n choices counts once)", None),
    "hetserve_prefill_choices_total": ("counter", "First tokens sampled for requests of n > 1 choices (n each)",
                                       None),
    "hetserve_prefill_batch_size": ("histogram", "Prompts per prefill forward (batched prefill)",
                                    [1, 2, 4, 8, 16, 32, 64]),
    "hetserve_queue_depth": ("gauge", "Sequences waiting for decode admission", None),
    "hetserve_breaker_state": ("gauge", "Circuit breaker state: 0 closed, 1 half-open, 2 open", None),
    "hetserve_snapshot_age_seconds": ("gauge", "Age of the oldest in-flight KV snapshot (s)", None),
    "hetserve_kv_preemptions_total": ("counter", "Running sequences swapped down a KV tier (or dropped for "
                                                 "recompute) to make room", None),
    "hetserve_snapshot_restores_total": ("counter", "Resumed sequences whose KV came from a snapshot", None),
    "hetserve_kv_transfer_not_ok_total": ("counter", "Requests whose prefill reported transfer_ok=false (decode "
                                                     "told to recompute at once)", None),
    "hetserve_migrations_total": ("counter", "Streams moved to another decode server mid-generation", None),
    "hetserve_breaker_rejections_total": ("counter", "Requests refused at once by the circuit breaker", None),
    "hetserve_request_errors_total": ("counter", "Requests the llm ended with an error, by kind (hetserve.errors: "
                                                 "bad_input, overloaded, unavailable, internal)", None),
    "hetserve_decode_servers": ("gauge", "Decode servers in the pool by health", None),
    "hetserve_utilization_ratio": ("gauge", "Fraction of wall time the engine was busy (5 s window)", None),
    "hetserve_engine_cpu_seconds_total": ("counter", "CPU seconds inside engine calls (the model's cost; the rest of "
                                                     "the process's CPU is the serving plane's)", None),
}

_KINDS = {"counter": "COUNTER", "gauge": "GAUGE", "histogram": "HISTOGRAM"}


def server_role() -> str:
    return config.get("HETSERVE_ROLE")


class Registry:
    """Lazily creates one MetricFamily per name and one Metric per label set (process-wide)."""

    def __init__(self):
        self._families: Dict[str, Any] = {}  # pb_utils.MetricFamily
        self._metrics: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], object] = {}
        self._lock = threading.Lock()
        self._op_lock = threading.Lock()
        self.enabled = bool(config.get("HETSERVE_METRICS"))
        self._unknown: set = set()

    def metric(self, name: str, **labels):
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        m = self._metrics.get(key)
        if m is not None:
            return m
        with self._lock:
            m = self._metrics.get(key)
            if m is None:
                kind, desc, buckets = _SPECS[name]
                fam = self._families.get(name)
                if fam is None:
                    fam = pb_utils.MetricFamily(name=name, description=desc,
                                                kind=getattr(pb_utils.MetricFamily, _KINDS[kind]))
                    self._families[name] = fam
                lab = {"server": server_role(), **{k: str(v) for k, v in labels.items()}}
                m = fam.Metric(labels=lab, buckets=buckets) if kind == "histogram" else fam.Metric(labels=lab)
                self._metrics[key] = m
        return m

    def _safe(self, fn: Callable[[], None]):
        if not self.enabled:
            return
        try:
            with self._op_lock:  # one metric IPC to the Triton core at a time (request threads + poller)
                if self.enabled:  # (close() may have run while this waited)
                    fn()
        except KeyError as e:  # a name missing from _SPECS: our bug, said once (tests/test_layering.py guards)
            if e.args and e.args[0] not in self._unknown:
                self._unknown.add(e.args[0])
                log.error("metric %s is not declared in triton/metrics.py _SPECS; it is not exported", e.args[0])
        except Exception:  # metrics must never fail a request
            log.debug("metric update failed", exc_info=True)

    def declare(self, name: str, **labels):
        """Create a metric up front so it is exported (as 0) before its first event."""
        self._safe(lambda: self.metric(name, **labels))

    def inc(self, name: str, value: float = 1.0, **labels):
        if value > 0:
            self._safe(lambda: self.metric(name, **labels).increment(float(value)))

    def set(self, name: str, value: float, **labels):
        self._safe(lambda: self.metric(name, **labels).set(float(value)))

    def observe(self, name: str, value: float, **labels):
        self._safe(lambda: self.metric(name, **labels).observe(float(value)))

    def close(self):
        """Release every metric, then its family, while the stub still takes the deletes: the last step of each
        model's finalize. Left to the interpreter's exit, they were deleted after the stub's shared memory was
        gone, and every stub with metrics died of SIGSEGV in Metric::SaveToSharedMemory on every stop (seen in
        the kernel log, 2026-12-08). Updates after close are dropped."""
        with self._op_lock:
            self.enabled = False
            with self._lock:  # metrics before their families (the stub enforces the order)
                self._metrics.clear()
                self._families.clear()


REGISTRY = Registry()


class BusyMeter:
    """Engine busy time -> utilization over a sliding window."""

    def __init__(self):
        self._busy = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float):
        with self._lock:
            self._busy += seconds

    def total(self) -> float:
        with self._lock:
            return self._busy

    def timed(self):
        meter = self

        class _T:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                meter.add(time.perf_counter() - self.t0)

        return _T()


class Poller:
    """Background refresh of sampled metrics every `interval_s`.

    sample() returns {"gauges": {(name, labels-tuple): value}, "counters": {(name, labels-tuple): total},
    "busy_seconds": float}; monotone counter totals are turned into increments here. engine_cpu: the process
    runs engines; its hetserve_engine_cpu_seconds_total{model=component} is exported (declared at 0).
    """

    def __init__(self, sample: Callable[[], dict], component: str, interval_s: Optional[float] = None,
                 registry: Registry = REGISTRY, engine_cpu: bool = False):
        self.sample = sample
        self.component = component
        self.engine_cpu = engine_cpu
        if engine_cpu:
            registry.declare("hetserve_engine_cpu_seconds_total", model=component)
        self.interval = interval_s or float(config.get("HETSERVE_METRICS_INTERVAL_S"))
        self.window = float(config.get("HETSERVE_UTILIZATION_WINDOW_S"))
        self.reg = registry
        self._last: Dict[tuple, float] = {}
        self._busy_hist: List[Tuple[float, float]] = []  # (t, busy_total)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{component}", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:
                log.debug("metrics poll failed", exc_info=True)

    def tick(self):
        s = self.sample() or {}
        for (name, labels), v in s.get("gauges", {}).items():
            self.reg.set(name, v, **dict(labels))
        counters = dict(s.get("counters", {}))
        if self.engine_cpu:
            counters[("hetserve_engine_cpu_seconds_total", (("model", self.component),))] = ENGINE_CPU.seconds()
        for key, total in counters.items():
            prev = self._last.get(key, 0.0)
            if total > prev:
                self.reg.inc(key[0], total - prev, **dict(key[1]))
            self._last[key] = max(prev, total)
        if "busy_seconds" in s:
            now = time.monotonic()
            self._busy_hist.append((now, float(s["busy_seconds"])))
            while len(self._busy_hist) > 2 and now - self._busy_hist[1][0] >= self.window:
                self._busy_hist.pop(0)
            (t0, b0), (t1, b1) = self._busy_hist[0], self._busy_hist[-1]
            if t1 > t0:
                self.reg.set("hetserve_utilization_ratio", min(1.0, max(0.0, (b1 - b0) / (t1 - t0))),
                             model=self.component)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)


def labels(**kw) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in kw.items()))


def gauges(pairs: Iterable[Tuple[str, dict, float]]) -> dict:
    return {(n, labels(**lab)): v for n, lab, v in pairs}


_REASON_KEYS = (("model hash", "hash_mismatch"), ("compat", "hash_mismatch"), ("crc", "checksum"),
                ("checksum", "checksum"), ("layout", "layout"), ("dtype", "dtype"), ("shape", "shape"),
                ("size", "size"), ("timed out", "timeout"), ("timeout", "timeout"), ("deadline", "timeout"),
                ("unavailable", "unavailable"), ("connect", "unavailable"), ("shm", "shm"),
                ("shared memory", "shm"))
FAILURE_REASONS = tuple(dict.fromkeys([r for _, r in _REASON_KEYS] + ["error"]))


def transfer_failure_reason(exc: Optional[BaseException]) -> str:
    """Short, bounded-cardinality reason label (one of FAILURE_REASONS) for a failed/refused KV transfer."""
    msg = str(exc or "").lower()
    for key, reason in _REASON_KEYS:
        if key in msg:
            return reason
    return "error"


def declare_transfer_failures(transports: Iterable[str], registry: Registry = REGISTRY):
    """Export every (transport, reason) failure counter at 0, so increase() sees the first failure."""
    for t in transports:
        for r in FAILURE_REASONS:
            registry.declare("hetserve_kv_transfer_failures_total", transport=t, reason=r)
