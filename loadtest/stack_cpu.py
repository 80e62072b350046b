#!/usr/bin/env python3
"""Serving-plane CPU per request (issue 27): the whole `hetserve up` stack under closed-loop load with a model so
small that the engine costs almost nothing, CPU summed from /proc per process and grouped by role.

One command does everything:
  1. makes a seeded random Llama checkpoint (2 layers, hidden 64, 4 heads / 2 KV heads, intermediate 128, the
     default model's byte-level BPE tokenizer and chat template; tests/zoo.py's SMALL shape) in the work dir and
     builds it with `hetserve build` (both cached there; --engine-dir uses an existing build instead);
  2. starts the real stack with `hetserve up` (prefill + decode tritonservers pinned as `up` pins them, their
     Python backend stubs, the OpenAI frontend) and waits until it serves; the circuit breaker's TTFT threshold is
     raised (HETSERVE_BREAKER_P99_MS=600000; --keep-breaker keeps it): at 32 closed-loop clients on a busy box it
     would otherwise shed most requests as cheap refusals;
  3. per path and round: N closed-loop clients (aiohttp, one event loop, no think time) send non-streaming
     requests for --warmup s, then for --duration s the measured window:
       generate: POST /v2/models/llm/generate  {"text_input", "max_tokens", "ignore_eos", "temperature"}
       chat:     POST /v1/chat/completions     {"messages", "max_tokens", "ignore_eos", "temperature"}
  4. reads utime+stime (/proc/<pid>/stat: all threads) of every process of the stack at the window's start and
     end, grouped by role (each tritonserver, each Python stub by the model it serves, the OpenAI frontend, the
     `up` launcher, anything else), and prints req/s and stack CPU ms per request, total and per role; the load
     generator's own CPU and the rest of the box (other jobs) are measured and reported apart, never in the stack;
  5. --profile adds one window per path with py-spy attached (`py-spy record --format raw --gil`) to the llm,
     decode, prefill, preprocess, kv_ingest stubs and the OpenAI frontend, writes the raw collapsed stacks and
     prints each one's top functions by self time and its hetserve frames by inclusive time (py-spy samples wall
     time: a GIL holder waiting in the run queue of a busy box counts, so read the shares, and take CPU from the
     /proc table or --perf; that window's CPU figures are perturbed by the sampling and flagged so); --perf adds
     `perf record -e cpu-clock -a` over the same window: native symbols and libraries per stack process (the C++
     stub, gRPC's C core, ONNX Runtime, libc, the kernel: the CPU py-spy cannot see);
  6. tears everything down on exit, error, Ctrl-C or SIGTERM: `up` is stopped (SIGINT, as a user would), then any
     process left of its tree is SIGKILLed by id (this script is a child subreaper, so orphans stay in its tree),
     and /dev/shm regions created during the run that no process maps any more are removed.
  7. with each window it reads hetserve_engine_cpu_seconds_total from the servers' /metrics (CPU inside engine
     calls, engines/cpu_clock.py) and reports the serving plane's CPU: the stack's minus the engines'.

    python3 loadtest/stack_cpu.py                                  # both paths, 32 clients, 20 s windows
    python3 loadtest/stack_cpu.py --paths generate --rounds 2 --json /tmp/stack.json
    python3 loadtest/stack_cpu.py --rev HEAD --profile --perf      # serve a clean export of HEAD, + profiles
    python3 loadtest/stack_cpu.py --env HETSERVE_KV_TRANSPORT=grpc # extra environment for `hetserve up`

Needs aiohttp (orjson used when present); py-spy for --profile (`pip install py-spy`). Work files (checkpoint,
engines, `up` log, profiles) go to --work-dir (default .hetserve/stack_cpu, ignored by git).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

_dumps: Callable[[Any], bytes]
_loads: Callable[[Any], Any]
try:
    import orjson

    _dumps, _loads = orjson.dumps, orjson.loads
except ImportError:  # pragma: no cover
    _dumps, _loads = (lambda o: json.dumps(o).encode()), json.loads

REPO = Path(__file__).resolve().parents[1]
TCK = os.sysconf("SC_CLK_TCK")
SHM_PATTERNS = ("triton_python_backend_shm_region_", "hetserve_kv_")
PROFILE_ROLES = ("llm stub", "decode stub", "prefill stub", "preprocess stub", "kv_ingest stub", "openai frontend")


# ---- tiny checkpoint ---------------------------------------------------------------------------------------------
def make_checkpoint(tree: Path, out: Path, seed: int) -> None:
    """tests/zoo.py's SMALL Llama (2 layers, hidden 64, 4 heads / 2 KV heads, intermediate 128, vocab 49152,
    transformers' own save_pretrained), the default model's tokenizer and chat template. Runs in a child process
    (torch/transformers stay out of the load generator)."""
    code = (
        "import json, sys; from pathlib import Path\n"
        f"sys.path[:0] = [{str(tree / 'python_backends')!r}, {str(tree / 'tests')!r}]\n"
        "import zoo\n"
        "from hetserve.model.checkpoint import load_checkpoint\n"
        f"out = Path({str(out)!r})\n"
        f"zoo.make_hf(out, 'plain', seed={seed}, tok_json=zoo.tokenizer_json())\n"
        "(out / 'tokenizer_config.json').write_text(json.dumps({'chat_template': load_checkpoint(None).chat_template,"
        " 'add_bos_token': False}))\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tree / "python_backends"))


def export_tree(rev: str, work: Path) -> Path:
    """`git archive REV` of what the servers run (model_repository, python_backends, tests) into the work dir, so
    a measurement is of a commit, not of whatever is being edited in the working tree."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    dst = work / f"tree-{sha[:12]}"
    if not (dst / "python_backends" / "hetserve").is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "-C", str(REPO), "archive", sha, "model_repository", "python_backends",
                               "tests"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dst)], input=arch, check=True)
    return dst


# ---- /proc -------------------------------------------------------------------------------------------------------
def _stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat after the command name (index 0 = state), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> List[str]:
    try:
        return [c for c in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if c]
    except OSError:
        return []


def children_map() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat(int(d))
            if f is not None:
                kids[int(f[1])].append(int(d))
    return kids


def descendants(root: int) -> List[int]:
    kids, out, todo = children_map(), [], [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, ()):
            out.append(c)
            todo.append(c)
    return out


def cpu_s(pid: int) -> Optional[float]:
    f = _stat(pid)
    return None if f is None else (int(f[11]) + int(f[12])) / TCK  # utime + stime, all threads


def start_time(pid: int) -> Optional[int]:
    f = _stat(pid)
    return None if f is None else int(f[19])


def box_busy_s() -> Tuple[float, float]:
    """(busy CPU seconds of the whole box, elapsed CPU seconds: busy + idle) from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]
    total = sum(v[:8])
    return (total - idle) / TCK, total / TCK


def thread_cpu(pid: int) -> Dict[str, float]:
    out: Dict[str, float] = defaultdict(float)
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for t in tasks:
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            name = (t / "comm").read_text().strip()
        except OSError:
            continue
        out[name] += (int(f[11]) + int(f[12])) / TCK
    return dict(out)


class Stack:
    """The processes of one `hetserve up` (its process tree) and their roles."""

    def __init__(self, up_pid: int):
        self.up_pid = up_pid
        self.seen: Dict[int, int] = {}  # pid -> start time: every process ever seen in the tree (teardown)

    def pids(self) -> List[int]:
        ps = [self.up_pid] + descendants(self.up_pid)
        for p in ps:
            st = start_time(p)
            if st is not None:
                self.seen.setdefault(p, st)
        return ps

    def roles(self, pids: List[int]) -> Dict[int, str]:
        server_role: Dict[int, str] = {}
        out: Dict[int, str] = {}
        for p in pids:
            cmd = _cmdline(p)
            if cmd and cmd[0].endswith("tritonserver"):
                server_role[p] = _server_role(p, cmd)
        for p in pids:
            cmd = _cmdline(p)
            if p in server_role:
                out[p] = f"tritonserver ({server_role[p]})"
            elif cmd and "triton_python_backend_stub" in cmd[0]:
                model = next((Path(c).parts[-3] for c in cmd if c.endswith("/model.py")), "?")
                f = _stat(p)
                srv = server_role.get(int(f[1]), "?") if f else "?"
                out[p] = (f"{model} stub", srv)  # type: ignore[assignment]
            elif "--role" in cmd and "openai" in cmd:
                out[p] = "openai frontend"
            elif p == self.up_pid:
                out[p] = "hetserve up (launcher)"
            else:
                out[p] = "other: " + (Path(cmd[0]).name if cmd else str(p))
        # a model's stubs on one server only: "llm stub"; on several: "llm stub @prefill", ...
        servers_of: Dict[str, set] = defaultdict(set)
        for v in out.values():
            if isinstance(v, tuple):
                servers_of[v[0]].add(v[1])
        return {p: (v if not isinstance(v, tuple) else v[0] if len(servers_of[v[0]]) == 1 else f"{v[0]} @{v[1]}")
                for p, v in out.items()}


def _server_role(pid: int, cmd: List[str]) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for e in env:
            if e.startswith(b"HETSERVE_ROLE="):
                role = e.split(b"=", 1)[1].decode()
                port = next((c.split("=", 1)[1] for c in cmd if c.startswith("--http-port=")), "")
                return f"{role} :{port}" if role == "decode" else role
    except OSError:
        pass
    return next((c for c in cmd if c.startswith("--http-port=")), "?")


def snapshot(stack: Stack) -> Dict[int, Tuple[str, float, Optional[int]]]:
    """{pid: (role, CPU s, start time)} of the stack now."""
    pids = stack.pids()
    roles = stack.roles(pids)
    out = {}
    for p in pids:
        c, st = cpu_s(p), start_time(p)
        if c is not None and p in roles:
            out[p] = (roles[p], c, st)
    return out


def cpu_delta(a: dict, b: dict) -> Tuple[Dict[int, Tuple[str, float]], List[str]]:
    """Per pid CPU seconds between two snapshots; processes born in the window count from 0, ones that died in it
    are lost (named in the warnings)."""
    out, warn = {}, []
    for p, (role, c1, st) in b.items():
        if p in a and a[p][2] == st:
            out[p] = (role, c1 - a[p][1])
        else:
            out[p] = (role, c1)
            warn.append(f"{role} (pid {p}) started during the window")
    for p, (role, _, _) in a.items():
        if p not in b:
            warn.append(f"{role} (pid {p}) exited during the window: its CPU in the window is not counted")
    return out, warn


# ---- load --------------------------------------------------------------------------------------------------------
PROMPTS = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.",
           "Count from one to five.", "What is two plus two?", "Give me a fruit.", "Describe the sky briefly.",
           "Which animal barks?"]


def _prompt(client: int, n: int) -> str:
    return f"{PROMPTS[(client + n) % len(PROMPTS)]} (client {client}, request {n})"


class Path_:
    def __init__(self, name: str, url: str, body, tokens):
        self.name, self.url, self.body, self.tokens = name, url, body, tokens


def make_path(name: str, a, prefill_http: str, openai_url: str, model_name: str) -> Path_:
    if name == "generate":
        def body(c, n):
            return {"text_input": _prompt(c, n), "max_tokens": a.max_tokens, "ignore_eos": a.ignore_eos,
                    "temperature": a.temperature}

        def tokens(r):
            ids = r.get("token_ids")
            return len(ids) if isinstance(ids, list) else (None if ids is None else 1)

        return Path_(name, f"http://{prefill_http}/v2/models/llm/generate", body, tokens)
    if name == "chat":
        def body(c, n):
            return {"model": model_name, "messages": [{"role": "user", "content": _prompt(c, n)}],
                    "max_tokens": a.max_tokens, "ignore_eos": a.ignore_eos, "temperature": a.temperature}

        def tokens(r):
            return (r.get("usage") or {}).get("completion_tokens")

        return Path_(name, f"{openai_url}/chat/completions", body, tokens)
    raise SystemExit(f"unknown path {name!r} (generate, chat)")


async def closed_loop(path: Path_, clients: int, warmup: float, duration: float, timeout: float,
                      on_start, on_end) -> dict:
    """`clients` closed-loop clients; on_start()/on_end() run (synchronously, in the loop) at the measured
    window's edges. Returns what completed inside the window."""
    import aiohttp

    state: Dict[str, Any] = {"t0": None, "t1": None, "stop": False}
    lat: List[float] = []
    toks: List[int] = []
    errors: Counter = Counter()
    headers = {"Content-Type": "application/json"}

    async def client(i: int, session) -> None:
        n = 0
        while not state["stop"]:
            data = _dumps(path.body(i, n))
            n += 1
            t0 = time.perf_counter()
            err, ntok = None, None
            try:
                async with session.post(path.url, data=data, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        err = f"HTTP {r.status}: {raw[:120].decode(errors='replace')}"
                    else:
                        ntok = path.tokens(_loads(raw))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - every failure is counted by kind
                err = f"{type(e).__name__}: {str(e)[:120]}"
            t1 = time.perf_counter()
            if state["t0"] is not None and state["t1"] is None and t1 >= state["t0"]:
                if err:
                    errors[re.sub(r"[0-9]+(\.[0-9]+)?", "N", err)] += 1
                else:
                    lat.append(t1 - t0)
                    if ntok is not None:
                        toks.append(ntok)
            if err:
                await asyncio.sleep(0.05)  # a failing server is not hammered in a tight loop

    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        tasks = [asyncio.ensure_future(client(i, session)) for i in range(clients)]
        await asyncio.sleep(warmup)
        extra = on_start()
        state["t0"] = time.perf_counter()
        await asyncio.sleep(duration)
        state["t1"] = time.perf_counter()
        on_end()
        state["stop"] = True
        done, pending = await asyncio.wait(tasks, timeout=min(timeout, 30.0))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    window = state["t1"] - state["t0"]
    return {"window_s": window, "ok": len(lat), "errors": dict(errors), "lat": lat, "tokens": toks,
            "extra": extra}


# ---- py-spy ------------------------------------------------------------------------------------------------------
def start_profiles(targets: Dict[str, int], out_dir: Path, duration: float, rate: int, tag: str,
                   mode: str = "gil") -> list:
    import shutil

    spy = shutil.which("py-spy")
    if not spy:
        raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for role, pid in targets.items():
        f = out_dir / f"{tag}-{role.replace(' ', '_').replace('@', '')}-{pid}.txt"
        log = open(out_dir / (f.stem + ".log"), "wb")
        p = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(max(1, round(duration))),
                              "--rate", str(rate), "--format", "raw", "--output", str(f)]
                             + (["--gil"] if mode == "gil" else []),
                             stdout=log, stderr=subprocess.STDOUT)
        procs.append((role, pid, f, p, log))
    return procs


def finish_profiles(procs, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    for _, _, _, p, log in procs:
        try:
            p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def top_self(raw_file: Path, n: int):
    """(samples, [(frame, self samples, inclusive samples)], [(hetserve frame, inclusive samples)]) from py-spy's
    collapsed-stack raw output: one line per stack, `frame;frame;...;leaf count`, frames `function (file:line)`."""
    selfc: Counter = Counter()
    incl: Counter = Counter()
    total = 0
    try:
        lines = raw_file.read_text(errors="replace").splitlines()
    except OSError:
        return 0, [], []
    for line in lines:
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        c = int(cnt)
        frames = stack.split(";")
        total += c
        selfc[frames[-1]] += c
        for fr in set(frames):
            incl[fr] += c
    return total, [(f, c, incl[f]) for f, c in selfc.most_common(n)], \
        [(f, incl[f]) for f, _ in incl.most_common() if "hetserve/" in f][:n]


def start_perf(out_dir: Path, duration: float, tag: str):
    """System-wide on-CPU sampling (`perf record -e cpu-clock -a`, no call graphs): sees the native code (the C++
    stub's IPC, gRPC's C core, libc, the kernel) that py-spy cannot; the stack's pids are picked out afterwards."""
    import shutil

    perf = shutil.which("perf")
    if not perf:
        raise SystemExit("--perf needs `perf` on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    f = out_dir / f"{tag}-perf.data"
    log = open(out_dir / f"{tag}-perf.log", "wb")
    p = subprocess.Popen([perf, "record", "-q", "-e", "cpu-clock", "-F", "499", "-a", "-o", str(f), "--",
                          "sleep", str(duration)], stdout=log, stderr=subprocess.STDOUT)
    return f, p, log


def perf_by_pid(f: Path, roles: Dict[int, str], n: int) -> Dict[str, dict]:
    """{role: {"samples", "by_dso": [(dso, samples)], "top": [(symbol (dso), samples)]}} from `perf script`."""
    r = subprocess.run(["perf", "script", "-i", str(f), "-F", "pid,tid,ip,sym,dso"], capture_output=True,
                       text=True, errors="replace")
    sym: Dict[str, Counter] = defaultdict(Counter)
    dso: Dict[str, Counter] = defaultdict(Counter)
    for line in r.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3:
            continue
        try:
            pid = int(parts[0].split("/")[0])
        except ValueError:
            continue
        role = roles.get(pid)
        if role is None:
            continue
        rest = parts[2]
        name, _, lib = rest.rpartition(" (")
        lib = Path(lib.rstrip(")")).name or lib
        sym[role][f"{name.strip() or '[unknown]'} ({lib})"] += 1
        dso[role][lib] += 1
    return {role: {"samples": sum(c.values()), "by_dso": dso[role].most_common(8), "top": c.most_common(n)}
            for role, c in sym.items()}


# ---- the run -----------------------------------------------------------------------------------------------------
def _log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def start_up(a, tree: Path, ckpt: Path, engine_dir: Path, work: Path, base_port: int):
    log_path = work / f"up-{base_port}.log"
    log = open(log_path, "wb")
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    a.up_env = [kv.partition("=")[0] for kv in a.env]
    cmd = [sys.executable, "-m", "hetserve", "up", "--checkpoint", str(ckpt), "--engine-dir", str(engine_dir),
           "--base-port", str(base_port), "--prompt", "Hello", "--max-tokens", str(a.max_tokens)]
    if a.no_pin:
        cmd.append("--no-pin")
    shown = [f"{k}={env[k]}" for k in a.up_env] + ["python"] + cmd[1:]
    print(f"$ (cd {tree / 'python_backends'} && {' '.join(shown)})", file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=str(tree / "python_backends"), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log, log_path


def wait_serving(proc, log_path: Path, stack: Stack, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        stack.pids()  # remember every process as it appears (teardown)
        if proc.poll() is not None:
            raise RuntimeError(f"`hetserve up` exited with code {proc.returncode}:\n{_log_tail(log_path)}")
        if b"serving; try:" in log_path.read_bytes():
            return
        time.sleep(0.5)
    raise RuntimeError(f"`hetserve up` not serving after {timeout:.0f}s:\n{_log_tail(log_path)}")


def openai_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def teardown(procs: list, stacks: list, shm_before: set) -> List[str]:
    """Stop every `up` as a user would (SIGINT to it: it stops its servers and the frontend), then SIGKILL by id
    any process of their trees still alive, then remove /dev/shm regions new since the start that nobody maps."""
    notes = []
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        running = [p for p in procs if p is not None and p.poll() is None]
        for proc in running:
            try:
                os.kill(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for proc in running:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                notes.append("`hetserve up` did not stop within 90 s of SIGINT: killed")
                proc.kill()
                proc.wait(10)
        if stacks:
            left = [p for stack in stacks for p, st in stack.seen.items() if p != stack.up_pid
                    and start_time(p) == st and (_stat(p) or ["Z"])[0] != "Z"]
            left += [p for p in descendants(os.getpid()) if p not in left and (_stat(p) or ["Z"])[0] != "Z"]
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                    notes.append(f"killed leftover pid {p} ({' '.join(_cmdline(p))[:80]})")
                except ProcessLookupError:
                    pass
            deadline = time.time() + 10
            while time.time() < deadline and any((_stat(p) or ["Z"])[0] != "Z" for p in left):
                time.sleep(0.1)
        _reap()
        notes += clean_shm(shm_before)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return notes


def _reap() -> None:
    """Orphans of the tree reparented to this subreaper: collect their exit status."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def shm_names() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PATTERNS)}
    except OSError:
        return set()


def clean_shm(before: set) -> List[str]:
    new = shm_names() - before
    if not new:
        return []
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backends"))
    from hetserve.server import shm_mapped_by  # this checkout's /proc reader (whatever --rev is served)

    used = shm_mapped_by(int(d) for d in os.listdir("/proc") if d.isdigit())
    notes = []
    for n in sorted(new - used):
        try:
            os.unlink(f"/dev/shm/{n}")
            notes.append(f"removed /dev/shm/{n}")
        except OSError:
            pass
    for n in sorted(new & used):
        notes.append(f"/dev/shm/{n} is new since the start but still mapped by a live process: left")
    return notes


def engine_cpu(base_port: int) -> Dict[str, float]:
    """{model: CPU seconds inside engine calls} summed over the prefill and first decode server
    (hetserve_engine_cpu_seconds_total, engines/cpu_clock.py; refreshed every HETSERVE_METRICS_INTERVAL_S, 1 s by
    default, so a window's figure is off by up to that much engine time at each end)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backends"))
    from hetserve.cluster import metric_samples  # this checkout's /metrics reader (whatever --rev is served)

    out: Dict[str, float] = defaultdict(float)
    for port in (base_port + 2, base_port + 1002):
        for _, labels, value in metric_samples(f"127.0.0.1:{port}", ["hetserve_engine_cpu_seconds_total"], 5) or []:
            model = labels.split('model="', 1)[1].split('"', 1)[0] if 'model="' in labels else "?"
            out[model] += value
    return dict(out)


def measure(a, stack: Stack, path: Path_, profile: bool, prof_dir: Path, tag: str, port: int) -> dict:
    snaps = {}
    me = os.getpid()
    prof = []

    def on_start():
        if profile:
            roles = stack.roles(stack.pids())
            targets = {}
            for pid, role in roles.items():
                base = role.split(" @")[0]
                if base in PROFILE_ROLES and (role not in targets):
                    targets[role] = pid
            prof.extend(start_profiles(targets, prof_dir, a.duration, a.profile_rate, tag, a.profile_mode))
        if profile and a.perf:
            snaps["perf"] = start_perf(prof_dir, a.duration, tag)
            time.sleep(0.5)  # let py-spy attach before the window opens
        snaps["a"] = snapshot(stack)
        snaps["eng_a"] = engine_cpu(port)
        snaps["me_a"] = cpu_s(me)
        snaps["box_a"] = box_busy_s()
        snaps["load_a"] = os.getloadavg()
        snaps["thr_a"] = {p: thread_cpu(p) for p in snaps["a"]} if a.threads else {}
        snaps["spy_a"] = {p[3].pid: cpu_s(p[3].pid) or 0.0 for p in prof}

    def on_end():
        snaps["b"] = snapshot(stack)
        snaps["eng_b"] = engine_cpu(port)
        snaps["me_b"] = cpu_s(me)
        snaps["box_b"] = box_busy_s()
        snaps["load_b"] = os.getloadavg()
        snaps["thr_b"] = {p: thread_cpu(p) for p in snaps["b"]} if a.threads else {}
        snaps["spy_b"] = {p[3].pid: cpu_s(p[3].pid) or 0.0 for p in prof}

    res = asyncio.run(closed_loop(path, a.clients, a.warmup, a.duration, a.timeout, on_start, on_end))
    if prof:
        finish_profiles(prof)
    perf_res = None
    if "perf" in snaps:
        pf, pp, plog = snaps["perf"]
        try:
            pp.wait(60)
        except subprocess.TimeoutExpired:
            pp.send_signal(signal.SIGINT)
            pp.wait(30)
        plog.close()
        perf_res = perf_by_pid(pf, {p: v[0] for p, v in snaps["b"].items()}, a.profile_top)
    per_pid, warn = cpu_delta(snaps["a"], snaps["b"])
    n = res["ok"]
    w = res["window_s"]
    acc: Dict[str, float] = defaultdict(float)
    for role, c in per_pid.values():
        acc[role] += c
    by_role = Counter(acc)
    stack_s = sum(by_role.values())
    gen_s = snaps["me_b"] - snaps["me_a"]
    spy_s = sum(snaps["spy_b"].get(k, 0.0) - v for k, v in snaps["spy_a"].items())
    box_s = snaps["box_b"][0] - snaps["box_a"][0]
    box_elapsed = snaps["box_b"][1] - snaps["box_a"][1]
    lat = sorted(res["lat"])
    eng = {m: snaps["eng_b"].get(m, 0.0) - v for m, v in snaps["eng_a"].items()}
    eng_s = sum(eng.values())
    out = {
        "path": path.name, "tag": tag, "url": path.url, "profiled": profile, "window_s": round(w, 3),
        "requests_ok": n, "errors": dict(Counter(res["errors"]).most_common()), "req_per_s": round(n / w, 2),
        "latency_ms": {"p50": _pct(lat, 50), "p90": _pct(lat, 90), "p99": _pct(lat, 99)},
        "tokens_per_request": {"mean": round(statistics.mean(res["tokens"]), 3) if res["tokens"] else None,
                               "min": min(res["tokens"]) if res["tokens"] else None,
                               "counted": len(res["tokens"])},
        "stack_cpu_ms_per_request": round(stack_s * 1e3 / n, 3) if n else None,
        "stack_cpu_cores": round(stack_s / w, 3),
        "engine_cpu_ms_per_request": {m: round(s_ * 1e3 / n, 3) for m, s_ in eng.items()} if n else {},
        "serving_plane_cpu_ms_per_request": round((stack_s - eng_s) * 1e3 / n, 3) if n else None,
        "by_role_ms_per_request": {r: round(c * 1e3 / n, 3) if n else None for r, c in by_role.most_common()},
        "by_role_cores": {r: round(c / w, 3) for r, c in by_role.most_common()},
        "processes": [{"pid": p, "role": r, "cpu_s": round(c, 3)} for p, (r, c) in
                      sorted(per_pid.items(), key=lambda kv: -kv[1][1])],
        "loadgen_cpu_ms_per_request": round(gen_s * 1e3 / n, 3) if n else None,
        "loadgen_cpu_cores": round(gen_s / w, 3),
        "profiler_cpu_cores": round(spy_s / w, 3) if profile else None,
        "box_cpu_cores_busy": round(box_s / w, 3),
        "box_cores": round(box_elapsed / w, 2),
        "other_jobs_cpu_cores": round((box_s - stack_s - gen_s - spy_s) / w, 3),
        "loadavg_start_end": [round(x, 2) for x in snaps["load_a"]][:1] + [round(x, 2) for x in snaps["load_b"]][:1],
        "warnings": warn,
    }
    if perf_res is not None:
        out["perf"] = {role: {"samples": v["samples"], "hz": 499,
                              "by_dso_pct": [(d, round(100 * c / v["samples"], 1)) for d, c in v["by_dso"]],
                              "top_self": [{"symbol": s_, "pct": round(100 * c / v["samples"], 1),
                                            "ms_per_request": round(c * 1e3 / 499 / n, 3) if n else None}
                                           for s_, c in v["top"]]}
                       for role, v in sorted(perf_res.items(), key=lambda kv: -kv[1]["samples"])}
    if a.threads:
        thr = {}
        for p, (r, _) in per_pid.items():
            t1, t0 = snaps["thr_b"].get(p, {}), snaps["thr_a"].get(p, {})
            d = {k: round((v - t0.get(k, 0.0)) * 1e3 / max(n, 1), 3) for k, v in t1.items()}
            thr[f"{r} ({p})"] = dict(sorted(((k, v) for k, v in d.items() if v > 0), key=lambda kv: -kv[1]))
        out["threads_ms_per_request"] = thr
    if prof:
        out["profiles"] = {}
        for role, pid, f, _, _ in prof:
            total, top, ours = top_self(f, a.profile_top)
            out["profiles"][role] = {
                "pid": pid, "file": str(f), "samples": total, "rate_hz": a.profile_rate, "mode": a.profile_mode,
                "top_inclusive_hetserve": [{"frame": fr, "inclusive_pct": round(100 * i / total, 1),
                                            "inclusive_gil_wall_ms_per_request": round(i * 1e3 / a.profile_rate / n, 3)
                                            if n else None} for fr, i in ours],
                "top_self": [{"frame": fr, "self_samples": c, "self_pct": round(100 * c / total, 1) if total else 0,
                              "self_gil_wall_ms_per_request": round(c * 1e3 / a.profile_rate / n, 3) if n else None,
                              "inclusive_pct": round(100 * i / total, 1) if total else 0}
                             for fr, c, i in top]}
    return out


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    return round(1e3 * xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))], 2)


def print_window(r: dict) -> None:
    flag = "  (PROFILED: py-spy attached, CPU perturbed)" if r["profiled"] else ""
    print(f"\n== {r['path']} [{r['tag']}]: {r['req_per_s']:.1f} req/s ({r['requests_ok']} ok in {r['window_s']:.1f} s, "
          f"errors {sum(r['errors'].values())}), latency p50/p99 {r['latency_ms']['p50']}/{r['latency_ms']['p99']} "
          f"ms, tokens/request {r['tokens_per_request']['mean']}{flag}")
    for e, c in list(r["errors"].items())[:6]:
        print(f"   error x{c}: {e}")
    print(f"   {'role':<32} {'ms/request':>10} {'cores':>7}")
    for role, ms in r["by_role_ms_per_request"].items():
        print(f"   {role:<32} {ms:>10.3f} {r['by_role_cores'][role]:>7.3f}")
    print(f"   {'STACK TOTAL':<32} {r['stack_cpu_ms_per_request']:>10.3f} {r['stack_cpu_cores']:>7.3f}")
    for m, ms in (r.get("engine_cpu_ms_per_request") or {}).items():
        print(f"   {'  of it in engine calls: ' + m:<32} {ms:>10.3f}")
    if r.get("serving_plane_cpu_ms_per_request") is not None:
        print(f"   {'SERVING PLANE (stack - engines)':<32} {r['serving_plane_cpu_ms_per_request']:>10.3f}")
    print(f"   {'(load generator, excluded)':<32} {r['loadgen_cpu_ms_per_request']:>10.3f} "
          f"{r['loadgen_cpu_cores']:>7.3f}")
    if r["profiled"]:
        print(f"   {'(py-spy, excluded)':<32} {'':>10} {r['profiler_cpu_cores']:>7.3f}")
    print(f"   {'(rest of the box, excluded)':<32} {'':>10} {r['other_jobs_cpu_cores']:>7.3f}   "
          f"box busy {r['box_cpu_cores_busy']:.2f} of {r['box_cores']:.0f} cores, load avg "
          f"{r['loadavg_start_end'][0]} -> {r['loadavg_start_end'][1]}")
    for w in r["warnings"]:
        print(f"   warning: {w}")
    for proc, thr in (r.get("threads_ms_per_request") or {}).items():
        top = ", ".join(f"{k} {v:.3f}" for k, v in list(thr.items())[:8])
        print(f"   threads of {proc}: {top}")
    for role, p in (r.get("profiles") or {}).items():
        print(f"\n   py-spy {role} (pid {p['pid']}, {p['mode']}): {p['samples']} samples at {p['rate_hz']} Hz "
              f"(= {p['samples'] * 1e3 / p['rate_hz'] / max(r['requests_ok'], 1):.2f} ms/request of wall time with the "
              f"GIL held) -> {p['file']}")
        print(f"     {'self%':>6} {'incl%':>6} {'ms/req':>7}  function (file:line)   [ms/req: wall time, not CPU]")
        for t in p["top_self"]:
            print(f"     {t['self_pct']:>6.1f} {t['inclusive_pct']:>6.1f} {t['self_gil_wall_ms_per_request']:>7.3f}  "
                  f"{t['frame']}")
        if p["top_inclusive_hetserve"]:
            print("     hetserve frames by inclusive time:")
            for t in p["top_inclusive_hetserve"][:8]:
                print(f"     {'':>6} {t['inclusive_pct']:>6.1f} {t['inclusive_gil_wall_ms_per_request']:>7.3f}  "
                      f"{t['frame']}")


def print_perf(r: dict) -> None:
    for role, p in (r.get("perf") or {}).items():
        if p["samples"] < 20:
            continue
        print(f"\n   perf {role}: {p['samples']} on-CPU samples at {p['hz']} Hz "
              f"(= {p['samples'] * 1e3 / p['hz'] / max(r['requests_ok'], 1):.2f} ms/request); by library: "
              + ", ".join(f"{d} {pc}%" for d, pc in p["by_dso_pct"][:6]))
        for t in p["top_self"]:
            print(f"     {t['pct']:>6.1f} {t['ms_per_request']:>7.3f}  {t['symbol']}")


def print_summary(results: List[dict]) -> None:
    roles: List[str] = []
    for r in results:
        for k in r["by_role_ms_per_request"]:
            if k not in roles:
                roles.append(k)
    cols = [f"{r['path']}/{r['tag'].rsplit('-', 1)[0]}" for r in results]
    w = max(12, *(len(c) + 1 for c in cols))
    print("\n== summary: stack CPU ms per request by role (load generator and other jobs excluded)")
    print(f"{'':<30}" + "".join(f"{c:>{w}}" for c in cols))

    def row(label, vals, fmt):
        print(f"{label:<30}" + "".join(f"{v:>{w}{fmt}}" if v is not None else f"{'-':>{w}}" for v in vals))

    row("req/s", [r["req_per_s"] for r in results], ".1f")
    row("errors", [sum(r["errors"].values()) for r in results], "d")
    row("latency p50 ms", [r["latency_ms"]["p50"] for r in results], ".1f")
    row("STACK CPU ms/request", [r["stack_cpu_ms_per_request"] for r in results], ".2f")
    row("  in engine calls", [sum((r.get("engine_cpu_ms_per_request") or {}).values()) for r in results], ".3f")
    row("SERVING PLANE ms/request", [r.get("serving_plane_cpu_ms_per_request") for r in results], ".2f")
    for k in roles:
        row("  " + k[:28], [r["by_role_ms_per_request"].get(k, 0.0) for r in results], ".3f")
    row("load generator ms/request", [r["loadgen_cpu_ms_per_request"] for r in results], ".2f")
    row("other jobs on the box, cores", [r["other_jobs_cpu_cores"] for r in results], ".2f")


def print_pairs(results: List[dict], paths: List[str], stacks: List[dict]) -> None:
    """--against: per path, each round's A and B windows as a pair, their differences (A - B) and the medians."""
    print(f"\n== paired: A = {stacks[0]['rev'][:12]}, B = {stacks[1]['rev'][:12]} (A - B per round; negative: A "
          "costs less)")
    for p in paths:
        pairs = []
        for tag in dict.fromkeys(r["tag"].split("-")[0] for r in results if r["path"] == p and not r["profiled"]):
            got = {r["stack"]: r for r in results if r["path"] == p and r["tag"].split("-")[0] == tag
                   and not r["profiled"]}
            if "A" in got and "B" in got:
                pairs.append((got["A"], got["B"]))
        if not pairs:
            continue
        for key, label in (("stack_cpu_ms_per_request", "stack CPU ms/request"),
                           ("serving_plane_cpu_ms_per_request", "serving plane ms/request"),
                           ("req_per_s", "req/s")):
            d = [x[key] - y[key] for x, y in pairs if x.get(key) is not None and y.get(key) is not None]
            if not d:
                continue
            print(f"  {p:<9} {label:<26} A {statistics.median(x[key] for x, _ in pairs):8.2f}   "
                  f"B {statistics.median(y[key] for _, y in pairs):8.2f}   A-B per round "
                  + " ".join(f"{v:+.2f}" for v in d)
                  + f"   median {statistics.median(d):+.2f}, A lower in {sum(v < 0 for v in d)} of {len(d)}")
        # The box's speed drifts between windows by up to 2x (other tenants' memory traffic), and it moves every
        # process's CPU per request together, the engines' too: the same engine code costs as much more in a slow
        # window. So also: the serving plane in units of the same window's engine CPU (a probe of the box's speed
        # measured under the same load), A over B per round. Read it next to the raw figures: the engine's cost
        # per request also falls a little as batches grow with req/s.
        norm = []
        for x, y in pairs:
            ex, ey = sum(x["engine_cpu_ms_per_request"].values()), sum(y["engine_cpu_ms_per_request"].values())
            if ex > 0 and ey > 0 and x.get("serving_plane_cpu_ms_per_request") and \
                    y.get("serving_plane_cpu_ms_per_request"):
                norm.append((x["serving_plane_cpu_ms_per_request"] / ex) / (y["serving_plane_cpu_ms_per_request"] / ey))
        if norm:
            print(f"  {p:<9} {'serving plane / engine CPU':<26} A/B per round " + " ".join(f"{v:.3f}" for v in norm)
                  + f"   median {statistics.median(norm):.3f}, A lower in {sum(v < 1 for v in norm)} of {len(norm)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="generate,chat", help="comma list of generate, chat (default both)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0, help="measured window per path and round, s")
    ap.add_argument("--warmup", type=float, default=5.0, help="load before each window, s")
    ap.add_argument("--rounds", type=int, default=1, help="windows per path (paths alternate)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let EOS end a request early (default: every request makes max_tokens tokens)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    ap.add_argument("--base-port", type=int, default=47600, help="`hetserve up --base-port` (OpenAI: base+80)")
    ap.add_argument("--no-pin", action="store_true", help="`hetserve up --no-pin`")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for `hetserve up`")
    ap.add_argument("--keep-breaker", action="store_true",
                    help="keep the circuit breaker's default threshold (by default it is raised to 10 min: at 32 "
                         "closed-loop clients p99 TTFT passes 500 ms on a busy box and the breaker would shed "
                         "most requests as cheap refusals, which is not the per-request cost being measured)")
    ap.add_argument("--work-dir", default=str(REPO / ".hetserve" / "stack_cpu"))
    ap.add_argument("--checkpoint", help="serve this checkpoint instead of making the tiny one")
    ap.add_argument("--engine-dir", help="an existing build (skips making and building the checkpoint)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny checkpoint")
    ap.add_argument("--rev", help="serve `git archive REV` (exported into the work dir) instead of the working tree")
    ap.add_argument("--against", metavar="REV",
                    help="paired comparison: also serve `git archive REV` (base port + 100, its own engine dir) and "
                         "alternate the windows between the two stacks, A B then B A each pair of rounds, so the "
                         "box's drift falls on both; prints the paired differences per round (A = --rev or the "
                         "working tree, B = REV)")
    ap.add_argument("--threads", action="store_true", help="also CPU per request by thread name")
    ap.add_argument("--profile", action="store_true",
                    help="one more window per path with py-spy on the llm/decode/prefill/preprocess/kv_ingest "
                         "stubs and the OpenAI frontend")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--perf", action="store_true",
                    help="with --profile: also `perf record -e cpu-clock -a` over the profiled window, native "
                         "symbols per stack process (where the CPU outside Python goes)")
    ap.add_argument("--profile-top", type=int, default=12)
    ap.add_argument("--profile-mode", choices=["gil", "active"], default="gil",
                    help="gil (default): sample only the thread holding the GIL (Python running; CPU in C code that "
                         "releases the GIL is not seen), because py-spy cannot tell idle threads of Triton's "
                         "embedded-interpreter stubs from busy ones and would count every waiting thread; active: "
                         "py-spy's own idle filter")
    ap.add_argument("--json", help="write the results here (default <work-dir>/stack_cpu-<time>.json)")
    a = ap.parse_args(argv)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    if not a.keep_breaker and not any(kv.startswith("HETSERVE_BREAKER_P99_MS=") for kv in a.env):
        a.env.append("HETSERVE_BREAKER_P99_MS=600000")

    work = Path(a.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = export_tree(a.rev, work) if a.rev else REPO
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", a.rev or "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(not a.rev and subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                               "python_backends", "model_repository"],
                                              capture_output=True, text=True).stdout.strip())
    if a.engine_dir:
        engine_dir = Path(a.engine_dir).resolve()
        ckpt = Path(a.checkpoint).resolve() if a.checkpoint else None
        if ckpt is None:
            try:
                ckpt = Path(json.loads((engine_dir / "manifest.json").read_text())["source"])
            except (OSError, KeyError, ValueError, TypeError):
                ckpt = None
    else:
        if a.checkpoint:
            ckpt = Path(a.checkpoint).resolve()
        else:
            ckpt = work / f"llama-tiny-seed{a.seed}"
            if not (ckpt / "config.json").exists():
                print(f"making the tiny checkpoint in {ckpt} ...", file=sys.stderr)
                make_checkpoint(tree, ckpt, a.seed)
        engine_dir = work / f"engines-{ckpt.name}"
        t0 = time.time()
        print(f"$ (cd {tree / 'python_backends'} && python -m hetserve build --checkpoint {ckpt} --engine-dir "
              f"{engine_dir})", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "hetserve", "build", "--checkpoint", str(ckpt), "--engine-dir",
                        str(engine_dir)], cwd=str(tree / "python_backends"), check=True)
        print(f"build (cached when unchanged): {time.time() - t0:.0f} s", file=sys.stderr)

    # this script is the subreaper of everything it starts: a server orphaned by a dying `up` stays in its tree
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    shm_before = shm_names()
    proc = log = None
    results: List[dict] = []
    rc = 0
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit,
            "working_tree_dirty": dirty, "tree": str(tree), "checkpoint": str(ckpt) if ckpt else None,
            "engine_dir": str(engine_dir), "clients": a.clients, "max_tokens": a.max_tokens,
            "duration_s": a.duration, "warmup_s": a.warmup, "env": a.env, "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    out_json = Path(a.json) if a.json else work / f"stack_cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    # the stacks measured: "A" (--rev or the working tree) and, with --against, "B" on base port + 100
    stacks = [{"label": "A", "tree": tree, "engine_dir": engine_dir, "port": a.base_port, "rev": commit}]
    if a.against:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", a.against], check=True, capture_output=True,
                             text=True).stdout.strip()
        stacks.append({"label": "B", "tree": export_tree(a.against, work), "rev": sha, "port": a.base_port + 100,
                       "engine_dir": engine_dir.with_name(f"{engine_dir.name}-{sha[:12]}")})
        meta["against"] = sha
    procs: list = []
    logs: list = []
    try:
        if ckpt is None:
            raise SystemExit("--engine-dir: give --checkpoint too (the manifest does not name one)")
        for s in stacks:
            t0 = time.time()
            proc, log, log_path = start_up(a, s["tree"], ckpt, s["engine_dir"], work, s["port"])
            procs.append(proc)
            logs.append(log)
            s.update(proc=proc, log_path=log_path, stack=Stack(proc.pid))
            wait_serving(proc, log_path, s["stack"], timeout=600)
            print(f"stack {s['label']} ({s['rev'][:12]}) serving after {time.time() - t0:.0f} s (log {log_path})",
                  file=sys.stderr)
            s["openai"] = f"http://127.0.0.1:{s['port'] + 80}/v1"
            s["model"] = openai_model(s["openai"]) if "chat" in paths else ""
        prof_dir = work / "profiles" / time.strftime("%Y%m%d-%H%M%S")
        plan = []
        for rnd in range(a.rounds):
            order = stacks if rnd % 2 == 0 else stacks[::-1]  # A B, B A, ...: a drift of the box hits both
            plan += [(p, f"round{rnd + 1}", False, s) for s in order for p in paths]
        plan += [(p, "profiled", True, stacks[0]) for p in paths] if a.profile else []
        for name, tag, prof, s in plan:
            if s["proc"].poll() is not None:
                raise RuntimeError(f"`hetserve up` exited with code {s['proc'].returncode}:\n"
                                   f"{_log_tail(s['log_path'])}")
            path = make_path(name, a, f"127.0.0.1:{s['port']}", s["openai"], s["model"])
            label = f"-{s['label']}" if a.against else ""
            r = measure(a, s["stack"], path, prof, prof_dir, f"{tag}{label}-{name}", s["port"])
            r["stack"] = s["label"]
            results.append(r)
            print_window(r)
            print_perf(r)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("\ninterrupted: tearing down", file=sys.stderr)
        rc = 130
    except Exception as e:  # noqa: BLE001 - report, then tear down
        print(f"\nerror: {e}", file=sys.stderr)
        rc = 1
    finally:
        notes = teardown(procs, [s["stack"] for s in stacks if "stack" in s], shm_before)
        for log in logs:
            log.close()
        for n in notes:
            print(f"teardown: {n}", file=sys.stderr)
    if results:
        print_summary(results)
        if a.against:
            print_pairs(results, paths, stacks)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"\nJSON: {out_json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
