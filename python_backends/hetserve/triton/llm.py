"""llm (prefill server, decoupled BLS orchestrator): the Triton binding of stages/orchestrator.py.

This file converts tensors <-> the stage's dataclasses and provides its neighbours: prefill and preprocess
through BLS on this server, decode servers over gRPC (stages/grpc_decode.py), the pool and breaker from
reliability.py, Triton metrics.

`stream` input (bool, TensorRT-LLM ensemble convention), default false: the model then sends exactly one final
response (whole text, all token ids, finish_reason), which is what Triton's HTTP `/generate` endpoint requires
and what a plain Triton user tries first. stream=true sends one response per decode step (what `generate_stream`
and gRPC streaming clients want for TTFT; hetserve's own clients always ask for it).
Errors (hetserve.errors) end the stream typed: with stream=true a response carrying the error as data (kind,
message, where, retry_after_s) precedes the final Triton error, whose code is the kind's (bad input
INVALID_ARG, refusals UNAVAILABLE with a "retry after N s" hint, our failures INTERNAL, logged here with the
request id). A stream=false client that reads responses from a gRPC stream (the OpenAI frontend) sets the request
parameter errors.ERROR_DATA_PARAM to get the typed error as data too.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config, errors, schema
from ..engines.manifest import read_manifest
from ..errors import Overloaded
from ..model.checkpoint import LlamaConfig
from ..reliability import CircuitBreaker, DecodePool, canary_check
from ..sampling import MAX_CHOICES, TokenLogprobs
from ..stages.grpc_decode import GrpcDecodeClient
from ..stages.orchestrator import REQUEST_ERRORS_METRIC, TRANSFER_FAILED_METRIC, Orchestrator, OrchestratorConfig
from ..stages.router import (
    PREFILL_PLACEMENT_METRIC,
    ROUTER_HIT_TOKENS_METRIC,
    ROUTER_LOOKUP_METRIC,
    PrefixRouter,
    Refresher,
    RouterConfig,
)
from ..stages.types import GenerateRequest, PrefillJob, PrefillResult
from ..structured import GuideSpec
from ..tokenizer import encode_prompt
from .common import (
    PREFILL_HOP,
    RequestError,
    engine_dir,
    internal_token,
    log_if_ours,
    raise_bls_failure,
    send_error,
    str_tensor,
    tensors_of,
    tokenizer,
    wants_error_data,
)
from .metrics import REGISTRY
from .streaming import ChoiceSender, TextStreamer

log = logging.getLogger("hetserve.llm")


def _bls(model, inputs, outputs):
    """One BLS request that asks for failures as data (request parameter errors.ERROR_DATA_PARAM, the `error`
    output): the kind stays intact, where Triton 2.51's BLS makes every error code INTERNAL
    (triton-inference-server/server#7804)."""
    resp = pb_utils.InferenceRequest(model_name=model, inputs=inputs,
                                     requested_output_names=outputs + [errors.ERROR_OUTPUT],
                                     parameters={errors.ERROR_DATA_PARAM: True}).exec()
    raise_bls_failure(model, resp)
    return {n: (None if (t := pb_utils.get_output_tensor_by_name(resp, n)) is None else t.as_numpy())
            for n in outputs}


def _wants_stream(r) -> bool:
    """The request's `stream` input (default false); false when it cannot be read (the error is sent once)."""
    try:
        return bool(schema.scalar(tensors_of(r, "llm"), "stream", schema.INPUTS["stream"].default))
    except (ValueError, TypeError, errors.HetserveError):  # a malformed `stream` input: answer once
        return False



def _errors_as_data(r) -> bool:
    return _wants_stream(r) or wants_error_data(r)


class BlsPrefill:
    """PrefillClient: the `prefill` model on this server, through BLS."""

    def __init__(self):
        self.token = internal_token(PREFILL_HOP)  # lets prefill accept the decode_url we pick

    def prefill(self, job: PrefillJob) -> PrefillResult:
        ins = [pb_utils.Tensor("input_ids", np.asarray(job.prompt, np.int32)),
               str_tensor("request_id", [job.request_id]), str_tensor("decode_url", [job.decode_url]),
               str_tensor("internal_token", [self.token])]
        for name, value in (("transport", job.transport), ("kv_dtype", job.kv_dtype)):
            if value:
                ins.append(str_tensor(name, [value]))
        if job.n > 1:
            ins.append(pb_utils.Tensor("num_return_sequences", np.array([job.n], np.int32)))
        if job.prompt_logprobs:
            ins.append(pb_utils.Tensor("return_prompt_log_probs", np.array([True])))
        if job.kv_skip_tokens:
            ins.append(pb_utils.Tensor("kv_skip_tokens", np.array([job.kv_skip_tokens], np.int32)))
        ins += [pb_utils.Tensor(n, a) for n, a in schema.sampling_arrays(job.params)]
        names = ["first_token", "transfer_ok", "transport_used"]
        if job.params.wants_logprobs:
            names += ["output_log_probs", "top_logprob_ids", "top_logprob_values"]
        if job.prompt_logprobs:
            names += ["prompt_log_probs", "prompt_top_logprob_ids", "prompt_top_logprob_values"]
        out = _bls("prefill", ins, names)
        used = out["transport_used"]
        firsts = [int(x) for x in out["first_token"].reshape(-1)]
        lps = []
        if job.params.wants_logprobs and out.get("output_log_probs") is not None:
            all_lp = TokenLogprobs.from_arrays(out["output_log_probs"], out["top_logprob_ids"],
                                               out["top_logprob_values"])
            lps = [TokenLogprobs([all_lp.logprob[i]], [all_lp.top_ids[i]], [all_lp.top_values[i]])
                   for i in range(len(all_lp))]
        plp = (TokenLogprobs.from_arrays(out["prompt_log_probs"], out["prompt_top_logprob_ids"],
                                         out["prompt_top_logprob_values"]) if job.prompt_logprobs else None)
        return PrefillResult(firsts[0], bool(out["transfer_ok"].reshape(-1)[0]),
                             bytes(used.reshape(-1)[0]).decode() if used is not None and used.size else "",
                             first_tokens=firsts, first_logprobs=lps, prompt_logprobs=plp)


class Sink(TextStreamer):
    """TokenSink over the request's response sender (stream=true: one response per step). n > 1: choice(i) is
    choice i's sink over one ChoiceSender (each response says its sequence_index; FINAL comes once)."""

    def cancelled(self) -> bool:
        return bool(getattr(self.sender, "is_cancelled", lambda: False)())

    def choice(self, i: int) -> "Sink":
        if not isinstance(self.sender, ChoiceSender):
            raise RuntimeError("choice() of a sink made for one choice")
        s = Sink(self.sender, self.tok, self.params.for_choice(i), self.eos_ids, self.model, index=i)
        if i == 0 and self._prompt_lps is not None:  # the prompt's logprobs go out once, with choice 0
            s.prompt_logprobs(self._prompt_lps)
        return s


class WholeAnswer(Sink):
    """stream=false: hold every step back and send one final response with the whole answer (text_output = the
    full text, token_ids = output_ids = all generated ids, their logprobs when asked), so exactly one response
    reaches the client."""

    streaming = False
    _all_logprobs: Optional[TokenLogprobs] = None

    def _send(self, delta, new, final, logprobs=None):
        if logprobs is not None:
            if self._all_logprobs is None:
                self._all_logprobs = TokenLogprobs()
            self._all_logprobs.extend(logprobs)
        if final:
            super()._send(self.text, list(self.ids), final=True, logprobs=self._all_logprobs)


class TritonPythonModel:
    def initialize(self, args):
        man = read_manifest(engine_dir())
        self.cfg = LlamaConfig.from_dict(man["config"])
        # unset: None, so each decode server applies its own default (HETSERVE_DECODE_PRECISION or its first engine)
        self.default_precision = config.get("HETSERVE_DECODE_PRECISION")
        self.max_inflight = int(config.get("HETSERVE_LLM_MAX_INFLIGHT"))
        self._slots = threading.BoundedSemaphore(self.max_inflight)
        # one worker per request in flight (each blocks on its decode stream), reused: a thread started per
        # request was a tenth of this stub's CPU (loadtest/stack_cpu.py --profile)
        self._workers = concurrent.futures.ThreadPoolExecutor(self.max_inflight, thread_name_prefix="llm-request")
        REGISTRY.set("hetserve_breaker_state", 0)
        REGISTRY.declare(TRANSFER_FAILED_METRIC, reason="transfer_failed", transport="grpc")
        for kind in errors.KINDS:
            REGISTRY.declare(REQUEST_ERRORS_METRIC, kind=kind)
        breaker = CircuitBreaker.from_env(on_state=lambda st: REGISTRY.set("hetserve_breaker_state", st))
        self.decode_client = GrpcDecodeClient()
        # the health canary rides the decode client's shared stream: a canary that times out on a stalled server
        # is forgotten, not cancelled (grpc_streams' docstring)
        self.pool = DecodePool.from_env(
            on_change=self._pool_metrics, check=lambda url, t: canary_check(url, t, self.decode_client.op),
            on_fallback=lambda req, used, why: REGISTRY.inc(
                "hetserve_kv_transport_fallbacks_total", requested=req, used=used, reason=why))
        self._pool_metrics(self.pool.snapshot())
        self.router, self.refresher = self._kv_router(man["compat_hash"])
        step_timeout_s = float(config.get("HETSERVE_DECODE_STEP_TIMEOUT_S"))
        self.stage = Orchestrator(
            BlsPrefill(), self.decode_client, self.pool, breaker, self.cfg.eos_token_ids,
            OrchestratorConfig(step_timeout_s=step_timeout_s,
                               # well inside the step timeout: a paced stream must not look stalled
                               whole_answer_send_interval_s=min(config.get("HETSERVE_WHOLE_ANSWER_SEND_MS") / 1e3,
                                                                step_timeout_s / 4),
                               max_migrations=int(config.get("HETSERVE_MAX_MIGRATIONS"))),
            metrics=REGISTRY, router=self.router, lookup=self._prefix_lookup())
        tokenizer()

    def _prefix_lookup(self):
        """The router's lookup on a miss: every healthy decode server asked at once (HETSERVE_ROUTER_LOOKUP_MS)."""
        wait_s = float(config.get("HETSERVE_ROUTER_LOOKUP_MS")) / 1e3
        if self.router is None or wait_s <= 0:
            return None

        def lookup(prompt):
            healthy = [u for u, m in self.pool.snapshot().items() if m.healthy]
            return self.decode_client.held_tokens(healthy, prompt, wait_s)
        return lookup

    def _kv_router(self, compat_hash: str):
        """The KV-aware router and the thread that reads the decode servers' block lists (HETSERVE_KV_ROUTING)."""
        for where in ("prefill", "decode"):
            REGISTRY.declare(PREFILL_PLACEMENT_METRIC, where=where)
        REGISTRY.declare(ROUTER_HIT_TOKENS_METRIC)
        for result in ("found", "none"):
            REGISTRY.declare(ROUTER_LOOKUP_METRIC, result=result)
        if not config.get("HETSERVE_KV_ROUTING"):
            return None, None
        router = PrefixRouter(int(config.get("HETSERVE_PREFIX_BLOCK_TOKENS")), compat_hash, RouterConfig.from_env())
        timeout_s = float(config.get("HETSERVE_HEALTH_TIMEOUT_S"))
        refresher = Refresher(router, lambda: {u: m.healthy for u, m in self.pool.snapshot().items()},
                              lambda url: self.decode_client.json_op(url, "prefix", timeout_s),
                              float(config.get("HETSERVE_ROUTER_REFRESH_S")))
        return router, refresher

    def finalize(self):
        if self.refresher is not None:
            self.refresher.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.decode_client.close()
        self.pool.close()
        REGISTRY.close()  # last: metrics released while the stub still takes the deletes

    @staticmethod
    def _pool_metrics(members):
        up = sum(1 for m in members.values() if m.healthy)
        REGISTRY.set("hetserve_decode_servers", up, state="healthy")
        REGISTRY.set("hetserve_decode_servers", len(members) - up, state="down")

    @staticmethod
    def _prompt_ids(t) -> list:
        ids = schema.int_list(t, "input_ids")
        if ids:
            return ids
        if t.get("text_input") is None:
            raise RequestError("provide 'text_input' (or 'input_ids')")
        return encode_prompt(tokenizer(), schema.scalar(t, "text_input", None, str),
                             bool(schema.scalar(t, "apply_chat_template", True)))

    def _handle(self, r, sender):
        streamer = None
        try:
            try:
                t = tensors_of(r, "llm")
                params = schema.sampling_params(t)
                n = schema.scalar(t, "num_return_sequences", 1, int)
                streaming = bool(schema.scalar(t, "stream", schema.INPUTS["stream"].default))
                if not 1 <= n <= MAX_CHOICES:
                    raise RequestError(f"num_return_sequences must be in [1, {MAX_CHOICES}], got {n}")
                if n > 1 and not streaming:
                    raise RequestError("num_return_sequences > 1 needs stream=true (each choice's responses carry "
                                       "its sequence_index; HTTP /generate takes exactly one response)")
                if params.guide_type:  # a malformed guide is the client's 400 here, before any prefill
                    GuideSpec.parse(params.guide_type, params.guide)
                cls = Sink if streaming else WholeAnswer
                streamer = cls(ChoiceSender(sender, n) if n > 1 else sender, tokenizer(), params,
                               self.cfg.eos_token_ids, model="llm")
                streamer.error_data = wants_error_data(r)
                precision = schema.scalar(t, "decode_precision", None, str) or self.default_precision
                transport = schema.scalar(t, "transport", None, str) or None
                kv_dtype = schema.scalar(t, "kv_dtype", None, str) or None
            except Exception as e:  # the request's own fields
                raise errors.parse_failure(e, "llm request") from e
            prompt = self._prompt_ids(t)
            schema.check_prompt(prompt, self.cfg, params.max_tokens)
            params.check_vocab(self.cfg.vocab_size)
            self.stage.run(GenerateRequest(prompt, params, precision, transport, kv_dtype, r.request_id(), n=n,
                                           prompt_logprobs=bool(schema.scalar(t, "return_prompt_log_probs", False))),
                           streamer, t0=streamer.t0)
        except Exception as e:
            log_if_ours(log, e, "llm", r.request_id())
            if streamer is not None and streamer.finish_reason is not None:
                return  # answered already (the sink finished before the failure)
            if streamer is not None:
                streamer.fail(e)
            else:
                send_error(sender, e, as_data=_errors_as_data(r))

    def _run(self, r, sender):
        try:
            self._handle(r, sender)
        finally:
            self._slots.release()

    def execute(self, requests):
        # one thread per request (each blocks on its decode stream), at most max_inflight of them: beyond that
        # the request is refused at once as overload instead of piling up threads
        for r in requests:
            sender = r.get_response_sender()
            if not self._slots.acquire(blocking=False):
                send_error(sender, Overloaded(f"llm busy: {self.max_inflight} requests in flight "
                                              "(HETSERVE_LLM_MAX_INFLIGHT)", where="llm"),
                           as_data=_errors_as_data(r))
                continue
            self._workers.submit(self._run, r, sender)
        return None
