"""llm (prefill server, decoupled BLS orchestrator): preprocess -> prefill (KV pushed to decode) -> decode
stream over gRPC -> incremental detokenisation -> streamed text.

Control plane only: KV bytes go prefill -> decode directly, once; this model moves token ids.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import uuid

import numpy as np

import triton_python_backend_utils as pb_utils

from ..engines.manifest import read_manifest
from ..model.checkpoint import LlamaConfig
from ..sampling import is_stop_token
from .common import (RequestError, check_prompt, classify, engine_dir, error, inp, sampling_params,
                     sampling_tensors, scalar, str_tensor, tokenizer)
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
                raise TimeoutError(f"decode server sent nothing for {timeout_s:.0f}s") from None
            if err is not None:
                raise RuntimeError(f"decode: {err}")
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
        self.decode_urls = os.environ.get("HETSERVE_DECODE_URL", "127.0.0.1:9001").split(",")
        self.default_precision = os.environ.get("HETSERVE_DECODE_PRECISION", "fp32")
        self.step_timeout_s = float(os.environ.get("HETSERVE_DECODE_STEP_TIMEOUT_S", "30"))
        self._rr = 0
        tokenizer()

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

    def _handle(self, r, sender):
        tok = tokenizer()
        params = None
        streamer = None
        try:
            params = sampling_params(r)
            streamer = TextStreamer(sender, tok, params, self.cfg.eos_token_ids, model="llm")
            prompt = self._prompt_ids(r)
            check_prompt(prompt, self.cfg, params.max_tokens)
            precision = scalar(r, "decode_precision", None, str) or self.default_precision
            url = self.decode_urls[self._rr % len(self.decode_urls)]
            self._rr += 1
            rid = f"{uuid.uuid4().hex}"
            pf_in = [pb_utils.Tensor("input_ids", np.asarray(prompt, np.int32)), str_tensor("request_id", [rid]),
                     str_tensor("decode_url", [url])]
            for name in ("transport", "kv_dtype"):
                v = scalar(r, name, None, str)
                if v:
                    pf_in.append(str_tensor(name, [v]))
            pf_in += [pb_utils.Tensor(n, a) for n, a in sampling_tensors(params)]
            pf = _bls("prefill", pf_in, ["first_token", "transfer_ok"])
            first = int(pf["first_token"].reshape(-1)[0])
            stop_now = is_stop_token(first, params, self.cfg.eos_token_ids) or params.max_tokens == 1
            if not streamer.push([first], ("stop" if is_stop_token(first, params, self.cfg.eos_token_ids)
                                           else "length") if stop_now else None):
                return
            ds = DecodeStream(url)
            cancel = False
            try:
                ds.start(rid, prompt, [first], params, precision)
                for toks, reason in ds.responses(self.step_timeout_s):
                    if getattr(sender, "is_cancelled", lambda: False)():
                        cancel = True
                        return
                    if not streamer.push(toks, reason):
                        cancel = reason is None or streamer.finish_reason != reason
                        return
            finally:
                ds.close(cancel=cancel)
            streamer.finish("stop")
        except Exception as e:
            code = classify(e)
            if code == pb_utils.TritonError.INTERNAL:
                log.exception("llm request failed")
            if streamer is not None and streamer.finish_reason is not None:
                return
            err = error(str(e), code)
            try:
                if streamer is not None:
                    streamer.fail(err)
                else:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                pass

    def execute(self, requests):
        for r in requests:
            threading.Thread(target=self._handle, args=(r, r.get_response_sender()), daemon=True).start()
        return None
