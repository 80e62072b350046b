"""CPU seconds spent inside engine calls, per process (`ENGINE_CPU`): what a server's model costs, apart from what
serving it costs. Exported as hetserve_engine_cpu_seconds_total{model}; loadtest/stack_cpu.py subtracts it from
the stack's CPU to give the serving plane's own.

Each call is measured with the calling thread's CPU clock (time.thread_time), so time the thread spends waiting
for the core (a busy box) is not counted. The CPU engines run a call on the calling thread: ONNX Runtime with one
intra-op thread (what `hetserve up` gives a server pinned to one core) and the native engine. With more intra-op
threads, the pool threads' share of a call is not seen, and the figure is a lower bound."""
from __future__ import annotations

import threading
import time


class EngineCpuClock:
    def __init__(self) -> None:
        self._seconds = 0.0
        self._lock = threading.Lock()  # several threads may call engines (decode admission, the scheduler)

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def seconds(self) -> float:
        with self._lock:
            return self._seconds

    def timed(self) -> "_Timed":
        return _Timed(self)


class _Timed:
    __slots__ = ("clock", "t0")

    def __init__(self, clock: EngineCpuClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.t0 = time.thread_time()

    def __exit__(self, *exc) -> None:
        self.clock.add(time.thread_time() - self.t0)


ENGINE_CPU = EngineCpuClock()
