"""KV transports: one sender/receiver interface (base.py), one registry of names (registry.py), a capability
handshake (negotiate.py) and the prefill side's KVSender (sender.py). Transports: grpc_inline.py, shm.py,
nixl_pull.py, cuda_ipc.py (unverified: no GPU here)."""
from .base import (
                   CapacityExhausted,
                   PeerLostRegistration,
                   PeerRefused,
                   RecvState,
                   SendState,
                   TransferError,
                   TransferTimeout,
                   TransportCaps,
                   TransportReceiver,
                   TransportSender,
                   TransportUnavailable,
)
from .registry import BASELINE, CPU_NAMES, NAMES, SPECS, spec, to_prepare
from .sender import KVSender

TRANSPORTS = NAMES  # the registry's names, in preference order

__all__ = ["BASELINE", "CPU_NAMES", "NAMES", "SPECS", "TRANSPORTS", "CapacityExhausted", "KVSender",
           "PeerLostRegistration",
           "PeerRefused", "RecvState", "SendState", "TransferError", "TransferTimeout", "TransportCaps",
           "TransportReceiver", "TransportSender", "TransportUnavailable", "spec", "to_prepare"]
