"""Long-lived gRPC streams to Triton servers, shared by the requests of one process (tritonclient.grpc.aio on
one asyncio loop thread, no Triton Python-backend import): the llm's generates to a decode server
(stages/grpc_decode.py) and the prefill server's KV hand-offs to it (kv/transport/control.py) each cost one message
each way on a stream that stays open, instead of an HTTP/2 stream set up and half-closed per request (grpc.aio's
per-stream set-up and half-close were ~40% of the llm stub's GIL time: loadtest/README.md, issue 27)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Protocol, Tuple

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

    def __init__(self):
        import asyncio

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

    def close(self) -> None:
        import asyncio

        async def shut():
            for s in list(self._shared.values()):
                s.close()
            self._shared.clear()
            for c in list(self._clients.values()):
                await c.close()
            self._clients.clear()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(timeout=5)
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


# requests in flight on one shared stream; past this a request gets a stream of its own
MAX_SHARED_REQUESTS = 4096


class SharedStream:
    """One long-lived bidi stream to a server carrying this process's requests to it (each names its model), one
    message each way per request. Lives on the StreamHub's loop.

    Lifecycle: made at the first request for its url (StreamHub.shared); ends when the server ends it, the call
    fails, or the hub closes; the next request then makes a new one. Responses are routed to their request by
    the Triton request id (unique among the requests in flight on it); a request ends at its final response or
    its typed error. To end one early the client sends its model's own cancel op on the stream (Triton cancels
    only whole streams; the decode model's is op=cancel).
    An error response goes to the request whose id it carries (the raw responses are read: tritonclient's
    iterator drops the id). The Triton error that follows each typed error (send_error sends the error as data,
    then the Triton error) comes after that request left the routing table and is dropped; an error without an
    id otherwise, or the call failing, fails every request on the stream with it (the llm's decode client makes
    that a DecodeFailed, which the orchestrator migrates; the KV sender a TransferError)."""

    def __init__(self, url: str, hub: "StreamHub"):
        import asyncio

        self.url, self.hub = url, hub
        self.out: "asyncio.Queue" = asyncio.Queue()  # requests to write; None ends the stream (bounded: live)
        self.live: Dict[str, Routed] = {}
        self.expected_errors = 0
        self.dead = False
        self._task = asyncio.ensure_future(self._run())

    def send(self, request: dict) -> None:
        """Write a request nobody waits on (a cancel op); carry() for one whose responses are routed back."""
        self.out.put_nowait(request)

    def carry(self, request_id: str, routed: Routed, request: dict) -> bool:
        """Send `request` and route its responses to `routed` (on the loop thread). False, sending nothing, when
        its id is already in flight here or MAX_SHARED_REQUESTS are: the caller then takes another way."""
        if request_id in self.live or len(self.live) >= MAX_SHARED_REQUESTS:
            return False
        self.live[request_id] = routed
        self.out.put_nowait(request)
        return True

    def close(self) -> None:
        self.out.put_nowait(None)
        self._task.cancel()

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
                        why = err
                        return
                    continue
                result = InferResult(response.infer_response)
                typed = typed_error(result) is not None
                if typed:
                    self.expected_errors += 1  # its Triton error follows (without an id in some versions)
                if req is None:
                    continue  # a request closed early (its last responses), or op=cancel's own answer
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
            self.dead = True
            if it is not None:
                it.cancel()  # the server then cancels what is still running on it
            if self.live:
                log.warning("shared stream to %s ended (%s); failing its %d requests: %s", self.url,
                            describe(why), len(self.live), sorted(self.live)[:8])
            for req in self.live.values():
                req.put((None, why))
            self.live.clear()

