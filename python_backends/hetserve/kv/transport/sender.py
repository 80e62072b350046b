"""KVSender: the prefill side's entry point. Holds one TransportSender per transport (made on first use) and
one gRPC client per decode URL, and applies the two allowed, visible recoveries:
  * CapacityExhausted (staging region full): this transfer goes over grpc; on_fallback(requested, used, reason)
    is called (the prefill model turns it into hetserve_kv_transport_fallbacks_total + a log line) and the
    result says transport=grpc, fallback=<reason>.
  * PeerLostRegistration (the decode server restarted and forgot our region): forget it, register again, retry
    once on the same transport.
Everything else propagates as a TransferError subclass (typed; no error-message matching)."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Optional

import numpy as np

from ..wire import KVHeader
from .base import CapacityExhausted, PeerLostRegistration, TransferError, TransportSender
from .control import ClientCache
from .registry import BASELINE, spec

log = logging.getLogger("hetserve.kv.transport")

FallbackHook = Callable[[str, str, str], None]  # (requested, used, reason)


class KVSender:
    def __init__(self, on_fallback: Optional[FallbackHook] = None):
        self.clients = ClientCache()
        self.on_fallback = on_fallback
        self._senders: Dict[str, TransportSender] = {}
        self._lock = threading.Lock()
        self._serial: Dict[str, threading.Lock] = {}  # transports without concurrent_sends: one send at a time

    def transport(self, name: str) -> TransportSender:
        s = spec(name)  # ValueError for an unknown name
        with self._lock:
            t = self._senders.get(name)
            if t is None:
                t = self._senders[name] = getattr(s.load(), s.sender)(self.clients)
            return t

    def prepare(self, name: str) -> None:
        """Start `name`'s sender now (NIXL: agent + registered staging: ~2 s) instead of in the first request."""
        try:
            self.transport(name).prepare()
        except Exception as e:  # the first send will raise it again, typed; here it is only a head start
            log.warning("could not prepare KV transport %s: %s", name, e)

    def client(self, url: str):
        return self.clients.get(url)

    def send(self, url: str, transport: str, request_id: str, hdr: KVHeader, payload: np.ndarray,
             timeout_s: float = 30.0) -> dict:
        """Blocking send; {"transport" (the one used), "bytes", "seconds"[, "fallback": reason]}."""
        try:
            sender = self.transport(transport)
        except ValueError as e:
            raise TransferError(str(e)) from None
        if not sender.concurrent_sends:
            with self._lock:
                serial = self._serial.setdefault(transport, threading.Lock())
            with serial:
                return self._send(sender, url, transport, request_id, hdr, payload, timeout_s)
        return self._send(sender, url, transport, request_id, hdr, payload, timeout_s)

    def _send(self, sender: TransportSender, url: str, transport: str, request_id: str, hdr: KVHeader,
              payload: np.ndarray, timeout_s: float) -> dict:
        try:
            try:
                return sender.start(url, request_id, hdr, payload, timeout_s).wait(timeout_s)
            except PeerLostRegistration as e:
                log.warning("%s; registering again and retrying once", e)
                sender.forget(url)
                return sender.start(url, request_id, hdr, payload, timeout_s).wait(timeout_s)
        except CapacityExhausted as e:
            if transport == BASELINE:
                raise
            log.warning("KV transfer %s to %s: %s; sending this one over %s (counted in "
                        "hetserve_kv_transport_fallbacks_total)", request_id, url, e, BASELINE)
            if self.on_fallback is not None:
                self.on_fallback(transport, BASELINE, e.reason)
            info = self.transport(BASELINE).start(url, request_id, hdr, payload, timeout_s).wait(timeout_s)
            return {**info, "fallback": e.reason}

    def close(self) -> None:
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for s in senders:
            try:
                s.close()
            except Exception as e:  # closing must not stop the others from closing
                log.warning("closing KV transport %s: %s", s.name, e)
        self.clients.close()
