"""Ctrl-C / SIGTERM at any moment of `hetserve up` stops everything it started (issue 27).

Each case runs the real `hetserve up` (real tritonservers, the session's engine dir) in a session of its own, waits
for one observable moment of its start-up (its first output line, its first child process, a model stub, the decode
server answering ready, the OpenAI frontend's process, serving) and sends the signal as a terminal would: Ctrl-C is
SIGINT to the whole foreground process group, `kill` is SIGTERM to the launcher alone. Once the launcher has exited
(it must exit on its own, and with the documented code) nothing of that run may be left:
  * no process: none of the launcher's descendants seen while it ran (pid + start time), and nothing whose command
    line names the run's ports or its shared-memory prefix (an orphan re-parented to init is found this way);
  * no /dev/shm region: none of the python backend regions of its servers (triton_python_backend_shm_region_hetserve-
    <launcher pid>-*), none of the KV regions its processes were seen mapping, none mapped by a leftover process.
Whatever a failing case leaves is killed by pid and removed here, so the next case starts clean.
"""
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hetserve.server import PB_SHM_PREFIX, SHM_DIR, port_in_use, proc_stats, shm_mapped_by

ROOT = Path(__file__).resolve().parents[1]
BASE = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000")) + 800  # prefill base+10k.., decode +1000, frontend +90
WAIT_S = 180  # for one start-up moment on a busy 2-core box


def _start_time(pid: int):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Up:
    """One `hetserve up` run and what it started."""

    def __init__(self, engine_dir: str, tmp: Path, k: int, no_openai: bool = False):
        self.base = BASE + 10 * k
        self.openai_port = BASE + 90 + k
        self.ports = [self.base, self.base + 1, self.base + 2, self.base + 3, self.base + 1000, self.base + 1001,
                      self.base + 1002, self.base + 1003, self.openai_port]
        busy = [p for p in self.ports if port_in_use(p)]
        assert not busy, f"ports of this case already in use: {busy}"
        self.log_path = tmp / f"up{k}.log"
        cmd = [sys.executable, "-m", "hetserve", "up", "--engine-dir", engine_dir, "--base-port", str(self.base),
               "--openai-port", str(self.openai_port), "--prompt", "", "--snapshot-dir", str(tmp / "snaps")]
        if no_openai:
            cmd.append("--no-openai")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            self.p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.seen = {}  # pid -> start time: every descendant observed while it ran
        self.kv_seen = set()  # hetserve_kv_* regions its processes were seen mapping

    # ---- observation --------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def descendants(self) -> list:
        kids = {}
        for pid, state, ppid, _, _ in proc_stats():
            if state != "Z":
                kids.setdefault(ppid, []).append(pid)
        out, todo = [], [self.p.pid]
        while todo:
            for c in kids.get(todo.pop(), []):
                out.append(c)
                todo.append(c)
        for pid in out:
            self.seen.setdefault(pid, _start_time(pid))
        return out

    def wait(self, what: str, pred, timeout_s: float = WAIT_S, poll_s: float = 0.02):
        """Poll pred() (descendants are recorded at each round) until truthy; the launcher must still run."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.descendants()
            got = pred()
            if got:
                return got
            assert self.p.poll() is None, \
                f"hetserve up exited ({self.p.returncode}) before {what}:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s}s:\n{self.log()[-3000:]}"
            time.sleep(poll_s)

    def children_named(self, needle: str) -> list:
        return [pid for pid in self.descendants() if needle in _cmdline(pid)]

    def ready(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    # ---- signals and the verdict ----------------------------------------------------------------
    def ctrl_c(self):  # a terminal's Ctrl-C: SIGINT to the foreground process group
        os.killpg(self.p.pid, signal.SIGINT)

    def kill(self, sig=signal.SIGTERM):  # `kill PID`: the launcher alone
        os.kill(self.p.pid, sig)

    def exit_code(self, timeout_s: float = 90) -> int:
        try:
            return self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hetserve up still running {timeout_s}s after the signal:\n{self.log()[-3000:]}")

    def markers(self) -> list:
        return [f"hetserve-{self.p.pid}-", f"--http-port={self.base} ", f"--http-port={self.base + 1000} ",
                f"--http-port {self.openai_port} ", f"--triton-url 127.0.0.1:{self.base + 1} "]

    def leftovers(self) -> dict:
        """pid -> command line of every live (non-zombie) process of this run."""
        stats = list(proc_stats())
        live = {pid for pid, state, *_ in stats if state != "Z"}
        left = {pid for pid, st in self.seen.items() if pid in live and _start_time(pid) == st}
        marks = self.markers()
        left |= {pid for pid in live if pid != os.getpid() and any(m in _cmdline(pid) + " " for m in marks)}
        kids = {}
        for pid, state, ppid, _, _ in stats:
            if state != "Z":
                kids.setdefault(ppid, []).append(pid)
        todo = list(left)
        while todo:
            for c in kids.get(todo.pop(), []):
                if c not in left:
                    left.add(c)
                    todo.append(c)
        left.discard(self.p.pid)
        return {pid: _cmdline(pid)[:160] for pid in sorted(left)}

    def shm_left(self, procs) -> list:
        names = {p.name for p in SHM_DIR.glob(f"{PB_SHM_PREFIX}hetserve-{self.p.pid}-*")}
        names |= {n for n in self.kv_seen if (SHM_DIR / n).exists()}
        names |= shm_mapped_by(procs)
        return sorted(names)

    def reap(self):
        """(processes, shm regions) of this run still there; kills those processes by pid and removes those regions,
        so the next case starts clean whatever this one found."""
        left = self.leftovers()
        shm = self.shm_left(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if left:
            time.sleep(1)
        for n in shm:
            try:
                (SHM_DIR / n).unlink()
            except OSError:
                pass
        return left, shm

    def check_clean(self):
        left, shm = self.reap()
        assert not left, f"{len(left)} process(es) of this run left after hetserve up exited: {left}\n" \
                         f"{self.log()[-2500:]}"
        assert not shm, f"{len(shm)} /dev/shm region(s) of this run left: {shm}\n{self.log()[-2500:]}"
        busy = [p for p in self.ports if port_in_use(p)]
        assert not busy, f"ports still held: {busy}"

    def finish(self):
        """After the case, passed or not: the launcher (if a failure left it running), then what the run left."""
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
        self.reap()


@pytest.fixture
def up(engine_dir, tmp_path):
    runs = []

    def start(k: int, **kw) -> Up:
        r = Up(engine_dir, tmp_path, k, **kw)
        runs.append(r)
        return r

    yield start
    for r in runs:
        r.finish()


def _startup(run: Up, sig_name: str, rc: int):
    code = run.exit_code()
    run.check_clean()
    assert code == rc, f"exit code {code}, expected {rc}:\n{run.log()[-2500:]}"
    assert f"{sig_name} during start-up: stopped" in run.log(), run.log()[-2500:]


def test_sigint_during_engine_check(up):
    """First output line (the engine build/cache check): nothing spawned yet, and nothing may be afterwards."""
    run = up(0)
    run.wait("first output line", lambda: run.log().strip())
    run.ctrl_c()
    _startup(run, "SIGINT", 130)
    assert not run.seen, f"processes spawned after Ctrl-C: {run.seen}"


def test_sigint_as_the_first_server_spawns(up):
    """The moment the first tritonserver exists (the old code's window: the launcher died, the servers went on)."""
    run = up(1)
    run.wait("first server process", lambda: run.children_named("tritonserver"), poll_s=0.005)
    run.ctrl_c()
    _startup(run, "SIGINT", 130)


def test_sigint_while_models_load(up):
    """A python backend stub is up: the servers are loading their models (their shm regions exist)."""
    run = up(2)
    run.wait("model stub", lambda: run.children_named("triton_python_backend_stub"))
    run.ctrl_c()
    _startup(run, "SIGINT", 130)


def test_sigint_after_decode_ready_before_prefill(up):
    """The decode server answers ready, the prefill server (more models) does not yet."""
    run = up(3)
    run.wait("decode server ready", lambda: run.ready(run.base + 1000), poll_s=0.1)
    assert not run.ready(run.base), "prefill already ready: this case would not test its moment"
    run.ctrl_c()
    _startup(run, "SIGINT", 130)


def test_sigterm_while_the_openai_frontend_starts(up):
    """`kill PID` (the launcher alone; its servers run in sessions of their own) once the Triton servers are ready
    and the OpenAI frontend is starting."""
    run = up(4)
    run.wait("OpenAI frontend process", lambda: "servers ready" in run.log() and run.children_named("--role openai"))
    run.kill(signal.SIGTERM)
    _startup(run, "SIGTERM", 143)
    assert "OpenAI API:" not in run.log()


def test_sigint_while_serving_with_shm_kv(up):
    """Serving after a request whose KV went over shared memory (a KV region the prefill stub and the decode
    server both map): Ctrl-C exits 0 and removes that region as well."""
    from hetserve.client import generate

    run = up(5, no_openai=True)
    run.wait("serving", lambda: "serving;" in run.log(), poll_s=0.2)
    g = generate(f"127.0.0.1:{run.base + 1}", "Hello", max_tokens=2, transport="shm")
    assert g.token_ids
    run.kv_seen = {n for n in shm_mapped_by(run.descendants()) if n.startswith("hetserve_kv_")}
    assert run.kv_seen, "the shm transfer left no KV region mapped: this case checks nothing about KV regions"
    run.ctrl_c()
    code = run.exit_code()
    run.check_clean()
    assert code == 0, run.log()[-2500:]


def test_second_sigint_during_teardown(up):
    """Ctrl-C while models load, Ctrl-C again while the launcher is stopping them: they are killed at once, still
    nothing is left."""
    run = up(6)
    run.wait("model stub", lambda: run.children_named("triton_python_backend_stub"))
    run.ctrl_c()
    run.wait("teardown", lambda: "stopping everything it started" in run.log(), timeout_s=30, poll_s=0.005)
    run.ctrl_c()
    code = run.exit_code()
    run.check_clean()
    assert code == 130, run.log()[-2500:]
    assert "SIGINT during teardown: killing what is left" in run.log(), run.log()[-2500:]
