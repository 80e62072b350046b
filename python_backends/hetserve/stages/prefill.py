"""The prefill server's request logic, without Triton: check a prefill call, queue it for the batcher
(prefill_batch.py), and once its prompt has KV sample the first token, push the KV to the decode member over
the requested transport and answer through the call's reply.

Lifecycle of one call: submit() refuses bad input at once (RequestError) and a full queue (Overloaded, from the
batcher); otherwise exactly one of reply.done(PrefillOutcome) or reply.error(exc) follows, from the batcher
thread or a send thread. A failed KV transfer is an outcome (transfer_ok=False), not an error: the decode server
then recomputes the prompt, and the orchestrator counts it.

triton/prefill.py converts tensors <-> PrefillCall / PrefillOutcome and owns who may name a decode server.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..bounded import BoundedExecutor
from ..engines.feeds import causal_mask
from ..errors import RequestError
from ..kv import wire
from ..kv.transport import NAMES as TRANSPORTS
from ..kv.transport import TransferTimeout, TransportUnavailable, spec
from ..sampling import MAX_CHOICES, MatcherFactory, SamplingParams, TokenLogprobs, TokenSampler, token_logprobs
from .prefill_batch import BatchConfig, PrefillBatcher

log = logging.getLogger("hetserve.prefill")
MAX_PROMPT_LOGPROB_TOKENS = 8192  # prompt logprobs cost a second forward over the prompt: bounded


def prompt_logprobs(scorer, ids: Sequence[int], n_top: int, chunk: int = 256) -> TokenLogprobs:
    """Logprobs of prompt tokens 1.. given the ones before (what `echo` + `logprobs` return; token 0 has none),
    from `scorer` (engines.runtime.Engine opened with score_view: every position's logits), chunk by chunk over
    the growing past so the logits held are [chunk, vocab], never [prompt, vocab]."""
    out = TokenLogprobs()
    pk = pv = scorer.empty_past(1)
    for s in range(0, len(ids) - 1, chunk):
        e = min(s + chunk, len(ids) - 1)
        T, P = e - s, int(pk.shape[3])
        lo, k, v = scorer.score(np.asarray([ids[s:e]]), np.arange(P, P + T)[None], causal_mask([P], [T], P, T),
                                pk, pv, np.arange(T))
        for j in range(T):
            out.extend(token_logprobs(lo[j], int(ids[s + j + 1]), n_top))
        pk, pv = np.concatenate([pk, k], axis=3), np.concatenate([pv, v], axis=3)
    return out


@dataclass
class PrefillCall:
    """One request to the prefill model, typed; None fields take the server's defaults."""
    prompt: List[int]
    params: SamplingParams
    request_id: str
    transport: Optional[str] = None
    kv_dtype: Optional[str] = None
    decode_url: Optional[str] = None  # who may set it is the binding's business (orchestrator token / admin key)
    skip_transfer: bool = False
    use_prefix: bool = True
    n: int = 1  # choices: one first token each, sampled from the one prefill (the KV is sent once)
    prompt_logprobs: bool = False  # also the logprobs of the prompt's tokens (echo + logprobs)
    kv_skip_tokens: int = 0  # the decode server holds these leading tokens' KV: send the rest only


@dataclass
class PrefillOutcome:
    first_token: int
    prompt_len: int
    kv_bytes: int
    prefill_ms: float        # engine time of the forwards this prompt took part in (shared by the batch)
    transfer_ms: float
    transfer_ok: bool        # false: the KV did not reach decode, which recomputes it
    prefix_hit_tokens: int   # prompt tokens whose KV came from the prefix cache
    transport_used: str      # the requested one, grpc after a counted fallback, "none" when skipped
    first_tokens: List[int] = field(default_factory=list)  # one per choice (first_token is [0])
    first_logprobs: List[TokenLogprobs] = field(default_factory=list)  # per choice, when the request asks
    prompt_logprobs: Optional[TokenLogprobs] = None  # of prompt tokens 1.., when asked


class PrefillReply(Protocol):
    def done(self, outcome: PrefillOutcome) -> None: ...

    def error(self, exc: BaseException) -> None: ...


class TransferMetrics(Protocol):  # triton.metrics.Registry
    def inc(self, name: str, value: float = 1.0, **labels) -> None: ...

    def observe(self, name: str, value: float, **labels) -> None: ...

    def set(self, name: str, value: float, **labels) -> None: ...


class Sender(Protocol):  # kv.transport.KVSender
    def send(self, url: str, transport: str, request_id: str, hdr, payload, timeout_s: float = 30.0) -> dict: ...

    def close(self) -> None: ...


@dataclass
class PrefillDefaults:
    decode_url: str
    transport: str
    kv_dtype: str


@dataclass
class _Queued:
    """A checked call waiting in the batcher (PrefillJob.handle)."""
    call: PrefillCall
    reply: PrefillReply
    transport: str
    kv_dtype: str
    url: str


class PrefillStage:
    """send_threads: threads that encode + send each finished prompt's KV and answer it. 0: the batcher thread
    does it inline (tests that drive step() themselves). Off the batcher thread, the next forward starts at once:
    inline, 11 prompts finishing together held the engine ~10 ms each (wire encode + the round trip to decode's
    kv_ingest, which waits for a core busy with decode steps) before the next forward could start. Sends run
    concurrently only over transports that allow it (TransportSender.concurrent_sends)."""

    def __init__(self, engine, sender: Sender, defaults: PrefillDefaults, batch: BatchConfig,
                 metrics: TransferMetrics, prefix=None, on_forward: Optional[Callable[[Any, float], None]] = None,
                 classify_failure: Callable[[BaseException], str] = lambda e: "refused", start: bool = True,
                 send_threads: int = 0, matcher_factory: Optional[MatcherFactory] = None,
                 scorer: Optional[Callable[[], Any]] = None):
        self.engine, self.sender, self.defaults, self.metrics = engine, sender, defaults, metrics
        self.matcher_factory = matcher_factory  # structured output (hetserve.structured); None: refused
        self.scorer = scorer  # () -> an engine with every position's logits (prompt logprobs); None: refused
        self.classify_failure = classify_failure  # exception -> the `reason` label of a failed transfer
        self._unavailable: Dict[str, str] = {}  # transport -> why it cannot run here ('' = it can), asked once
        # bounded like the batcher: at most max_queue finished prompts wait for their send
        self._senders = BoundedExecutor(send_threads, batch.max_queue, "prefill-send") if send_threads else None
        # start=False: the caller drives self.batcher.step() (unit tests)
        self.batcher = PrefillBatcher(engine, batch, self._done, self._fail, prefix=prefix, on_forward=on_forward,
                                      start=start)

    def unavailable_reason(self, transport: str) -> str:
        why = self._unavailable.get(transport)
        if why is None:
            why = self._unavailable[transport] = spec(transport).available()
        return why

    def submit(self, call: PrefillCall, reply: PrefillReply) -> None:
        """Queue `call`; raises RequestError (bad input) or Overloaded (queue full) instead of replying."""
        transport = call.transport or self.defaults.transport
        if transport not in TRANSPORTS:
            raise RequestError(f"unknown transport {transport!r}; use one of {list(TRANSPORTS)}")
        why = self.unavailable_reason(transport)
        if why:
            raise RequestError(f"KV transport {transport!r} cannot run on this prefill server: {why}")
        call.params.check_vocab(self.engine.config.vocab_size)
        if call.params.guide_type and self.matcher_factory is None:
            raise RequestError("structured output (guided decoding) is not available on this prefill server")
        if call.prompt_logprobs and self.scorer is None:
            raise RequestError("prompt logprobs are not available on this prefill server")
        if call.prompt_logprobs and len(call.prompt) > MAX_PROMPT_LOGPROB_TOKENS:
            raise RequestError(f"prompt logprobs are served for prompts of up to {MAX_PROMPT_LOGPROB_TOKENS} tokens, "
                               f"this one has {len(call.prompt)}")
        if not 1 <= call.n <= MAX_CHOICES:
            raise RequestError(f"num_return_sequences must be in [1, {MAX_CHOICES}], got {call.n}")
        if not 0 <= call.kv_skip_tokens < len(call.prompt):
            raise RequestError(f"kv_skip_tokens must be in [0, {len(call.prompt) - 1}] (the prompt's length - 1), "
                               f"got {call.kv_skip_tokens}")
        kv_dtype = call.kv_dtype or self.defaults.kv_dtype
        if kv_dtype not in wire.DTYPES:
            raise RequestError(f"unknown kv_dtype {kv_dtype!r}; use one of {sorted(wire.DTYPES)}")
        queued = _Queued(call, reply, transport, kv_dtype, call.decode_url or self.defaults.decode_url)
        self.batcher.submit(call.prompt, queued, use_prefix=call.use_prefix)

    def record_transfer(self, transport: str, info: Optional[dict], exc: Optional[BaseException] = None) -> None:
        if exc is not None:
            reason = "timeout" if isinstance(exc, TransferTimeout) else \
                "unavailable" if isinstance(exc, TransportUnavailable) else self.classify_failure(exc)
            self.metrics.inc("hetserve_kv_transfer_failures_total", transport=transport, reason=reason)
            return
        assert info is not None  # a transfer that did not raise reports what it sent
        used = info["transport"]  # the one used (grpc after a counted fallback)
        self.metrics.inc("hetserve_kv_transfer_bytes_total", info["bytes"], transport=used)
        self.metrics.observe("hetserve_kv_transfer_seconds", info["seconds"], transport=used)
        if info["seconds"] > 0:
            self.metrics.set("hetserve_kv_transfer_bandwidth_bytes_per_second", info["bytes"] / info["seconds"],
                             transport=used)

    def _done(self, job) -> None:
        """Batcher thread: the whole prompt has KV; finish it here or hand it to a send thread."""
        if self._senders is None:
            self._finish(job)
            return
        try:
            self._senders.submit(self._finish_or_fail, job)
        except Exception as e:  # Overloaded (bounded queue) or shut down: answer now, never leave it hanging
            self._fail(job, e)

    def _finish_or_fail(self, job) -> None:
        try:
            self._finish(job)
        except Exception as e:  # _finish answers transfer failures itself; anything else is answered here
            log.exception("request %s: finishing the prefill failed", job.handle.call.request_id)
            self._fail(job, e)

    def _finish(self, job) -> None:
        """The whole prompt has KV. Sample the first token, push the KV to decode, answer."""
        q: _Queued = job.handle
        firsts, lps = self.first_tokens(q.call, job.logits)
        plp = (prompt_logprobs(self.scorer(), q.call.prompt, q.call.params.top_logprobs)
               if q.call.prompt_logprobs and self.scorer is not None else None)
        t1 = time.perf_counter()
        info: Dict[str, Any] = {"transport": "none", "bytes": 0, "seconds": 0.0}
        ok = True
        if not q.call.skip_transfer:
            s = q.call.kv_skip_tokens  # the decode server's prefix cache holds those: only the rest moves
            hdr, payload = wire.encode(job.k[:, :, s:], job.v[:, :, s:], self.engine.compat_hash, q.kv_dtype,
                                       start=s)
            try:
                info = self.sender.send(q.url, q.transport, q.call.request_id, hdr, payload)
                self.record_transfer(q.transport, info)
            except Exception as e:
                log.warning("request %s: %s", q.call.request_id, e)
                self.record_transfer(q.transport, None, e)
                ok = False
                info = {"transport": q.transport, "bytes": 0, "seconds": time.perf_counter() - t1}
        q.reply.done(PrefillOutcome(firsts[0], len(job.ids), int(info["bytes"]), job.compute_s * 1e3,
                                    info["seconds"] * 1e3, ok, int(job.hit), str(info["transport"]), firsts, lps,
                                    plp))

    def first_tokens(self, call: PrefillCall, logits) -> Tuple[List[int], List[TokenLogprobs]]:
        """The first token of each choice (its own random stream, penalties over the prompt, grammar) and, when
        asked, its logprobs."""
        firsts, lps = [], []
        for i in range(call.n):
            p = call.params.for_choice(i) if i else call.params
            matcher = self.matcher_factory(p, ()) if p.guide_type and self.matcher_factory else None
            tok, lp = TokenSampler(p, call.prompt, (), matcher).next(logits, 0)
            firsts.append(int(tok))
            if lp is not None:
                lps.append(lp)
        return firsts, lps

    def _fail(self, job, exc) -> None:
        job.handle.reply.error(exc)

    def close(self) -> None:
        self.batcher.close()
        if self._senders is not None:  # finish the sends under way (each has a timeout), then stop
            self._senders.shutdown(wait=True)
        self.sender.close()
