"""Python-backend stubs that die while their server lives: found and replaced.

Triton 2.51 does not restart a Python-backend stub that crashed. The model stays READY (so does the server), and
every request to it fails after a one-second health wait ("Stub process '<model>_0_0' is not healthy") until the
server restarts. Seen here under load (2026-12-08): the prefill stub died of a SIGSEGV in CPython's allocator,
and from then on the prefill server answered one request a second, each with an internal error, while its
readiness said 200.

StubWatch, one per server a launcher started (server.TritonProcess, from `hetserve up` and `hetserve serve`),
looks at the server's child processes every HETSERVE_STUB_WATCH_S. When a model has fewer stubs than it had when
the server became ready, and Triton still reports that model READY, it reloads the model: repository API unload,
then load, with the admin key. That starts a new stub (about 2 s for the default model), and requests to the
model fail typed meanwhile. A model that is not READY, because it is loading or was unloaded on purpose, is left
alone. One reload per model per MIN_RELOAD_GAP_S, whatever happens.

Lifecycle: start() after the server is ready; close() before the server is stopped, so a stop is never taken for a
crash.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional

log = logging.getLogger("hetserve.server")

STUB_BINARY = "triton_python_backend_stub"
MIN_RELOAD_GAP_S = 30.0


def stub_models(server_pid: int) -> Dict[int, str]:
    """{pid: model} of the live Python-backend stubs among the direct children of `server_pid` (a stub's argv[1]
    is <repository>/<model>/<version>/model.py)."""
    stubs: Dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z" or int(fields[1]) != server_pid:
                continue
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if len(argv) > 1 and argv[0].endswith(STUB_BINARY.encode()):
            parts = Path(argv[1].decode(errors="replace")).parts
            if len(parts) >= 3:
                stubs[int(d)] = parts[-3]
    return stubs


def stub_counts(server_pid: int) -> Dict[str, int]:
    """{model: live Python-backend stubs} among the direct children of `server_pid`."""
    return dict(collections.Counter(stub_models(server_pid).values()))


class StubWatch:
    def __init__(self, server_pid: int, http_url: str, admin_header: str, admin_key: str, interval_s: float,
                 name: str = "server", counts: Callable[[int], Dict[str, int]] = stub_counts):
        self.server_pid, self.http_url, self.name = server_pid, http_url, name
        self._header = {admin_header: admin_key}
        self.interval_s = interval_s
        self._counts = counts
        self.baseline: Dict[str, int] = {}
        self.reloads: Dict[str, int] = collections.Counter()
        self._last: Dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StubWatch":
        self.baseline = self._counts(self.server_pid)
        self._thread = threading.Thread(target=self._run, name=f"stub-watch-{self.name}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as e:  # the watch must outlive its own failures; said, never silent
                log.warning("%s: stub watch check failed: %s: %s", self.name, type(e).__name__, e)

    def check(self) -> List[str]:
        """Reload every READY model with fewer stubs than at start; returns the models reloaded."""
        now = self._counts(self.server_pid)
        done = []
        for model, n in self.baseline.items():
            live = now.get(model, 0)
            if live >= n or self._stop.is_set():
                continue
            if time.monotonic() - self._last.get(model, float("-inf")) < MIN_RELOAD_GAP_S:
                continue
            if not self._ready(model):
                continue
            self._last[model] = time.monotonic()
            log.error("%s: the Python-backend stub of model %r is gone (%d of %d running) while the model reports "
                      "ready (Triton does not restart it): reloading %r", self.name, model, live, n, model)
            try:
                self._post(f"/v2/repository/models/{model}/unload")
                self._post(f"/v2/repository/models/{model}/load")
            except (OSError, urllib.error.HTTPError) as e:
                log.error("%s: reloading %r failed: %s (next try in %.0f s)", self.name, model, e, MIN_RELOAD_GAP_S)
                continue
            self.reloads[model] += 1
            log.warning("%s: model %r reloaded with a new stub", self.name, model)
            done.append(model)
        return done

    def _ready(self, model: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/ready", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def _post(self, path: str) -> None:
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=b"", method="POST", headers=self._header)
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
