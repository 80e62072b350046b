"""Decode step time of the decode engines, A/B interleaved in one process (loadtest/README.md, "decode step
breakdown"). Each round builds a batch of B rows with P-token contexts per engine, then times `steps` decode
steps per engine back to back; medians over rounds. Pin it to one core for numbers comparable to the server:

  taskset -c 1 python3 loadtest/decode_step_bench.py --engines decode_int8_standard,decode_int8 --batch 1,16

Reports per engine and batch: median step ms, of which inside the engine (ONNX Runtime's sess.run, or the native
engine's C call; column "ORT ms") and Python around it, tok/s = B / step, and the ratio to the first engine.
--profile-ops instead runs each engine once more with ONNX Runtime profiling on and prints the kernel time per op
type (profiling adds a per-node cost, so its totals are above the unprofiled step time; use it for the shares);
for the native engine it prints the time per section of its C forward pass (NativeModel.profile).
--contend runs the steps while another core streams a 64 MB array, as the serving stack's other processes do to
the shared L3 (loadtest/README.md, "The engine's share"):

  taskset -c 1 python3 loadtest/decode_step_bench.py --engine-dir .hetserve/stack_cpu/engines-llama-tiny-seed0 \
      --engines decode_fp32,decode_int8_native --batch 1,4,16 --context 40 [--contend]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backends"))


def _timed_run(batch):
    """Wrap the engine call of a batch so the time inside the engine (ONNX Runtime, or the native engine's C call)
    is counted separately."""
    acc = {"ort": 0.0}
    if hasattr(batch, "_model"):  # NativeBatch: NativeModel.run
        model, real_run = batch._model, batch._model.run

        def nrun(*a, **k):
            t = time.perf_counter()
            try:
                return real_run(*a, **k)
            finally:
                acc["ort"] += time.perf_counter() - t
        model.run = nrun
        return acc
    if hasattr(batch, "_sess"):  # GqaBatch: run_with_iobinding
        sess, real = batch._sess, batch._sess.run_with_iobinding

        class S:
            def __getattr__(self, a):
                return getattr(sess, a)

            def run_with_iobinding(self, io):
                t = time.perf_counter()
                real(io)
                acc["ort"] += time.perf_counter() - t
        batch._sess = S()
    else:  # StandardBatch: engine.forward -> engine._run
        eng, real = batch.engine, batch.engine._run

        def run(feeds):
            t = time.perf_counter()
            out = real(feeds)
            acc["ort"] += time.perf_counter() - t
            return out
        eng._run = run
    return acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=None)
    ap.add_argument("--engines", default="decode_int8_standard,decode_int8")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=192, help="tokens of KV per row before the timed steps")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile-ops", action="store_true")
    ap.add_argument("--contend", action="store_true", help="another core streams memory meanwhile")
    a = ap.parse_args(argv)
    if a.profile_ops:
        return profile_ops(a)
    if not a.contend:
        return bench(a)
    mine = os.sched_getaffinity(0)
    other = sorted(set(range(os.cpu_count() or 1)) - mine)
    if not other:
        raise SystemExit("--contend needs a core outside this process's affinity (run it under taskset -c N)")
    noise = subprocess.Popen(["taskset", "-c", str(other[0]), sys.executable, "-c", STREAM])
    try:
        time.sleep(1)
        return bench(a)
    finally:
        noise.kill()
        noise.wait()


STREAM = "import numpy as np\na = np.ones(64 * 1024 * 1024 // 8)\nwhile True:\n    a.sum()\n"


def bench(a):
    from hetserve.engines.builder import default_engine_dir
    from hetserve.engines.runtime import Engine

    d = a.engine_dir or default_engine_dir()
    names = a.engines.split(",")
    engines = {n: Engine(d, n, threads=a.threads) for n in names}
    c = engines[names[0]].config
    rng = np.random.default_rng(0)
    shape = (c.num_layers, c.num_kv_heads, a.context, c.head_dim)
    k0 = rng.standard_normal(shape).astype(np.float32) * 0.5  # KV content does not change the step cost
    v0 = rng.standard_normal(shape).astype(np.float32) * 0.5
    results = {}
    for B in [int(x) for x in a.batch.split(",")]:
        per = {n: {"step": [], "ort": []} for n in names}
        for r in range(a.rounds + 1):  # round 0 warms up
            for n in (names if r % 2 else names[::-1]):
                bt = engines[n].new_batch(B)
                for _ in range(B):
                    bt.add(k0, v0)
                acc = _timed_run(bt)
                toks = rng.integers(0, c.vocab_size, B)
                bt.step(toks)  # binds / first-call allocations outside the timing
                acc["ort"] = 0.0
                t = time.perf_counter()
                for _ in range(a.steps):
                    toks = bt.step(toks).argmax(1)
                dt = (time.perf_counter() - t) / a.steps
                if r:
                    per[n]["step"].append(dt)
                    per[n]["ort"].append(acc["ort"] / a.steps)
        results[B] = {n: {k: statistics.median(v) for k, v in per[n].items()} for n in names}
    print(f"context {a.context} tokens, {a.steps} steps x {a.rounds} rounds, threads {a.threads}; medians")
    print(f"{'batch':>5} {'engine':<24} {'step ms':>8} {'ORT ms':>8} {'Python ms':>9} {'tok/s':>7} {'vs first':>8}")
    for B, row in results.items():
        base = row[names[0]]["step"]
        for n in names:
            s, o = row[n]["step"], row[n]["ort"]
            print(f"{B:>5} {n:<24} {s * 1e3:8.2f} {o * 1e3:8.2f} {(s - o) * 1e3:9.2f} {B / s:7.1f} {base / s:7.2f}x")
    return results


def profile_ops(a):
    import tempfile

    from hetserve.engines.builder import default_engine_dir
    from hetserve.engines.runtime import Engine

    d = a.engine_dir or default_engine_dir()
    tmp = tempfile.mkdtemp(prefix="hetserve-prof-")
    os.environ["HETSERVE_ORT_PROFILE"] = os.path.join(tmp, "p")
    for B in [int(x) for x in a.batch.split(",")]:
        for n in a.engines.split(","):
            e = Engine(d, n, threads=a.threads)
            c = e.config
            rng = np.random.default_rng(0)
            k0 = rng.standard_normal((c.num_layers, c.num_kv_heads, a.context, c.head_dim)).astype(np.float32)
            bt = e.new_batch(B)
            for _ in range(B):
                bt.add(k0, k0)
            toks = rng.integers(0, c.vocab_size, B)
            if getattr(e, "native", None) is not None:  # the native engine times its own sections
                bt.step(toks)
                e.native.profile()
                for _ in range(a.steps):
                    toks = bt.step(toks).argmax(1)
                sec = e.native.profile()
                tot = sum(sec.values())
                print(f"batch {B} {n}: {tot / a.steps * 1e3:.2f} ms in the C forward per step (sections)")
                for name, v in sorted(sec.items(), key=lambda kv: -kv[1]):
                    print(f"    {name:<34} {v / a.steps * 1e3:7.2f} ms {100 * v / tot:5.1f}%")
                continue
            for _ in range(a.steps):
                toks = bt.step(toks).argmax(1)
            events = json.load(open(e.end_profiling()))
            per, count, runs = collections.Counter(), collections.Counter(), 0
            for x in events:
                if x.get("cat") == "Node" and x["name"].endswith("_kernel_time"):
                    per[x["args"]["op_name"]] += x["dur"]
                    count[x["args"]["op_name"]] += 1
                elif x.get("cat") == "Session" and x["name"] == "model_run":
                    runs += 1
            tot = sum(per.values())
            print(f"batch {B} {n}: {tot / runs / 1e3:.2f} ms kernel time per step ({sum(count.values()) // runs} "
                  f"nodes)")
            for op, us in per.most_common(8):
                print(f"    {op:<34} {us / runs / 1e3:7.2f} ms {100 * us / tot:5.1f}%  x{count[op] // runs}")


if __name__ == "__main__":
    main()
