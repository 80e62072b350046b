import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends"))

# CI (HETSERVE_STRICT_SKIPS=1, set by .ci/run): a skipped test is a failure -- a core test must never pass by
# skipping because a dependency is missing. Only tests marked `gpu` (they need an NVIDIA GPU) may skip.
STRICT_SKIPS = os.environ.get("HETSERVE_STRICT_SKIPS", "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU; the only tests that may skip in CI")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if (STRICT_SKIPS and rep.skipped and not hasattr(rep, "wasxfail")
            and item.get_closest_marker("gpu") is None):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped under HETSERVE_STRICT_SKIPS (a core test may not skip): {reason}"


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="session")
def engine_dir():
    from hetserve.engines.builder import build_engines

    d = os.environ.get("HETSERVE_ENGINE_DIR") or str(ROOT / ".hetserve" / "engines")
    build_engines(None, d)
    return d


@pytest.fixture(scope="session")
def tokenizer(engine_dir):
    from hetserve.engines.manifest import load_tokenizer

    return load_tokenizer(engine_dir)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer):
    return {p: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS}


@pytest.fixture(scope="session")
def reference_tokens(prompt_ids):
    """transformers greedy tokens on the same GGUF, 32 per prompt (the oracle)."""
    pytest.importorskip("transformers")
    from hetserve.model import default_checkpoint_path
    from hetserve.reference import greedy

    ck = default_checkpoint_path()
    return {p: greedy(ck, ids, 32) for p, ids in prompt_ids.items()}


@pytest.fixture(scope="session")
def topology(engine_dir, tmp_path_factory):
    """Real prefill + decode tritonservers on separate cores (ports 18000-18002 / 19000-19002)."""
    from hetserve.topology import Topology

    base = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000"))
    # functional tests: a slow CI box must not trip the latency breaker (tests/test_reliability.py tests it)
    snaps = str(tmp_path_factory.mktemp("snapshots"))  # pytest's own temp tree: removed with it
    topo = Topology(engine_dir, base_port=base, env={"HETSERVE_KV_TIMEOUT_MS": "100",
                                                     "HETSERVE_BREAKER_P99_MS": "60000",
                                                     "HETSERVE_SNAPSHOT_DIR": snaps})
    topo.start()
    yield topo
    topo.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server of our own on a free port (no persistence); skipped only if the binary is missing."""
    import shutil
    import socket
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if not exe:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc)


def stop_process(proc, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`: for helper servers the tests start (redis, prometheus)."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- helpers shared by the live tests ---------------------------------------------------------
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(target) -> dict:
    """{(name, frozenset(labels)): value} from a Prometheus text endpoint (a port on 127.0.0.1, or host:port)."""
    import urllib.request

    addr = f"127.0.0.1:{target}" if isinstance(target, int) else target
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(samples: dict, name: str, **want) -> float:
    w = set((k, str(v)) for k, v in want.items())
    return sum(v for (n, lab), v in samples.items() if n == name and w <= lab)


def wait_for(fn, timeout_s: float, what: str, interval: float = 0.25):
    """Poll fn() until it returns something truthy (returned), else fail naming `what`."""
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


def run_scheduler(pre, dec, prompt_ids, n, pool=None, stagger=0.0, timeout_s=180.0):
    """Greedy-decode `prompt_ids` ((name, ids) pairs; prefill on `pre`, decode on `dec`) for n tokens through a
    real DecodeScheduler (optionally over `pool`, joins `stagger` s apart); returns ({name: tokens}, stats)
    after checking every row and KV block was freed."""
    import threading

    from hetserve.sampling import SamplingParams
    from hetserve.scheduler import DecodeScheduler, Sequence

    prec = dec.precision
    sched = DecodeScheduler({prec: dec}, max_batch=8, pool=pool)
    try:
        out, done = {}, {}
        for i, (p, ids) in enumerate(prompt_ids):
            lo, k, v = pre.prefill(ids)
            out[p] = [int(lo.argmax())]
            done[p] = threading.Event()

            def cb(toks, reason, p=p):
                out[p].extend(toks)
                if reason:
                    done[p].set()
            sched.submit(Sequence(p, len(ids), list(out[p]), SamplingParams(max_tokens=n, ignore_eos=True), prec,
                                  cb, k=k, v=v, prompt_ids=list(ids)))
            time.sleep(stagger * i)
        for e in done.values():
            assert e.wait(timeout_s)
        time.sleep(0.05)
        assert sched.batches[prec].n == 0 and sched.kv_pool.stats()["used_blocks"] == 0
        return out, dict(sched.stats)
    finally:
        sched.close()
