"""The local topology: one prefill server and one decode server on separate cores (separate 'devices')."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from .server import REPO_ROOT, ServerSpec, TritonProcess, bind_host, check_ports_free


def split_cpus() -> Dict[str, Optional[List[int]]]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"prefill": None, "decode": None}
    half = len(cpus) // 2
    return {"prefill": cpus[:half], "decode": cpus[half:]}


@dataclass
class Topology:
    engine_dir: str
    base_port: int = 8000  # prefill: base..base+2, decode: base+1000..base+1002
    log_dir: str = field(default_factory=lambda: str(REPO_ROOT / ".hetserve" / "logs"))
    env: dict = field(default_factory=dict)
    pin: bool = True
    host: str = field(default_factory=bind_host)
    servers: Dict[str, TritonProcess] = field(default_factory=dict)

    def spec(self, role: str) -> ServerSpec:
        cpus = split_cpus() if self.pin else {"prefill": None, "decode": None}
        off = {"prefill": 0, "decode": 1000}[role]
        b = self.base_port + off
        env = dict(self.env)
        if role == "prefill":
            env.setdefault("HETSERVE_DECODE_URL", f"127.0.0.1:{self.base_port + 1001}")
        return ServerSpec(role, b, b + 1, b + 2, self.engine_dir, cpus=cpus[role], env=env, host=self.host,
                          log_file=str(Path(self.log_dir) / f"{role}-{self.base_port}.log"))

    def processes(self) -> List[TritonProcess]:
        return list(self.servers.values())

    @property
    def prefill_grpc(self) -> str:
        return f"127.0.0.1:{self.base_port + 1}"

    @property
    def prefill_http(self) -> str:
        return f"127.0.0.1:{self.base_port}"

    @property
    def decode_grpc(self) -> str:
        return f"127.0.0.1:{self.base_port + 1001}"

    def start(self, timeout: float = 300.0) -> "Topology":
        roles = ("decode", "prefill")
        check_ports_free([self.spec(r) for r in roles])  # before anything starts: a running one keeps serving
        try:
            for role in roles:
                self.servers[role] = TritonProcess(self.spec(role)).start(check_ports=False)
            for p in self.servers.values():
                p.wait_ready(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self):
        for p in self.servers.values():
            p.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
