"""A thread pool whose queue has a bound: work beyond it is refused at once (Overloaded), never queued forever.

concurrent.futures.ThreadPoolExecutor bounds threads but not its queue; a request flood then holds memory and
answers late. Here at most `max_workers` run and `max_queue` wait; submit() past that raises Overloaded, which
the Triton bindings turn into UNAVAILABLE (HTTP 503) with a retry hint.
"""
from __future__ import annotations

import concurrent.futures
import threading

from .errors import Overloaded


class BoundedExecutor:
    def __init__(self, max_workers: int, max_queue: int, name: str):
        if max_workers < 1 or max_queue < 0:
            raise ValueError("max_workers must be >= 1 and max_queue >= 0")
        self.name = name
        self.limit = max_workers + max_queue
        self._slots = threading.BoundedSemaphore(self.limit)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)

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
