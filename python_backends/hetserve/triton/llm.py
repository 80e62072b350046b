"""llm (prefill server, decoupled BLS orchestrator): preprocess -> prefill (KV pushed to decode) -> decode
stream over gRPC -> incremental detokenisation -> streamed text.

Control plane only: KV bytes go prefill -> decode directly, once; this model moves token ids.
Reliability (see reliability.py): decode servers come from a health-checked pool and are picked by load; the
circuit breaker refuses requests at once (UNAVAILABLE) while latency or queues are out of bounds; when a decode
server fails or stalls mid-stream the request moves to another one, which resumes from the KV snapshot or by
recomputing prompt + tokens so far, and the client keeps one uninterrupted stream.

`stream` input (bool, TensorRT-LLM ensemble convention), default false: the model then sends exactly one final
response (whole text, all token ids, finish_reason), which is what Triton's HTTP `/generate` endpoint requires
and what a plain Triton user tries first. stream=true sends one response per decode step (what `generate_stream`
and gRPC streaming clients want for TTFT; hetserve's own clients always ask for it).
Overload refusals (breaker open, no decode server, queues full) are UNAVAILABLE and carry a "retry after N s"
hint (hetserve.retry) that HTTP frontends turn into 503 + Retry-After.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
import uuid

import numpy as np

import triton_python_backend_utils as pb_utils

from .. import retry
from ..engines.manifest import read_manifest
from ..model.checkpoint import LlamaConfig
from ..reliability import BreakerOpen, CircuitBreaker, DecodePool
from ..sampling import is_stop_token
from ..scheduler import Overloaded
from .common import (PREFILL_HOP, RequestError, check_prompt, classify, engine_dir, error, inp, internal_token,
                     sampling_params, sampling_tensors, scalar, str_tensor, tokenizer)
from .metrics import REGISTRY
from .streaming import TextStreamer

log = logging.getLogger("hetserve.llm")


def _bls(model, inputs, outputs):
    resp = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs).exec()
    if resp.has_error():
        err = resp.error()
        if err.code() == pb_utils.TritonError.INVALID_ARG:
            raise RequestError(err.message())
        raise RuntimeError(f"{model}: {err.message()}")
    return {n: pb_utils.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}


class WholeAnswer(TextStreamer):
    """stream=false: hold every step back and send one final response with the whole answer (text_output = the
    full text, token_ids = output_ids = all generated ids), so exactly one response reaches the client."""

    def _send(self, delta, new, final):
        if final:
            super()._send(self.text, list(self.ids), final=True)


class DecodeFailed(RuntimeError):
    """The decode server failed, went away or stalled mid-stream: move the request to another one."""


def _stream_error(err) -> Exception:
    """Classify a decode-stream error. A gRPC status means the call itself failed (server gone, stream broken,
    deadline): migrate. No status means the decode model answered with an error response: its verdict stands
    (bad input), except "overloaded" refusals, which another server may accept."""
    status = str(getattr(err, "status", lambda: "")() or "")
    msg = str(getattr(err, "message", lambda: str(err))() or err)
    if re.search(r"overloaded|queue full|budget", msg, re.I) and "INVALID_ARG" not in status:
        return Overloaded(msg)
    if not status or "INVALID_ARG" in status:
        return RequestError(msg)
    return DecodeFailed(f"{status}: {msg}")


class DecodeStream:
    """gRPC stream to the decode server's `decode` model for one request."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.q: "queue.Queue" = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def start(self, rid, prompt, out_ids, params, precision):
        from ..client import build_inputs

        ins = build_inputs(None, op="generate", request_id=rid, input_ids=prompt, output_ids=out_ids,
                           precision=precision, **dict(sampling_tensors(params)))
        self.client.async_stream_infer("decode", ins, request_id=rid, enable_empty_final_response=True)

    def responses(self, timeout_s: float):
        """Yields (token_ids, finish_reason|None) until the final response."""
        while True:
            try:
                result, err = self.q.get(timeout=timeout_s)
            except queue.Empty:
                raise DecodeFailed(f"decode server sent nothing for {timeout_s:.1f}s") from None
            if err is not None:
                raise _stream_error(err)
            resp = result.get_response()
            final = resp.parameters.get("triton_final_response")
            final = bool(final and final.bool_param)
            toks = result.as_numpy("token_ids")
            fr = result.as_numpy("finish_reason")
            reason = fr.reshape(-1)[0].decode() if fr is not None and fr.size else None
            yield ([] if toks is None else [int(x) for x in toks.reshape(-1)]), (reason or ("stop" if final else None))
            if final:
                return

    def close(self, cancel: bool = False):
        try:
            self.client.stop_stream(cancel_requests=cancel)
        except TypeError:
            self.client.stop_stream()
        except Exception:
            pass
        try:
            self.client.close()
        except Exception:
            pass


class TritonPythonModel:
    def initialize(self, args):
        man = read_manifest(engine_dir())
        self.cfg = LlamaConfig.from_dict(man["config"])
        self.prefill_token = internal_token(PREFILL_HOP)  # lets prefill accept the decode_url we pick
        self.default_precision = os.environ.get("HETSERVE_DECODE_PRECISION", "fp32")
        self.step_timeout_s = float(os.environ.get("HETSERVE_DECODE_STEP_TIMEOUT_S", "30"))
        self.max_migrations = int(os.environ.get("HETSERVE_MAX_MIGRATIONS", "3"))
        self.max_inflight = int(os.environ.get("HETSERVE_LLM_MAX_INFLIGHT", "256"))
        self._slots = threading.BoundedSemaphore(self.max_inflight)
        REGISTRY.set("hetserve_breaker_state", 0)
        self.breaker = CircuitBreaker.from_env(on_state=lambda st: REGISTRY.set("hetserve_breaker_state", st))
        self.pool = DecodePool.from_env(on_change=self._pool_metrics, on_fallback=lambda req, used, why: REGISTRY.inc(
            "hetserve_kv_transport_fallbacks_total", requested=req, used=used, reason=why))  # kv transport hunk
        self._pool_metrics(self.pool.snapshot())
        tokenizer()

    def finalize(self):
        self.pool.close()

    @staticmethod
    def _pool_metrics(members):
        up = sum(1 for m in members.values() if m.healthy)
        REGISTRY.set("hetserve_decode_servers", up, state="healthy")
        REGISTRY.set("hetserve_decode_servers", len(members) - up, state="down")

    def _prompt_ids(self, r):
        ids = inp(r, "input_ids")
        if ids is not None and ids.size:
            return [int(x) for x in ids.reshape(-1)]
        text = inp(r, "text_input")
        if text is None:
            raise RequestError("provide 'text_input' (or 'input_ids')")
        ins = [pb_utils.Tensor("text_input", text)]
        act = inp(r, "apply_chat_template")
        if act is not None:
            ins.append(pb_utils.Tensor("apply_chat_template", act))
        return [int(x) for x in _bls("preprocess", ins, ["input_ids"])["input_ids"].reshape(-1)]

    def _prefill(self, r, rid, prompt, params, url):
        pf_in = [pb_utils.Tensor("input_ids", np.asarray(prompt, np.int32)), str_tensor("request_id", [rid]),
                 str_tensor("decode_url", [url]), str_tensor("internal_token", [self.prefill_token])]
        # the transport negotiated with this decode member (kv/transport; a fallback is counted + logged)
        pf_in.append(str_tensor("transport", [self.pool.transport_for(url, scalar(r, "transport", None, str))]))
        v = scalar(r, "kv_dtype", None, str)
        if v:
            pf_in.append(str_tensor("kv_dtype", [v]))
        pf_in += [pb_utils.Tensor(n, a) for n, a in sampling_tensors(params)]
        return int(_bls("prefill", pf_in, ["first_token", "transfer_ok"])["first_token"].reshape(-1)[0])

    def _release(self, url, rid):
        """Tell the decode server to drop KV it holds for `rid` (off this thread; best effort, else its TTL)."""
        from ..client import build_inputs, stream_once

        def go():
            try:
                stream_once(url, "decode", build_inputs(None, op="release", request_id=rid), 10.0, rid)
            except Exception as e:
                log.info("release of %s on %s failed (%s); its pending TTL frees it", rid, url, e)
        threading.Thread(target=go, daemon=True).start()

    def _decode(self, sender, streamer, rid, prompt, tokens, params, precision, lease):
        """Stream from decode servers until the sequence ends; on failure migrate to another server.
        lease[0] is the pool member in use (released by the caller)."""
        tried = []
        migrations = 0
        while True:
            url = lease[0]
            ds = DecodeStream(url)
            cancel = False
            try:
                ds.start(rid, prompt, list(tokens), params, precision)
                for toks, reason in ds.responses(self.step_timeout_s):
                    if getattr(sender, "is_cancelled", lambda: False)():
                        cancel = True
                        return
                    tokens.extend(toks)
                    if not streamer.push(toks, reason):
                        cancel = reason is None or streamer.finish_reason != reason
                        return
                streamer.finish("stop")
                return
            except (DecodeFailed, Overloaded) as e:
                cancel = True
                overloaded = isinstance(e, Overloaded)
                if not overloaded:
                    self.pool.mark_down(url, str(e))
                tried.append(url)
                migrations += 1
                if migrations > self.max_migrations:
                    raise
                self.pool.release(url)
                lease[0] = None
                try:
                    lease[0] = self.pool.pick(exclude=tried)
                except Exception:
                    if overloaded:
                        raise e from None
                    raise
                log.warning("request %s: %s; resuming after %d tokens on %s", rid, e, len(tokens), lease[0])
                REGISTRY.inc("hetserve_migrations_total")
            finally:
                ds.close(cancel=cancel)

    def _handle(self, r, sender):
        tok = tokenizer()
        params = None
        streamer = None
        lease = [None]  # the decode server in use
        probe = False
        try:
            params = sampling_params(r)
            cls = TextStreamer if bool(scalar(r, "stream", False)) else WholeAnswer
            streamer = cls(sender, tok, params, self.cfg.eos_token_ids, model="llm")
            prompt = self._prompt_ids(r)
            check_prompt(prompt, self.cfg, params.max_tokens)
            precision = scalar(r, "decode_precision", None, str) or self.default_precision
            self.breaker.allow()  # raises BreakerOpen -> UNAVAILABLE at once
            probe = True
            lease[0] = self.pool.pick()
            rid = f"{uuid.uuid4().hex}"
            first = self._prefill(r, rid, prompt, params, lease[0])
            self.breaker.record(time.perf_counter() - streamer.t0)
            probe = False
            stop_now = is_stop_token(first, params, self.cfg.eos_token_ids) or params.max_tokens == 1
            if not streamer.push([first], ("stop" if is_stop_token(first, params, self.cfg.eos_token_ids)
                                           else "length") if stop_now else None) \
                    or getattr(sender, "is_cancelled", lambda: False)():
                self._release(lease[0], rid)  # no decode for this request: free the KV pushed to decode
                return
            self._decode(sender, streamer, rid, prompt, [first], params, precision, lease)
        except Exception as e:
            code = classify(e)
            if isinstance(e, BreakerOpen):
                REGISTRY.inc("hetserve_breaker_rejections_total")
            elif not isinstance(e, RequestError):
                self.breaker.record_failure(overloaded=isinstance(e, Overloaded))
                probe = False
            if code == pb_utils.TritonError.INTERNAL:
                log.exception("llm request failed")
            if streamer is not None and streamer.finish_reason is not None:
                return
            msg = retry.hint(str(e)) if code == pb_utils.TritonError.UNAVAILABLE else str(e)
            err = error(msg, code)
            try:
                if streamer is not None:
                    streamer.fail(err)
                else:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                pass
        finally:
            if probe:
                self.breaker.release_probe()
            if lease[0] is not None:
                self.pool.release(lease[0])

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
                msg = retry.hint(f"llm busy: {self.max_inflight} requests in flight (HETSERVE_LLM_MAX_INFLIGHT)")
                sender.send(pb_utils.InferenceResponse(output_tensors=[],
                                                       error=error(msg, pb_utils.TritonError.UNAVAILABLE)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            threading.Thread(target=self._run, args=(r, sender), daemon=True).start()
        return None
