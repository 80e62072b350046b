"""Capability handshake: which transports a prefill/decode pair can use, decided once per decode member.

Each end describes itself (offer): a host identity (boot id + the /dev/shm mount it sees: two containers on one
host with separate IPC namespaces are different "hosts" for POSIX shm), the GPUs it sees, and the transports it
can run with the reason for each one it cannot. usable() intersects two offers under each transport's
TransportCaps. The decode side answers kv_ingest op=caps; the orchestrator (reliability.DecodePool) asks each
member after its first good health check and again after it comes back from down (it may have restarted with
another configuration). The orchestrator runs on the prefill server, so its own offer stands for the sender's.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, Optional, Tuple

from .registry import BASELINE, NAMES, SPECS


def host_identity() -> str:
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "none"
    return f"{boot}/{shm}"


def local_offer(receivers: Optional[Dict[str, dict]] = None) -> dict:
    """This process's offer. `receivers`: per-transport extras a receiver adds (nixl: its agent name)."""
    from .cuda_ipc import gpu_uuids

    transports, unavailable = {}, {}
    for name, s in SPECS.items():
        why = s.available()
        if why:
            unavailable[name] = why
        else:
            transports[name] = (receivers or {}).get(name, {})
    return {"host": host_identity(), "gpus": gpu_uuids(), "transports": transports, "unavailable": unavailable}


@lru_cache(maxsize=1)
def sender_offer() -> dict:
    """The prefill side's offer (cached: what a process can import does not change while it runs)."""
    return local_offer()


@dataclass
class Negotiated:
    transports: Tuple[str, ...] = ()
    reasons: Dict[str, str] = field(default_factory=dict)  # transport -> why this pair cannot use it

    def allows(self, name: str) -> bool:
        return name in self.transports


def usable(local: dict, peer: dict) -> Negotiated:
    out, why = [], {}
    for name in NAMES:
        caps = SPECS[name].caps
        if name not in local.get("transports", {}):
            why[name] = "not available on the prefill side: " + local.get("unavailable", {}).get(name, "?")
        elif name not in peer.get("transports", {}):
            why[name] = "not offered by the decode server: " + peer.get("unavailable", {}).get(name, "unknown")
        elif caps.same_host and local.get("host") != peer.get("host"):
            why[name] = "needs the same host (and /dev/shm); the decode server is on another"
        elif caps.same_device and not set(local.get("gpus", [])) & set(peer.get("gpus", [])):
            why[name] = "needs the same GPU on both ends"
        else:
            out.append(name)
    if BASELINE not in out:  # a decode server that cannot take inline KV is misconfigured; say so, keep grpc
        why.setdefault(BASELINE, "baseline not negotiated")
    return Negotiated(tuple(out), why)


def fetch_offer(url: str, timeout_s: float) -> dict:
    """Ask a decode server's kv_ingest for its offer (op=caps)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    op = grpcclient.InferInput("op", [1], "BYTES")
    op.set_data_from_numpy(np.array([b"caps"], dtype=np.object_))
    c = grpcclient.InferenceServerClient(url)
    try:
        r = c.infer("kv_ingest", [op], outputs=[grpcclient.InferRequestedOutput("kv_caps")],
                    client_timeout=timeout_s)
    finally:
        c.close()
    raw = r.as_numpy("kv_caps")
    if raw is None:
        raise RuntimeError(f"{url}: kv_ingest answered op=caps without kv_caps (an older decode server?)")
    return json.loads(bytes(raw.reshape(-1)[0]))


def negotiate(url: str, timeout_s: float) -> Negotiated:
    return usable(sender_offer(), fetch_offer(url, timeout_s))
