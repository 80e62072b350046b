"""The one place KV transport names are defined: name -> capabilities + where its sender/receiver live.

Modules are imported on first use (nixl and CUDA pull in large native libraries), so listing names, checking a
request's transport and negotiating capabilities never import them. Order = preference when negotiating.
To add a transport: write a module with a TransportSender, a TransportReceiver and available(), add it here.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Tuple

from .base import TransportCaps


@dataclass(frozen=True)
class TransportSpec:
    name: str
    caps: TransportCaps
    module: str    # under hetserve.kv.transport
    sender: str    # class names in that module
    receiver: str
    summary: str

    def load(self):
        return importlib.import_module(f"{__package__}.{self.module}")

    def available(self) -> str:
        """'' when this process can use the transport, else the reason (never raises)."""
        try:
            return self.load().available()
        except Exception as e:  # a broken native dependency is a reason, not a crash
            return f"{type(e).__name__}: {e}"


_SPECS = (
    TransportSpec("grpc", TransportCaps(), "grpc_inline", "GrpcSender", "GrpcReceiver",
                  "KV bytes inline in the kv_ingest gRPC call"),
    TransportSpec("shm", TransportCaps(same_host=True), "shm", "ShmSender", "ShmReceiver",
                  "POSIX shm region registered with the decode server (same host)"),
    TransportSpec("nixl", TransportCaps(rdma=True), "nixl_pull", "NixlSender", "NixlReceiver",
                  "NIXL agents (UCX); decode READs from the prefill's registered memory"),
    TransportSpec("cuda_shm", TransportCaps(same_host=True, same_device=True, needs_gpu=True, verified=False),
                  "cuda_ipc", "CudaShmSender", "CudaShmReceiver",
                  "Triton CUDA shared memory (CUDA IPC), same GPU; unverified (no GPU here)"),
)
SPECS: Dict[str, TransportSpec] = {s.name: s for s in _SPECS}
NAMES: Tuple[str, ...] = tuple(SPECS)
BASELINE = "grpc"  # every decode server accepts it; the fallback target
CPU_NAMES: Tuple[str, ...] = tuple(n for n, s in SPECS.items() if not s.caps.needs_gpu)  # doctor's default probes


def spec(name: str) -> TransportSpec:
    s = SPECS.get(name)
    if s is None:
        raise ValueError(f"unknown KV transport {name!r}; use one of {', '.join(NAMES)}")
    return s


def to_prepare(value: str, default: str) -> Tuple[str, ...]:
    """The transports HETSERVE_KV_PREPARE names: start-up work (NIXL: ~2 s of imports + agent, on a loaded box
    several) done with the server instead of in the first request that uses the transport. 'default' stands
    for the default transport, 'all' for every transport available in this process, 'none' (or '') for none.
    ValueError for an unknown name: a typo must not leave the first requests paying for start-up silently."""
    out = []
    for raw in (value or "").split(","):
        name = raw.strip()
        if name in ("", "none"):
            continue
        if name == "all":
            out += [n for n, s in SPECS.items() if not s.available()]
            continue
        name = default if name == "default" else name
        if name not in SPECS:
            raise ValueError(f"HETSERVE_KV_PREPARE names unknown KV transport {name!r}; use default, all, none "
                             f"or some of {', '.join(NAMES)}")
        out.append(name)
    return tuple(dict.fromkeys(n for n in out if n != BASELINE))  # the baseline has nothing to start
