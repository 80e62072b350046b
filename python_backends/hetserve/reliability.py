"""Control-plane reliability: the decode-server pool (health checks + load-aware routing) and the circuit breaker.

Both live in the orchestrator (`llm` on the prefill server) and are plain Python, so they are unit-testable.

DecodePool
  * members: HETSERVE_DECODE_URL (comma list) plus, when HETSERVE_DECODE_REGISTRY names a file, the URLs in it
    (one per line or a JSON list), plus every address HETSERVE_DECODE_DNS (host:port, comma list) resolves to (a
    Kubernetes headless Service: one record per ready pod); re-read at every health round, which is how
    autoscaling adds/removes members. A failed lookup keeps the last DNS answer; a name without records has none.
  * every `interval_s` (default 5 s): Triton server-ready + model-ready + a canary inference (one engine step on
    the decode server, with a deadline), in parallel across members. Failing the check marks a member down;
    passing it brings it back. A request that fails on a member also marks it down at once (passive check).
  * pick(): the healthy member with the fewest in-flight streams (round-robin among equals), skipping `exclude`.
  * KV transports: after a member's first passing check (and again after it was down: it may have restarted
    with another configuration) the pool negotiates the transports the pair can use (kv/transport/negotiate.py:
    kv_ingest op=caps, same host / same device / RDMA). transport_for(url, requested) returns the requested
    transport when negotiated, else the baseline (grpc) -- a fallback: on_fallback(requested, used, reason) for
    the metric, and one log line per member and transport.

CircuitBreaker
  closed -> open when the p99 of recent latencies (TTFT) exceeds the threshold (default 500 ms) over at least
  `min_samples` requests, or after `overload_trips` consecutive "queue full" refusals. While open every request is
  refused at once (UNAVAILABLE + reason + retry-after). After `open_s` it goes half-open and lets `probes`
  requests through: if they are fast it closes (window cleared), otherwise it re-opens.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import config
from .errors import Overloaded, Unavailable
from .kv.transport.registry import BASELINE as BASELINE_TRANSPORT

log = logging.getLogger("hetserve.reliability")

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half-open", OPEN: "open"}


class BreakerOpen(Overloaded):
    """Refused at once by the circuit breaker (kind overloaded: UNAVAILABLE / 503 + Retry-After)."""


class NoDecodeServer(Unavailable):
    """No healthy decode server (kind unavailable: UNAVAILABLE / 503)."""


class CircuitBreaker:
    def __init__(self, p99_threshold_s: float = 0.5, window_s: float = 30.0, min_samples: int = 20,
                 open_s: float = 5.0, probes: int = 1, overload_trips: int = 3,
                 clock: Callable[[], float] = time.monotonic, on_state: Optional[Callable[[int], None]] = None):
        self.threshold = p99_threshold_s
        self.window_s = window_s
        self.min_samples = min_samples
        self.open_s = open_s
        self.probes = probes
        self.overload_trips = overload_trips
        self.clock = clock
        self.on_state = on_state
        self.state = CLOSED
        self.reason = ""
        self._samples: Deque = collections.deque()  # (t, latency_s)
        self._over = 0  # samples in the window above the threshold
        self._opened_at = 0.0
        self._probes_left = 0
        self._overloads = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, **kw) -> "CircuitBreaker":
        return cls(p99_threshold_s=float(config.get("HETSERVE_BREAKER_P99_MS")) / 1e3,
                   window_s=float(config.get("HETSERVE_BREAKER_WINDOW_S")),
                   min_samples=int(config.get("HETSERVE_BREAKER_MIN_SAMPLES")),
                   open_s=float(config.get("HETSERVE_BREAKER_OPEN_S")),
                   overload_trips=int(config.get("HETSERVE_BREAKER_OVERLOAD_TRIPS")), **kw)

    def _set(self, state: int, reason: str = ""):
        if state != self.state:
            log.warning("circuit breaker %s -> %s %s", STATE_NAMES[self.state], STATE_NAMES[state], reason)
        self.state, self.reason = state, reason
        if state == OPEN:
            self._opened_at = self.clock()
        if self.on_state:
            try:
                self.on_state(state)
            except Exception:  # a metrics hook must not break the breaker
                log.warning("circuit breaker state callback failed", exc_info=True)

    def _expire(self) -> None:
        now = self.clock()
        while self._samples and now - self._samples[0][0] > self.window_s:
            if self._samples.popleft()[1] > self.threshold:
                self._over -= 1

    def p99(self) -> Optional[float]:
        self._expire()
        return self._window_p99() if len(self._samples) >= self.min_samples else None

    def _window_p99(self) -> float:
        return float(np.percentile([s for _, s in self._samples], 99))

    def _p99_over(self) -> Optional[float]:
        """p99() when it may exceed the threshold, else None. The p99 (numpy's linear interpolation between the
        sorted samples at ceil and floor of 0.99 (n - 1)) can only exceed it when the sample at the ceiling
        does, i.e. when at least n - ceil(0.99 (n - 1)) samples do: counted as samples come and go, so a healthy
        window costs no sort per request (it was ~7% of the llm stub's CPU at 130 requests/s)."""
        self._expire()
        n = len(self._samples)
        if n < self.min_samples or self._over < n - math.ceil(0.99 * (n - 1)):
            return None
        p = self._window_p99()
        return p if p > self.threshold else None

    def allow(self) -> None:
        """Raise BreakerOpen when the request must be refused now."""
        with self._lock:
            if self.state == OPEN:
                left = self.open_s - (self.clock() - self._opened_at)
                if left > 0:
                    raise BreakerOpen(f"circuit breaker open ({self.reason})", where="llm breaker",
                                      retry_after_s=max(left, 0.1))
                self._set(HALF_OPEN, "probing")
                self._probes_left = self.probes
            if self.state == HALF_OPEN:
                if self._probes_left <= 0:
                    raise BreakerOpen("circuit breaker half-open: a probe request is in flight", where="llm breaker")
                self._probes_left -= 1

    def record(self, latency_s: float) -> None:
        """A request got its first token after `latency_s`."""
        with self._lock:
            self._overloads = 0
            if self.state == HALF_OPEN:
                if latency_s <= self.threshold:
                    self._samples.clear()
                    self._over = 0
                    self._set(CLOSED, "probe succeeded")
                else:
                    self._set(OPEN, f"probe latency {latency_s * 1e3:.0f} ms > {self.threshold * 1e3:.0f} ms")
                return
            self._samples.append((self.clock(), latency_s))
            self._over += latency_s > self.threshold
            p = self._p99_over()
            if self.state == CLOSED and p is not None:
                self._set(OPEN, f"p99 latency {p * 1e3:.0f} ms > {self.threshold * 1e3:.0f} ms over the last "
                                f"{len(self._samples)} requests")

    def record_failure(self, overloaded: bool) -> None:
        """A request failed; `overloaded` when the decode side refused it because its queue was full."""
        with self._lock:
            if self.state == HALF_OPEN:
                self._set(OPEN, "probe failed")
                return
            if overloaded:
                self._overloads += 1
                if self.state == CLOSED and self._overloads >= self.overload_trips:
                    self._set(OPEN, f"decode queues full ({self._overloads} refusals in a row)")

    def release_probe(self) -> None:
        """A half-open probe ended without a latency sample or failure (e.g. client cancelled)."""
        with self._lock:
            if self.state == HALF_OPEN:
                self._probes_left = max(self._probes_left, 1)


@dataclass
class Member:
    url: str
    healthy: bool = True
    inflight: int = 0
    last_check: float = 0.0
    last_error: str = ""
    canary_ms: float = 0.0
    failures: int = 0
    transports: Tuple[str, ...] = ()  # negotiated KV transports; () = not negotiated (yet, or since it was down)
    transport_notes: Optional[Dict[str, str]] = None  # transport -> why this pair cannot use it
    negotiation_failures: int = 0  # in a row; a failed negotiation is retried with backoff, not every round
    negotiate_after: float = 0.0  # time.monotonic() before which a failed negotiation is not retried


def _read_registry(path: Optional[str]) -> List[str]:
    if not path or not os.path.exists(path):
        return []
    try:
        text = open(path).read().strip()
    except OSError:
        return []
    if not text:
        return []
    if text.startswith("["):
        try:
            return [str(u) for u in json.loads(text)]
        except ValueError:
            return []
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


Resolver = Callable[..., list]  # socket.getaddrinfo's signature; a stub in unit tests


def _resolve_all(names: Optional[str], resolver: Optional[Resolver] = None) -> Optional[List[str]]:
    """Every address behind `names` ("host:port", comma-separated): a Kubernetes headless Service has one A/AAAA
    record per *ready* decode pod, so the answer is the live membership. None when a lookup fails (the caller
    keeps what it had: a DNS hiccup must not empty the pool); an empty list when the name has no records left.
    """
    if not names:
        return []
    import socket

    resolver = resolver or socket.getaddrinfo
    out = set()
    for hostport in (n.strip() for n in names.split(",")):
        if not hostport:
            continue
        host, _, port = hostport.rpartition(":")
        host = host.strip("[]")
        try:
            infos = resolver(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                continue  # authoritative "no such name / no records": a headless Service with no ready pod
            log.warning("cannot resolve decode pool name %s: %s", hostport, e)
            return None
        except (OSError, ValueError) as e:
            log.warning("cannot resolve decode pool name %s: %s", hostport, e)
            return None
        for fam, *_, addr in infos:
            ip, p = addr[0], addr[1]
            if not isinstance(ip, str) or not isinstance(p, int):  # AF_INET/AF_INET6 only: (text, port, ...)
                continue
            if fam == socket.AF_INET:
                out.add(f"{ip}:{p}")
            elif fam == socket.AF_INET6:
                out.add(f"[{ip}]:{p}")
    return sorted(out)


def canary_check(url: str, timeout_s: float, op: Optional[Callable[..., Any]] = None) -> float:
    """Triton ready + decode model ready + one canary step on the decode engine (the model is decoupled, so
    over a gRPC stream); returns the canary round trip in ms. Raises on failure or after `timeout_s`.
    `op(url, "canary", timeout_s)` sends the canary (the llm's: GrpcDecodeClient.op, on its shared stream,
    never cancelled); without it, a stream of its own (client.stream_once, whose deadline cancels it)."""
    import tritonclient.grpc as grpcclient

    from .client import build_inputs, stream_once

    c = grpcclient.InferenceServerClient(url)
    try:
        if not c.is_server_ready(client_timeout=timeout_s):
            raise RuntimeError("server not ready")
        if not c.is_model_ready("decode", client_timeout=timeout_s):
            raise RuntimeError("model 'decode' not ready")
    finally:
        c.close()
    t0 = time.perf_counter()
    if op is None:
        def op(url, name, t):
            return stream_once(url, "decode", build_inputs(None, op=name), t, name)
    if op(url, "canary", timeout_s).as_numpy("token_ids") is None:
        raise RuntimeError("canary returned no token")
    return (time.perf_counter() - t0) * 1e3


NEGOTIATION_BACKOFF_MAX_S = 60.0


def _negotiate(url: str, timeout_s: float):
    from .kv.transport.negotiate import negotiate

    return negotiate(url, timeout_s)


class DecodePool:
    def __init__(self, urls: Sequence[str], registry: Optional[str] = None, dns: Optional[str] = None,
                 interval_s: float = 5.0, resolver: Optional[Resolver] = None,
                 timeout_s: float = 2.0, check: Callable[[str, float], float] = canary_check,
                 start: bool = True, on_change: Optional[Callable[[Dict[str, Member]], None]] = None,
                 negotiate: Optional[Callable[[str, float], Any]] = None, default_transport: str = "grpc",
                 on_fallback: Optional[Callable[[str, str, str], None]] = None):
        self.static = [u for u in urls if u]
        self.registry = registry
        self.dns = dns
        self.resolver = resolver
        self._dns_members: List[str] = []  # last good DNS answer, kept while lookups fail
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.check = check
        self.on_change = on_change
        self.negotiate = negotiate or _negotiate
        self.default_transport = default_transport
        self.on_fallback = on_fallback
        self._fallback_logged: set = set()  # (url, transport) already logged since the last negotiation
        self.members: Dict[str, Member] = {}
        self._lock = threading.Lock()
        self._rr = 0
        self._last_forced = -1e9
        self._force_lock = threading.Lock()
        self._stop = threading.Event()
        self._exec = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="health")
        self._sync_members()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="decode-health", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, **kw) -> "DecodePool":
        return cls(config.get("HETSERVE_DECODE_URL").split(","), registry=config.get("HETSERVE_DECODE_REGISTRY"),
                   dns=config.get("HETSERVE_DECODE_DNS"),
                   interval_s=float(config.get("HETSERVE_HEALTH_INTERVAL_S")),
                   timeout_s=float(config.get("HETSERVE_HEALTH_TIMEOUT_S")),
                   default_transport=config.get("HETSERVE_KV_TRANSPORT"), **kw)

    def _sync_members(self):
        """Membership = static URLs + registry file + DNS answer, re-read every health round (that is how the
        local autoscaler and a Kubernetes HPA add and remove decode servers). A member that leaves keeps no
        state here; streams already on it finish or migrate through the usual failure path."""
        if self.dns:
            found = _resolve_all(self.dns, self.resolver)
            if found is not None:
                if found != self._dns_members:
                    log.info("decode pool %s resolves to %s", self.dns, ", ".join(found) or "nothing")
                self._dns_members = found
        urls = list(dict.fromkeys(self.static + _read_registry(self.registry) + self._dns_members))
        with self._lock:
            for u in urls:
                self.members.setdefault(u, Member(u))
            for u in [u for u in self.members if u not in urls]:
                del self.members[u]

    def _run(self):
        while not self._stop.is_set():
            try:
                self.check_all()
            except Exception:
                log.exception("health round failed")
            self._stop.wait(self.interval_s)

    def check_all(self) -> Dict[str, Member]:
        self._sync_members()
        with self._lock:
            urls = list(self.members)
        futs = {u: self._exec.submit(self._check_member, u) for u in urls}
        for u, f in futs.items():
            nego = None
            try:
                ms, nego = f.result(timeout=self.timeout_s * 4 + 1)
                ok, err = True, ""
            except Exception as e:  # includes a hung server (deadline exceeded)
                ms, ok, err = 0.0, False, f"{type(e).__name__}: {e}"[:300]
            with self._lock:
                m = self.members.get(u)
                if m is None:
                    continue
                if m.healthy != ok:
                    log.warning("decode server %s is %s %s", u, "healthy" if ok else "DOWN", err)
                m.healthy, m.last_error, m.canary_ms, m.last_check = ok, err, ms, time.time()
                m.failures = 0 if ok else m.failures + 1
                if not ok:
                    m.transports, m.transport_notes = (), None  # renegotiate when it is back
                    m.negotiation_failures, m.negotiate_after = 0, 0.0
                elif nego is not None:
                    m.transports, m.transport_notes = nego
                    self._fallback_logged = {k for k in self._fallback_logged if k[0] != u}
                    if "*" in nego[1]:
                        # each retry costs up to timeout_s of a health worker: back off, capped
                        m.negotiation_failures += 1
                        backoff = min(self.interval_s * 2 ** min(m.negotiation_failures - 1, 10),
                                      NEGOTIATION_BACKOFF_MAX_S)
                        m.negotiate_after = time.monotonic() + backoff
                    else:
                        m.negotiation_failures, m.negotiate_after = 0, 0.0
        snap = self.snapshot()
        if self.on_change:  # every round: membership may have changed through the registry
            self.on_change(snap)
        return snap

    def _check_member(self, url: str):
        """Health check, then (first time, or after being down) the transport negotiation: (canary ms, None or
        (transports, notes)). A negotiation that fails leaves the member healthy with the baseline only, and is
        tried again after a backoff (interval_s doubling, at most NEGOTIATION_BACKOFF_MAX_S)."""
        ms = self.check(url, self.timeout_s)
        with self._lock:
            m = self.members.get(url)
            # "*" = the last negotiation failed (e.g. kv_ingest not loaded yet): grpc meanwhile, ask again later
            failed = m is not None and "*" in (m.transport_notes or {})
            known = m is not None and bool(m.transports) and not failed
            waiting = failed and m is not None and time.monotonic() < m.negotiate_after
            failures = m.negotiation_failures if m is not None else 0
        if known or waiting:
            return ms, None
        try:
            n = self.negotiate(url, self.timeout_s)
            result = (tuple(n.transports) or (BASELINE_TRANSPORT,), dict(n.reasons))
        except Exception as e:
            why = f"transport negotiation failed ({type(e).__name__}: {e})"[:300]
            # warn on the first failure only; the retries (with backoff) would repeat it every round
            (log.warning if failures == 0 else log.debug)(
                "decode server %s: %s; using %s only", url, why, BASELINE_TRANSPORT)
            result = ((BASELINE_TRANSPORT,), {"*": why})
        log.info("decode server %s: KV transports %s", url, ", ".join(result[0]))
        return ms, result

    def transport_for(self, url: str, requested: Optional[str]) -> str:
        """The KV transport for a request to `url`: the requested one (or the default) when negotiated with that
        member, else the baseline, counted through on_fallback and logged once per member and transport. An
        unknown name is passed through for prefill to refuse with the list of names."""
        from .kv.transport import NAMES

        want = requested or self.default_transport
        if want == BASELINE_TRANSPORT or want not in NAMES:
            return want
        with self._lock:
            m = self.members.get(url)
            ok = m is not None and want in m.transports
            notes = (m.transport_notes or {}) if m is not None else {}
            negotiated = m is not None and bool(m.transports)
        if ok:
            return want
        reason = "peer_unsupported" if negotiated else "not_negotiated"
        if self.on_fallback is not None:
            self.on_fallback(want, BASELINE_TRANSPORT, reason)
        if (url, want) not in self._fallback_logged:
            self._fallback_logged.add((url, want))
            log.warning("KV transport %s is not usable with decode server %s (%s); its transfers go over %s "
                        "(counted in hetserve_kv_transport_fallbacks_total)", want, url,
                        notes.get(want) or notes.get("*") or reason, BASELINE_TRANSPORT)
        return BASELINE_TRANSPORT

    def mark_down(self, url: str, why: str):
        with self._lock:
            m = self.members.get(url)
            if m is not None and m.healthy:
                log.warning("decode server %s marked DOWN: %s", url, why)
                m.healthy, m.last_error = False, why[:300]
                m.failures += 1
                m.transports, m.transport_notes = (), None
        if self.on_change:
            self.on_change(self.snapshot())

    def _any_healthy(self, exclude: Sequence[str]) -> bool:
        with self._lock:
            return any(m.healthy and m.url not in exclude for m in self.members.values())

    def pick(self, exclude: Sequence[str] = (), cost: Optional[Callable[[str, int], float]] = None) -> str:
        """Least-loaded healthy member, or with `cost` (url, streams in flight -> cost; the KV-aware router's) the
        cheapest; ties go round robin. When none is healthy, re-check at once (at most once a second) before
        giving up, so start-up races and a pool that was marked down passively recover without waiting 5 s."""
        if not self._any_healthy(exclude):
            with self._force_lock:  # concurrent pickers wait for one re-check instead of failing
                if not self._any_healthy(exclude) and time.monotonic() - self._last_forced > 1.0:
                    self.check_all()
                    self._last_forced = time.monotonic()
        with self._lock:
            cands = [m for m in self.members.values() if m.healthy and m.url not in exclude]
            if not cands:
                downs = "; ".join(f"{m.url}: {m.last_error or 'excluded'}" for m in self.members.values())
                raise NoDecodeServer(f"no healthy decode server ({downs or 'none configured'})")
            costs = [cost(m.url, m.inflight) if cost is not None else m.inflight for m in cands]
            low = min(costs)
            best = [m for m, c in zip(cands, costs) if c == low]
            m = best[self._rr % len(best)]
            self._rr += 1
            m.inflight += 1
            return m.url

    def hold(self, url: str) -> None:
        """One more lease on `url` (a choice of an n > 1 request decodes where its KV went)."""
        with self._lock:
            m = self.members.get(url)
            if m is not None:
                m.inflight += 1

    def release(self, url: str):
        with self._lock:
            m = self.members.get(url)
            if m is not None and m.inflight > 0:
                m.inflight -= 1

    def snapshot(self) -> Dict[str, Member]:
        with self._lock:
            return {u: Member(**vars(m)) for u, m in self.members.items()}

    def close(self):
        self._stop.set()
        self._exec.shutdown(wait=False, cancel_futures=True)
