"""prefill: run the prompt through the prefill engine, sample the first token, push KV to the decode server.

Inputs: input_ids, request_id, decode_url?, transport? (a kv/transport registry name: grpc|shm|nixl|cuda_shm; the
orchestrator passes the one it negotiated with the decode member), kv_dtype? (fp32|fp16|int8|fp8), skip_transfer?,
prefix_cache? (default true), sampling params.
Outputs: first_token, prompt_len, kv_bytes, prefill_ms, transfer_ms, transfer_ok, transport_used, prefix_hit_tokens
(prompt tokens whose KV came from the prefix cache, kv/prefix.py; HETSERVE_PREFIX_CACHE_MB sizes it, 0 disables).
A failed transfer is reported (transfer_ok=false), not raised: the decode server then recomputes the prompt.
A transfer that had to fall back (staging region full -> grpc) says so in transport_used, in
hetserve_kv_transport_fallbacks_total{requested,used,reason} and in a log line (kv/transport/sender.py).

Batched prefill (prefill_batch.py): execute() only validates and queues; one background thread runs the
waiting prompts together, under a token budget and chunked (HETSERVE_PREFILL_TOKEN_BUDGET, _CHUNK_TOKENS,
_MAX_BATCH, _PAST_BUDGET, _MAX_QUEUE), and answers each request through its response sender as soon as its
prompt is done (Triton's Python backend allows the response sender in non-decoupled mode: exactly one
response, with the FINAL flag, and execute() returns None). So the model stays non-decoupled with one response
per request, and callers (llm's BLS, planner, clients) see the same contract as before. prefill_ms is
the engine time of the forwards the prompt took part in (as before: engine time, now shared by the batch).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config, diagnostics
from ..engines.runtime import Engine
from ..kv import wire
from ..kv.prefix import PrefixCache
from ..kv.transport import NAMES as TRANSPORTS
from ..kv.transport import KVSender, TransferTimeout, TransportUnavailable, spec
from ..prefill_batch import BatchConfig, PrefillBatcher
from ..sampling import SamplingParams, sample
from .common import (
    PREFILL_HOP,
    RequestError,
    check_prompt,
    classify,
    engine_dir,
    error_response,
    inp,
    internal_token_ok,
    is_admin,
    sampling_params,
    scalar,
    start_admin_channel,
    str_tensor,
)
from .metrics import REGISTRY, BusyMeter, Poller, declare_transfer_failures, gauges, transfer_failure_reason

log = logging.getLogger("hetserve.prefill")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class PrefillRequest:
    """A validated prefill request waiting in the batcher (PrefillJob.handle)."""
    sender: Any  # the request's response sender
    rid: str
    params: SamplingParams
    transport: str
    kv_dtype: str
    url: str
    skip_transfer: bool


class TritonPythonModel:
    def initialize(self, args):
        self.engine = Engine(engine_dir(), config.get("HETSERVE_PREFILL_ENGINE"))
        self.engine.warmup()
        self._unavailable = {}  # transport -> why it cannot run here ('' = it can), asked once per transport
        self.sender = KVSender(on_fallback=self._record_fallback)
        self.default_url = config.get("HETSERVE_DECODE_URL").split(",")[0]
        self.default_transport = config.get("HETSERVE_KV_TRANSPORT")
        if self.default_transport in TRANSPORTS and not self._unavailable_reason(self.default_transport):
            threading.Thread(target=self.sender.prepare, args=(self.default_transport,), daemon=True,
                             name="kv-transport-prepare").start()
        self.default_kv_dtype = config.get("HETSERVE_KV_DTYPE")
        self.cfg = self.engine.config
        self.prefix = PrefixCache.from_env(seed=self.engine.compat_hash)  # HETSERVE_PREFIX_CACHE_MB
        self.busy = BusyMeter()
        for t in TRANSPORTS:
            REGISTRY.declare("hetserve_kv_transfer_bytes_total", transport=t)
        declare_transfer_failures(TRANSPORTS)
        for t in TRANSPORTS:
            if t != "grpc":
                REGISTRY.declare("hetserve_kv_transport_fallbacks_total", requested=t, used="grpc", reason="capacity")
        for n in ("hetserve_kv_prefix_hits_total", "hetserve_kv_prefix_lookups_total"):
            REGISTRY.declare(n)
        self.batch_cfg = BatchConfig.from_env()
        REGISTRY.declare("hetserve_prefill_batch_size")
        self.batcher = PrefillBatcher(self.engine, self.batch_cfg, self._finish, self._fail, prefix=self.prefix,
                                      on_forward=self._on_forward)
        self.poller = Poller(self._sample_metrics, "prefill")
        self.admin = start_admin_channel(config.get("HETSERVE_PREFILL_ADMIN"), "prefill",
                                         {op: (lambda a, op=op: self._admin_op(op, a))
                                          for op in diagnostics.PREFILL_OPS})

    def _sample_metrics(self) -> dict:
        out = {"busy_seconds": self.busy.total(), "counters": {}}
        prefix = getattr(self, "prefix", None)  # prefix cache, when enabled
        if prefix is not None:
            st = prefix.stats()
            out["counters"] = gauges([
                ("hetserve_kv_prefix_hits_total", {}, st.get("hits", 0)),
                ("hetserve_kv_prefix_lookups_total", {}, st.get("lookups", 0)),
                ("hetserve_kv_prefix_hit_tokens_total", {}, st.get("hit_tokens", 0))])
        return out

    @staticmethod
    def _record_fallback(requested: str, used: str, reason: str):
        REGISTRY.inc("hetserve_kv_transport_fallbacks_total", requested=requested, used=used, reason=reason)

    def _unavailable_reason(self, transport: str) -> str:
        why = self._unavailable.get(transport)
        if why is None:
            why = self._unavailable[transport] = spec(transport).available()
        return why

    def _record_transfer(self, transport: str, info: Optional[dict], exc=None):
        if exc is not None:
            reason = "timeout" if isinstance(exc, TransferTimeout) else \
                "unavailable" if isinstance(exc, TransportUnavailable) else transfer_failure_reason(exc)
            REGISTRY.inc("hetserve_kv_transfer_failures_total", transport=transport, reason=reason)
            return
        assert info is not None  # a transfer that did not raise reports what it sent
        transport = info["transport"]  # the one used (grpc after a counted fallback)
        REGISTRY.inc("hetserve_kv_transfer_bytes_total", info["bytes"], transport=transport)
        REGISTRY.observe("hetserve_kv_transfer_seconds", info["seconds"], transport=transport)
        if info["seconds"] > 0:
            REGISTRY.set("hetserve_kv_transfer_bandwidth_bytes_per_second", info["bytes"] / info["seconds"],
                         transport=transport)

    def finalize(self):
        if self.admin is not None:
            self.admin.close()
        self.batcher.close()
        self.poller.close()
        self.sender.close()

    def _on_forward(self, plan, seconds: float):
        self.busy.add(seconds)
        REGISTRY.observe("hetserve_prefill_batch_size", len(plan.rows))

    def _admin_op(self, op: str, args: dict) -> dict:
        """`hetserve doctor`'s prefill ops (diagnostics.prefill_op), served on the admin side channel."""
        return diagnostics.prefill_op(self, op, args)

    @staticmethod
    def tokenizer():
        from .common import tokenizer

        return tokenizer()

    def _queue(self, r, sender) -> None:
        """Validate a prefill request and hand it to the batcher (answered later by _finish/_fail)."""
        ids_a = inp(r, "input_ids")
        if ids_a is None or ids_a.size == 0:
            raise RequestError("empty prompt: 'input_ids' has no tokens")
        params = sampling_params(r)
        ids = check_prompt([int(x) for x in ids_a.reshape(-1)], self.cfg, params.max_tokens)
        transport = scalar(r, "transport", None, str) or self.default_transport
        if transport not in TRANSPORTS:
            raise RequestError(f"unknown transport {transport!r}; use one of {list(TRANSPORTS)}")
        why = self._unavailable_reason(transport)
        if why:
            raise RequestError(f"KV transport {transport!r} cannot run on this prefill server: {why}")
        kv_dtype = scalar(r, "kv_dtype", None, str) or self.default_kv_dtype
        if kv_dtype not in wire.DTYPES:
            raise RequestError(f"unknown kv_dtype {kv_dtype!r}; use one of {sorted(wire.DTYPES)}")
        url = scalar(r, "decode_url", None, str)
        # the orchestrator proves its pick with the hop token; operators' tools (planner --measure) hold the key
        if url and not (internal_token_ok(scalar(r, "internal_token", "", str), PREFILL_HOP) or is_admin(r)):
            raise RequestError("'decode_url' is chosen by the orchestrator from its decode pool; a client cannot "
                               "set it (use the llm model, or send the admin key as hetserve doctor and "
                               "hetserve plan --measure do)")
        req = PrefillRequest(sender, scalar(r, "request_id", None, str) or f"req-{time.time_ns()}", params,
                             transport, kv_dtype, url or self.default_url,
                             bool(scalar(r, "skip_transfer", False)))
        self.batcher.submit(ids, req, use_prefix=bool(scalar(r, "prefix_cache", True)))

    def _finish(self, job) -> None:
        """Batcher thread: the whole prompt has KV. Sample the first token, push the KV to decode, answer."""
        req: PrefillRequest = job.handle
        first = sample(job.logits, req.params, 0)
        t1 = time.perf_counter()
        info: Dict[str, Any] = {"transport": "none", "bytes": 0, "seconds": 0.0}
        ok = True
        if not req.skip_transfer:
            hdr, payload = wire.encode(job.k, job.v, self.engine.compat_hash, req.kv_dtype)
            try:
                info = self.sender.send(req.url, req.transport, req.rid, hdr, payload)
                self._record_transfer(req.transport, info)
            except Exception as e:
                log.warning("request %s: %s", req.rid, e)
                self._record_transfer(req.transport, None, e)
                ok = False
                info = {"transport": req.transport, "bytes": 0, "seconds": time.perf_counter() - t1}
        req.sender.send(pb_utils.InferenceResponse([
            pb_utils.Tensor("first_token", np.array([first], np.int32)),
            pb_utils.Tensor("prompt_len", np.array([len(job.ids)], np.int32)),
            pb_utils.Tensor("kv_bytes", np.array([info["bytes"]], np.int64)),
            pb_utils.Tensor("prefill_ms", np.array([job.compute_s * 1e3], np.float32)),
            pb_utils.Tensor("transfer_ms", np.array([info["seconds"] * 1e3], np.float32)),
            pb_utils.Tensor("transfer_ok", np.array([ok], bool)),
            pb_utils.Tensor("prefix_hit_tokens", np.array([job.hit], np.int32)),
            str_tensor("transport_used", [info["transport"]]),
        ]), flags=FINAL)

    def _fail(self, job, exc) -> None:
        self._answer_error(job.handle.sender, exc)

    @staticmethod
    def _answer_error(sender, exc) -> None:
        code = classify(exc)
        if code == pb_utils.TritonError.INTERNAL:
            log.error("prefill request failed: %s", exc, exc_info=exc)
        try:
            sender.send(error_response(str(exc), code), flags=FINAL)
        except Exception:  # the request is already answered or gone
            log.debug("could not send the error response", exc_info=True)

    def execute(self, requests):
        """Every request is answered through its response sender: prefill when its prompt is done (by the
        batcher thread), bad input at once with INVALID_ARG, a full queue UNAVAILABLE."""
        for r in requests:
            sender = r.get_response_sender()
            try:
                self._queue(r, sender)
            except Exception as e:
                self._answer_error(sender, e)
        return None
