#!/usr/bin/env python3
"""Prompt processing side by side, in one process, alternating: hetserve's native INT8 prefill engine vs llama.cpp
on a Q8_0 GGUF made from the same weights by llama.cpp's own quantizer (equal precision), plus one core's read
bandwidth (the floor a single decode stream is held to). Not a CI test (loadtest/README.md, "Models of 1B and 3B").

    python3 loadtest/prefill_vs_llamacpp.py --engine-dir /tmp/e1g --gguf /tmp/llama1b/model-f16.gguf \\
        --lengths 512,2048 --llama-threads 1,2 --rounds 3

hetserve: `Engine(prefill_int8_native).prefill(ids)` (the prefill server's engine; one thread). llama.cpp:
`Llama.eval(ids)` with n_batch 512 (llama-server's default), n_threads = n_threads_batch = each of
--llama-threads. Same random token ids for both, a fresh KV each round. Prints tokens/s medians and ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends"))


def read_bandwidth(gib: float = 1.0, rounds: int = 5) -> float:
    """Bytes/s one core reads from memory: a reduction over a buffer far larger than the caches (numpy's
    vectorized OR of 64-bit words: one pass, no stores), best of `rounds`."""
    a = np.ones(int(gib * (1 << 30)) // 8, np.uint64)
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        np.bitwise_or.reduce(a)
        best = max(best, a.nbytes / (time.perf_counter() - t))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--gguf", required=True, help="the GGUF the engines were built from (Q8_0 is made from it)")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--llama-threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work-dir", default=str(ROOT / ".hetserve" / "bench"))
    ap.add_argument("--json")
    a = ap.parse_args()
    import llama_cpp

    from hetserve.engines.llamacpp_compat import no_repack
    from hetserve.engines.quality import llamacpp_quantize
    from hetserve.engines.runtime import Engine

    os.makedirs(a.work_dir, exist_ok=True)
    q8 = os.path.join(a.work_dir, Path(a.gguf).stem + "-q8_0.gguf")
    if not os.path.exists(q8):
        llamacpp_quantize(a.gguf, q8, 7)
    lengths = [int(x) for x in a.lengths.split(",")]
    threads = [int(x) for x in a.llama_threads.split(",")]
    ours = Engine(a.engine_dir, "prefill_int8_native")
    rng = np.random.default_rng(0)
    with no_repack():  # AMX repacking of Q8_0 segfaults here (llamacpp_compat)
        llms = {t: llama_cpp.Llama(model_path=q8, n_ctx=max(lengths) + 8, n_batch=512, n_ubatch=512, n_threads=t,
                                   n_threads_batch=t, verbose=False) for t in threads}
    res: dict = {}
    for L in lengths:
        times: dict = {"hetserve": [], **{f"llama.cpp {t}t": [] for t in threads}}
        for r in range(a.rounds):
            ids = rng.integers(100, 49000, L).tolist()
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for name in order:
                t0 = time.perf_counter()
                if name == "hetserve":
                    ours.prefill(ids)
                else:
                    llm = llms[int(name.split()[1][:-1])]
                    llm.reset()
                    llm.eval(ids)
                times[name].append(time.perf_counter() - t0)
        res[L] = {n: L / statistics.median(v) for n, v in times.items()}
        row = ", ".join(f"{n} {tps:.0f} tok/s" for n, tps in res[L].items())
        ratios = ", ".join(f"x{res[L]['hetserve'] / res[L][f'llama.cpp {t}t']:.2f} vs {t}t" for t in threads)
        print(f"prompt {L}: {row}  (hetserve {ratios})", flush=True)
    bw = read_bandwidth()
    print(f"one core reads {bw / 1e9:.1f} GB/s (numpy OR-reduce over 1 GiB, best of 5)")
    out = {"prefill_tok_s": res, "read_bandwidth_gb_s": round(bw / 1e9, 2), "rounds": a.rounds,
           "engine_dir": a.engine_dir, "q8_0": q8}
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
