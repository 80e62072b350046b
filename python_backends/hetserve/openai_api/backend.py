"""The frontend's link to the prefill server: one gRPC stream to `llm` per request (tritonclient.grpc.aio, one
shared channel), at most `max_concurrent` at a time.

Cancelling the stream (client disconnect, or the frontend ending early) cancels the Triton request; `llm` sees
`is_cancelled()` at the next decode step and cancels its decode stream, so the decode server frees the sequence.
Errors: `llm` sends its typed error as data before the final Triton error (hetserve.errors; Triton's streaming
gRPC responses carry no status code), mapped here once by kind: bad_input -> 400, overloaded/unavailable -> 503 +
Retry-After (from retry_after_s), internal -> 500. An error without that data comes from Triton or the transport,
never from the client's request (the frontend builds the inputs): "unknown model"/"not found" -> 503 (misdeployed),
a failed call -> 502, anything else -> 500.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, List, Optional

import grpc

from .. import errors, retry
from ..client import build_inputs
from ..sampling import TokenLogprobs
from .schema import ApiError, GenRequest

log = logging.getLogger("hetserve.openai")

# The longest a whole answer may take per token it may hold: a decode step slower than this is broken, not slow.
WHOLE_ANSWER_S_PER_TOKEN = 1.0


@dataclass
class Delta:
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    index: int = 0                              # the choice (llm's sequence_index)
    logprobs: Optional[TokenLogprobs] = None    # aligned with token_ids, when asked
    prompt_logprobs: Optional[TokenLogprobs] = None  # prompt tokens 1.. (first response, when asked)


def api_error(err: "errors.HetserveError") -> ApiError:
    """A typed hetserve error -> the OpenAI error of its kind (the frontend's one mapping)."""
    if err.kind == errors.BAD_INPUT:
        return ApiError(400, err.message)
    if err.retryable:  # the message keeps the hint for people; Retry-After carries it for clients
        return ApiError(err.http_status, err.human(), "server_error", code="overloaded",
                        retry_after=retry.header_value(err.retry_after_s))
    return ApiError(err.http_status, err.message, "server_error", code="internal_error")


def classify(msg: str, call_failed: bool = False) -> ApiError:
    """An error that came without hetserve's typed data: Triton's own or the transport's."""
    if call_failed or "unknown model" in msg or "not found" in msg.lower():
        return ApiError(502 if call_failed else 503, f"inference server: {msg}", "server_error",
                        code="upstream_error", retry_after=None if call_failed else "1")
    return ApiError(500, f"inference server: {msg}", "server_error", code="internal_error")


class Overload:
    """Non-blocking admission: a request over `limit` is refused at once (503), never queued unboundedly."""

    def __init__(self, limit: int):
        self.limit, self.active = limit, 0

    def __enter__(self):
        if self.active >= self.limit:
            raise api_error(errors.Overloaded(f"frontend busy: {self.limit} requests in flight (--max-concurrent)",
                                              where="openai frontend"))
        self.active += 1
        return self

    def __exit__(self, *exc):
        self.active -= 1


class TritonLLM:
    def __init__(self, url: str, model: str = "llm", max_concurrent: int = 64, step_timeout_s: float = 60.0):
        self.url, self.model, self.step_timeout_s = url, model, step_timeout_s
        self.admission = Overload(max_concurrent)
        self._client = None

    def client(self):
        if self._client is None:  # created inside the server's event loop
            import tritonclient.grpc.aio as grpcaio

            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self):
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client().is_model_ready(self.model))
        except Exception as e:  # not reachable yet: not ready (the readiness probe asks again)
            log.debug("%s not ready at %s: %s", self.model, self.url, e)
            return False

    async def generate(self, req: GenRequest) -> AsyncIterator[Delta]:
        """Stream deltas until the final response; raises ApiError. Closing the generator early cancels the
        Triton request."""
        done = asyncio.Event()
        request = {"model_name": self.model, "inputs": build_inputs(None, **req.params()),
                   "request_id": req.request_id, "enable_empty_final_response": True,
                   "parameters": {errors.ERROR_DATA_PARAM: True}}  # typed errors also for whole answers

        async def requests():
            yield request
            await done.wait()  # keep our half of the stream open until the answer is complete

        # a whole answer (stream=false) arrives in one response after every token: bounded by the generation's
        # length (llm moves a decode stream silent for HETSERVE_DECODE_STEP_TIMEOUT_S, so it answers well before)
        wait_s = self.step_timeout_s if req.stream or req.num_return_sequences > 1 else \
            self.step_timeout_s + req.max_tokens * WHOLE_ANSWER_S_PER_TOKEN
        with self.admission:
            try:
                it = self.client().stream_infer(requests())
            except Exception as e:
                raise classify(str(e), call_failed=True) from None
            finished = False
            try:
                while True:
                    try:
                        result, err = await asyncio.wait_for(it.__anext__(), wait_s)
                    except asyncio.TimeoutError:
                        raise ApiError(504, f"no response from {self.model} for {wait_s:.0f}s",
                                       "server_error", code="timeout") from None
                    except StopAsyncIteration:
                        raise classify("stream ended before the final response", call_failed=True) from None
                    except grpc.RpcError as e:
                        raise classify(f"{e.code().name}: {e.details()}", call_failed=True) from None
                    if err is not None:
                        raise classify(err.message() if hasattr(err, "message") else str(err))
                    data = result.as_numpy(errors.ERROR_OUTPUT)
                    if data is not None and data.size:  # llm's typed error; its final Triton error follows
                        raise api_error(errors.from_wire(bytes(data.reshape(-1)[0])))
                    resp = result.get_response()
                    fp = resp.parameters.get("triton_final_response")
                    final = bool(fp and fp.bool_param)
                    txt = result.as_numpy("text_output")
                    ids = result.as_numpy("token_ids")
                    fr = result.as_numpy("finish_reason")
                    si = result.as_numpy("sequence_index")
                    lp = result.as_numpy("output_log_probs")
                    plp = result.as_numpy("prompt_log_probs")
                    yield Delta(txt.reshape(-1)[0].decode("utf-8", "replace") if txt is not None and txt.size else "",
                                [] if ids is None else [int(i) for i in ids.reshape(-1)],
                                (fr.reshape(-1)[0].decode() or None) if fr is not None and fr.size else
                                ("stop" if final and req.num_return_sequences == 1 else None),
                                int(si.reshape(-1)[0]) if si is not None and si.size else 0,
                                None if lp is None else TokenLogprobs.from_arrays(
                                    lp, result.as_numpy("top_logprob_ids"), result.as_numpy("top_logprob_values")),
                                None if plp is None else TokenLogprobs.from_arrays(
                                    plp, result.as_numpy("prompt_top_logprob_ids"),
                                    result.as_numpy("prompt_top_logprob_values")))
                    if final:
                        finished = True
                        return
            finally:
                done.set()
                if not finished:
                    it.cancel()  # client gone or error: Triton cancels the llm request -> decode frees it
