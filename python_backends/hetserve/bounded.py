"""A thread pool whose queue has a bound: work beyond it is refused at once (Overloaded), never queued forever.

concurrent.futures.ThreadPoolExecutor bounds threads but not its queue; a request flood then holds memory and
answers late. Here at most `max_workers` run and `max_queue` wait; submit() past that raises Overloaded, which
the Triton bindings turn into UNAVAILABLE (HTTP 503) with a retry hint.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Callable, Optional

from .errors import Overloaded

log = logging.getLogger("hetserve.bounded")


def nice_this_thread(increment: int) -> None:
    """Lower the calling thread's CPU priority by `increment` (Linux keeps a nice value per thread). For work
    that shares a core with latency-bound work and should yield to it: a decode server's admission threads,
    which prefill prompts (local prefill, recompute) next to the decode steps. It cannot be raised back without
    privileges, so it is meant for a pool's own threads (an initializer)."""
    if increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (OSError, AttributeError) as e:  # not Linux, or refused: the work runs at normal priority
        log.info("thread priority unchanged (%s: %s)", type(e).__name__, e)


class BoundedExecutor:
    def __init__(self, max_workers: int, max_queue: int, name: str,
                 initializer: Optional[Callable[[], None]] = None):
        """initializer: run once in each worker thread (e.g. nice_this_thread)."""
        if max_workers < 1 or max_queue < 0:
            raise ValueError("max_workers must be >= 1 and max_queue >= 0")
        self.name = name
        self.limit = max_workers + max_queue
        self._slots = threading.BoundedSemaphore(self.limit)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                                                           initializer=initializer)

    def submit(self, fn, *args, **kw) -> concurrent.futures.Future:
        if not self._slots.acquire(blocking=False):
            raise Overloaded(f"{self.name}: {self.limit} requests in flight (queue full)", where=self.name)
        try:
            fut = self._pool.submit(fn, *args, **kw)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _: self._slots.release())
        return fut

    def shutdown(self, wait: bool = False) -> None:
        """wait: run what was submitted and wait for it; else drop what has not started."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
