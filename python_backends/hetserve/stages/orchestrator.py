"""The orchestrator stage (what the `llm` model runs): pick a decode server, prefill (KV pushed there), stream
decode, migrate on decode failure.

Reliability (reliability.py): decode servers come from a health-checked pool and are picked by load; the
circuit breaker refuses requests at once while latency or queues are out of bounds; when a decode server fails
or stalls mid-stream the request moves to another one, which resumes from the KV snapshot or by recomputing
prompt + tokens so far, and the client keeps one uninterrupted stream. A prefill that reports transfer_ok=false
makes decode recompute at once (kv_sent=false) instead of waiting for KV that will not come.

KV-aware routing (router.py, when configured): the member is the one whose prefix cache holds most of the prompt
against its load, and a prompt it lacks only a short suffix of is prefilled there (no prefill hop, no KV moved):
the decode request then carries no output_ids and the first token comes from the decode server. On a miss of
the router's view the decode servers are asked first (lookup: another replica's router may have sent the history).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..errors import HetserveError, Overloaded, RequestError, kind_of_exception
from ..sampling import is_stop_token
from .router import PREFILL_PLACEMENT_METRIC, ROUTER_HIT_TOKENS_METRIC, ROUTER_LOOKUP_METRIC, PrefixRouter
from .types import (
    Breaker,
    DecodeClient,
    DecodeFailed,
    DecodeRequest,
    GenerateRequest,
    Metrics,
    NoMetrics,
    Pool,
    PrefillClient,
    PrefillJob,
    TokenSink,
)

log = logging.getLogger("hetserve.orchestrator")

# {reason, transport}: prefill reported transfer_ok=false, decode was told to recompute at once
TRANSFER_FAILED_METRIC = "hetserve_kv_transfer_not_ok_total"
# {kind}: requests that ended in an error (hetserve.errors kinds)
REQUEST_ERRORS_METRIC = "hetserve_request_errors_total"


@dataclass
class OrchestratorConfig:
    step_timeout_s: float = 30.0   # a decode server silent this long is treated as dead (migrate)
    max_migrations: int = 3        # moves per request before giving up
    max_choice_threads: int = 64   # threads decoding the extra choices of n > 1 requests, all requests together
    # a client that wants one final answer: decode sends its tokens at most this often (stages/decode.PacedReply)
    whole_answer_send_interval_s: float = 0.2


def internal_request_id(client_id: str) -> str:
    """A unique id for the hops of one request (KV transfer key, decode sequence), prefixed with the client's own
    id (sanitized, at most 64 characters) so one grep finds the request in every server's log."""
    safe = "".join(c for c in client_id[:64] if c.isalnum() or c in "._-")
    return f"{safe}-{uuid.uuid4().hex[:16]}" if safe else uuid.uuid4().hex


class _ChoiceGroup:
    """The choices of one request: their sinks, and the first failure (which cancels the rest)."""

    def __init__(self, sink: TokenSink):
        self._sink = sink
        self._sinks: Dict[int, TokenSink] = {}
        self._lock = threading.Lock()
        self.error: Optional[BaseException] = None

    def sink(self, i: int) -> TokenSink:
        with self._lock:
            s = self._sinks.get(i)
            if s is None:
                s = _GroupSink(self._sink.choice(i), self)
                self._sinks[i] = s
            return s

    def fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e

    def cancelled(self) -> bool:
        return self.error is not None or self._sink.cancelled()

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error


class _GroupSink:
    """A choice's sink that also stops when another choice of its request failed."""

    def __init__(self, sink: TokenSink, group: _ChoiceGroup):
        self._s, self._g = sink, group

    @property
    def finish_reason(self) -> Optional[str]:
        return self._s.finish_reason

    @finish_reason.setter
    def finish_reason(self, value: Optional[str]) -> None:
        self._s.finish_reason = value

    @property
    def streaming(self) -> bool:
        return self._s.streaming

    def push(self, token_ids, reason=None, logprobs=None) -> bool:
        return self._s.push(token_ids, reason, logprobs) and not self._g.cancelled()

    def finish(self, reason: str) -> None:
        self._s.finish(reason)

    def cancelled(self) -> bool:
        return self._g.cancelled()

    def prompt_logprobs(self, lps) -> None:
        self._s.prompt_logprobs(lps)

    def choice(self, i: int) -> TokenSink:
        return self._g.sink(i)


class Orchestrator:
    def __init__(self, prefill: PrefillClient, decode: DecodeClient, pool: Pool, breaker: Breaker,
                 eos_ids, config: Optional[OrchestratorConfig] = None, metrics: Optional[Metrics] = None,
                 router: Optional[PrefixRouter] = None,
                 lookup: Optional[Callable[[List[int]], Dict[str, int]]] = None):
        self.prefill, self.decode, self.pool, self.breaker = prefill, decode, pool, breaker
        self.router = router  # None: least-loaded member, every prompt prefilled on the prefill server
        # lookup(prompt) -> {decode url: leading prompt tokens it holds}, asked on the router's misses (bounded)
        self.lookup = lookup
        self.eos_ids = list(eos_ids)
        self.config = config or OrchestratorConfig()
        self.metrics = metrics or NoMetrics()
        # prompt tokens this orchestrator has at the prefill servers now (waiting or running): the router's measure
        # of the prefill side's backlog (a local prefill may stall decode streams up to that much)
        self._prefill_queued = 0
        self._queue_lock = threading.Lock()
        # choices 2..n of n > 1 requests decode on these threads (choice 1 on the request's own)
        self._choice_workers = concurrent.futures.ThreadPoolExecutor(self.config.max_choice_threads,
                                                                     thread_name_prefix="llm-choice")

    def run(self, req: GenerateRequest, sink: TokenSink, t0: Optional[float] = None) -> None:
        """Generate into `sink` until it is finished. Raises on failure (the adapter answers with the error,
        unless the sink already finished); the breaker and the pool lease are settled here either way.
        `t0` is when the request arrived (TTFT for the breaker)."""
        t0 = time.perf_counter() if t0 is None else t0
        lease: List[Optional[str]] = [None]  # the pool member in use
        probe = False
        try:
            self.breaker.allow()  # raises BreakerOpen -> UNAVAILABLE at once
            probe = True
            router = self.router
            costing = router.cost(router.hashes(req.prompt), len(req.prompt)) if router is not None else None
            if router is not None and costing is not None and self.lookup is not None \
                    and router.should_look_up(costing):
                self._look_up(router, costing, req.prompt)
            member = lease[0] = self.pool.pick(cost=costing)
            rid = internal_request_id(req.request_id)
            route = router.route(member, costing, self._prefill_queued) if router and costing else None
            if route is not None:
                self.metrics.inc(ROUTER_HIT_TOKENS_METRIC, route.hit_tokens)
            if route is not None and route.local and req.n == 1 and not req.prompt_logprobs:
                self.metrics.inc(PREFILL_PLACEMENT_METRIC, where="decode")

                def first_tokens() -> None:  # TTFT for the breaker, once the decode server's first token is here
                    nonlocal probe
                    if probe:
                        self.breaker.record(time.perf_counter() - t0)
                        probe = False
                dreq = DecodeRequest(rid, list(req.prompt), [], req.params, req.precision, kv_sent=False,
                                     send_interval_s=self._send_interval(sink))
                self._decode(sink, dreq, lease, on_first=first_tokens)
                return
            self.metrics.inc(PREFILL_PLACEMENT_METRIC, where="prefill")
            # the transport negotiated with this member (kv/transport); a fallback is counted + logged by the pool
            transport = self.pool.transport_for(member, req.transport)
            # the member's prefix cache holds the first hit_tokens: only the KV after them moves
            skip = route.whole_blocks if route is not None else 0
            queued = len(req.prompt) - skip
            with self._queue_lock:
                self._prefill_queued += queued
            try:
                res = self.prefill.prefill(PrefillJob(rid, list(req.prompt), req.params, member, transport,
                                                      req.kv_dtype, n=req.n, prompt_logprobs=req.prompt_logprobs,
                                                      kv_skip_tokens=skip))
            finally:
                with self._queue_lock:
                    self._prefill_queued -= queued
            self.breaker.record(time.perf_counter() - t0)
            probe = False
            if not res.transfer_ok:
                transport = res.transport_used or req.transport or "default"
                self.metrics.inc(TRANSFER_FAILED_METRIC, reason="transfer_failed", transport=transport)
                log.warning("request %s: prefill could not send the KV to %s over %s; decode recomputes it at "
                            "once", rid, member, transport)
            if res.prompt_logprobs is not None:
                sink.prompt_logprobs(res.prompt_logprobs)
            if req.n > 1:
                self._choices(req, sink, res, rid, lease)
                return
            first = res.first_token
            stop = is_stop_token(first, req.params, self.eos_ids)
            reason = "stop" if stop else ("length" if req.params.max_tokens == 1 else None)
            if not sink.push([first], reason, res.choice_logprobs(0)) or sink.cancelled():
                if res.transfer_ok:
                    self.decode.release(member, rid)  # no decode for it: free the KV pushed to decode
                return
            dreq = DecodeRequest(rid, list(req.prompt), [first], req.params, req.precision, kv_sent=res.transfer_ok,
                                 send_interval_s=self._send_interval(sink))
            self._decode(sink, dreq, lease)
        except Exception as e:
            from ..reliability import BreakerOpen

            self.metrics.inc(REQUEST_ERRORS_METRIC, kind=kind_of_exception(e))
            if isinstance(e, BreakerOpen):
                self.metrics.inc("hetserve_breaker_rejections_total")
            elif not isinstance(e, RequestError):
                self.breaker.record_failure(overloaded=isinstance(e, Overloaded))
                probe = False
            raise
        finally:
            if probe:
                self.breaker.release_probe()
            if lease[0] is not None:
                self.pool.release(lease[0])

    def _look_up(self, router: PrefixRouter, costing, prompt: List[int]) -> None:
        """Ask the decode servers what they hold of this prompt (a turn whose history another router sent)."""
        assert self.lookup is not None
        found = False
        for url, n in self.lookup(prompt).items():
            blocks = n // router.block
            found = found or blocks * router.block > router.hit_tokens(url, costing.hashes)
            router.learn(url, costing.hashes, blocks)
        self.metrics.inc(ROUTER_LOOKUP_METRIC, result="found" if found else "none")

    def _send_interval(self, sink: TokenSink) -> float:
        """How often decode may send tokens: each at once for a stream, paced for one final answer."""
        return 0.0 if sink.streaming else self.config.whole_answer_send_interval_s

    def _choices(self, req: GenerateRequest, sink: TokenSink, res, rid: str, lease: List[Optional[str]]) -> None:
        """n choices from one prefill: each pushes its own first token, the ones that go on decode on the member
        that received the KV (each forks it there, kv_key = rid, kv_shares = how many), concurrently, each
        migrating on its own. The first failure cancels the others and is raised."""
        member = lease[0]
        assert member is not None
        group = _ChoiceGroup(sink)
        going = []
        for i in range(req.n):
            first = res.choice_first(i)
            p = req.params.for_choice(i)
            reason = "stop" if is_stop_token(first, p, self.eos_ids) else ("length" if p.max_tokens == 1 else None)
            if group.sink(i).push([first], reason, res.choice_logprobs(i)):
                going.append((i, first, p))
        if not going or group.cancelled():
            if res.transfer_ok:
                self.decode.release(member, rid)
            return
        def run(i: int, first: int, p) -> None:
            own: List[Optional[str]] = [member]
            if i != going[0][0]:
                self.pool.hold(member)  # each choice holds its own lease (a migration moves it alone)
            try:
                self._decode(group.sink(i), DecodeRequest(f"{rid}.{i}", list(req.prompt), [first], p, req.precision,
                                                          kv_sent=res.transfer_ok, kv_key=rid,
                                                          kv_shares=len(going)), own)
            except BaseException as e:
                group.fail(e)
            finally:
                if i != going[0][0] and own[0] is not None:
                    self.pool.release(own[0])
        futures = [self._choice_workers.submit(run, *g) for g in going[1:]]
        own0 = lease  # the first going choice decodes on the request's own lease
        try:
            self._decode(group.sink(going[0][0]), DecodeRequest(
                f"{rid}.{going[0][0]}", list(req.prompt), [going[0][1]], going[0][2], req.precision,
                kv_sent=res.transfer_ok, kv_key=rid, kv_shares=len(going)), own0)
        except BaseException as e:
            group.fail(e)
        for f in futures:
            f.result()
        group.raise_first()

    def _decode(self, sink: TokenSink, dreq: DecodeRequest, lease: List[Optional[str]],
                on_first: Optional[Callable[[], None]] = None) -> None:
        """Stream from decode servers until the sequence ends; on failure migrate to another server with the
        tokens so far. lease[0] is the pool member in use (released by run()). on_first: called at the first
        tokens (the decode server sampled the first one: local prefill)."""
        tried: List[str] = []
        migrations = 0
        while True:
            url = lease[0]
            assert url is not None  # run() and the migration below always leave a member leased here
            ds = self.decode.open(url)
            cancel = False
            try:
                ds.start(dreq)
                for chunk in ds.responses(self.config.step_timeout_s):
                    if sink.cancelled():
                        cancel = True
                        return
                    if on_first is not None and chunk.token_ids:
                        on_first()
                        on_first = None
                    dreq.output_ids.extend(chunk.token_ids)
                    if self.router is not None and chunk.finish_reason in ("stop", "length"):
                        # the sequence ended on the server: it keeps prompt + answer (but the last token), and the
                        # router knows before the client sees the end (its next turn may follow at once)
                        self.router.routed(url, dreq.prompt + dreq.output_ids[:-1])
                    if not sink.push(chunk.token_ids, chunk.finish_reason, chunk.logprobs):
                        cancel = chunk.finish_reason is None or sink.finish_reason != chunk.finish_reason
                        return
                sink.finish("stop")
                return
            except HetserveError as e:
                if not e.migrate:  # its verdict stands (bad input), or nothing else would do better
                    raise
                cancel = True
                if isinstance(e, DecodeFailed):  # the server is gone or stalled (an engine error is not that)
                    self.pool.mark_down(url, str(e))
                    if self.router is not None:  # whatever it held is gone with it
                        self.router.forget(url)
                tried.append(url)
                migrations += 1
                if migrations > self.config.max_migrations:
                    raise
                self.pool.release(url)
                lease[0] = None
                try:
                    lease[0] = self.pool.pick(exclude=tried)
                except Exception:  # no other server: a dead one is "unavailable", anything else stays itself
                    if not isinstance(e, DecodeFailed):
                        raise e from None
                    raise
                dreq.kv_sent = False  # the transferred KV (if any) went to the old server: none will come
                log.warning("request %s: %s at %s (%s); resuming after %d tokens on %s", dreq.request_id, e,
                            url, e.where or type(e).__name__, len(dreq.output_ids), lease[0])
                self.metrics.inc("hetserve_migrations_total")
            finally:
                ds.close(cancel=cancel)
