"""Every command block of README.md runs, as written, with short settings, so none rots.

Each ```bash line and ```python block is classified by what it starts with; a line no adapter knows fails the
test (add an adapter when you add a command to the README). Adapters change only what a test must change:
ports (README's 8000/8001/8002/8080/9001/9002 become this test's own), optional `[...]` parts dropped,
`a|b|c` alternatives resolved, and shorter settings appended (max tokens, doctor sizes, exit after the prompt).
The servers the commands need are started by the README's own `hetserve up` line (then stopped with SIGTERM,
which must exit 0); `bash .ci/run` is the suite itself, so it is syntax-checked, not run recursively.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = int(os.environ.get("HETSERVE_TEST_BASE_PORT", "18000"))
UP = BASE + 500  # `hetserve up` (and its decode server at +1000, OpenAI frontend at +80)
RUNSH = BASE + 600  # `bash run.sh`
SERVE = BASE + 700  # `hetserve serve --role ...`
PORTS = {8000: 0, 8001: 1, 8002: 2, 8080: 80, 9001: 1001, 9002: 1002}
SHORT = 8  # max tokens for generation commands


def readme_blocks():
    text = (ROOT / "README.md").read_text()
    return [(lang, code) for lang, code in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang in ("bash", "python")]


def commands():
    out = []
    for lang, code in readme_blocks():
        if lang == "python":
            out.append(("python", code))
            continue
        for line in code.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                out.append(("bash", line.strip()))
    return out


def ports(text: str, base: int) -> str:
    return re.sub(r"\b(8000|8001|8002|8080|9001|9002)\b", lambda m: str(base + PORTS[int(m.group(1))]), text)


def argv(line: str, base: int = UP) -> list:
    """shell words of a README line: comments and optional [...] groups dropped, ports mapped."""
    words, depth = [], 0
    for w in shlex.split(ports(line, base), comments=True):
        if w.startswith("["):
            depth += 1
        if depth == 0:
            words.append(w)
        if w.endswith("]"):
            depth -= 1
    return words


KINDS = ["bash run.sh", "bash .ci/run", "hetserve build", "hetserve up", "hetserve generate",
         "hetserve serve --role openai", "hetserve serve --role", "hetserve plan", "hetserve doctor",
         "hetserve config", "curl",
         "python"]


def kind(lang: str, cmd: str) -> str:
    if lang == "python":
        return "python"
    return next((k for k in KINDS if cmd.startswith(k)), "")


# one admin key for every command of the run, as an operator would export it (doctor talks to `up`'s servers)
ENV = {**os.environ, "HETSERVE_ADMIN_KEY": os.environ.get("HETSERVE_ADMIN_KEY") or os.urandom(12).hex()}


def run(args, timeout=300, **kw):
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV, **kw)
    assert r.returncode == 0, f"{args} exited {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


class Background:
    """A long-running README command; its stderr is watched for a line."""

    def __init__(self, args):
        self.lines = []
        self.p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True, env=ENV)
        self.out = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stderr), daemon=True).start()
        # stdout per character: a streamed answer has no newline until the process ends
        threading.Thread(target=lambda: self.out.extend(iter(lambda: self.p.stdout.read(1), "")),
                         daemon=True).start()

    def wait_for(self, pattern: str, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(re.search(pattern, ln) for ln in list(self.lines)):
                return
            assert self.p.poll() is None, f"exited {self.p.returncode}:\n{''.join(self.lines)[-4000:]}"
            time.sleep(0.5)
        raise AssertionError(f"no {pattern!r} after {timeout:.0f}s:\n{''.join(self.lines)[-4000:]}")

    def stop(self, timeout: float = 60) -> int:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGTERM)  # the launcher itself: it must stop what it started
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
            raise AssertionError(f"{self.p.args} ignored SIGTERM for {timeout:.0f}s") from None


def _ready(url: str, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready after {timeout:.0f}s")


def _gone(port: int) -> bool:
    from hetserve.server import port_in_use

    return not port_in_use(port)


def test_every_readme_command_is_known():
    cmds = commands()
    unknown = [c for lang, c in cmds if not kind(lang, c)]
    assert not unknown, f"README commands without an adapter in {__file__}: {unknown}"
    seen = {kind(lang, c) for lang, c in cmds}
    assert {"bash run.sh", "hetserve up", "hetserve plan", "curl"} <= seen, seen


@pytest.mark.timeout(1800)
def test_readme_commands_run(engine_dir):
    cmds = commands()
    by = {}
    for lang, c in cmds:
        by.setdefault(kind(lang, c), []).append(c)
    hs = [sys.executable, "-m", "hetserve"]

    def hetserve(words):  # `hetserve ...` through this interpreter (same install as the servers)
        assert words[0] == "hetserve"
        return hs + words[1:]

    for c in by.get("bash .ci/run", []):
        run(["bash", "-n", argv(c)[1]])
        assert "pytest" in (ROOT / argv(c)[1]).read_text()
    for c in by.get("hetserve build", []):
        run(hetserve(argv(c)), timeout=1200)
    for c in by.get("hetserve plan", []):
        r = run(hetserve(argv(c)), timeout=300)
        assert "SLO" in r.stdout or "SLO" in r.stderr, r.stdout[-2000:]
    for c in by.get("hetserve config", []):
        assert "HETSERVE_MAX_BATCH" in run(hetserve(argv(c)), timeout=60).stdout

    # the servers: README's `hetserve up`, with this test's ports and a short answer
    (up_line,) = by["hetserve up"]
    up = Background(hetserve(argv(up_line)) + ["--base-port", str(UP), "--max-tokens", str(SHORT)])
    try:
        up.wait_for(r"^serving", 600)
        assert any("OpenAI API: http://127.0.0.1:" in ln for ln in up.lines), "".join(up.lines)
        time.sleep(0.5)
        assert "Paris" in "".join(up.out), "".join(up.out)
        for c in by.get("hetserve generate", []):
            r = run(hetserve(argv(c)) + ["--url", f"127.0.0.1:{UP + 1}", "--max-tokens", str(SHORT)])
            assert r.stdout.strip(), r.stderr
        for c in by.get("curl", []):
            r = run(["bash", "-c", ports(c, UP)], timeout=120)
            out = r.stdout.strip()
            if "generate_stream" in c:
                events = [json.loads(x[6:]) for x in out.splitlines() if x.startswith("data: ")]
                assert len(events) > 1 and all("error" not in e for e in events), out
            elif "/generate" in c:
                body = json.loads(out)
                assert "error" not in body and body["text_output"] and body["finish_reason"], body
            else:
                body = json.loads(out)
                assert body["choices"][0]["message"]["content"], body
        for code in by.get("python", []):
            r = run([sys.executable, "-c", ports(code, UP)], timeout=120)
            assert r.stdout.strip(), r.stderr
        for c in by.get("hetserve doctor", []):
            run(hetserve(argv(c)) + ["--sizes", "128", "--repeats", "1", "--ping", "3", "--kv-dtypes", "fp16",
                                     "--prompt", "Hello"], timeout=600)
        for c in by.get("hetserve serve --role openai", []):
            fe = Background(hetserve(argv(c)) + ["--http-port", str(SERVE + 80)])
            try:
                _ready(f"http://127.0.0.1:{SERVE + 80}/health", 60)
            finally:
                assert fe.stop() == 0, "".join(fe.lines)
    finally:
        rc = up.stop()
    assert rc == 0, "".join(up.lines)[-4000:]
    for p in (UP, UP + 1, UP + 80, UP + 1001):
        assert _gone(p), f"port {p} still held after `hetserve up` got SIGTERM"

    for c in by.get("hetserve serve --role", []):
        words = [w.split("|")[-1] if "|" in w else w for w in argv(c.replace("host:", "127.0.0.1:"))]
        s = Background(hetserve(words) + ["--http-port", str(SERVE), "--grpc-port", str(SERVE + 1),
                                          "--metrics-port", str(SERVE + 2)])
        try:
            _ready(f"http://127.0.0.1:{SERVE}/v2/health/ready", 300)
        finally:
            assert s.stop() == 0, "".join(s.lines)[-3000:]

    for c in by.get("bash run.sh", []):
        r = run(argv(c) + ["What is the capital of France?", "--base-port", str(RUNSH), "--max-tokens", str(SHORT),
                           "--exit-after-prompt", "--no-openai"], timeout=1200)
        assert "Paris" in r.stdout, r.stdout + r.stderr[-3000:]
