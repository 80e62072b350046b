"""The KV transport interface: one sender and one receiver per transport, registered by name (registry.py).

Every transport carries the same (KVHeader, payload) from the prefill server to the decode server, which verifies
it (kv/wire.py: handshake + HMAC tag). Transports differ only in how the payload bytes travel; the control message
(request_id, kv_header and, where the transport needs it, kv_remote; control.post() sends it to the decode model
or to kv_ingest) is the same for all of them and its reply is the completion signal.

Sender lifecycle (prefill side, one instance per transport per process, made lazily by KVSender):
  __init__()              nothing remote yet (cheap; allocation and registration happen on first use)
  prepare()               optional: do that first-use work now (agent start, staging registration)
  start(url, rid, hdr, payload, timeout_s) -> Transfer
                          stage the payload (copy into a registered region for shm/nixl/cuda_shm) and post the
                          control call asynchronously; raises CapacityExhausted when the staging region is full
                          (the caller may fall back, visibly) and TransportUnavailable when it cannot run here
  Transfer.poll()         -> SendState: PENDING (posted, waiting) -> DONE | FAILED; never blocks
  Transfer.wait(timeout)  poll until DONE/FAILED; returns the result dict or raises a TransferError subclass
                          (PeerLostRegistration: the peer forgot our registration, e.g. it restarted)
  forget(url)             drop what is registered with `url` (re-registered on next start)
  close()                 release every region, registration and connection; idempotent

Receiver lifecycle (decode side, in kv_ingest; one instance per transport per model instance):
  __init__()              may create agents/regions (nixl: its agent) -- kv_ingest makes it on first use
  offer() -> dict         what this receiver tells a sender in the capability handshake (JSON-able)
  receive(hdr, payload, remote, timeout_s) -> np.ndarray
                          the payload bytes for `hdr`: in-band transports return the tensor Triton delivered
                          (grpc inline, system/CUDA shm resolved by Triton); pulling transports (nixl) READ from
                          the sender's registered memory described by `remote`, polling RecvState
                          TRANSFERRING -> DONE | FAILED with a deadline
  close()                 release agents, registrations, buffers; idempotent

Capabilities (TransportCaps) say what a link needs: same host (POSIX shm), same device (CUDA IPC), RDMA
capable (NIXL/UCX). The orchestrator negotiates the usable set ONCE per decode member (reliability.DecodePool,
negotiate.py) instead of a request discovering it by failing.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..wire import KVHeader


@dataclass(frozen=True)
class TransportCaps:
    same_host: bool = False    # both ends must share the host (and its /dev/shm namespace)
    same_device: bool = False  # both ends must share one GPU (CUDA IPC handles do not cross devices)
    rdma: bool = False         # can use RDMA when the link has it (else TCP/shared memory under the hood)
    needs_gpu: bool = False    # only where a CUDA device is present
    verified: bool = True      # exercised by the tests on this project's machines (False: written, unverified)


class SendState(enum.Enum):
    PENDING = "pending"    # control call posted, the peer has not answered yet
    DONE = "done"          # the peer verified and took the KV
    FAILED = "failed"      # see Transfer.error


class RecvState(enum.Enum):
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class TransferError(RuntimeError):
    """A KV transfer failed; `reason` is a bounded-cardinality label for metrics."""
    reason = "error"


class TransportUnavailable(TransferError):
    """The transport cannot run here (package, device or peer missing); says why."""
    reason = "unavailable"


class CapacityExhausted(TransferError):
    """The local staging region has no room for this payload now (a fallback is allowed, and counted)."""
    reason = "capacity"


class PeerLostRegistration(TransferError):
    """The peer no longer knows our registration (it restarted): forget it, register again, retry once."""
    reason = "lost_registration"


class PeerRefused(TransferError):
    """The peer answered and refused the KV (verification failed, bad input): retrying will not help."""
    reason = "refused"


class TransferTimeout(TransferError):
    reason = "timeout"


class Transfer(ABC):
    """One posted KV send. poll() never blocks; wait() does, up to a timeout."""

    @abstractmethod
    def poll(self) -> SendState: ...

    @abstractmethod
    def wait(self, timeout_s: float) -> dict:
        """{"transport", "bytes", "seconds"} on DONE; raises a TransferError on FAILED or timeout."""


class TransportSender(ABC):
    name: str = ""
    # True: start() and forget() may run from several threads at once (the prefill server's send threads);
    # False: KVSender runs this transport's sends one at a time
    concurrent_sends: bool = False

    @abstractmethod
    def start(self, url: str, request_id: str, hdr: KVHeader, payload: np.ndarray, timeout_s: float) -> Transfer:
        ...

    def prepare(self) -> None:  # noqa: B027 -- transports without local setup have nothing to do ahead
        pass

    def forget(self, url: str) -> None:  # noqa: B027 -- transports without per-peer state have nothing to drop
        pass

    @abstractmethod
    def close(self) -> None: ...


class TransportReceiver(ABC):
    name: str = ""
    pulls: bool = False  # True: receive() fetches hdr.nbytes from the sender (kv_ingest bounds that size first)

    def offer(self) -> dict:
        return {}

    @abstractmethod
    def receive(self, hdr: KVHeader, payload: Optional[np.ndarray], remote: Optional[bytes],
                timeout_s: float) -> np.ndarray: ...

    def close(self) -> None:  # noqa: B027
        pass


class InBandReceiver(TransportReceiver):
    """Transports whose payload arrives as the kv_payload tensor (Triton resolved shm/CUDA shm before we run)."""

    def receive(self, hdr, payload, remote, timeout_s):
        if payload is None:
            raise PeerRefused(f"transport {self.name!r} sends the payload as 'kv_payload', which is missing")
        return np.ascontiguousarray(payload.reshape(-1), dtype=np.uint8)
