"""The OpenAI frontend as a child process of `hetserve up` (its own session, like the Triton servers, so the
launcher's supervisor and stop logic treat it the same way: alive(), log_tail(), stop()). It is spawned through
server.CHILDREN, so a stop signal at any moment of the launcher finds it recorded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional


@dataclass
class FrontendSpec:
    triton_url: str
    port: int
    engine_dir: str
    host: str = "127.0.0.1"
    log_file: Optional[str] = None
    role: str = "openai"
    model_name: Optional[str] = None  # --served-model-name; None: the checkpoint's name (openai_api/app.py)

    @property
    def grpc_port(self) -> int:  # what the supervisor prints for a dead server
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


class FrontendProcess:
    def __init__(self, spec: FrontendSpec):
        self.spec = spec
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def command(self) -> List[str]:
        s = self.spec
        cmd = [sys.executable, "-m", "hetserve", "serve", "--role", "openai", "--triton-url", s.triton_url,
               "--http-port", str(s.port), "--host", s.host, "--engine-dir", s.engine_dir]
        return cmd + (["--served-model-name", s.model_name] if s.model_name else [])

    def start(self) -> "FrontendProcess":
        from ..server import CHILDREN, ServerError, port_in_use

        if port_in_use(self.spec.port, self.spec.host):
            raise ServerError(f"port {self.spec.port} (openai frontend) already in use; pick another --openai-port")
        out = subprocess.DEVNULL
        if self.spec.log_file:
            Path(self.spec.log_file).parent.mkdir(parents=True, exist_ok=True)
            if self._log is None:
                self._log = open(self.spec.log_file, "ab")
            out = self._log
        CHILDREN.spawn(self, self.command(), stdout=out, stderr=subprocess.STDOUT)  # sets self.proc
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        from ..server import ServerError

        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.alive():
                raise ServerError(f"openai frontend exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.spec.host}:{self.spec.port}/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        raise ServerError(f"openai frontend not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        from ..server import log_tail

        return log_tail(self.spec.log_file, n)

    def served_models(self, timeout: float = 5.0) -> List[str]:
        """The model ids its /v1/models lists."""
        with urllib.request.urlopen(f"http://{self.spec.host}:{self.spec.port}/v1/models", timeout=timeout) as r:
            return [m["id"] for m in json.loads(r.read())["data"]]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM its process group (uvicorn shuts down gracefully), SIGKILL it after `timeout`. Idempotent."""
        from ..server import CHILDREN

        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                self.proc.wait(5)
        if self._log:
            self._log.close()
            self._log = None
        CHILDREN.forget(self)
