"""The control call every transport makes: one asynchronous gRPC infer on the decode server's kv_ingest.

It carries request_id + kv_header (+ kv_payload in-band or by shm reference, + kv_remote for pulling transports)
and names the transport in the request parameter `hetserve_transport`. Its reply means "verified and taken".
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

from ..wire import KVHeader
from .base import PeerRefused, SendState, Transfer, TransferError, TransferTimeout

INGEST_MODEL = "kv_ingest"
TRANSPORT_PARAM = "hetserve_transport"


class ClientCache:
    """One tritonclient gRPC client per decode URL (thread-safe: clients are shared across requests)."""

    def __init__(self):
        self._clients: Dict[str, Any] = {}  # url -> tritonclient InferenceServerClient
        self._lock = threading.Lock()

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


class ControlTransfer(Transfer):
    """A posted kv_ingest call. `on_settle(ok)` runs exactly once, when it ends (releases staging ranges)."""

    def __init__(self, client, url: str, transport: str, inputs, nbytes: int, timeout_s: float,
                 on_settle: Optional[Callable[[bool], None]] = None,
                 classify: Optional[Callable[[TransferError], TransferError]] = None):
        self.url, self.transport, self.nbytes = url, transport, nbytes
        self._on_settle = on_settle
        self._classify = classify
        self._done = threading.Event()
        self._error: Optional[TransferError] = None
        self._settled = False
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        try:
            client.async_infer(INGEST_MODEL, inputs, self._callback, client_timeout=timeout_s,
                               parameters={TRANSPORT_PARAM: transport})
        except Exception as e:
            self._callback(None, e)

    def _callback(self, result, error) -> None:
        self.seconds = time.perf_counter() - self.t0
        if error is not None:
            self._error = _error_of(self.url, self.transport, error)
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
        if not self._done.wait(timeout_s + 1.0):  # the call's own deadline fires first; this is a backstop
            # the staging range stays reserved until the call settles (the peer may still read it)
            raise TransferTimeout(f"KV transfer over {self.transport} to {self.url}: no answer in {timeout_s:.0f}s")
        if self._error is not None:
            err = self._classify(self._error) if self._classify else self._error
            raise err
        return {"transport": self.transport, "bytes": int(self.nbytes), "seconds": self.seconds}
