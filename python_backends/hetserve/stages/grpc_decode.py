"""DecodeClient over Triton gRPC: the orchestrator's link to a decode server's `decode` model (tritonclient,
no Triton Python-backend import)."""
from __future__ import annotations

import json
import logging
import queue
from typing import Any, Dict, Iterator, Optional, Sequence

from .. import config, errors
from ..grpc_streams import CallFailed, SharedStream, StreamHub, describe, is_final, typed_error
from ..sampling import TokenLogprobs
from .types import DecodeFailed, DecodeRequest, TokenChunk

log = logging.getLogger("hetserve.orchestrator")
RELEASE_TIMEOUT_S = 10.0
# responses buffered per stream: decode sends one per step and the orchestrator drains them as they come;
# past this the decode side is far ahead of a stuck consumer, which the step timeout then reports
MAX_BUFFERED = 4096


def stream_error(err) -> Exception:
    """A stream error that came without the decode model's typed error before it (send_error sends that first,
    and responses() raises it): the call itself failed (server gone, stream broken, deadline) or Triton refused
    it (model not loaded): the server cannot serve it, so migrate."""
    return DecodeFailed(describe(err))


def generate_request(req: DecodeRequest) -> dict:
    """The stream_infer request (tritonclient.grpc.aio) of a DecodeRequest: op=generate on the `decode` model."""
    from .. import schema
    from ..client import build_inputs

    ins = build_inputs(None, op="generate", request_id=req.request_id, input_ids=req.prompt,
                       output_ids=req.output_ids or None, precision=req.precision,
                       kv_sent=None if req.kv_sent else False, kv_key=req.kv_key,
                       kv_shares=req.kv_shares if req.kv_shares > 1 else None,
                       send_interval_ms=round(req.send_interval_s * 1e3) if req.send_interval_s > 0 else None,
                       **dict(schema.sampling_arrays(req.params, choice=True)))
    return {"model_name": "decode", "inputs": ins, "request_id": req.request_id,
            "enable_empty_final_response": True}


def cancel_request(request_id: str) -> dict:
    """The stream_infer request that ends the generate of `request_id` on the decode server (op=cancel): how a
    generate is ended early without cancelling its gRPC call (grpc_streams' docstring)."""
    from ..client import build_inputs

    return {"model_name": "decode", "request_id": "", "inputs": build_inputs(None, op="cancel", request_id=request_id)}


class GrpcDecodeStream:
    """One request's stream of its own to the decode server's `decode` model, carried by the StreamHub's loop.
    Ended early by op=cancel on the same stream; read to its end (our half closes after the final answer), never
    cancelled (grpc_streams' docstring)."""

    def __init__(self, url: str, hub: StreamHub):
        self.url, self.hub = url, hub
        # filled by the hub's loop thread only (one producer), so the bound is a size check before each put
        self.q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._task: Any = None
        self._closed = False
        self._ended = False  # the reader got the final response or an error: nothing of it is left on the server
        self._rid: Optional[str] = None
        self._more: Any = None  # asyncio.Queue on the loop: op=cancel to write, None to close our half

    def put(self, item) -> None:
        if self._closed:
            return
        if self.q.qsize() >= MAX_BUFFERED:  # the consumer is gone or stuck: drop, it fails on its step timeout
            log.warning("decode stream buffer full (%d responses); dropping one", MAX_BUFFERED)
            return
        self.q.put_nowait(item)

    def start(self, req: DecodeRequest) -> None:
        import asyncio

        self._rid = req.request_id
        self._task = asyncio.run_coroutine_threadsafe(self._run(generate_request(req)), self.hub.loop)

    async def _run(self, request: dict) -> None:
        import asyncio

        import grpc

        more: "asyncio.Queue" = asyncio.Queue()
        self._more = more
        if self._closed:
            return  # closed before it started: nothing sent

        async def requests():
            yield request
            while (r := await more.get()) is not None:
                yield r

        ended = False
        try:
            it = self.hub.client(self.url).stream_infer(requests())
            async for result, error in it:  # to the end of the stream: our half closes after the answer ends
                if ended:
                    continue  # op=cancel's own answer
                self.put((result, error))
                if error is not None or is_final(result.get_response()):
                    ended = True
                    more.put_nowait(None)
        except grpc.RpcError as e:
            self.put((None, CallFailed(f"StatusCode.{e.code().name}", str(e.details()))))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # the stream could not be made (channel, client): the call failed
            self.put((None, CallFailed("StatusCode.UNKNOWN", f"{type(e).__name__}: {e}")))
        finally:
            more.put_nowait(None)

    def responses(self, timeout_s: float) -> Iterator[TokenChunk]:
        """The decode responses as chunks; responses already waiting are merged into one chunk (a consumer that
        fell behind catches up with one client response, not one per token)."""
        while True:
            try:
                item = self.q.get(timeout=timeout_s)
            except queue.Empty:
                raise DecodeFailed(f"decode server sent nothing for {timeout_s:.1f}s") from None
            ids: list = []
            lps: Optional[TokenLogprobs] = None
            while True:
                try:
                    chunk = self._chunk(*item)
                except Exception:
                    self._ended = True
                    if ids:  # tokens that arrived before the error still count (a migration resumes after them)
                        yield TokenChunk(ids, None, lps)
                    raise
                ids += chunk.token_ids
                if chunk.logprobs is not None:
                    lps = lps or TokenLogprobs()
                    lps.extend(chunk.logprobs)
                if chunk.finish_reason is not None:
                    self._ended = True
                    yield TokenChunk(ids, chunk.finish_reason, lps)
                    return
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
            yield TokenChunk(ids, None, lps)

    @staticmethod
    def _chunk(result, err) -> TokenChunk:
        if err is not None:
            raise stream_error(err)
        typed = typed_error(result)
        if typed is not None:  # the decode model's typed error (its Triton error follows)
            raise errors.from_wire(typed)
        final = is_final(result.get_response())
        toks = result.as_numpy("token_ids")
        fr = result.as_numpy("finish_reason")
        reason = fr.reshape(-1)[0].decode() if fr is not None and fr.size else None
        lp = result.as_numpy("output_log_probs")
        lps = None if lp is None else TokenLogprobs.from_arrays(lp, result.as_numpy("top_logprob_ids"),
                                                                result.as_numpy("top_logprob_values"))
        return TokenChunk([] if toks is None else [int(x) for x in toks.reshape(-1)],
                          reason or ("stop" if final else None), lps)

    def close(self, cancel: bool = False) -> None:
        """Stop reading; with cancel, end the generate on the server (op=cancel: the decode server frees the
        sequence at its next step)."""
        self._closed = True
        if not cancel or self._rid is None:
            return
        rid = self._rid

        def go() -> None:  # on the loop: if _run has not started yet, it sees _closed and sends nothing
            if self._more is not None:
                self._more.put_nowait(cancel_request(rid))
        self.hub.loop.call_soon_threadsafe(go)


class SharedStreamRequest(GrpcDecodeStream):
    """One request carried by its server's SharedStream (the GrpcDecodeStream interface; a request whose id is
    already in flight there, or past MAX_SHARED_REQUESTS, gets a stream of its own instead)."""

    def __init__(self, url: str, hub: StreamHub):
        super().__init__(url, hub)
        self._stream: Optional[SharedStream] = None
        self._rid: Optional[str] = None

    def start(self, req: DecodeRequest) -> None:
        import asyncio

        request = generate_request(req)
        rid = self._rid = req.request_id

        def go() -> None:  # on the loop: before any close() of this request (call_soon_threadsafe is FIFO)
            s = self.hub.shared(self.url)
            if not s.carry(rid, self, request):
                self._task = asyncio.ensure_future(self._run(request))
                return
            self._stream = s
        self.hub.loop.call_soon_threadsafe(go)

    def close(self, cancel: bool = False) -> None:
        self._closed = True
        rid = self._rid
        if self._ended and self._stream is not None:
            return  # its final response or error came: the stream's router dropped it then, nothing to end

        def go() -> None:
            s = self._stream
            if s is None:  # a stream of its own, or never started
                GrpcDecodeStream.close(self, cancel)
                return
            if rid is not None and s.live.get(rid) is self:  # still running there: stop routing it, end it if asked
                del s.live[rid]
                if cancel and not s.dead:
                    s.send(cancel_request(rid))
        self.hub.loop.call_soon_threadsafe(go)


class GrpcDecodeClient:
    """The llm's link to its decode servers: generates (one shared stream per server, or one stream each with
    HETSERVE_DECODE_SHARED_STREAM=0) and the one-answer ops (canary, prefix, release, stats) on the same shared
    stream (StreamHub.post); none of them cancels a gRPC call (grpc_streams' docstring)."""

    def __init__(self):
        self.hub = StreamHub(cancel_request=cancel_request)

    def open(self, url: str) -> GrpcDecodeStream:
        if config.get("HETSERVE_DECODE_SHARED_STREAM"):
            return SharedStreamRequest(url, self.hub)
        return GrpcDecodeStream(url, self.hub)

    def close(self) -> None:
        self.hub.close()

    def op(self, url: str, op: str, timeout_s: float, **inputs):
        """One decode op (op=canary, stats, prefix, release) on the url's shared stream; its InferResult. Raises
        TimeoutError (the request is then forgotten, not cancelled) or the error it got."""
        from ..client import build_inputs

        return self.hub.post(url, "decode", build_inputs(None, op=op, **inputs), op).result(timeout_s)

    def json_op(self, url: str, op: str, timeout_s: float, **inputs) -> dict:
        """op() of an op that answers JSON (stats, prefix)."""
        return json.loads(bytes(self.op(url, op, timeout_s, **inputs).as_numpy("op_json").reshape(-1)[0]))

    def held_tokens(self, urls: Sequence[str], prompt: Sequence[int], timeout_s: float) -> Dict[str, int]:
        """How many leading tokens of `prompt` each of `urls` holds in its prefix cache (decode op=prefix), all
        asked at once; a server that does not answer within timeout_s is left out (its answer forgotten)."""
        import time

        from ..client import build_inputs

        if not urls:
            return {}
        inputs = build_inputs(None, op="prefix", input_ids=list(prompt))  # one serialised prompt for every server
        asked = {u: self.hub.post(u, "decode", inputs, "prefix-lookup") for u in urls}
        deadline = time.monotonic() + timeout_s
        held: Dict[str, int] = {}
        for u, answer in asked.items():
            try:
                r = answer.result(deadline - time.monotonic())
                held[u] = int(json.loads(bytes(r.as_numpy("op_json").reshape(-1)[0])).get("held_tokens", 0))
            except Exception as e:  # slow or unreachable: the router goes on with its own view (a miss costs time)
                log.debug("prefix lookup on %s: %s: %s", u, type(e).__name__, e)
        return held

    def release(self, url: str, request_id: str) -> None:
        """Free the KV pushed to `url` for a request that went elsewhere (op=release); not waited on. One that
        gets no answer within RELEASE_TIMEOUT_S is forgotten: the server's pending-KV TTL frees the KV anyway."""
        from ..client import build_inputs

        answer = self.hub.post(url, "decode", build_inputs(None, op="release", request_id=request_id), "release")
        self.hub.loop.call_soon_threadsafe(self.hub.loop.call_later, RELEASE_TIMEOUT_S, answer.forget)
