"""Long-lived gRPC streams to Triton servers, shared by the requests of one process (tritonclient.grpc.aio on
one asyncio loop thread, no Triton Python-backend import): the llm's generates to a decode server
(stages/grpc_decode.py) and the prefill server's KV hand-offs to it (kv/transport/control.py) each cost one message
each way on a stream that stays open, instead of an HTTP/2 stream set up and half-closed per request (grpc.aio's
per-stream set-up and half-close were ~40% of the llm stub's GIL time: loadtest/README.md, issue 27). The llm's
one-answer ops to a decode server (health canary, prefix lookups, block lists, releases) ride the same stream
(StreamHub.post).

Nothing here cancels a gRPC call that may still have requests in flight on the server: Triton 2.51's gRPC frontend
can crash (SIGSEGV in TRITONBACKEND_ResponseSend) when a call's cancellation races a response to it
(triton-inference-server/server#7368, #8034; fixed upstream in 24.12 and 25.04), and a server that stalls and
resumes (SIGSTOP, a long pause) receives every cancellation at once, next to its queued responses. So a request
that is given up on is forgotten, its late answer dropped; a generate is ended by its model's op=cancel; a stream
ends by half-closing and draining to the server's end of it. gRPC cancels a call only as the last resort, after
DRAIN_MAX_S of draining to a server that never answers (docs/reliability.md)."""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import threading
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

from . import errors

log = logging.getLogger("hetserve.streams")


def is_final(resp) -> bool:
    """A Triton stream response (ModelInferResponse) flagged the request's last."""
    fp = resp.parameters.get("triton_final_response")
    return bool(fp is not None and fp.bool_param)


def typed_error(result) -> Optional[bytes]:
    """A hetserve model's typed error carried as data in a response (send_error), or None."""
    data = result.as_numpy(errors.ERROR_OUTPUT)
    return bytes(data.reshape(-1)[0]) if data is not None and data.size else None


def describe(err) -> str:
    """'status: message' of a stream error (an InferenceServerException or a CallFailed)."""
    status = str(getattr(err, "status", lambda: "")() or "")
    msg = str(getattr(err, "message", lambda: str(err))() or err)
    return f"{status + ': ' if status else ''}{msg}"


class Routed(Protocol):
    """A request carried by a SharedStream: put() gets (InferResult, None) per response or (None, error) once,
    on the hub's loop thread; it must not block."""

    def put(self, item: Tuple[Any, Any]) -> None: ...


class StreamHub:
    """One asyncio loop thread per process carries every stream of it: one gRPC channel per server
    (tritonclient.grpc.aio, created on the loop), the shared stream per server (SharedStream) and any stream of
    its own a request needs. The blocking client made a channel, a client and a reader thread per request (13% of
    the llm stub's samples, loadtest/stack_cpu.py --profile)."""

    def __init__(self, cancel_request: Optional[Callable[[str], dict]] = None):
        """`cancel_request(request_id)`: the request that ends a request of that id on the server (the decode
        model's op=cancel); sent for each request still in flight when a shared stream is abandoned."""
        import asyncio

        self.cancel_request = cancel_request
        self._ids = itertools.count()
        self.loop = asyncio.new_event_loop()
        self._clients: dict = {}
        self._shared: Dict[str, "SharedStream"] = {}  # url -> the live shared stream (on the loop thread only)
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-streams", daemon=True)
        self._thread.start()

    def client(self, url: str):
        """The url's aio client (on the loop thread only)."""
        c = self._clients.get(url)
        if c is None:
            import tritonclient.grpc.aio as grpcaio

            c = self._clients[url] = grpcaio.InferenceServerClient(url)
        return c

    def shared(self, url: str) -> "SharedStream":
        """The url's shared stream, a new one when there is none or the last one ended (on the loop thread)."""
        s = self._shared.get(url)
        if s is None or s.dead:
            s = self._shared[url] = SharedStream(url, self)
        return s

    def streams(self) -> Dict[str, "SharedStream"]:
        """The shared streams now open, by url (a snapshot)."""
        return dict(self._shared)

    def post(self, url: str, model: str, inputs, tag: str) -> "Answer":
        """Send one request that answers once (an op) on the url's shared stream; Answer.result() waits for the
        answer. Any thread."""
        rid = f"{tag}-{os.getpid()}-{next(self._ids)}"
        answer = Answer(self, url, rid)
        request = {"model_name": model, "inputs": inputs, "request_id": rid}

        def go() -> None:
            s = self.shared(url)
            if s.carry(rid, answer, request):
                answer.stream = s
            else:
                answer.put((None, CallFailed("StatusCode.RESOURCE_EXHAUSTED",
                                             f"{len(s.live)} requests in flight on the stream to {url}")))
        self.loop.call_soon_threadsafe(go)
        return answer

    def close(self) -> None:
        import asyncio

        async def shut():
            streams = list(self._shared.values())
            self._shared.clear()
            for s in streams:
                s.close()  # half-close: the server ends each stream once what is on it has answered
            tasks = [s.task for s in streams if not s.task.done()]
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
            for s in streams:
                s.task.cancel()  # still open past the grace: the last resort
            for c in list(self._clients.values()):
                await c.close()
            self._clients.clear()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(timeout=CLOSE_GRACE_S + 3)
        except Exception as e:  # a channel that will not close: the process is going away anyway
            log.info("gRPC stream hub close: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class CallFailed:
    """What a failed gRPC call hands its requests in place of an error object (status + message)."""

    def __init__(self, status: str, msg: str):
        self._status, self._msg = status, msg

    def status(self) -> str:
        return self._status

    def message(self) -> str:
        return self._msg


class Answer:
    """The one answer of a request posted on a shared stream (StreamHub.post; a Routed). A request whose answer
    does not come in time is forgotten, not cancelled (the module's docstring): its late answer is dropped."""

    def __init__(self, hub: StreamHub, url: str, request_id: str):
        self.hub, self.url, self.request_id = hub, url, request_id
        self.stream: Optional["SharedStream"] = None  # set on the loop once carried
        self._fut: "concurrent.futures.Future" = concurrent.futures.Future()

    def put(self, item: Tuple[Any, Any]) -> None:
        if not self._fut.done():
            self._fut.set_result(item)

    def result(self, timeout_s: float):
        """The InferResult. Raises TimeoutError when none came within timeout_s (then forgets the request), the
        typed error the server answered with (errors.HetserveError), or errors.Unavailable when the call
        failed."""
        try:
            result, err = self._fut.result(timeout=max(timeout_s, 0.0))
        except concurrent.futures.TimeoutError:
            self.forget()
            raise TimeoutError(f"{self.url}: no answer to {self.request_id} within {timeout_s:.1f}s") from None
        if err is not None:
            raise errors.Unavailable(f"{self.url}: {describe(err)}")
        typed = typed_error(result)
        if typed is not None:
            raise errors.from_wire(typed)
        return result

    def forget(self) -> None:
        """Stop routing its answer (any thread)."""
        def go() -> None:
            if self.stream is not None:
                self.stream.forget(self.request_id, self)
        self.hub.loop.call_soon_threadsafe(go)


# requests in flight on one shared stream (and requests waiting to be written to it); past this a request is
# refused (a generate then takes a stream of its own)
MAX_SHARED_REQUESTS = 4096
# how long a stream that is given up on (or the hub closing) drains before gRPC cancels it, the last resort
DRAIN_MAX_S = 60.0
CLOSE_GRACE_S = 2.0


class SharedStream:
    """One long-lived bidi stream to a server carrying this process's requests to it (each names its model), one
    message each way per request. Lives on the StreamHub's loop.

    Lifecycle: made at the first request for its url (StreamHub.shared); ends when the server ends it, the call
    fails, or the hub closes (our half closes, then it drains); the next request then makes a new one. Responses
    are routed to their request by the Triton request id (unique among the requests in flight on it); a request
    ends at its final response or its typed error, or when it is forgotten (forget(): its later responses are
    dropped). To end one early the client sends its model's own cancel op on the stream (Triton cancels only
    whole streams; the decode model's is op=cancel); nothing here cancels the call while the server may still
    answer on it (the module's docstring).
    An error response goes to the request whose id it carries (the raw responses are read: tritonclient's
    iterator drops the id). The Triton error that follows each typed error (send_error sends the error as data,
    then the Triton error) comes after that request left the routing table and is dropped; an error without an
    id otherwise, or the call failing, fails every request on the stream with it (the llm's decode client makes
    that a DecodeFailed, which the orchestrator migrates; the KV sender a TransferError). After an error without
    an id the stream is abandoned: the hub's cancel request goes out for each request that was on it, our half
    closes, and it drains (responses dropped) until the server ends it."""

    def __init__(self, url: str, hub: "StreamHub"):
        import asyncio

        self.url, self.hub = url, hub
        self.out: "asyncio.Queue" = asyncio.Queue()  # requests to write; None ends our half (bounded in carry)
        self.live: Dict[str, Routed] = {}
        self.expected_errors = 0
        self.dead = False  # takes no new requests
        self._dropping = False  # abandoned: every response is dropped
        # requests forgotten while in flight (bounded, oldest dropped), and how many of them the server answered
        # later on this stream (the stream was not cancelled under them)
        self._forgotten: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self.late_answers = 0
        self.task = asyncio.ensure_future(self._run())

    def send(self, request: dict) -> None:
        """Write a request nobody waits on (a cancel op); carry() for one whose responses are routed back."""
        self.out.put_nowait(request)

    def carry(self, request_id: str, routed: Routed, request: dict) -> bool:
        """Send `request` and route its responses to `routed` (on the loop thread). False, sending nothing, when
        the stream takes no more requests, its id is already in flight here, or MAX_SHARED_REQUESTS are in flight
        or waiting to be written (a server that stopped reading): the caller then takes another way."""
        if self.dead or request_id in self.live or max(len(self.live), self.out.qsize()) >= MAX_SHARED_REQUESTS:
            return False
        self.live[request_id] = routed
        self.out.put_nowait(request)
        return True

    def forget(self, request_id: str, routed: Routed) -> None:
        """Stop routing `routed`'s responses (on the loop thread); the server's later answers to it are dropped."""
        if self.live.get(request_id) is routed:
            del self.live[request_id]
            self._forgotten[request_id] = None
            if len(self._forgotten) > MAX_SHARED_REQUESTS:
                self._forgotten.popitem(last=False)

    def close(self) -> None:
        """End our half (on the loop thread): the server ends the stream once what is on it has answered, and
        those answers are still routed."""
        if not self.dead:
            self.dead = True
            self.out.put_nowait(None)

    def _abandon(self, why) -> None:
        """Fail every request on the stream with `why` and drain it: the hub's cancel request for each, our
        half closed, responses dropped; gRPC cancels it only past DRAIN_MAX_S."""
        ids = sorted(self.live)
        self._fail(why)
        self._dropping = True
        if self.hub.cancel_request is not None:
            for rid in ids:
                self.out.put_nowait(self.hub.cancel_request(rid))
        self.close()
        self.hub.loop.call_later(DRAIN_MAX_S, self.task.cancel)

    def _fail(self, why) -> None:
        self.dead = True
        if self.live:
            log.warning("shared stream to %s ended (%s); failing its %d requests: %s", self.url,
                        describe(why), len(self.live), sorted(self.live)[:8])
        for req in self.live.values():
            req.put((None, why))
        self.live.clear()

    async def _requests(self):
        while True:
            r = await self.out.get()
            if r is None:
                return
            yield r

    async def _run(self) -> None:
        import asyncio

        import grpc
        from tritonclient.grpc import InferResult
        from tritonclient.utils import InferenceServerException

        why: Any = CallFailed("StatusCode.UNAVAILABLE", "the server ended the shared stream")
        it: Any = None
        try:
            it = self.hub.client(self.url).stream_infer(self._requests())
            # the raw responses (tritonclient's iterator drops an error response's request id, which Triton sets)
            async for response in it._grpc_call:
                if self._dropping:
                    continue
                rid = response.infer_response.id
                req = self.live.get(rid) if rid else None
                if response.error_message:
                    err = InferenceServerException(msg=response.error_message)
                    if req is not None:
                        req.put((None, err))
                        del self.live[rid]
                    elif self.expected_errors > 0:
                        self.expected_errors -= 1
                    elif not rid:  # whose it is cannot be known: it ends every request on this stream
                        self._abandon(err)
                    continue
                result = InferResult(response.infer_response)
                typed = typed_error(result) is not None
                if typed:
                    self.expected_errors += 1  # its Triton error follows (without an id in some versions)
                if req is None:  # a request forgotten or closed early (its last responses), or op=cancel's answer
                    if rid in self._forgotten and is_final(response.infer_response):
                        del self._forgotten[rid]
                        self.late_answers += 1
                    continue
                req.put((result, None))
                if typed or is_final(response.infer_response):
                    del self.live[rid]
        except grpc.RpcError as e:
            why = CallFailed(f"StatusCode.{e.code().name}", str(e.details()))
        except asyncio.CancelledError:
            why = CallFailed("StatusCode.CANCELLED", "the gRPC stream hub closed")
        except Exception as e:  # the stream could not be made (channel, client): the call failed
            why = CallFailed("StatusCode.UNKNOWN", f"{type(e).__name__}: {e}")
        finally:
            self._fail(why)
            if it is not None and not it._grpc_call.done():
                it.cancel()  # the last resort only: drained past DRAIN_MAX_S, or the hub closed past its grace
