"""Launch tritonserver (binary from the nvidia-pytriton wheel) for one role of the topology."""
from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
PKG_DIR = Path(__file__).resolve().parents[1]  # python_backends/

ROLE_MODELS: Dict[str, List[str]] = {
    # `aggregated` (the no-transfer baseline) rides on the prefill server so comparisons share hardware
    "prefill": ["preprocess", "postprocess", "prefill", "llm", "ensemble", "aggregated"],
    "decode": ["kv_ingest", "decode"],
    "aggregated": ["preprocess", "postprocess", "aggregated"],
}
ROLE_MODELS["all"] = list(dict.fromkeys(ROLE_MODELS["prefill"] + ROLE_MODELS["decode"] + ["aggregated"]))


class ServerError(RuntimeError):
    pass


def pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise ServerError("nvidia-pytriton is not installed (pip install nvidia-pytriton)")
    return Path(spec.origin).parent / "tritonserver"


def tritonserver_binary() -> str:
    env = os.environ.get("HETSERVE_TRITONSERVER")
    if env:
        return env
    b = pytriton_dir() / "bin" / "tritonserver"
    if not b.exists():
        found = shutil.which("tritonserver")
        if not found:
            raise ServerError(f"tritonserver binary not found at {b} or on PATH")
        return found
    return str(b)


def default_model_repository() -> str:
    return os.environ.get("HETSERVE_MODEL_REPOSITORY", str(REPO_ROOT / "model_repository"))


def prepare_backend_dir(dest: Optional[Path] = None) -> Path:
    """Our own backend dir: the python backend + the 3.x stub copied next to it (never into site-packages)."""
    src = pytriton_dir()
    dest = Path(dest or os.environ.get("HETSERVE_BACKEND_DIR", REPO_ROOT / ".hetserve" / "backends"))
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = {src / "backends" / "python" / "libtriton_python.so": py / "libtriton_python.so",
             src / "backends" / "python" / "triton_python_backend_utils.py": py / "triton_python_backend_utils.py",
             src / "python_backend_stubs" / ver / "triton_python_backend_stub": py / "triton_python_backend_stub"}
    for s, d in files.items():
        if not s.exists():
            raise ServerError(f"{s} missing from nvidia-pytriton (Python {ver} stub needed)")
        if not d.exists() or d.stat().st_size != s.stat().st_size:
            shutil.copy2(s, d)
    return dest


def stub_environment(extra: Optional[dict] = None) -> dict:
    """The stub links libpython3.x; point it at this interpreter's libpython, stdlib and site-packages."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    # the copied stub's RPATH no longer reaches the wheel's bundled libs (libcudart etc.)
    wheel_libs = str(pytriton_dir().parents[1] / "nvidia_pytriton.libs")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [libdir, wheel_libs, env.get("LD_LIBRARY_PATH", "")] if p)
    env["PYTHONHOME"] = sys.base_prefix
    # The 2.51 stub does not honour PYTHONPATH for the model's own imports, so hetserve must be pip-installed
    # (scripts/install.sh does `pip install -e .`); the path is still passed for any helper processes.
    paths = [str(PKG_DIR)] + site.getsitepackages() + [site.getusersitepackages()]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


@dataclass
class ServerSpec:
    role: str
    http_port: int
    grpc_port: int
    metrics_port: int
    engine_dir: str
    model_repository: str = field(default_factory=default_model_repository)
    cpus: Optional[Sequence[int]] = None
    env: dict = field(default_factory=dict)
    log_file: Optional[str] = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"


class TritonProcess:
    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def command(self) -> List[str]:
        s = self.spec
        if s.role not in ROLE_MODELS:
            raise ServerError(f"unknown role {s.role!r}; choose one of {sorted(ROLE_MODELS)}")
        cmd = [tritonserver_binary(), f"--model-repository={s.model_repository}",
               "--model-control-mode=explicit", f"--backend-directory={prepare_backend_dir()}",
               f"--http-port={s.http_port}", f"--grpc-port={s.grpc_port}", f"--metrics-port={s.metrics_port}",
               "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-timeout-secs=10",
               "--backend-config=python,shm-default-byte-size=16777216",
               "--backend-config=python,shm-growth-byte-size=16777216",
               "--backend-config=python,stub-timeout-seconds=120",
               "--log-verbose=0"]
        cmd += [f"--load-model={m}" for m in ROLE_MODELS[s.role]]
        return cmd

    def start(self) -> "TritonProcess":
        s = self.spec
        env = stub_environment({"HETSERVE_ENGINE_DIR": s.engine_dir, "HETSERVE_ROLE": s.role, **s.env})
        cpus = list(s.cpus) if s.cpus else None
        if s.cpus:
            env["HETSERVE_THREADS"] = str(len(cpus))

        def pin():  # act as a separate device: pin to its own cores
            os.setsid()
            if cpus:
                os.sched_setaffinity(0, cpus)

        out = subprocess.DEVNULL
        if s.log_file:
            Path(s.log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(s.log_file, "ab")
            out = self._log
        self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=pin)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        url = f"http://{self.spec.http_url}/v2/health/ready"
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"{self.spec.role} server exited with code {self.proc.returncode}"
                                  f" (log: {self.spec.log_file})")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.spec.role} server not ready after {timeout:.0f}s (log: {self.spec.log_file})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        finally:
            if self._log:
                self._log.close()

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
