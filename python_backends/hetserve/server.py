"""Launch tritonserver (binary from the nvidia-pytriton wheel) for one role of the topology.

Safe by default (docs/reliability.md, "Security"): every port binds loopback unless HETSERVE_BIND / --host says
otherwise; the admin APIs (model repository control, shared-memory registration, trace, logging) answer only
requests carrying the deployment's admin key (header `hetserve-admin-key`, HETSERVE_ADMIN_KEY, random per
launcher when unset); ports already in use are refused before anything starts; stop() ends the server's whole
process group (tritonserver and its python backend stubs) and removes the shared-memory regions they leave.

Every child a launcher starts (tritonservers, the OpenAI frontend, nginx) is spawned through CHILDREN.spawn: with
SIGINT/SIGTERM/SIGHUP held in the spawning thread until the child is recorded both on its owner (`owner.proc`) and in
the registry, so a stop signal at any moment finds every child already known (cli.py's _Lifecycle stops them all).
"""
from __future__ import annotations

import contextlib
import http.client
import itertools
import logging
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set

from . import config
from .admin_key import (  # noqa: F401  (re-exported: the launcher's callers use them from here)
    ADMIN_HEADER,
    ADMIN_PARAM,
    GRPC_HEADER_PREFIX,
    AdminKeyError,
    admin_headers,
    admin_key,
    admin_key_file,
)
from .stub_watch import StubWatch

log = logging.getLogger("hetserve.server")

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


# ---- exposure ------------------------------------------------------------------------------------
LOOPBACK = "127.0.0.1"
# Triton APIs that change server state or map memory: only the orchestrator and operators hold the key.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")


def bind_host(host: Optional[str] = None) -> str:
    """The address every port binds: loopback unless asked (--host / HETSERVE_BIND); warns when exposed."""
    h = host or config.get("HETSERVE_BIND") or LOOPBACK
    if h not in (LOOPBACK, "localhost", "::1"):
        log.warning("binding %s: Triton ports are reachable beyond this host (admin APIs stay key-protected)", h)
    return h


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when something listens on `port` (or holds it) on `host` or the wildcard address."""
    for target in {host, LOOPBACK}:
        try:
            with socket.create_connection((target, port), timeout=0.3):
                return True
        except OSError:
            pass
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not "in use"
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports_free(specs: Sequence["ServerSpec"]) -> None:
    """Refuse to start when any port of any server is taken (another `hetserve up`, a stray tritonserver)."""
    busy = [(sp.role, p) for sp in specs for p in sp.ports if port_in_use(p, sp.host)]
    if busy:
        raise ServerError("port(s) already in use: " + ", ".join(f"{p} ({role})" for role, p in busy)
                          + "; is another `hetserve up` running? Stop it or pick another --base-port")


def _listening_inodes(port: int) -> set:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                out.add(f[9])
    return out


def owns_port(pid: int, port: int) -> bool:
    """True when process `pid` holds the listening socket of `port` (readiness must come from *our* server)."""
    inodes = _listening_inodes(port)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


# ---- leftovers -----------------------------------------------------------------------------------
SHM_DIR = Path("/dev/shm")
PB_SHM_PREFIX = "triton_python_backend_shm_region_"  # Triton's python backend (one region per model stub)
KV_SHM_PREFIX = "hetserve_kv_"  # our KV sender (kv/transport/shm.py), mapped by the prefill stub and the decode server
SHM_PATTERNS = (PB_SHM_PREFIX + "*", KV_SHM_PREFIX + "*")
_SERVER_SEQ = itertools.count()


def _shm_in_use() -> set:
    """Names of /dev/shm files some live process maps or holds open."""
    return shm_mapped_by(pid for pid in os.listdir("/proc") if pid.isdigit())


def shm_mapped_by(pids) -> Set[str]:
    """Names of the /dev/shm files the processes `pids` map or hold open."""
    out = set()
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/maps"):
                if "/dev/shm/" in line:
                    out.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("/dev/shm/"):
                    out.add(link[9:].split()[0])
        except OSError:
            continue
    return out


def sweep_stale_shm(min_age_s: float = 30.0) -> List[str]:
    """Remove shared-memory regions of ours / of Triton's python backend that no live process maps or holds
    (left by killed servers). Young regions are kept: a starting server may not have mapped its region yet."""
    try:
        candidates = [p for pat in SHM_PATTERNS for p in SHM_DIR.glob(pat)]
    except OSError:
        return []
    if not candidates:
        return []
    used = _shm_in_use()
    now = time.time()
    removed = []
    for p in candidates:
        try:
            if p.name in used or now - p.stat().st_mtime < min_age_s or p.stat().st_uid != os.geteuid():
                continue
            p.unlink()
            removed.append(p.name)
        except OSError:
            continue
    if removed:
        log.info("removed %d stale shared-memory region(s) from /dev/shm", len(removed))
    return removed


PYTHON_ENV_GLOB = "python_env_*"  # Triton's python backend: /tmp/python_env_XXXXXX per server (hard-coded path)


def _tritonserver_alive() -> bool:
    """Some tritonserver process (ours or not) is running on this machine."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        if argv0.endswith(b"tritonserver"):
            return True
    return False


def sweep_python_envs(tmp: Path = Path("/tmp"), alive: Optional[Callable[[], bool]] = None) -> List[str]:
    """Remove the empty python_env_* directories Triton's python backend left in /tmp: it makes one per server and
    removes it only on a clean shutdown, so every killed server leaves one. Only while no tritonserver runs on
    this machine (a live server's directory is not told apart from a dead one's, and removing it would make the
    backend's destructor throw at exit); only empty ones (an extracted EXECUTION_ENV_PATH is not ours to drop)
    and only our own."""
    if (alive or _tritonserver_alive)():
        return []
    removed = []
    for p in tmp.glob(PYTHON_ENV_GLOB):
        try:
            if p.is_dir() and p.stat().st_uid == os.geteuid():
                p.rmdir()  # fails on a non-empty directory: left alone
                removed.append(p.name)
        except OSError:
            continue
    if removed:
        log.info("removed %d python_env directories left in %s by stopped tritonservers", len(removed), tmp)
    return removed


def pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise ServerError("nvidia-pytriton is not installed (pip install nvidia-pytriton)")
    return Path(spec.origin).parent / "tritonserver"


def tritonserver_binary() -> str:
    env = config.get("HETSERVE_TRITONSERVER")
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
    return config.get("HETSERVE_MODEL_REPOSITORY") or str(REPO_ROOT / "model_repository")


def prepare_backend_dir(dest: Optional[Path] = None) -> Path:
    """Our own backend dir: the python backend + the 3.x stub copied next to it (never into site-packages)."""
    src = pytriton_dir()
    dest = Path(dest or config.get("HETSERVE_BACKEND_DIR") or REPO_ROOT / ".hetserve" / "backends")
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
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + inherited))
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
    host: str = field(default_factory=bind_host)  # address every port binds (loopback by default)
    admin_port: Optional[int] = None  # the admin side channel (admin_channel.py); None: gRPC port + 2

    @property
    def admin_ports(self) -> Dict[str, int]:
        """Env var -> port of each admin side channel this server's models open ("all" runs both models)."""
        base = self.admin_port if self.admin_port is not None else self.grpc_port + 2
        models = ROLE_MODELS.get(self.role, [])
        out = {}
        if "prefill" in models:
            out["HETSERVE_PREFILL_ADMIN"] = base
        if "decode" in models:
            out["HETSERVE_DECODE_ADMIN"] = base + len(out)
        return out

    @property
    def ports(self) -> List[int]:
        return [self.http_port, self.grpc_port, self.metrics_port, *self.admin_ports.values()]

    def _client_host(self) -> str:
        return LOOPBACK if self.host in ("0.0.0.0", "::") else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host()}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self._client_host()}:{self.http_port}"


# ---- children ------------------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a launcher (cli.py's _Lifecycle)


class _Held:
    depth = 0  # main thread inside signals_held()
    pending: List[int] = []  # stop signals a handler deferred meanwhile


def defer_signal(signum: int) -> bool:
    """For a launcher's Python signal handler (it runs in the main thread): True when the main thread is inside
    signals_held(), the signal then being raised again at the block's end; False: handle it now."""
    if _Held.depth > 0:
        _Held.pending.append(signum)
        return True
    _Held.pending.clear()
    return False


@contextlib.contextmanager
def signals_held():
    """A block a stop signal must not cut in two (spawning a child and recording it). The signals are blocked in
    this thread (a child forked here inherits the mask until its preexec restores it), and a handler that asks
    defer_signal() waits for the block's end: a signal another thread received (numpy's, gRPC's) is handled by a
    Python handler in the main thread, whatever that thread's mask."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if main:
        _Held.depth += 1
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if main:
            _Held.depth -= 1
            if _Held.depth == 0 and _Held.pending:
                signum = _Held.pending[0]
                _Held.pending.clear()
                signal.raise_signal(signum)


class ChildRegistry:
    """Every process a launcher spawned and has not reaped yet, each with its owner (TritonProcess, FrontendProcess,
    NginxLB: objects with `.proc` and `.stop()`). spawn() records the child before a stop signal can be handled;
    close() refuses later spawns (a launcher tearing down: the autoscaler thread may be starting a server);
    stop_all() stops what is left; kill_all() SIGKILLs it at once (a second Ctrl-C during teardown)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: Dict[int, object] = {}  # pid -> owner
        self.closed = False

    def spawn(self, owner, argv: List[str], new_session: bool = True, cpus: Optional[Sequence[int]] = None,
              **popen_kw) -> subprocess.Popen:
        """Popen(argv) with the stop signals held until `owner.proc` is set and the child recorded. The child gets
        the default handlers and an empty signal mask back before exec; `new_session`: it leads a session (and
        process group) of its own, so stop() can end it with everything it starts; `cpus`: pinned to them."""
        held = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]  # nohup's SIGHUP stays off

        def child():
            if new_session:
                os.setsid()
            if cpus:
                os.sched_setaffinity(0, cpus)
            for s in held:  # a signal that reached the child before setsid() kills it, not a Python handler
                signal.signal(s, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

        with signals_held():
            with self._lock:
                if self.closed:
                    raise ServerError(f"shutting down: not starting {Path(argv[0]).name}")
                proc = subprocess.Popen(argv, preexec_fn=child, **popen_kw)
                owner.proc = proc
                owner._own_group = new_session
                self._owners[proc.pid] = owner
        return proc

    def forget(self, owner) -> None:
        """`owner`'s child is reaped (its stop() ran to the end)."""
        with self._lock:
            for pid in [pid for pid, o in self._owners.items() if o is owner]:
                del self._owners[pid]

    def owners(self) -> list:
        with self._lock:
            return list(self._owners.values())

    def close(self) -> None:
        with self._lock:
            self.closed = True

    def stop_all(self) -> None:
        """Refuse new children, then stop() every one still recorded (each removes its shm regions)."""
        self.close()
        for o in self.owners():
            try:
                o.stop()
            except Exception:
                log.exception("stopping pid %s", getattr(o.proc, "pid", None))

    def kill_all(self) -> None:
        """SIGKILL every recorded child (its whole group when it leads one) now; their owners' stop() then only
        reaps them and removes their shm regions. Safe in a signal handler: no lock, no waiting."""
        for o in list(self._owners.values()):
            proc = o.proc
            if proc is None or proc.returncode is not None:
                continue
            note = getattr(o, "note_shm", None)
            if note is not None:
                note()  # what the group maps, before it dies (KV regions are found this way)
            try:
                if getattr(o, "_own_group", False):
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(proc.pid, signal.SIGKILL)
            except OSError:
                pass


CHILDREN = ChildRegistry()


class TritonProcess:
    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        self._own_group = True
        # this server's python backend regions: /dev/shm/<shm_prefix><uuid>, one per model stub (launcher pid, gRPC
        # port and a per-launcher count: stop() removes exactly these, even those a killed stub never unmapped)
        self.shm_prefix = f"{PB_SHM_PREFIX}hetserve-{os.getpid()}-{spec.grpc_port}-{next(_SERVER_SEQ)}_"
        self._shm_seen: Set[str] = set()  # KV regions (hetserve_kv_*) this server's processes were seen mapping
        self._stopped = False  # stop() ran to its end: the group is gone (its pgid may be reused: never signal it)
        self.stub_watch: Optional[StubWatch] = None  # from wait_ready() to stop(): crashed stubs replaced
        self._watch_lock = threading.Lock()
        self._stopping = False

    def command(self) -> List[str]:
        s = self.spec
        if s.role not in ROLE_MODELS:
            raise ServerError(f"unknown role {s.role!r}; choose one of {sorted(ROLE_MODELS)}")
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key()}"
        cmd = [tritonserver_binary(), f"--model-repository={s.model_repository}",
               "--model-control-mode=explicit", f"--backend-directory={prepare_backend_dir()}",
               f"--http-address={s.host}", f"--grpc-address={s.host}", f"--metrics-address={s.host}",
               f"--http-port={s.http_port}", f"--grpc-port={s.grpc_port}", f"--metrics-port={s.metrics_port}",
               f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
               "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-timeout-secs=10",
               "--backend-config=python,shm-default-byte-size=16777216",
               "--backend-config=python,shm-growth-byte-size=16777216",
               "--backend-config=python,stub-timeout-seconds=120",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               "--log-verbose=0"]
        cmd += [f"--load-model={m}" for m in ROLE_MODELS[s.role]]
        return cmd

    def start(self, check_ports: bool = True) -> "TritonProcess":
        s = self.spec
        if check_ports:
            check_ports_free([s])
        sweep_stale_shm()
        # admin side channels: HETSERVE_ADMIN_BIND, else the server's own address, but never a wildcard one (a
        # container binds 0.0.0.0 for its clients; operators reach the admin port by exec / port-forward)
        ah = config.get("HETSERVE_ADMIN_BIND") or (LOOPBACK if s.host in ("0.0.0.0", "::") else s.host)
        from .admin_channel import format_addr

        admin = {var: format_addr(ah, port) for var, port in s.admin_ports.items()}
        env = stub_environment({"HETSERVE_ENGINE_DIR": s.engine_dir, "HETSERVE_ROLE": s.role,
                                "HETSERVE_ADMIN_KEY": admin_key(), **admin, **s.env})
        cpus = list(s.cpus) if s.cpus else None
        if cpus:
            env["HETSERVE_THREADS"] = str(len(cpus))
        cmd = self.command()
        out = subprocess.DEVNULL
        if s.log_file:
            Path(s.log_file).parent.mkdir(parents=True, exist_ok=True)
            if self._log is None:
                self._log = open(s.log_file, "ab")
            out = self._log
        # its own session (stop() ends the group: tritonserver and its stubs), pinned to its cores (a separate
        # device); self.proc is set before a stop signal can be handled
        CHILDREN.spawn(self, cmd, cpus=cpus, env=env, stdout=out, stderr=subprocess.STDOUT)
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
                        if not owns_port(self.proc.pid, self.spec.http_port):
                            raise ServerError(f"{self.spec.role}: port {self.spec.http_port} answers but is not "
                                              f"held by our tritonserver (pid {self.proc.pid})")
                        self._watch_stubs()
                        return
            except (OSError, http.client.HTTPException):  # not listening yet, or a half-started HTTP frontend
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.spec.role} server not ready after {timeout:.0f}s (log: {self.spec.log_file})")

    def watch_stubs_when_ready(self, timeout: float = 24 * 3600.0) -> None:
        """For a launcher that does not wait_ready() itself (`hetserve serve`: a container's server may load for
        minutes): a thread waits for readiness and starts the stub watch; a server that exits first is the
        supervisor's to report."""
        def wait() -> None:
            try:
                self.wait_ready(timeout)
            except ServerError as e:
                log.debug("stub watch not started: %s", e)
        threading.Thread(target=wait, name="stub-watch-start", daemon=True).start()

    def _watch_stubs(self) -> None:
        interval = float(config.get("HETSERVE_STUB_WATCH_S"))
        with self._watch_lock:  # never after stop() began (a stop is not a crash)
            if interval > 0 and self.stub_watch is None and self.proc is not None and not self._stopping:
                self.stub_watch = StubWatch(self.proc.pid, self.spec.http_url, ADMIN_HEADER, admin_key(), interval,
                                            name=f"{self.spec.role} server :{self.spec.grpc_port}").start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        return log_tail(self.spec.log_file, n)

    def note_shm(self) -> None:
        """Remember the KV regions this server's processes map now (stop() removes them once nobody does)."""
        if self.proc is not None:
            pids = [pid for pid, state, _, g, _ in proc_stats() if g == self.proc.pid and state != "Z"]
            self._shm_seen |= {n for n in shm_mapped_by(pids) if n.startswith(KV_SHM_PREFIX)}

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left of it (python backend stubs can outlive
        tritonserver), then remove its shared-memory regions: its python backend ones (by its prefix) and the KV
        ones it mapped that no live process maps any more. Idempotent; a stop cut short can be run again."""
        with self._watch_lock:  # first: a stopping server's stubs are not crashes
            self._stopping = True
            watch, self.stub_watch = self.stub_watch, None
        if watch is not None:
            watch.close()
        if not self.proc or self._stopped:
            self._close_log()
            return
        pgid = self.proc.pid  # start() made it a session (and group) leader
        self.note_shm()
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        self.note_shm()  # stubs still running after tritonserver (and regions made meanwhile)
        _kill_group(pgid)
        if self.proc.poll() is None:
            self.proc.wait(5)
        self._stopped = True
        self._close_log()
        self._remove_shm()
        CHILDREN.forget(self)
        sweep_python_envs()  # the last server of the machine to stop clears what killed ones left

    def _close_log(self) -> None:
        if self._log:
            self._log.close()
            self._log = None

    def _remove_shm(self) -> None:
        names = {p.name for p in SHM_DIR.glob(self.shm_prefix + "*")} | self._shm_seen
        if not names:
            return
        used = _shm_in_use()
        removed = 0
        for n in names - used:
            try:
                (SHM_DIR / n).unlink()
                removed += 1
            except OSError:
                pass
        self._shm_seen &= used  # still mapped (another of our servers): removed when that one stops
        if removed:
            log.info("%s server: removed %d shared-memory region(s)", self.spec.role, removed)

    def kill9(self) -> None:
        """Simulated crash: SIGKILL the whole group at once (no cleanup, as a real crash; a later stop() removes its
        shm regions as after a real one)."""
        if self.proc and self.proc.poll() is None:
            self.note_shm()
            _kill_group(self.proc.pid)
            self.proc.wait(5)


def log_tail(path: Optional[str], n: int = 4000) -> str:
    """The last n bytes of a server's log file ('' when there is none)."""
    try:
        return Path(path).read_bytes()[-n:].decode(errors="replace") if path else ""
    except OSError:
        return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_group(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL every process left in group `pgid` and wait until none runs (our own child stays a zombie until
    Popen.wait reaps it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not _group_alive(pgid) or _only_zombies(pgid):
            return
        time.sleep(0.05)
        try:  # again: a process forked while the first signal was delivered escapes it
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return


def _proc_stat_fields():
    """(pid, the fields of /proc/<pid>/stat after the command name) of every live process."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            yield int(pid), Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue


def proc_stats():
    """(pid, state, ppid, pgid, sid) of every live process, from /proc/<pid>/stat."""
    for pid, f in _proc_stat_fields():
        yield pid, f[0], int(f[1]), int(f[2]), int(f[3])


def cpu_seconds_by_pid(pgid: int) -> Dict[int, float]:
    """{pid: CPU seconds (user + system) used so far} of the live processes of process group `pgid` (a server
    started by TritonProcess: tritonserver and its Python backend stubs)."""
    tick = os.sysconf("SC_CLK_TCK")
    return {pid: (int(f[11]) + int(f[12])) / tick for pid, f in _proc_stat_fields() if int(f[2]) == pgid}


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by the whole process group `pgid` (cpu_seconds_by_pid, summed)."""
    return sum(cpu_seconds_by_pid(pgid).values())


def _only_zombies(pgid: int) -> bool:
    return all(state == "Z" for _, state, _, g, _ in proc_stats() if g == pgid)
