"""Local launcher: one prefill server and an elastic pool of decode servers on this host, plus the autoscaler.

Decode server i listens on base+1000+10*i (HTTP), +1 (gRPC), +2 (metrics). The prefill server's orchestrator
learns the pool from a registry file (HETSERVE_DECODE_REGISTRY) that this launcher rewrites whenever it adds or
removes a decode server; the orchestrator re-reads it at every health round (5 s). On Kubernetes the registry is
the decode Deployment's endpoints and the autoscaler is an HPA on the same metrics (docs/reliability.md).

Autoscaler: every `interval_s` it scrapes each decode server's /metrics (hetserve_utilization_ratio of the decode
engine and hetserve_queue_depth), and with hysteresis
  * scales up by one when the mean utilization > `up_util` or any queue > `up_queue` for `up_after` rounds in a row,
  * scales down by one (draining: removed from the registry first, stopped once idle) when the mean utilization
    < `down_util` and all queues are empty for `down_after` rounds in a row,
staying within [min, max] and waiting `cooldown_s` after each action.
"""
from __future__ import annotations

import http.client
import logging
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from . import config
from .server import CHILDREN, REPO_ROOT, ServerSpec, TritonProcess, bind_host, check_ports_free

log = logging.getLogger("hetserve.cluster")


def split_cpus() -> Dict[str, Optional[List[int]]]:
    """This host's cores in two halves, prefill and decode: two 'devices' that do not share cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"prefill": None, "decode": None}
    half = len(cpus) // 2
    return {"prefill": cpus[:half], "decode": cpus[half:]}


class LocalCluster:
    """The one local launcher (`hetserve up`, the tests, topology.Topology): prefill server(s) + decode pool."""

    def __init__(self, engine_dir: str, base_port: int = 8000, n_decode: int = 1, env: Optional[dict] = None,
                 decode_env: Optional[dict] = None, log_dir: Optional[str] = None, pin: bool = True,
                 run_dir: Optional[str] = None, n_prefill: int = 1, host: Optional[str] = None,
                 static_decode: bool = False):
        self.engine_dir = engine_dir
        # one fixed decode server: the prefill server also gets decode 0 as its HETSERVE_DECODE_URL (unless env
        # sets one), so direct prefill calls without a decode_url (doctor, tests) go there; a pool (False)
        # is the registry alone, so a drained server leaves it
        self.static_decode = static_decode
        self.host = host or bind_host()
        self.base_port = base_port
        self.n_initial = n_decode
        self.env = dict(env or {})
        self.decode_env = dict(decode_env or {})
        self.log_dir = log_dir or str(REPO_ROOT / ".hetserve" / "logs")
        self.cpus = split_cpus() if pin else {"prefill": None, "decode": None}
        run = Path(run_dir or (REPO_ROOT / ".hetserve" / "run"))
        run.mkdir(parents=True, exist_ok=True)
        self.registry = str(run / f"decode-pool-{base_port}.txt")
        self.n_prefill = n_prefill
        self.prefills: List[TritonProcess] = []  # prefill server j at base+10*j (HTTP), +1 gRPC, +2 metrics
        self.decode: Dict[int, TritonProcess] = {}
        self.run_dir = run
        self.lb: Optional["NginxLB"] = None
        self._lock = threading.Lock()

    # ---- addresses ------------------------------------------------------------------------------
    def decode_port(self, i: int) -> int:
        return self.base_port + 1000 + 10 * i

    def decode_grpc(self, i: int) -> str:
        return f"127.0.0.1:{self.decode_port(i) + 1}"

    def decode_metrics(self, i: int) -> str:
        return f"127.0.0.1:{self.decode_port(i) + 2}"

    @property
    def prefill(self) -> Optional[TritonProcess]:
        return self.prefills[0] if self.prefills else None

    @property
    def prefill_grpc(self) -> str:
        return f"127.0.0.1:{self.base_port + 1}"

    @property
    def prefill_http(self) -> str:
        return f"127.0.0.1:{self.base_port}"

    @property
    def prefill_metrics(self) -> str:
        return f"127.0.0.1:{self.base_port + 2}"

    def decode_urls(self) -> List[str]:
        return [self.decode_grpc(i) for i in sorted(self.decode)]

    def _write_registry(self):
        tmp = self.registry + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(self.decode_urls()) + "\n")
        os.replace(tmp, self.registry)

    # ---- lifecycle ------------------------------------------------------------------------------
    def _decode_spec(self, i: int) -> ServerSpec:
        b = self.decode_port(i)
        return ServerSpec("decode", b, b + 1, b + 2, self.engine_dir, cpus=self.cpus["decode"],
                          env={**self.env, **self.decode_env}, host=self.host,
                          log_file=str(Path(self.log_dir) / f"decode{i}-{self.base_port}.log"))

    def _start_decode(self, i: int, timeout: float) -> TritonProcess:
        p = TritonProcess(self._decode_spec(i))
        try:
            p.start()
            p.wait_ready(timeout)
        except BaseException:  # a stop signal (KeyboardInterrupt, cli's Interrupted) too
            p.stop()
            raise
        return p

    def _prefill_spec(self, j: int) -> ServerSpec:
        b = self.base_port + 10 * j
        static = {"HETSERVE_DECODE_URL": self.decode_grpc(0)} if self.static_decode else {}
        env = {**static, **self.env, "HETSERVE_DECODE_REGISTRY": self.registry}
        if not self.static_decode:
            env["HETSERVE_DECODE_URL"] = ""
        return ServerSpec("prefill", b, b + 1, b + 2, self.engine_dir, cpus=self.cpus["prefill"], env=env,
                          host=self.host, log_file=str(Path(self.log_dir) / f"prefill-cluster-{b}.log"))

    def processes(self) -> List[TritonProcess]:
        with self._lock:
            return list(self.prefills) + list(self.decode.values())

    def start(self, timeout: float = 300.0) -> "LocalCluster":
        check_ports_free([self._decode_spec(i) for i in range(self.n_initial)]
                         + [self._prefill_spec(j) for j in range(self.n_prefill)])
        # each server is in self.decode / self.prefills before it is spawned, so stop() finds every one started,
        # whatever interrupts this (a server that fails, Ctrl-C, SIGTERM)
        try:
            for i in range(self.n_initial):
                p = TritonProcess(self._decode_spec(i))
                with self._lock:
                    self.decode[i] = p
                p.start(check_ports=False)
            self._write_registry()
            for j in range(self.n_prefill):
                p = TritonProcess(self._prefill_spec(j))
                self.prefills.append(p)
                p.start(check_ports=False)
            for p in self.processes():
                p.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_lb(self, http_port: int, grpc_port: int) -> "NginxLB":
        """nginx in front of the prefill servers (least_conn, passive health, retry on connect errors)."""
        self.lb = NginxLB(self.run_dir / f"nginx-{self.base_port}",
                          [self.base_port + 10 * j for j in range(self.n_prefill)], http_port, grpc_port).start()
        return self.lb

    def add_decode(self, timeout: float = 300.0) -> int:
        """Start one more decode server; it joins the pool once ready. Returns its index."""
        with self._lock:
            i = next(j for j in range(1000) if j not in self.decode)
        p = self._start_decode(i, timeout)
        with self._lock:
            self.decode[i] = p
            self._write_registry()
        log.info("decode server %d up at %s", i, self.decode_grpc(i))
        return i

    def remove_decode(self, i: Optional[int] = None, drain_timeout_s: float = 60.0) -> int:
        """Drain and stop a decode server (the newest by default): out of the registry first, then wait until
        it has no running or queued sequences (or the timeout), then stop it."""
        with self._lock:
            if not self.decode:
                raise RuntimeError("no decode server to remove")
            i = max(self.decode) if i is None else i
            p = self.decode.pop(i)
            self._write_registry()
        deadline = time.time() + drain_timeout_s
        time.sleep(config.get("HETSERVE_HEALTH_INTERVAL_S", self.env) + 0.5)  # let the pool re-read
        while time.time() < deadline:
            s = scrape_decode(self.decode_metrics(i))
            if s is None or (s["batch"] == 0 and s["queue"] == 0):
                break
            time.sleep(0.5)
        p.stop()
        log.info("decode server %d removed", i)
        return i

    def restart_decode(self, i: int, timeout: float = 300.0):
        with self._lock:
            old = self.decode.get(i)
        if old is not None:  # also when it died: its Python backend stubs can outlive it, holding its ports
            old.stop()
        p = self._start_decode(i, timeout)
        with self._lock:
            self.decode[i] = p
            self._write_registry()

    def restart_if_decode(self, proc: TritonProcess) -> bool:
        """Supervisor hook: a dead decode server is restarted in place (its streams were already migrated by the
        orchestrator); a dead prefill server is not ours to replace (False)."""
        with self._lock:
            idx = next((i for i, p in self.decode.items() if p is proc), None)
        if idx is None:
            return False
        log.warning("decode server %d died (code %s); restarting it", idx, proc.proc.returncode)
        try:
            self.restart_decode(idx)
            return True
        except Exception:
            log.exception("restarting decode server %d failed", idx)
            return False

    def kill9(self, i: int):
        self.decode[i].kill9()

    def stop(self):
        if self.lb is not None:
            self.lb.stop()
        procs = list(self.prefills) + list(self.decode.values())
        for p in procs:
            try:
                p.stop()
            except Exception:
                log.exception("stopping %s", p.spec.role)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# What a load balancer in front of the prefill servers exposes (deploy/nginx/nginx.conf mirrors it).
CLIENT_MODELS_RE = "llm|ensemble|aggregated"
GRPC_CLIENT_METHODS_RE = "ServerLive|ServerReady|ModelReady|ServerMetadata|ModelMetadata|ModelInfer|ModelStreamInfer"


class NginxLB:
    """A real nginx load balancer for local prefill servers (the docker-compose one, pointed at 127.0.0.1)."""

    def __init__(self, root: Path, prefill_http_ports: List[int], http_port: int, grpc_port: int):
        self.root = Path(root)
        self.http_ports = prefill_http_ports
        self.http_port, self.grpc_port = http_port, grpc_port
        self.proc = None

    def config(self) -> str:
        http = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;" for p in self.http_ports)
        grpc = "\n".join(f"        server 127.0.0.1:{p + 1} max_fails=1 fail_timeout=10s;" for p in self.http_ports)
        r = self.root
        return f"""daemon off;
pid {r}/nginx.pid;
error_log {r}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {r}/body; proxy_temp_path {r}/proxy; fastcgi_temp_path {r}/fcgi;
    uwsgi_temp_path {r}/uwsgi; scgi_temp_path {r}/scgi;
    upstream prefill_http {{
        least_conn;
{http}
    }}
    upstream prefill_grpc {{
        least_conn;
{grpc}
    }}
    server {{
        listen 127.0.0.1:{self.http_port};
        # allow-list: health, metadata and the client models' inference endpoints; everything else (model
        # control, shared-memory registration, trace, logging, internal models) is refused here.
        location / {{ return 403 '{{"error":"not exposed through the load balancer"}}'; }}
        location ~ ^/v2(/health/(ready|live))?$ {{ proxy_pass http://prefill_http; }}
        location ~ ^/v2/models/({CLIENT_MODELS_RE})(/versions/[0-9]+)?(/ready|/infer|/generate|/generate_stream)?$ {{
            proxy_pass http://prefill_http;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_connect_timeout 2s;
            proxy_next_upstream error timeout http_502 http_503;
        }}
    }}
    server {{
        listen 127.0.0.1:{self.grpc_port} http2;
        location / {{ return 403; }}
        location ~ ^/inference\\.GRPCInferenceService/({GRPC_CLIENT_METHODS_RE})$ {{
            grpc_pass grpc://prefill_grpc;
            grpc_connect_timeout 2s;
            grpc_read_timeout 600s;
            grpc_send_timeout 600s;
            grpc_next_upstream error timeout;
        }}
    }}
}}
"""

    def start(self, timeout_s: float = 15.0) -> "NginxLB":
        import shutil
        import socket

        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nginx.conf"
        conf.write_text(self.config())
        # a session of its own, as the servers: the launcher's teardown (or a second Ctrl-C) ends master and workers
        CHILDREN.spawn(self, [exe, "-c", str(conf), "-p", str(self.root)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.root / 'error.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("nginx did not start listening")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # nginx's master stops its workers
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        CHILDREN.forget(self)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def metric_samples(metrics_url: str, names: Iterable[str],
                   timeout_s: float = 2.0) -> Optional[List[Tuple[str, str, float]]]:
    """(name, label text, value) of each sample of `names` on a server's /metrics (Prometheus text), or None if it
    does not answer."""
    try:
        text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=timeout_s).read().decode()
    except (OSError, ValueError, http.client.HTTPException):  # down, refused, garbled: "does not answer"
        return None
    wanted = set(names)
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in wanted:
            out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def scrape_decode(metrics_url: str, timeout_s: float = 2.0) -> Optional[dict]:
    """{util, queue, batch} of one decode server from its /metrics, or None if it does not answer."""
    samples = metric_samples(metrics_url, ("hetserve_utilization_ratio", "hetserve_queue_depth",
                                           "hetserve_batch_size"), timeout_s)
    if samples is None:
        return None
    out = {"util": 0.0, "queue": 0.0, "batch": 0.0}
    for name, labels, v in samples:
        if name == "hetserve_utilization_ratio" and 'model="decode"' in labels:
            out["util"] = v
        elif name == "hetserve_queue_depth":
            out["queue"] = v
        elif name == "hetserve_batch_size":
            out["batch"] = v
    return out


@dataclass
class ScalePolicy:
    min_n: int = 1
    max_n: int = 4
    up_util: float = 0.8
    down_util: float = 0.3
    up_queue: float = 4
    up_after: int = 2
    down_after: int = 6
    cooldown_s: float = 30.0


@dataclass
class Autoscaler:
    cluster: LocalCluster
    policy: ScalePolicy = field(default_factory=ScalePolicy)
    interval_s: float = 5.0
    history: List[dict] = field(default_factory=list)
    _hot: int = 0
    _cold: int = 0
    _last_action: float = -1e9

    def decide(self, samples: List[dict], n: int, now: float) -> int:
        """+1 / -1 / 0 from this round's samples (hysteresis: consecutive rounds, cooldown, bounds)."""
        p = self.policy
        if n < p.min_n:
            return +1
        live = [s for s in samples if s is not None]
        if not live:
            return 0
        util = sum(s["util"] for s in live) / len(live)
        queue = max(s["queue"] for s in live)
        hot = util > p.up_util or queue > p.up_queue
        cold = util < p.down_util and queue == 0
        self._hot = self._hot + 1 if hot else 0
        self._cold = self._cold + 1 if cold else 0
        if now - self._last_action < p.cooldown_s:
            return 0
        if self._hot >= p.up_after and n < p.max_n:
            return +1
        if self._cold >= p.down_after and n > p.min_n:
            return -1
        return 0

    def tick(self, now: Optional[float] = None) -> int:
        now = time.monotonic() if now is None else now
        idx = sorted(self.cluster.decode)
        samples = [scrape_decode(self.cluster.decode_metrics(i)) for i in idx]
        d = self.decide(samples, len(idx), now)
        self.history.append({"t": now, "n": len(idx), "samples": samples, "action": d})
        if d:
            self._last_action = now
            self._hot = self._cold = 0
            if d > 0:
                self.cluster.add_decode()
            else:
                self.cluster.remove_decode()
            self._last_action = time.monotonic()
        return d

    def run(self, stop: threading.Event):
        while not stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("autoscaler round failed")


def decode_op(url: str, op: str = "stats", timeout_s: float = 10.0) -> dict:
    """Run a diagnostic op (stats, info) on a decode server and return its JSON answer."""
    from .client import decode_json_op

    return decode_json_op(url, op, timeout_s)
