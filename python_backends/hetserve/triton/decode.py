"""decode (decode server, decoupled): the Triton binding of stages/decode.py (op dispatch, the KV rendezvous,
admission into continuous batching). This file builds the stage from the environment and converts tensors <->
its dataclasses; the ops are described there.
"""
from __future__ import annotations

import collections
import logging
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config
from ..bounded import BoundedExecutor, nice_this_thread
from ..engines.manifest import configured_engines
from ..engines.runtime import load_engine
from ..kv.blocks import BlockPool
from ..kv.prefix import PrefixCache
from ..kv.snapshot import Snapshotter
from ..sampling import TokenLogprobs
from ..scheduler import DecodeScheduler
from ..stages.decode import (
    LOCAL_PREFILL_TOKENS_METRIC,
    PREFIX_HIT_METRIC,
    RECOMPUTE_REASONS,
    DecodeConfig,
    DecodeStage,
    PendingKV,  # re-exported for existing callers (tests/test_hardening.py)
)
from .common import (
    RequestError,
    engine_dir,
    grammar_matchers,
    ingest_token_ok,
    json_bytes,
    kv_transport_of,
    logprob_tensors,
    send_error,
    start_admin_channel,
    str_tensor,
    tensors_of,
)
from .metrics import REGISTRY, Poller, gauges, transfer_failure_reason

log = logging.getLogger("hetserve.decode")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TokenOutbox:
    """One thread sends the decode model's token responses. The scheduler hands a stream's tokens over and goes
    on with its next step; while a stream's earlier response is still being sent, its new tokens gather into the
    next one (one response per step for a stream that keeps up, several tokens in one when it falls behind). Per
    stream the order holds: tokens, then the final tokens or error. Bounded: one entry per live stream.
    Cancellation (Triton 2.51 can crash on a response sent to a stream it cancelled, docs/reliability.md) is asked
    right before each send, here, and remembered for the scheduler's per-token check."""

    def __init__(self):
        self._cv = threading.Condition()
        self._pending: "collections.OrderedDict[int, list]" = collections.OrderedDict()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="decode-outbox", daemon=True)
        self._thread.start()

    def put(self, reply: "SenderReply", ids, reason, final: bool, error=None, logprobs=None) -> None:
        with self._cv:
            e = self._pending.get(id(reply))
            if e is None:
                lps = None
                if logprobs is not None:
                    lps = TokenLogprobs()
                    lps.extend(logprobs)
                self._pending[id(reply)] = [reply, list(ids), reason, final, error, lps]
                self._cv.notify()
            else:
                e[1].extend(ids)
                e[2], e[3], e[4] = reason or e[2], final or e[3], error or e[4]
                if logprobs is not None:
                    if e[5] is None:
                        e[5] = TokenLogprobs()
                    e[5].extend(logprobs)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if not self._pending:
                    return
                batch = list(self._pending.values())
                self._pending.clear()
            for reply, ids, reason, final, error, lps in batch:
                try:
                    reply.deliver(ids, reason, final, error, lps)
                except Exception as e:  # the stream is gone: nothing left to tell it
                    log.info("decode response not delivered: %s", e)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)


class SenderReply:
    """stages.types.Reply over a Triton response sender; tokens and errors go out through the TokenOutbox."""

    def __init__(self, sender, outbox: TokenOutbox):
        self.sender, self.outbox = sender, outbox
        self._cancelled = False
        self._fresh = False  # the outbox asked Triton since the scheduler last did: its answer stands

    def tokens(self, token_ids, finish_reason=None, final=False, logprobs=None):
        self.outbox.put(self, token_ids, finish_reason, final, logprobs=logprobs)

    def error(self, exc):
        self.outbox.put(self, [], None, True, exc)

    def deliver(self, token_ids, finish_reason, final, error, logprobs=None) -> None:
        """Send on the outbox thread: the tokens, then the error (as data, then the final Triton error, which
        stages/grpc_decode reads) or the final flag. A cancelled stream gets only its final response."""
        if token_ids and (final or not self._ask()):
            tensors = [pb_utils.Tensor("token_ids", np.asarray(token_ids, np.int32))]
            if logprobs is not None:
                tensors += logprob_tensors(logprobs)
            if finish_reason:
                tensors.append(str_tensor("finish_reason", [finish_reason]))
            self.sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if final and error is None else 0)
            if final and error is None:
                return
        if error is not None:
            send_error(self.sender, error)
        elif final:
            tensors = [str_tensor("finish_reason", [finish_reason])] if finish_reason else []
            self.sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", np.zeros(0, np.int32))]
                                                        + tensors), flags=FINAL)

    def json(self, obj):
        self.sender.send(pb_utils.InferenceResponse([str_tensor("op_json", [json_bytes(obj)])]), flags=FINAL)

    def _ask(self) -> bool:
        """Triton's is_cancelled() (an IPC round trip from the stub), remembered once true."""
        if not self._cancelled:
            self._cancelled = bool(getattr(self.sender, "is_cancelled", lambda: False)())
        self._fresh = True
        return self._cancelled

    def cancelled(self):
        """The scheduler's per-token check: the outbox's answer when it asked since the last check (it asks
        right before each send), else ask now; about one IPC per token either way."""
        if self._cancelled:
            return True
        if self._fresh:
            self._fresh = False
            return False
        self._cancelled = bool(getattr(self.sender, "is_cancelled", lambda: False)())
        return self._cancelled


class TritonPythonModel:
    def initialize(self, args):
        names = configured_engines(engine_dir(), "HETSERVE_DECODE_ENGINES")
        engines = {}
        for n in names:
            e = load_engine(engine_dir(), n.strip())
            e.warmup()
            engines[e.precision] = e
        e0 = next(iter(engines.values()))
        cfg = e0.config
        max_queue = int(config.get("HETSERVE_MAX_QUEUE"))
        self.sched = DecodeScheduler(
            engines, eos_ids=cfg.eos_token_ids, max_batch=int(config.get("HETSERVE_MAX_BATCH")),
            pool=BlockPool.from_env(cfg),  # HETSERVE_KV_* and HETSERVE_REDIS_URL (README)
            idle_demote_s=float(config.get("HETSERVE_KV_IDLE_DEMOTE_S")), max_queue=max_queue,
            matcher_factory=grammar_matchers(cfg))
        self.snapshots = Snapshotter.from_env(e0.compat_hash)
        self.sched.snapshotter = self.snapshots
        # admission work (waiting for KV, recompute) off the request thread; bounded like the scheduler queue
        # ... optionally at a lower CPU priority (HETSERVE_DECODE_PREFILL_NICE): a prompt prefilled here (local
        # prefill, recompute) then yields the core to the running streams' decode steps (TPOT over TTFT)
        nice = int(config.get("HETSERVE_DECODE_PREFILL_NICE"))
        self.admit = BoundedExecutor(8, max_queue, "decode-admit", initializer=lambda: nice_this_thread(nice))
        self.outbox = TokenOutbox()
        self.stage = DecodeStage(
            engines, cfg, e0.compat_hash, self.sched, self.admit, PendingKV.from_env(),
            DecodeConfig(kv_timeout_s=float(config.get("HETSERVE_KV_TIMEOUT_MS")) / 1e3,
                         default_precision=config.get("HETSERVE_DECODE_PRECISION") or e0.precision),
            snapshots=self.snapshots, metrics=REGISTRY, ingest_token_ok=ingest_token_ok,
            prefix=PrefixCache(int(config.get("HETSERVE_DECODE_PREFIX_CACHE_MB") * (1 << 20)),
                               block=int(config.get("HETSERVE_PREFIX_BLOCK_TOKENS")), seed=e0.compat_hash),
            classify_failure=transfer_failure_reason)
        for name in (PREFIX_HIT_METRIC, LOCAL_PREFILL_TOKENS_METRIC):
            REGISTRY.declare(name)
        for reason in RECOMPUTE_REASONS:
            REGISTRY.declare("hetserve_kv_recompute_total", reason=reason)
        for name in ("hetserve_kv_preemptions_total", "hetserve_snapshot_restores_total"):
            REGISTRY.declare(name)
        self.poller = Poller(self._sample_metrics, "decode", engine_cpu=True)
        self.admin = start_admin_channel(config.get("HETSERVE_DECODE_ADMIN"), "decode", self.stage.admin_ops())

    def _sample_metrics(self) -> dict:
        sched = self.sched
        st = sched.stats
        g: list = [("hetserve_batch_size", {}, st["batch_size"] if sched.n_running() else 0),
             ("hetserve_queue_depth", {}, len(sched.waiting))]
        pool = getattr(sched, "kv_pool", None)  # paged KV pool, when present
        if pool is not None:
            for tier, n in pool.stats().get("tier_blocks", {}).items():
                g.append(("hetserve_kv_tier_blocks", {"tier": tier}, n))
        if self.snapshots is not None:
            g.append(("hetserve_snapshot_age_seconds", {}, self.snapshots.oldest_age_s()))
        if self.stage.prefix is not None:
            g.append(("hetserve_decode_prefix_cache_bytes", {}, self.stage.prefix.nbytes))
        counters = gauges([("hetserve_kv_preemptions_total", {}, st.get("preempted", 0))])
        return {"gauges": gauges(g), "counters": counters, "busy_seconds": st["step_seconds"]}

    def finalize(self):
        if self.admin is not None:
            self.admin.close()
        self.poller.close()
        self.sched.close()
        self.outbox.close()  # after the scheduler: its last responses go out
        if self.snapshots is not None:
            self.snapshots.close()
        self.admit.shutdown()
        REGISTRY.close()  # last: metrics released while the stub still takes the deletes

    def execute(self, requests):
        for r in requests:
            reply = SenderReply(r.get_response_sender(), self.outbox)
            t = tensors_of(r, "decode")
            transport = "grpc"
            if t.get("kv_header") is not None:  # op=ingest: the sender names its transport (a metric label)
                try:
                    transport = kv_transport_of(r)
                except RequestError as e:
                    reply.error(e)
                    continue
            self.stage.handle_tensors(t, reply, transport)
        return None
