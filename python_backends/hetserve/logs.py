"""One logging setup for every hetserve process: the Triton model stubs, the CLI, the OpenAI frontend.

Without it `log.info` goes nowhere (no handler on the `hetserve` loggers). Lines go to stderr: a Python model's
stub process inherits tritonserver's stderr, so they land in the server's output (its log file under
.hetserve/logs), tagged with the model name: `2026-12-03 18:20:01,123 INFO [decode] hetserve.decode: ...`.
Level: HETSERVE_LOG_LEVEL (INFO).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys

from . import config

_HANDLER = "hetserve-stderr"
log = logging.getLogger("hetserve.logs")


def setup(component: str, announce: bool = False) -> logging.Logger:
    """Route the `hetserve` logger tree to stderr at HETSERVE_LOG_LEVEL, each line tagged `[component]` (a model
    name, "cli", "openai"). Idempotent: a second call re-tags and re-levels the one handler. `announce` (the
    model shims) logs one INFO line saying which process and which hetserve package serve the model."""
    level = config.get("HETSERVE_LOG_LEVEL").upper()
    root = logging.getLogger("hetserve")
    handler = next((h for h in root.handlers if h.get_name() == _HANDLER), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER)
        root.addHandler(handler)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{component}] %(name)s: %(message)s"))
    root.setLevel(level)
    root.propagate = False  # one line per record even when a host app (uvicorn) configures the root logger
    if announce and not faulthandler.is_enabled():
        # a model's stub: a crash in native code (SIGSEGV, SIGABRT...) leaves every thread's Python stack in the
        # server's log before the stub dies (stub_watch.py then replaces it)
        faulthandler.enable(file=sys.stderr, all_threads=True)
    (log.info if announce else log.debug)("%s: pid %d, hetserve from %s, logs at %s", component, os.getpid(),
                                          os.path.dirname(os.path.abspath(__file__)), level)
    return root
