"""One prefill server and one decode server on separate cores: a thin view of cluster.LocalCluster (the one
launcher) with one decode server, addressed by role (`servers["prefill"]`, `decode_grpc`)."""
from __future__ import annotations

from typing import Dict, List, Optional

from .cluster import LocalCluster, split_cpus
from .server import TritonProcess

__all__ = ["Topology", "split_cpus"]


class Topology:
    """prefill: base..base+2 (HTTP, gRPC, metrics), decode: base+1000..base+1002."""

    def __init__(self, engine_dir: str, base_port: int = 8000, log_dir: Optional[str] = None,
                 env: Optional[dict] = None, pin: bool = True, host: Optional[str] = None):
        self.cluster = LocalCluster(engine_dir, base_port=base_port, n_decode=1, env=env, log_dir=log_dir,
                                    pin=pin, host=host, static_decode=True)

    @property
    def engine_dir(self) -> str:
        return self.cluster.engine_dir

    @property
    def base_port(self) -> int:
        return self.cluster.base_port

    @property
    def servers(self) -> Dict[str, TritonProcess]:
        c = self.cluster
        return {**({"decode": c.decode[0]} if 0 in c.decode else {}),
                **({"prefill": c.prefill} if c.prefill is not None else {})}

    def processes(self) -> List[TritonProcess]:
        return self.cluster.processes()

    @property
    def prefill_grpc(self) -> str:
        return self.cluster.prefill_grpc

    @property
    def prefill_http(self) -> str:
        return self.cluster.prefill_http

    @property
    def decode_grpc(self) -> str:
        return self.cluster.decode_grpc(0)

    def start(self, timeout: float = 300.0) -> "Topology":
        self.cluster.start(timeout)
        return self

    def stop(self):
        self.cluster.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
