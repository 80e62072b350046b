"""Decode *scheduler* step time (engine + everything the scheduler does per step: KV bookkeeping, feeds, sampling,
callbacks), split into time inside the engine (ONNX Runtime, or the native engine's C call; "ort_ms") and Python
around it. One JSON line per batch size.

Runs the DecodeScheduler of the hetserve tree on `--tree` (default: this checkout), so an older commit can be
measured side by side (`git archive <commit> python_backends | tar -x -C /tmp/old`), e.g. (loadtest/README.md):

  for r in 1 2 3; do
    taskset -c 1 python3 loadtest/sched_step_bench.py --tree /tmp/old/python_backends --engine-dir OLD --engine decode_int8
    taskset -c 1 python3 loadtest/sched_step_bench.py --engine-dir NEW --engine decode_int8
  done
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


class _TimedSession:
    """Proxy of an InferenceSession that adds up the seconds spent in run / run_with_iobinding."""

    def __init__(self, sess):
        self._s, self.seconds = sess, 0.0

    def __getattr__(self, a):
        return getattr(self._s, a)

    def run(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._s.run(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t

    def run_with_iobinding(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._s.run_with_iobinding(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t


class _TimedNative:
    """Adds up the seconds of a NativeModel's C calls (NativeModel.run)."""

    def __init__(self, model):
        self.seconds, real = 0.0, model.run

        def run(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
        model.run = run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1] / "python_backends"))
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--engine", default="decode_int8")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--tokens", type=int, default=40, help="decode steps per sequence (the first 8 are warm-up)")
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    sys.path.insert(0, a.tree)
    import numpy as np

    from hetserve.engines.runtime import Engine
    from hetserve.sampling import SamplingParams
    from hetserve.scheduler import DecodeScheduler, Sequence

    eng = Engine(a.engine_dir, a.engine, threads=1)
    if getattr(eng, "native", None) is not None:  # the native engine: time its C calls
        timed = _TimedNative(eng.native)
    else:
        eng._sess = timed = _TimedSession(eng._sess)
    c = eng.config
    rng = np.random.default_rng(0)
    shape = (c.num_layers, c.num_kv_heads, a.context, c.head_dim)
    k0 = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    v0 = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    for B in [int(x) for x in a.batch.split(",")]:
        sched = DecodeScheduler({eng.precision: eng}, max_batch=B)
        marks = []
        done = threading.Event()
        left = [B]

        def cb(toks, reason):
            if reason:
                left[0] -= 1
                if not left[0]:
                    done.set()
        try:
            sched._stop = True  # drive step() from here, not from the loop thread
            sched._thread.join()
            for i in range(B):
                sched.submit(Sequence(f"s{i}", a.context, [int(rng.integers(0, c.vocab_size))],
                                      SamplingParams(max_tokens=a.tokens, ignore_eos=True), eng.precision, cb,
                                      k=k0, v=v0))
            with sched.cv:
                sched._admit()
            for i in range(a.tokens - 1):
                if i == 8:
                    marks = [time.perf_counter(), timed.seconds]
                sched.step()
            dt, ort = time.perf_counter() - marks[0], timed.seconds - marks[1]
            n = a.tokens - 1 - 8
            assert done.is_set()
        finally:
            sched._stop = True
            sched.kv_pool.close()
        print(json.dumps({"label": a.label or f"{a.tree}:{a.engine}", "batch": B, "step_ms": dt / n * 1e3,
                          "ort_ms": ort / n * 1e3, "python_ms": (dt - ort) / n * 1e3}), flush=True)


if __name__ == "__main__":
    main()
