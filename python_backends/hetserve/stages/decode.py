"""The decode stage (what the `decode` model runs): op dispatch, the KV rendezvous and admission into the
continuous-batching scheduler.

op=generate : join the running batch; stream token ids. The KV normally arrives first (op=ingest, straight
              from the prefill server or through kv_ingest) and waits in PendingKV; when it has not come within
              the receive timeout, or the orchestrator said it will not come (kv_sent=false), or the request
              resumes after a migration, the KV is restored from a snapshot and/or recomputed from prompt +
              tokens so far. Without output_ids (and kv_sent=false) the prompt is prefilled here and the first
              token sampled here: the router's conditional disaggregation (stages/router.py), for a prompt whose
              uncached suffix is short. Recomputes start from the longest prefix in this server's prefix cache,
              which holds the KV of the sequences that ended here (a conversation's history).
op=ingest   : verify and store a transferred KV under request_id (kv_ingest, which verified it, proves so).
op=release  : the orchestrator will not decode this request: drop its pending KV.
op=canary   : health check, one real engine step (the orchestrator's pool).  op=stats: counters (autoscaler).
op=prefix   : the prefix cache's block hashes, most recent first (what the orchestrator's router reads); with
              input_ids, only how many leading tokens of them it holds (the router's lookup on a miss).
`hetserve doctor`'s info and verify are not ops of the model: admin_ops() hands them to the admin side channel
(admin_channel.py), so the data-plane schema carries no operator arguments.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .. import errors, schema
from ..diagnostics import PROBE_PREFIX
from ..errors import INTERNAL, Overloaded, RequestError, kind_of_exception
from ..kv import wire
from ..sampling import MAX_CHOICES, TokenLogprobs, is_stop_token
from ..scheduler import Sequence
from .types import DecodeCall, Metrics, NoMetrics, Reply

log = logging.getLogger("hetserve.decode")


def refused_kv(request_id: str, exc: BaseException, count: Callable[[BaseException], None]) -> RequestError:
    """The client's error for a KV refused on ingest (here or in kv_ingest), after count(exc) records it as a
    failed transfer, unless it was a link probe (diagnostics.PROBE_PREFIX: a deliberate `hetserve doctor` test)."""
    if not request_id.startswith(PROBE_PREFIX):
        count(exc)
    return RequestError(f"KV refused for request {request_id}: {exc}")

PENDING_TTL_S = 120.0
# {transport, reason}: KV refused here (triton/metrics.py; kv_ingest counts the ones it refuses)
TRANSFER_FAILURES_METRIC = "hetserve_kv_transfer_failures_total"
OPS = ("generate", "cancel", "ingest", "release", "canary", "stats", "prefix")
ADMIN_OPS = ("info", "verify")  # admin side channel only (DecodeStage.admin_ops)
RECOMPUTE_REASONS = ("timeout", "mismatch", "resume", "transfer_failed", "local_prefill", "prefix_evicted")
# the most block hashes one op=prefix answer carries (16 bytes each, hex in JSON: ~140 KiB)
MAX_PUBLISHED_BLOCKS = 4096
# {}: prompt + history tokens whose KV a recompute / local prefill took from this server's prefix cache
PREFIX_HIT_METRIC = "hetserve_decode_prefix_hit_tokens_total"
# {}: tokens computed by local prefill and recompute on this server
LOCAL_PREFILL_TOKENS_METRIC = "hetserve_decode_prefill_tokens_total"


class TakenKV(NamedTuple):
    """Transferred KV [L,KVH,T,D] of the prompt tokens at positions start.. (start > 0: the sender left out the
    ones this server's prefix cache holds)."""
    k: np.ndarray
    v: np.ndarray
    start: int = 0


class PendingKV:
    """KV that arrived before its generate request (the normal order), keyed by request id. Bounded in entries
    and bytes (HETSERVE_PENDING_KV_MAX / HETSERVE_PENDING_KV_MB): past either, expired entries go first, then
    the transfer is refused (Overloaded) and the generate recomputes; entries expire after `ttl_s`."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 1 << 30, ttl_s: float = PENDING_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._d: Dict[str, Tuple[np.ndarray, np.ndarray, float, int]] = {}  # k, v, arrived, start
        self._shares: Dict[str, int] = {}  # forked KV (choices of n): takes left after this one
        self._cv = threading.Condition()
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self.nbytes = 0

    @classmethod
    def from_env(cls) -> "PendingKV":
        from .. import config

        return cls(config.get("HETSERVE_PENDING_KV_MAX"), int(config.get("HETSERVE_PENDING_KV_MB") * (1 << 20)))

    def _drop(self, rid) -> TakenKV:
        k, v, _, start = self._d.pop(rid)
        self._shares.pop(rid, None)
        self.nbytes -= k.nbytes + v.nbytes
        return TakenKV(k, v, start)

    def put(self, rid, k, v, start: int = 0):
        size = k.nbytes + v.nbytes
        with self._cv:
            now = self.clock()
            for old in [x for x, (_, _, t, _) in self._d.items() if now - t > self.ttl_s]:
                self._drop(old)
            if rid in self._d:
                self._drop(rid)
            if len(self._d) >= self.max_entries or self.nbytes + size > self.max_bytes:
                raise Overloaded(f"pending KV full ({len(self._d)} transfers, {self.nbytes / 2**20:.0f} MiB of "
                                 f"{self.max_bytes / 2**20:.0f} MiB) waiting for their generate requests",
                                 where="decode pending KV")
            self._d[rid] = (k, v, now, start)
            self.nbytes += size
            self._cv.notify_all()

    def take(self, rid, timeout_s: float, shares: int = 1) -> Optional[TakenKV]:
        """The KV for `rid`, waiting up to `timeout_s` for it to arrive; None when it does not. With shares > 1
        (the choices of one request fork one transfer) the same arrays go to `shares` takers, the entry to the
        last (or the TTL)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while rid not in self._d:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            left_after = self._shares.get(rid, shares) - 1
            if left_after <= 0:
                return self._drop(rid)
            self._shares[rid] = left_after
            k, v, _, start = self._d[rid]
            return TakenKV(k, v, start)

    def __len__(self):
        return len(self._d)


def _prefill_on(eng, ids, past_k, past_v):
    """eng.prefill of `ids` after the KV past_k/past_v (None: from the start): logits of ids[-1] and the KV of
    past + ids."""
    if past_k is None:
        return eng.prefill(ids)
    logits, k, v = eng.prefill(ids, past_k=past_k, past_v=past_v)
    return logits, np.concatenate([past_k, k], axis=2), np.concatenate([past_v, v], axis=2)


def call_from_tensors(t: schema.Tensors) -> DecodeCall:
    """The decode model's inputs (hetserve.schema, model "decode") -> DecodeCall."""
    op = schema.scalar(t, "op", "generate", str)
    raw = t.get("kv_header")
    return DecodeCall(
        op=op, request_id=schema.scalar(t, "request_id", None, str) or None,
        prompt=schema.int_list(t, "input_ids"), output_ids=schema.int_list(t, "output_ids"),
        params=schema.sampling_params(t) if op == "generate" else None,
        precision=schema.scalar(t, "precision", None, str) or None,
        kv_sent=bool(schema.scalar(t, "kv_sent", schema.INPUTS["kv_sent"].default)),
        kv_key=schema.scalar(t, "kv_key", None, str) or None,
        kv_shares=schema.scalar(t, "kv_shares", schema.INPUTS["kv_shares"].default, int),
        send_interval_s=schema.scalar(t, "send_interval_ms", 0, int) / 1e3,
        kv_header=None if raw is None or raw.size == 0 else bytes(raw.reshape(-1)[0]),
        kv_payload=t.get("kv_payload"), ingest_token=schema.scalar(t, "ingest_token", "", str) or "")


class PacedReply:
    """A Reply that answers no more often than every `interval_s` (the request's send_interval_ms): tokens
    gather here between sends and go out with the next send, the final one at once; the scheduler's per-token
    cancellation check reaches the adapter at the same pace (the adapter still asks right before every send, the
    check Triton 2.51's cancellation race needs, docs/reliability.md). For a client that wants one final answer
    this turns ~2 IPC round trips per token in the decode stub (send + is_cancelled), one gRPC message and the
    orchestrator's per-message work into a few per request. A migrated stream resumes after the tokens sent,
    so up to one interval of tokens is generated again, identically (sampling is keyed by seed and step)."""

    def __init__(self, inner: Reply, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.inner, self.interval_s, self.clock = inner, interval_s, clock
        self._ids: list = []
        self._logprobs: Optional[TokenLogprobs] = None
        self._sent_at = self._asked_at = clock()
        self._cancelled = False
        self._lock = threading.Lock()  # the scheduler's thread; error() may come from an admission thread

    def _hold(self, token_ids, logprobs) -> None:
        self._ids.extend(token_ids)
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = TokenLogprobs()
            self._logprobs.extend(logprobs)

    def _take(self):
        ids, lps = self._ids, self._logprobs
        self._ids, self._logprobs = [], None
        return ids, lps

    def tokens(self, token_ids, finish_reason=None, final=False, logprobs=None) -> None:
        with self._lock:
            self._hold(token_ids, logprobs)
            now = self.clock()
            if not final and now - self._sent_at < self.interval_s:
                return
            ids, lps = self._take()
            self._sent_at = now
        self.inner.tokens(ids, finish_reason, final, lps)

    def json(self, obj: dict) -> None:
        self.inner.json(obj)

    def error(self, exc: BaseException) -> None:
        with self._lock:  # tokens held back go first: a migration resumes after them
            ids, lps = self._take()
        if ids:
            self.inner.tokens(ids, None, False, lps)
        self.inner.error(exc)

    def cancelled(self) -> bool:
        now = self.clock()
        if self._cancelled or now - self._asked_at < self.interval_s:
            return self._cancelled
        self._asked_at = now
        self._cancelled = bool(self.inner.cancelled())
        return self._cancelled


class LiveReply:
    """The Reply of a generate this server is working on, cancellable by request id (op=cancel): a client whose
    requests share one gRPC stream (stages/grpc_decode.SharedStream) cannot cancel one of them through Triton,
    which cancels whole streams. Leaves `live` at its final response or error."""

    def __init__(self, inner: Reply, request_id: str, live: "LiveGenerates"):
        self.inner, self.request_id, self.live = inner, request_id, live
        self.cancel_asked = False

    def tokens(self, token_ids, finish_reason=None, final=False, logprobs=None) -> None:
        if final:
            self.live.remove(self)
        self.inner.tokens(token_ids, finish_reason, final, logprobs)

    def json(self, obj: dict) -> None:
        self.inner.json(obj)

    def error(self, exc: BaseException) -> None:
        self.live.remove(self)
        self.inner.error(exc)

    def cancelled(self) -> bool:
        return self.cancel_asked or bool(self.inner.cancelled())


class LiveGenerates:
    """Request id -> the LiveReplies of the generates in progress under it (a handful: ids are unique per
    request; bounded by the scheduler's queue and batch, as every entry is a sequence it holds)."""

    def __init__(self):
        self._by_id: Dict[str, List[LiveReply]] = {}
        self._lock = threading.Lock()

    def add(self, inner: Reply, request_id: str) -> LiveReply:
        r = LiveReply(inner, request_id, self)
        with self._lock:
            self._by_id.setdefault(request_id, []).append(r)
        return r

    def remove(self, r: LiveReply) -> None:
        with self._lock:
            rs = self._by_id.get(r.request_id)
            if rs is not None and r in rs:
                rs.remove(r)
                if not rs:
                    del self._by_id[r.request_id]

    def cancel(self, request_id: str) -> int:
        with self._lock:
            rs = list(self._by_id.get(request_id, ()))
        for r in rs:
            r.cancel_asked = True
        return len(rs)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_id.values())


@dataclass
class DecodeConfig:
    kv_timeout_s: float = 0.1      # HETSERVE_KV_TIMEOUT_MS: how long a generate waits for its KV
    default_precision: str = "fp32"


class DecodeStage:
    """Decode requests on plain Python objects. `engines` maps precision -> engine (engines.runtime.Engine),
    `sched` is the DecodeScheduler, `admit` a bounded executor (BoundedExecutor: admission waits for KV and may
    recompute, so it runs off the request thread), `snapshots` a kv.snapshot.Snapshotter or None,
    `ingest_token_ok` checks kv_ingest's proof that it verified a transfer."""

    def __init__(self, engines: dict, cfg, compat: str, sched, admit, pending: PendingKV,
                 config: Optional[DecodeConfig] = None, snapshots=None, metrics: Optional[Metrics] = None,
                 ingest_token_ok: Callable[[str], bool] = lambda token: False, prefix=None,
                 classify_failure: Callable[[BaseException], str] = lambda e: "refused"):
        """prefix: a kv.prefix.PrefixCache (seeded with the build's compat hash) or None; the scheduler fills it
        with the KV of the sequences that end here. classify_failure: a refused KV's `reason` label."""
        self.engines, self.cfg, self.compat, self.sched, self.admit = engines, cfg, compat, sched, admit
        self.pending, self.snapshots = pending, snapshots
        self.prefix = prefix
        if prefix is not None:
            sched.prefix_cache = prefix
        self.config = config or DecodeConfig()
        self.metrics = metrics or NoMetrics()
        self.ingest_token_ok = ingest_token_ok
        self.classify_failure = classify_failure
        self.counters = {"recompute": 0, "ingested": 0, "local_prefill": 0, "prefix_hit_tokens": 0}
        self.live = LiveGenerates()

    # ---- dispatch ------------------------------------------------------------------------------------------
    def handle_tensors(self, t: schema.Tensors, reply: Reply, transport: str = "grpc") -> None:
        """handle() for the raw inputs; inputs that do not parse are refused through `reply`. `transport`: the
        one an op=ingest came over (the sender's request parameter)."""
        try:
            call = call_from_tensors(t)
            call.transport = transport
        except Exception as e:  # bad shape, UTF-8, sampling bounds: drop KV pushed for a refused generate
            rid = t.get("request_id")
            if rid is not None and rid.size == 1:
                self.pending.take(bytes(rid.reshape(-1)[0]).decode("utf-8", "replace"), 0)
            reply.error(errors.parse_failure(e, "decode request"))
            return
        self.handle(call, reply)

    def handle(self, call: DecodeCall, reply: Reply) -> None:
        """Answer one request through `reply`, now or later (generate: from the admission pool).
        Every failure becomes reply.error(exc), never an exception out of here."""
        try:
            if call.op in ADMIN_OPS:
                raise RequestError(f"op={call.op} is an admin op of `hetserve doctor`: it is served on the decode "
                                   "server's admin side channel (HETSERVE_DECODE_ADMIN), not by the decode model")
            if call.op not in OPS:
                raise RequestError(f"unknown op {call.op!r}; use {', '.join(OPS[:-1])} or {OPS[-1]}")
            getattr(self, "_op_" + call.op)(call, reply)
        except Exception as e:
            if call.op == "generate" and call.request_id:  # refused: drop KV already pushed for it (else TTL)
                self.pending.take(call.kv_key or call.request_id, 0, call.kv_shares)
            if kind_of_exception(e) == INTERNAL:
                log.error("decode op=%s of request %s failed: %s", call.op, call.request_id, e, exc_info=e)
            reply.error(errors.from_exception(e, f"decode op={call.op}"))

    def _precision(self, prec: Optional[str], default: Optional[str] = None) -> str:
        prec = prec or default or self.config.default_precision
        if prec not in self.engines:
            raise RequestError(f"decode precision {prec!r} not loaded; have {sorted(self.engines)}")
        return prec

    # ---- ops -----------------------------------------------------------------------------------------------
    def _op_canary(self, call: DecodeCall, reply: Reply) -> None:
        eng = self.engines[self.config.default_precision]
        bos = self.cfg.bos_token_id
        logits, _, _ = eng.prefill([int(bos) if bos is not None else 1])
        reply.tokens([int(np.argmax(logits))], final=True)

    def _op_ingest(self, call: DecodeCall, reply: Reply) -> None:
        """KV from kv_ingest (verified there; it proves it with the ingest token) or straight from a prefill
        server's sender (kv/transport/control.py, HETSERVE_KV_DIRECT) or anyone else, verified here: compat hash,
        layout, shape, context bound, size, HMAC tag. A refusal is counted as a failed transfer over
        call.transport. Link probes (diagnostics.PROBE_PREFIX) are verified, then discarded."""
        rid = call.request_id
        if not rid or call.kv_header is None or call.kv_payload is None:
            raise RequestError("op=ingest needs 'request_id', 'kv_header' and 'kv_payload'")
        payload = np.ascontiguousarray(call.kv_payload.reshape(-1), dtype=np.uint8)
        try:
            hdr = wire.KVHeader.from_json(call.kv_header)
            if not self.ingest_token_ok(call.ingest_token):
                schema.check_kv_tokens(hdr, self.cfg.max_position)
                wire.verify(hdr, payload, self.compat, (self.cfg.num_layers, self.cfg.num_kv_heads,
                                                        self.cfg.head_dim))
        except (wire.KVWireError, RequestError) as e:
            raise refused_kv(rid, e, lambda e: self.metrics.inc(
                TRANSFER_FAILURES_METRIC, transport=call.transport, reason=self.classify_failure(e))) from None
        if rid.startswith(PROBE_PREFIX):
            reply.tokens([], final=True)
            return
        k, v = wire.decode(hdr, payload)
        self.pending.put(rid, k, v, hdr.start)
        self.counters["ingested"] += 1
        reply.tokens([], final=True)

    def _op_release(self, call: DecodeCall, reply: Reply) -> None:
        if not call.request_id:
            raise RequestError("op=release needs 'request_id'")
        self.pending.take(call.request_id, 0)
        reply.tokens([], final=True)

    def _op_stats(self, call: DecodeCall, reply: Reply) -> None:
        reply.json(self.stats())

    def _op_prefix(self, call: DecodeCall, reply: Reply) -> None:
        p = self.prefix
        block = p.block if p is not None else 0
        if call.prompt:  # held tokens compared by token, not only by hash (cached_blocks checks the chain)
            schema.check_prompt(call.prompt, self.cfg, 0)
            reply.json({"block_tokens": block,
                        "held_tokens": p.cached_blocks(call.prompt) * block if p is not None else 0})
            return
        reply.json({"block_tokens": block,
                    "blocks": [h.hex() for h in p.held(MAX_PUBLISHED_BLOCKS)] if p is not None else []})

    def _op_generate(self, call: DecodeCall, reply: Reply) -> None:
        rid, prompt, out_ids, params = call.request_id, call.prompt, call.output_ids, call.params
        if not rid:
            raise RequestError("missing 'request_id'")
        if not prompt:
            raise RequestError("'input_ids' (the prompt) is required")
        if not out_ids and call.kv_sent:
            raise RequestError("'output_ids' (tokens so far, >= 1) is required unless kv_sent=false (then the "
                               "prompt is prefilled here)")
        assert params is not None  # call_from_tensors parses sampling for op=generate
        schema.check_prompt(prompt + out_ids, self.cfg, params.max_tokens - len(out_ids))
        params.stop_token_ids = [t for t in params.stop_token_ids if t >= 0]  # [-1] stands for "none"
        params.check_vocab(self.cfg.vocab_size)
        if not 1 <= call.kv_shares <= MAX_CHOICES:
            raise RequestError(f"kv_shares must be in [1, {MAX_CHOICES}]")
        lo, hi = schema.INPUTS["send_interval_ms"].bound or (0, 0)
        if not lo <= call.send_interval_s * 1e3 <= hi:
            raise RequestError(f"send_interval_ms must be in [{lo}, {hi}], got {call.send_interval_s * 1e3:g}")
        prec = self._precision(call.precision)
        if out_ids and (len(out_ids) >= params.max_tokens
                        or is_stop_token(out_ids[-1], params, self.cfg.eos_token_ids)):
            reply.tokens([], "length", final=True)
            self.pending.take(call.kv_key or rid, 0, call.kv_shares)
            return
        if call.send_interval_s > 0:
            reply = PacedReply(reply, call.send_interval_s)
        live = self.live.add(reply, rid)
        try:
            self.admit.submit(self._admit, call, prec, live)
        except BaseException:
            self.live.remove(live)
            raise

    def _op_cancel(self, call: DecodeCall, reply: Reply) -> None:
        """End the generate(s) of request_id early, as a Triton cancellation would: each finishes with reason
        "cancelled" at its next step (its KV freed); an id with none (already ended) is not an error."""
        if not call.request_id:
            raise RequestError("op=cancel needs 'request_id'")
        self.live.cancel(call.request_id)
        reply.tokens([], final=True)

    # ---- admin side channel (admin_channel.py; `hetserve doctor`) -------------------------------------------
    def admin_ops(self) -> Dict[str, Callable[[dict], dict]]:
        return {"info": self.admin_info, "verify": self.admin_verify}

    def admin_info(self, args: dict) -> dict:
        from .. import diagnostics

        man = next(iter(self.engines.values())).manifest
        return diagnostics.server_info("decode", man, {e.name: e.precision for e in self.engines.values()},
                                       pending=len(self.pending), counters=dict(self.counters),
                                       default_precision=self.config.default_precision,
                                       kv_timeout_ms=self.config.kv_timeout_s * 1e3)

    def admin_verify(self, args: dict) -> dict:
        """Take the KV sent under request_id out of pending and compare its next-token logits with a full
        recompute of input_ids (diagnostics.verify_kv). Runs on the admin channel's thread."""
        from .. import diagnostics

        rid, prompt = args.get("request_id"), args.get("input_ids") or []
        if not isinstance(rid, str) or not rid or not isinstance(prompt, list) or len(prompt) < 2 \
                or not all(isinstance(x, int) for x in prompt):
            raise RequestError("verify needs 'request_id' and 'input_ids' (the prompt, >= 2 token ids)")
        schema.check_prompt(prompt, self.cfg)
        prec = self._precision(args.get("precision"), "fp32" if "fp32" in self.engines else None)
        timeout_s = min(max(float(args.get("timeout_s", 5.0)), 0.0), 60.0)
        got = self.pending.take(rid, timeout_s)
        if got is None:
            raise RequestError(f"no KV arrived for request {rid!r} within {timeout_s:g}s")
        if got.start:
            raise RequestError(f"the KV sent for {rid!r} starts at token {got.start}: verify needs a whole prompt's")
        return diagnostics.verify_kv(self.engines[prec], prompt, got.k, got.v)

    def prefill_here(self, eng, ids, reason: str):
        """Logits of ids[-1] and the KV of `ids`, computed on this server from the longest prefix its prefix
        cache holds (counted as a recompute for `reason`)."""
        n, pk, pv = self.prefix.lookup(ids) if self.prefix is not None else (0, None, None)
        self.counters["recompute"] += 1
        self.counters["prefix_hit_tokens"] += n
        self.metrics.inc("hetserve_kv_recompute_total", reason=reason)
        self.metrics.inc(LOCAL_PREFILL_TOKENS_METRIC, len(ids) - n)
        if n:
            self.metrics.inc(PREFIX_HIT_METRIC, n)
        return _prefill_on(eng, ids[n:], pk, pv)

    def context_kv(self, call: DecodeCall, prec: str):
        """KV of prompt + output_ids[:-1]: the transferred KV, else a snapshot + the tail, else a recompute
        (from this server's prefix cache where it can)."""
        rid, prompt, out_ids = call.request_id, call.prompt, call.output_ids
        key = call.kv_key or rid
        first = len(out_ids) == 1
        got = self.pending.take(key, self.config.kv_timeout_s, call.kv_shares) if first and call.kv_sent else None
        if first and not call.kv_sent:
            self.pending.take(key, 0, call.kv_shares)  # a partial transfer may have landed: never use it, free it
        ctx = prompt + out_ids[:-1]
        eng = self.engines[prec]
        if got is not None and got.start + got.k.shape[2] == len(ctx):
            if not got.start:
                return got.k, got.v
            return self._join(eng, ctx, got)
        if not first and self.snapshots is not None:  # resume after migration
            snap = self.snapshots.restore(rid, ctx, (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim))
            if snap is not None:
                n, k, v = snap
                self.metrics.inc("hetserve_snapshot_restores_total")
                if n == len(ctx):
                    return k, v
                _, k, v = _prefill_on(eng, ctx[n:], k, v)
                return k, v
        # KV missing (timeout, failed transfer, or resume without snapshot): recompute it here.
        reason = ("resume" if not first else "transfer_failed" if not call.kv_sent
                  else "timeout" if got is None else "mismatch")
        _, k, v = self.prefill_here(eng, ctx, reason)
        return k, v

    def _join(self, eng, ctx, got: TakenKV):
        """KV of ctx from this server's prefix cache (tokens < got.start) and the transferred rest. Blocks the
        cache lost since the router looked are recomputed here (counted: reason prefix_evicted), never guessed."""
        s = got.start
        n, pk, pv = self.prefix.lookup(ctx[:s + 1]) if self.prefix is not None else (0, None, None)
        self.counters["prefix_hit_tokens"] += n
        self.metrics.inc(PREFIX_HIT_METRIC, n)
        if n < s:  # evicted in between: compute the gap on top of what is left
            self.counters["recompute"] += 1
            self.metrics.inc("hetserve_kv_recompute_total", reason="prefix_evicted")
            self.metrics.inc(LOCAL_PREFILL_TOKENS_METRIC, s - n)
            _, pk, pv = _prefill_on(eng, ctx[n:s], pk, pv)
        assert pk is not None and pv is not None  # s > 0: either the cache or the gap's prefill gave KV
        return np.concatenate([pk, got.k], axis=2), np.concatenate([pv, got.v], axis=2)

    def _first_token(self, call: DecodeCall, prec: str, reply: Reply):
        """Prefill the prompt here and sample the first token (conditional disaggregation). Returns the
        sequence's (tokens, k, v, sampler), or None when the first token already ended it."""
        assert call.params is not None
        params, prompt = call.params, call.prompt
        self.counters["local_prefill"] += 1
        logits, k, v = self.prefill_here(self.engines[prec], prompt, "local_prefill")
        sampler = self.sched.new_sampler(params, prompt, [])
        tok, lp = sampler.next(np.asarray(logits).reshape(-1), 0)
        reason = ("stop" if is_stop_token(tok, params, self.cfg.eos_token_ids)
                  else "length" if params.max_tokens <= 1 or len(prompt) + 1 >= self.cfg.max_position else None)
        reply.tokens([tok], reason, final=bool(reason), logprobs=lp)
        if reason:
            if self.prefix is not None:
                self.prefix.insert(prompt, k, v)
            return None
        return [tok], k, v, sampler

    def _admit(self, call: DecodeCall, prec: str, reply: Reply) -> None:
        try:
            sampler = None
            if call.output_ids:
                tokens = list(call.output_ids)
                k, v = self.context_kv(call, prec)
            else:
                got = self._first_token(call, prec, reply)
                if got is None:
                    return
                tokens, k, v, sampler = got
            if self.snapshots is not None:
                self.snapshots.track(call.request_id, call.prompt)

            def on_tokens(toks, reason, logprobs=None):
                reply.tokens(list(toks), reason, final=bool(reason), logprobs=logprobs)

            assert call.request_id and call.params is not None  # checked by _op_generate
            # a choice of n forks the KV sent once (copy on write in the block pool), unless it was recomputed
            group = (call.kv_key or call.request_id, call.kv_shares) if call.kv_shares > 1 and call.kv_sent \
                and len(call.output_ids) == 1 else None
            self.sched.submit(Sequence(call.request_id, len(call.prompt), tokens, call.params, prec,
                                       on_tokens, reply.cancelled, on_error=reply.error, k=k, v=v,
                                       prompt_ids=list(call.prompt), kv_group=group, sampler=sampler))
        except Exception as e:
            if kind_of_exception(e) == INTERNAL:
                log.error("decode admission of request %s failed: %s", call.request_id, e, exc_info=e)
            reply.error(errors.from_exception(e, "decode admission"))

    def stats(self) -> dict:
        sched = self.sched
        with sched.cv:
            out = {"running": sched.n_running(), "waiting": len(sched.waiting), "pending_kv": len(self.pending),
                   "scheduler": dict(sched.stats), "counters": dict(self.counters)}
        pool = getattr(sched, "kv_pool", None)
        if pool is not None:
            out["kv_pool"] = pool.stats()
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.stats()
        if self.snapshots is not None:
            out["snapshots"] = {**self.snapshots.stats, "files": self.snapshots.store.count(),
                                "tracked": len(self.snapshots.prompts)}
        return out
