"""DecodeClient over Triton gRPC: the orchestrator's link to a decode server's `decode` model (tritonclient,
no Triton Python-backend import)."""
from __future__ import annotations

import json
import logging
import queue
import threading
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


class GrpcDecodeStream:
    """One request's stream to the decode server's `decode` model, carried by the StreamHub's loop."""

    def __init__(self, url: str, hub: StreamHub):
        self.url, self.hub = url, hub
        self.q: "queue.Queue" = queue.Queue(MAX_BUFFERED)
        self._it: Any = None  # the aio stream (cancel() cancels the Triton request)
        self._task: Any = None
        self._closed = False

    def put(self, item) -> None:
        try:
            self.q.put_nowait(item)
        except queue.Full:  # the consumer is gone or stuck: drop, it fails on its step timeout
            log.warning("decode stream buffer full (%d responses); dropping one", MAX_BUFFERED)

    def start(self, req: DecodeRequest) -> None:
        import asyncio

        self._task = asyncio.run_coroutine_threadsafe(self._run(generate_request(req)), self.hub.loop)

    async def _run(self, request: dict) -> None:
        import asyncio

        import grpc

        done = asyncio.Event()

        async def requests():
            yield request
            await done.wait()  # our half stays open until the answer is complete

        try:
            self._it = it = self.hub.client(self.url).stream_infer(requests())
            if self._closed:
                it.cancel()
                return
            async for result, error in it:
                self.put((result, error))
                if error is not None or is_final(result.get_response()):
                    return  # an error response ends the request
        except grpc.RpcError as e:
            self.put((None, CallFailed(f"StatusCode.{e.code().name}", str(e.details()))))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # the stream could not be made (channel, client): the call failed
            self.put((None, CallFailed("StatusCode.UNKNOWN", f"{type(e).__name__}: {e}")))
        finally:
            done.set()

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
                    if ids:  # tokens that arrived before the error still count (a migration resumes after them)
                        yield TokenChunk(ids, None, lps)
                    raise
                ids += chunk.token_ids
                if chunk.logprobs is not None:
                    lps = lps or TokenLogprobs()
                    lps.extend(chunk.logprobs)
                if chunk.finish_reason is not None:
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
        """Stop reading; with cancel, cancel the Triton request (the decode server frees the sequence)."""
        self._closed = True
        if not cancel:
            return
        it = self._it
        if it is not None:
            self.hub.loop.call_soon_threadsafe(it.cancel)


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

        def go() -> None:
            s = self._stream
            if s is None:  # a stream of its own, or never started
                GrpcDecodeStream.close(self, cancel)
                return
            if rid is not None and s.live.get(rid) is self:  # still running there: stop routing it, end it if asked
                del s.live[rid]
                if cancel and not s.dead:
                    from ..client import build_inputs

                    s.send({"model_name": "decode", "request_id": "",
                            "inputs": build_inputs(None, op="cancel", request_id=rid)})
        self.hub.loop.call_soon_threadsafe(go)


class GrpcDecodeClient:
    # releases run on their own short-lived threads; past this many at once a release is skipped (the
    # decode server's pending-KV TTL frees the KV anyway)
    MAX_RELEASES = 64

    def __init__(self):
        self._releases = threading.BoundedSemaphore(self.MAX_RELEASES)
        self.hub = StreamHub()

    def open(self, url: str) -> GrpcDecodeStream:
        if config.get("HETSERVE_DECODE_SHARED_STREAM"):
            return SharedStreamRequest(url, self.hub)
        return GrpcDecodeStream(url, self.hub)

    def close(self) -> None:
        self.hub.close()

    def held_tokens(self, urls: Sequence[str], prompt: Sequence[int], timeout_s: float) -> Dict[str, int]:
        """How many leading tokens of `prompt` each of `urls` holds in its prefix cache (decode op=prefix), all
        asked at once on the hub's channels; a server that does not answer within timeout_s is left out."""
        import asyncio

        from ..client import build_inputs

        if not urls:
            return {}
        inputs = build_inputs(None, op="prefix", input_ids=list(prompt))  # one serialised prompt for every server

        async def ask(url: str) -> Optional[int]:
            async def requests():
                yield {"model_name": "decode", "inputs": inputs, "request_id": "prefix-lookup"}
            it = self.hub.client(url).stream_infer(requests())
            try:
                async for result, error in it:
                    if error is not None:
                        return None
                    got = json.loads(bytes(result.as_numpy("op_json").reshape(-1)[0]))
                    return int(got.get("held_tokens", 0))
                return None
            finally:
                it.cancel()

        async def ask_all() -> Dict[str, int]:
            tasks = [asyncio.ensure_future(ask(u)) for u in urls]
            done, late = await asyncio.wait(tasks, timeout=timeout_s)
            for t in late:
                t.cancel()
            held: Dict[str, int] = {}
            for u, t in zip(urls, tasks):
                n = t.result() if t in done and t.exception() is None else None
                if n is not None:
                    held[u] = n
            return held

        fut = asyncio.run_coroutine_threadsafe(ask_all(), self.hub.loop)
        try:
            return fut.result(timeout=timeout_s + 1.0)
        except Exception as e:  # slow or unreachable: the router goes on with its own view (a miss costs time only)
            fut.cancel()
            log.debug("prefix lookup on %s: %s: %s", list(urls), type(e).__name__, e)
            return {}

    def release(self, url: str, request_id: str) -> None:
        from ..client import build_inputs, stream_once

        if not self._releases.acquire(blocking=False):
            log.info("release of %s on %s skipped (%d in flight); its pending TTL frees it", request_id, url,
                     self.MAX_RELEASES)
            return

        def go():
            try:
                stream_once(url, "decode", build_inputs(None, op="release", request_id=request_id),
                            RELEASE_TIMEOUT_S, request_id)
            except Exception as e:
                log.info("release of %s on %s failed (%s); its pending TTL frees it", request_id, url, e)
            finally:
                self._releases.release()
        threading.Thread(target=go, daemon=True, name="decode-release").start()
