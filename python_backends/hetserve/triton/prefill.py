"""prefill: run the prompt through the prefill engine, sample the first token, push KV to the decode server.

Inputs: input_ids, request_id, decode_url?, transport? (a kv/transport registry name: grpc|shm|nixl|cuda_shm; the
orchestrator passes the one it negotiated with the decode member), kv_dtype? (fp32|fp16|int8|fp8), skip_transfer?,
prefix_cache? (default true), sampling params.
Outputs: first_token, prompt_len, kv_bytes, prefill_ms, transfer_ms, transfer_ok, transport_used, prefix_hit_tokens
(prompt tokens whose KV came from the prefix cache, kv/prefix.py; HETSERVE_PREFIX_CACHE_MB sizes it, 0 disables).
A failed transfer is reported (transfer_ok=false), not raised: the decode server then recomputes the prompt.
A transfer that had to fall back (staging region full -> grpc) says so in transport_used, in
hetserve_kv_transport_fallbacks_total{requested,used,reason} and in a log line (kv/transport/sender.py).

Batched prefill (stages/prefill.py, stages/prefill_batch.py): execute() only reads the tensors and queues;
one background thread runs the waiting prompts together, under a token budget and chunked
(HETSERVE_PREFILL_TOKEN_BUDGET, _CHUNK_TOKENS, _MAX_BATCH, _PAST_BUDGET, _MAX_QUEUE), and answers each request
through its response sender as soon as its prompt is done (Triton's Python backend allows the response sender
in non-decoupled mode: exactly one response, with the FINAL flag, and execute() returns None). So the model
stays non-decoupled with one response per request, and callers (llm's BLS, planner, clients) see the same
contract as before. prefill_ms is the engine time of the forwards the prompt took part in.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config, diagnostics, errors, schema
from ..engines.manifest import configured_engines
from ..engines.runtime import load_engine
from ..kv.prefix import PrefixCache
from ..kv.transport import NAMES as TRANSPORTS
from ..kv.transport import KVSender, to_prepare
from ..sampling import TokenLogprobs
from ..stages.prefill import PrefillCall, PrefillDefaults, PrefillOutcome, PrefillStage
from ..stages.prefill_batch import BatchConfig
from .common import (
    PREFILL_HOP,
    PROMPT_LOGPROB_OUTPUTS,
    RequestError,
    check_prompt,
    engine_dir,
    error_tensor,
    grammar_matchers,
    internal_token_ok,
    is_admin,
    log_if_ours,
    logprob_tensors,
    send_error,
    start_admin_channel,
    str_tensor,
    tensors_of,
    tokenizer,
    wants_error_data,
)
from .metrics import REGISTRY, BusyMeter, Poller, declare_transfer_failures, gauges, transfer_failure_reason

log = logging.getLogger("hetserve.prefill")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _answer_error(sender, exc, request_id: str = "", as_data: bool = False) -> None:
    """Prefill answers once. A caller that sets the request parameter errors.ERROR_DATA_PARAM (the llm's BLS hop)
    gets the typed error as data (the `error` output) in that response: Triton 2.51's BLS turns every error code
    into INTERNAL (triton-inference-server/server#7804), so a refusal would reach the llm's client as our
    failure. Anyone else gets the Triton error of its kind."""
    log_if_ours(log, exc, "prefill", request_id)
    if not as_data:
        send_error(sender, exc, as_data=False)
        return
    try:
        sender.send(pb_utils.InferenceResponse([error_tensor(errors.from_exception(exc, "prefill"))]), flags=FINAL)
    except Exception as e:  # the caller is gone or was answered already
        log.info("prefill error response not sent (%s): %s", e, exc)


class _Reply:
    """stages.prefill.PrefillReply over a request's response sender: exactly one FINAL response."""

    def __init__(self, sender, request_id: str, errors_as_data: bool = False):
        self.sender, self.request_id, self.errors_as_data = sender, request_id, errors_as_data

    def done(self, o: PrefillOutcome) -> None:
        REGISTRY.inc("hetserve_prefill_requests_total")
        if len(o.first_tokens) > 1:
            REGISTRY.inc("hetserve_prefill_choices_total", len(o.first_tokens))
        extra = []
        if o.first_logprobs:
            lps = TokenLogprobs()
            for lp in o.first_logprobs:
                lps.extend(lp)
            extra = logprob_tensors(lps)
        if o.prompt_logprobs is not None:
            extra += logprob_tensors(o.prompt_logprobs, PROMPT_LOGPROB_OUTPUTS)
        self.sender.send(pb_utils.InferenceResponse(extra + [
            pb_utils.Tensor("first_token", np.array(o.first_tokens or [o.first_token], np.int32)),
            pb_utils.Tensor("prompt_len", np.array([o.prompt_len], np.int32)),
            pb_utils.Tensor("kv_bytes", np.array([o.kv_bytes], np.int64)),
            pb_utils.Tensor("prefill_ms", np.array([o.prefill_ms], np.float32)),
            pb_utils.Tensor("transfer_ms", np.array([o.transfer_ms], np.float32)),
            pb_utils.Tensor("transfer_ok", np.array([o.transfer_ok], bool)),
            pb_utils.Tensor("prefix_hit_tokens", np.array([o.prefix_hit_tokens], np.int32)),
            str_tensor("transport_used", [o.transport_used]),
        ]), flags=FINAL)

    def error(self, exc: BaseException) -> None:
        _answer_error(self.sender, exc, self.request_id, self.errors_as_data)


class TritonPythonModel:
    def initialize(self, args):
        engine = load_engine(engine_dir(), configured_engines(engine_dir(), "HETSERVE_PREFILL_ENGINE")[0])
        engine.warmup()
        self.cfg = engine.config
        self.prefix = PrefixCache.from_env(seed=engine.compat_hash)  # HETSERVE_PREFIX_CACHE_MB
        self.busy = BusyMeter()
        for t in TRANSPORTS:
            REGISTRY.declare("hetserve_kv_transfer_bytes_total", transport=t)
        declare_transfer_failures(TRANSPORTS)
        for t in TRANSPORTS:
            if t != "grpc":
                REGISTRY.declare("hetserve_kv_transport_fallbacks_total", requested=t, used="grpc", reason="capacity")
        for n in ("hetserve_kv_prefix_hits_total", "hetserve_kv_prefix_lookups_total"):
            REGISTRY.declare(n)
        REGISTRY.declare("hetserve_prefill_batch_size")
        for n in ("hetserve_prefill_requests_total", "hetserve_prefill_choices_total"):
            REGISTRY.declare(n)
        defaults = PrefillDefaults(config.get("HETSERVE_DECODE_URL").split(",")[0], config.get("HETSERVE_KV_TRANSPORT"),
                                   config.get("HETSERVE_KV_DTYPE"))
        self.stage = PrefillStage(engine, KVSender(on_fallback=self._record_fallback), defaults,
                                  BatchConfig.from_env(), REGISTRY, prefix=self.prefix, on_forward=self._on_forward,
                                  classify_failure=transfer_failure_reason,
                                  send_threads=int(config.get("HETSERVE_PREFILL_SEND_THREADS")),
                                  scorer=self._scorer, matcher_factory=grammar_matchers(self.cfg))
        self._scorer_engine = None
        self._scorer_lock = threading.Lock()
        prepare = [t for t in to_prepare(config.get("HETSERVE_KV_PREPARE"), defaults.transport)
                   if not self.stage.unavailable_reason(t)]
        if prepare:  # in the background: the server is ready for grpc meanwhile; a send waits for its transport
            sender = self.stage.sender
            threading.Thread(target=lambda: [sender.prepare(t) for t in prepare], daemon=True,
                             name="kv-transport-prepare").start()
        self.poller = Poller(self._sample_metrics, "prefill", engine_cpu=True)
        self.admin = start_admin_channel(config.get("HETSERVE_PREFILL_ADMIN"), "prefill",
                                         {op: (lambda a, op=op: diagnostics.prefill_op(self.stage, op, a, tokenizer))
                                          for op in diagnostics.PREFILL_OPS})

    def _scorer(self):
        """The FP32 standard graph with every position's logits (prompt logprobs), opened on first use."""
        with self._scorer_lock:
            if self._scorer_engine is None:
                from ..engines.runtime import Engine

                self._scorer_engine = Engine(engine_dir(), "prefill_fp32", score_view=True)
            return self._scorer_engine

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

    def finalize(self):
        if self.admin is not None:
            self.admin.close()
        self.stage.close()
        self.poller.close()
        REGISTRY.close()  # last: metrics released while the stub still takes the deletes

    def _on_forward(self, plan, seconds: float):
        self.busy.add(seconds)
        REGISTRY.observe("hetserve_prefill_batch_size", len(plan.rows))

    def _queue(self, r, sender, errors_as_data: bool) -> None:
        """Read a prefill request's tensors and hand it to the stage (answered later through the reply)."""
        t = tensors_of(r, "prefill")  # one pass over the request's inputs
        ids_a = t.get("input_ids")
        if ids_a is None or ids_a.size == 0:
            raise RequestError("empty prompt: 'input_ids' has no tokens")
        params = schema.sampling_params(t)
        ids = check_prompt(ids_a.reshape(-1).tolist(), self.cfg, params.max_tokens)
        url = schema.scalar(t, "decode_url", None, str)
        # the orchestrator proves its pick with the hop token; operators' tools (planner --measure) hold the key
        if url and not (internal_token_ok(schema.scalar(t, "internal_token", "", str), PREFILL_HOP)
                        or is_admin(r)):
            raise RequestError("'decode_url' is chosen by the orchestrator from its decode pool; a client cannot "
                               "set it (use the llm model, or send the admin key as hetserve doctor and "
                               "hetserve plan --measure do)")
        call = PrefillCall(ids, params, schema.scalar(t, "request_id", None, str) or f"req-{time.time_ns()}",
                           schema.scalar(t, "transport", None, str), schema.scalar(t, "kv_dtype", None, str), url,
                           bool(schema.scalar(t, "skip_transfer", False)), bool(schema.scalar(t, "prefix_cache", True)),
                           n=schema.scalar(t, "num_return_sequences", 1, int),
                           prompt_logprobs=bool(schema.scalar(t, "return_prompt_log_probs", False)),
                           kv_skip_tokens=schema.scalar(t, "kv_skip_tokens", 0, int))
        self.stage.submit(call, _Reply(sender, call.request_id, errors_as_data))

    def execute(self, requests):
        """Every request is answered through its response sender: prefill when its prompt is done (by the
        batcher thread), bad input at once with INVALID_ARG, a full queue UNAVAILABLE."""
        for r in requests:
            sender = r.get_response_sender()
            as_data = wants_error_data(r)
            try:
                self._queue(r, sender, as_data)
            except Exception as e:
                _answer_error(sender, e, r.request_id(), as_data)
        return None
