"""The control call every transport makes: it carries request_id + kv_header (+ kv_payload in-band or by shm
reference, + kv_remote for pulling transports), names the transport in the request parameter
`hetserve_transport`, and its reply means "verified and taken".

Where it goes (post()): the in-band transports whose payload Triton hands the model itself (grpc, shm) send it
straight to the decode server's `decode` model (op=ingest) on the process's one shared gRPC stream to that server
(grpc_streams.SharedStream; HETSERVE_KV_DIRECT, default on): one message each way, the KV verified once, in the
process that decodes it. The others (nixl pulls, cuda_shm, grpc payloads past DIRECT_INLINE_MAX_BYTES), and every
transport with HETSERVE_KV_DIRECT=0, make one asynchronous unary call to `kv_ingest`, which verifies and hands
the KV to `decode` over BLS (two Triton requests more per transfer; loadtest/README.md, issue 27).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

from ... import config, errors
from ...grpc_streams import StreamHub, describe, is_final, typed_error
from ..wire import KVHeader
from .base import PeerRefused, SendState, Transfer, TransferError, TransferTimeout

INGEST_MODEL = "kv_ingest"
DIRECT_MODEL = "decode"  # op=ingest
DIRECT_TRANSPORTS = ("grpc", "shm")  # the payload reaches the model as a tensor (Triton resolves system shm)
# an inline (grpc) payload past this takes a call of its own (kv_ingest): one HTTP/2 stream delivers in order, so
# a long prompt's KV on the shared stream would hold the short ones behind it; at this size the extra hop is noise
DIRECT_INLINE_MAX_BYTES = 4 << 20
TRANSPORT_PARAM = "hetserve_transport"


class ClientCache:
    """One tritonclient gRPC client per decode URL (thread-safe: clients are shared across requests), and the
    stream hub that carries the direct hand-offs (made at the first one)."""

    def __init__(self):
        self._clients: Dict[str, Any] = {}  # url -> tritonclient InferenceServerClient
        self._hub: Optional[StreamHub] = None
        self._lock = threading.Lock()

    def hub(self) -> StreamHub:
        with self._lock:
            if self._hub is None:
                self._hub = StreamHub()
            return self._hub

    def get(self, url: str):
        import tritonclient.grpc as grpcclient

        with self._lock:
            c = self._clients.get(url)
            if c is None:
                c = self._clients[url] = grpcclient.InferenceServerClient(url, verbose=False)
            return c

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            hub, self._hub = self._hub, None
        if hub is not None:
            hub.close()
        for c in clients:
            try:
                c.close()
            except Exception:  # already closed / channel gone: nothing left to release
                pass


def ingest_inputs(request_id: str, hdr: KVHeader, payload_len: Optional[int], remote: Optional[bytes] = None):
    """request_id, kv_header, [kv_payload of payload_len bytes, data set by the caller], [kv_remote]."""
    import tritonclient.grpc as grpcclient

    def text(name, value: bytes):
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=np.object_))
        return t

    ins = [text("request_id", request_id.encode()), text("kv_header", hdr.to_json())]
    payload = None
    if payload_len is not None:
        payload = grpcclient.InferInput("kv_payload", [payload_len], "UINT8")
        ins.append(payload)
    if remote is not None:
        ins.append(text("kv_remote", remote))
    return ins, payload


def _error_of(url: str, transport: str, exc: BaseException) -> TransferError:
    """Type the failure by the gRPC status kv_ingest answered with (INVALID_ARG = it refused the KV)."""
    status = str(getattr(exc, "status", lambda: None)() or "")
    msg = f"KV transfer over {transport} to {url} failed: {exc}"
    if "INVALID_ARGUMENT" in status:
        return PeerRefused(msg)
    if "DEADLINE_EXCEEDED" in status:
        return TransferTimeout(msg)
    return TransferError(msg)


def post(clients: ClientCache, url: str, transport: str, request_id: str, inputs, nbytes: int,
         on_settle: Optional[Callable[[bool], None]] = None,
         classify: Optional[Callable[[TransferError], TransferError]] = None) -> Transfer:
    """Post the control call of one transfer where it goes (the module's docstring) and return it, under way."""
    inline_ok = transport != "grpc" or nbytes <= DIRECT_INLINE_MAX_BYTES
    if transport in DIRECT_TRANSPORTS and inline_ok and config.get("HETSERVE_KV_DIRECT"):
        return StreamedTransfer(clients.hub(), url, transport, request_id, inputs, nbytes, on_settle, classify)
    return ControlTransfer(clients.get(url), url, transport, inputs, nbytes, on_settle, classify)


class _Posted(Transfer):
    """A posted control call. `on_settle(ok)` runs exactly once, when it ends (releases staging ranges)."""

    def __init__(self, url: str, transport: str, nbytes: int, on_settle: Optional[Callable[[bool], None]],
                 classify: Optional[Callable[[TransferError], TransferError]]):
        self.url, self.transport, self.nbytes = url, transport, nbytes
        self._on_settle = on_settle
        self._classify = classify
        self._done = threading.Event()
        self._error: Optional[TransferError] = None
        self._settled = False
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.seconds = 0.0

    def _end(self, error: Optional[TransferError]) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._error = error
        self._settle(error is None)
        self._done.set()

    def _settle(self, ok: bool) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
        if self._on_settle is not None:
            self._on_settle(ok)

    def poll(self) -> SendState:
        if not self._done.is_set():
            return SendState.PENDING
        return SendState.FAILED if self._error is not None else SendState.DONE

    def wait(self, timeout_s: float) -> dict:
        if not self._done.wait(timeout_s):
            # the call is not cancelled (grpc_streams' docstring): it settles when the server answers or the
            # connection fails, and the staging range stays reserved until then (the peer may still read it)
            raise TransferTimeout(f"KV transfer over {self.transport} to {self.url}: no answer in "
                                  f"{timeout_s * 1e3:.0f} ms")
        if self._error is not None:
            err = self._classify(self._error) if self._classify else self._error
            raise err
        return {"transport": self.transport, "bytes": int(self.nbytes), "seconds": self.seconds}


class ControlTransfer(_Posted):
    """The unary call to kv_ingest. No gRPC deadline: a deadline cancels the call, and Triton 2.51 can crash on a
    cancellation that races the answer (grpc_streams' docstring); wait() times out on our side instead."""

    def __init__(self, client, url: str, transport: str, inputs, nbytes: int,
                 on_settle: Optional[Callable[[bool], None]] = None,
                 classify: Optional[Callable[[TransferError], TransferError]] = None):
        super().__init__(url, transport, nbytes, on_settle, classify)
        try:
            client.async_infer(INGEST_MODEL, inputs, self._callback, parameters={TRANSPORT_PARAM: transport})
        except Exception as e:
            self._callback(None, e)

    def _callback(self, result, error) -> None:
        self._end(None if error is None else _error_of(self.url, self.transport, error))


class StreamedTransfer(_Posted):
    """op=ingest on the decode model, carried by the shared stream to `url` (grpc_streams.Routed). The decode
    model answers one final response, or its typed error (bad input: PeerRefused). A failed stream fails it with
    a TransferError; a transfer whose id is already in flight there, or past MAX_SHARED_REQUESTS, is refused."""

    def __init__(self, hub: StreamHub, url: str, transport: str, request_id: str, inputs, nbytes: int,
                 on_settle: Optional[Callable[[bool], None]] = None,
                 classify: Optional[Callable[[TransferError], TransferError]] = None):
        import tritonclient.grpc as grpcclient

        super().__init__(url, transport, nbytes, on_settle, classify)
        op = grpcclient.InferInput("op", [1], "BYTES")
        op.set_data_from_numpy(np.array([b"ingest"], dtype=np.object_))
        request = {"model_name": DIRECT_MODEL, "inputs": [op, *inputs], "request_id": request_id,
                   "parameters": {TRANSPORT_PARAM: transport}, "enable_empty_final_response": True}

        def go() -> None:  # on the hub's loop
            s = hub.shared(url)
            if not s.carry(request_id, self, request):
                self._end(TransferError(f"KV transfer over {transport} to {url}: request {request_id} cannot be "
                                        f"carried ({len(s.live)} in flight, its id among them: "
                                        f"{request_id in s.live})"))
        hub.loop.call_soon_threadsafe(go)

    def put(self, item) -> None:
        result, err = item
        if err is not None:
            self._end(TransferError(f"KV transfer over {self.transport} to {self.url} failed: {describe(err)}"))
            return
        typed = typed_error(result)
        if typed is not None:
            e = errors.from_wire(typed)
            cls = PeerRefused if e.kind == errors.BAD_INPUT else TransferError
            self._end(cls(f"KV transfer over {self.transport} to {self.url} failed: {e}"))
        elif is_final(result.get_response()):
            self._end(None)
