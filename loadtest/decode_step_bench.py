"""One decode step of a built engine at several batch sizes, on one core, alone or while another core streams
memory (what the serving stack's other processes do to the shared L3): engine-level figures for the engine's
share of the serving plane's CPU (loadtest/README.md, "The engine's share").

    python3 loadtest/decode_step_bench.py --engine-dir .hetserve/stack_cpu/engines-llama-tiny-seed0 \\
        --engines decode_fp32,decode_int8_native [--contend]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backends"))

STREAM = "import numpy as np\na = np.ones(64 * 1024 * 1024 // 8)\nwhile True:\n    a.sum()\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--engines", default="decode_fp32,decode_int8_native")
    ap.add_argument("--rows", default="1,4,8,16,32", help="batch sizes")
    ap.add_argument("--past", type=int, default=40, help="KV tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--core", type=int, default=1, help="the core the steps run on")
    ap.add_argument("--contend", action="store_true", help="another core streams a 64 MB array meanwhile")
    a = ap.parse_args(argv)
    from hetserve.engines.runtime import load_engine

    os.sched_setaffinity(0, {a.core})
    other = sorted(os.sched_getaffinity(0) ^ set(range(os.cpu_count() or 1)) - {a.core})
    noise = None
    if a.contend:
        if not other:
            raise SystemExit("--contend needs a second core")
        noise = subprocess.Popen(["taskset", "-c", str(other[0]), sys.executable, "-c", STREAM])
        time.sleep(1)
    try:
        for name in a.engines.split(","):
            eng = load_engine(a.engine_dir, name, threads=1)
            c = eng.config
            for b in (int(x) for x in a.rows.split(",")):
                batch = eng.new_batch(rows=b)
                rng = np.random.default_rng(0)
                for _ in range(b):
                    k = rng.standard_normal((c.num_layers, c.num_kv_heads, a.past, c.head_dim)).astype(np.float32)
                    batch.add(k, k.copy())
                toks = np.ones(b, np.int64)
                times = []
                for i in range(a.steps + 3):
                    t = time.perf_counter()
                    np.argmax(batch.step(toks), axis=1)
                    if i >= 3:
                        times.append(time.perf_counter() - t)
                med = statistics.median(times) * 1e3
                print(f"{name:<22} rows {b:>3}  step {med:7.3f} ms  per row {med / b:6.3f} ms"
                      + ("  (other core streaming)" if a.contend else ""))
    finally:
        if noise is not None:
            noise.kill()
            noise.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
