"""Client helpers: stream a generation from the `llm` (or `aggregated`) model over Triton gRPC."""
from __future__ import annotations

import json
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional


def admin_parameters() -> dict:
    """Request parameters that unlock the operator ops (doctor, planner --measure): the deployment admin key
    (HETSERVE_ADMIN_KEY or the local key file; checked by triton/common.is_admin)."""
    from .admin_key import ADMIN_PARAM, admin_key

    return {ADMIN_PARAM: admin_key()}


class GenerationError(RuntimeError):
    """A failed generation: the message, `kind` (hetserve.errors; None when the error did not come from
    hetserve, e.g. the transport failed), the gRPC status, `retry_after_s` for refusals and `where` it failed."""

    def __init__(self, msg: str, status: str = "", kind: Optional[str] = None,
                 retry_after_s: Optional[float] = None, where: str = ""):
        super().__init__(msg)
        self.status, self.kind, self.retry_after_s, self.where = status, kind, retry_after_s, where

    @classmethod
    def of(cls, err, prefix: str = "") -> "GenerationError":
        """From a HetserveError a server sent as data (errors.from_wire)."""
        from . import errors

        status = "StatusCode." + err.grpc_status
        return cls(prefix + err.message, status, err.kind,
                   err.retry_after_s if err.kind in errors.RETRYABLE else None, err.where)


def error_in(result) -> Optional["GenerationError"]:
    """The typed error a response carries as data (the `error` output, hetserve.errors), None when it has none."""
    from . import errors

    data = result.as_numpy(errors.ERROR_OUTPUT)
    if data is None or not data.size:
        return None
    return GenerationError.of(errors.from_wire(bytes(data.reshape(-1)[0])))


# A stream the transport tore down (the server, or a proxy's upstream, died mid-request) reaches tritonclient as
# INTERNAL "Stream removed (RST_STREAM ...)": no server answered, so it is retryable, i.e. UNAVAILABLE.
_TRANSPORT_LOST = ("stream removed", "rst_stream", "socket closed", "connection reset", "failed to connect")


def _status_of(e) -> str:
    """The status of an error that came without hetserve's typed error before it (Triton's own, or the
    transport's): a torn-down transport reads as UNAVAILABLE (no server answered; retryable)."""
    raw = e.status() if hasattr(e, "status") else None
    status = str(raw) if raw else ""
    msg = (e.message() if hasattr(e, "message") else str(e)) or ""
    if "UNAVAILABLE" not in status and any(k in msg.lower() for k in _TRANSPORT_LOST):
        return "StatusCode.UNAVAILABLE"
    return status


@dataclass
class Chunk:
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    t: float
    index: int = 0                 # sequence_index (num_return_sequences > 1)
    logprobs: Optional[list] = None  # output_log_probs of token_ids (return_log_probs)


@dataclass
class Generation:
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    ttft_s: Optional[float] = None
    total_s: float = 0.0
    chunks: int = 0

    @property
    def tpot_s(self) -> Optional[float]:
        n = len(self.token_ids)
        if n < 2 or self.ttft_s is None:
            return None
        return (self.total_s - self.ttft_s) / (n - 1)


# models with a `stream` input (default false = one final response); stream() asks them to stream
STREAM_INPUT_MODELS = ("llm", "ensemble")


def build_inputs(prompt: Optional[str], **params):
    """tritonclient InferInputs for `text_input` = prompt and each named input (dtypes from hetserve.schema;
    None values are left out)."""
    import tritonclient.grpc as grpcclient

    from . import schema

    ins = []
    for name, value in ([("text_input", prompt)] if prompt is not None else []) + list(params.items()):
        if value is None:
            continue
        if name not in schema.INPUTS:
            raise ValueError(f"unknown input {name!r} (hetserve.schema.INPUTS lists them)")
        arr = schema.array(name, value)
        x = grpcclient.InferInput(name, list(arr.shape), schema.INPUTS[name].client_dtype)
        x.set_data_from_numpy(arr)
        ins.append(x)
    return ins


def stream(url: str, prompt: Optional[str], model: str = "llm", timeout_s: float = 120.0,
           triton_request_id: str = "", **params) -> Iterator[Chunk]:
    """Stream a generation. `triton_request_id` is the Triton request's id (the llm prefixes its internal id with
    it, so it finds the request in every server's log); `params` are model inputs (request_id among them is the
    decode model's input, not this)."""
    import tritonclient.grpc as grpcclient

    if model in STREAM_INPUT_MODELS:
        params.setdefault("stream", True)
    client = grpcclient.InferenceServerClient(url)
    q: "queue.Queue" = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, build_inputs(prompt, **params), request_id=triton_request_id,
                                  enable_empty_final_response=True)
        while True:
            try:
                r, e = q.get(timeout=timeout_s)
            except queue.Empty:
                raise GenerationError(f"no response from {model} within {timeout_s}s", "TIMEOUT") from None
            if e is not None:
                raise GenerationError(e.message() if hasattr(e, "message") else str(e), _status_of(e))
            typed = error_in(r)
            if typed is not None:  # hetserve's typed error; the final Triton error response follows
                raise typed
            resp = r.get_response()
            fp = resp.parameters.get("triton_final_response")
            final = bool(fp and fp.bool_param)
            txt = r.as_numpy("text_output")
            ids = r.as_numpy("token_ids")
            fr = r.as_numpy("finish_reason")
            si = r.as_numpy("sequence_index")
            lp = r.as_numpy("output_log_probs")
            yield Chunk(txt.reshape(-1)[0].decode("utf-8") if txt is not None and txt.size else "",
                        [] if ids is None else [int(i) for i in ids.reshape(-1)],
                        fr.reshape(-1)[0].decode() if fr is not None and fr.size else None, time.perf_counter(),
                        int(si.reshape(-1)[0]) if si is not None and si.size else 0,
                        None if lp is None else [float(x) for x in lp.reshape(-1)])
            if final:
                return
    finally:
        try:
            client.stop_stream()
        finally:
            client.close()


def generate(url: str, prompt: Optional[str], model: str = "llm", **params) -> Generation:
    g = Generation()
    t0 = time.perf_counter()
    for c in stream(url, prompt, model=model, **params):
        g.chunks += 1
        if c.token_ids and g.ttft_s is None:
            g.ttft_s = c.t - t0
        g.text += c.text
        g.token_ids += c.token_ids
        if c.finish_reason:
            g.finish_reason = c.finish_reason
    g.total_s = time.perf_counter() - t0
    return g


def stream_once(url: str, model: str, inputs, timeout_s: float, request_id: str = "",
                parameters: Optional[dict] = None):
    """One request to a decoupled model over its own gRPC stream; returns the first response (the diagnostic ops
    answer with a single final one). Raises TimeoutError after `timeout_s`, GenerationError on an error."""
    import tritonclient.grpc as grpcclient

    q: "queue.Queue" = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=timeout_s)
        c.async_stream_infer(model, inputs, request_id=request_id, parameters=parameters)
        try:
            result, err = q.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{model} at {url}: no response within {timeout_s:.1f}s") from None
        if err is not None:
            msg = err.message() if hasattr(err, "message") else str(err)
            raise GenerationError(f"{model} at {url}: {msg}", (err.status() if hasattr(err, "status") else "") or "")
        typed = error_in(result)
        if typed is not None:
            typed.args = (f"{model} at {url}: {typed}",)
            raise typed
        return result
    finally:
        try:
            c.stop_stream(cancel_requests=True)
        except Exception as e:  # the stream is already gone: nothing to stop
            logging.getLogger("hetserve.client").debug("stop_stream: %s", e)
        c.close()


def decode_json_op(url: str, op: str, timeout_s: float) -> dict:
    """A decode server op that answers JSON (stats, prefix) over its own gRPC stream."""
    r = stream_once(url, "decode", build_inputs(None, op=op), timeout_s, op)
    return json.loads(bytes(r.as_numpy("op_json").reshape(-1)[0]))
