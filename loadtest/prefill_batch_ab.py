#!/usr/bin/env python3
"""Batched vs one-at-a-time prefill on the prefill engine, in process, interleaved A/B. Not a CI test.

N chat-templated prompts (the benchmark's questions) arrive together; A prefills them one after another with
Engine.prefill (what the prefill server did before prefill_batch.py), B hands them to PrefillBatcher (the
server's batcher, default BatchConfig or HETSERVE_PREFILL_* env). Per round: the time until each prompt's KV +
logits are ready (its TTFT share on the prefill server), p50/p99 and the total; rounds alternate A/B order,
medians reported, plus B/A ratios. Also checks that both give the same greedy first token.

    taskset -c 0 python loadtest/prefill_batch_ab.py --engine-dir .hetserve/engines --prompts 16 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def sequential(engine, prompts):
    t0, done, first = time.perf_counter(), [], []
    for ids in prompts:
        lo, _, _ = engine.prefill(ids)
        done.append(time.perf_counter() - t0)
        first.append(int(np.argmax(lo)))
    return done, first


def batched(engine, cfg, prompts):
    from hetserve.stages.prefill_batch import PrefillBatcher

    out = {}
    t0 = time.perf_counter()
    b = PrefillBatcher(engine, cfg, lambda j: out.__setitem__(j.seq, (time.perf_counter() - t0, j.logits)),
                       lambda j, e: print("error:", e), start=False)
    for ids in prompts:
        b.submit(ids, use_prefix=False)
    while b.step():
        pass
    b.close()
    return [out[k][0] for k in sorted(out)], [int(np.argmax(out[k][1])) for k in sorted(out)]


def main(argv=None):
    from bench_vs_llamacpp import QUESTIONS
    from hetserve.engines.manifest import load_tokenizer
    from hetserve.engines.runtime import Engine
    from hetserve.stages.prefill_batch import BatchConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", default=os.environ.get("HETSERVE_ENGINE_DIR", str(REPO / ".hetserve" / "engines")))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.engine_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
               for i in range(a.prompts)]
    engine = Engine(a.engine_dir, "prefill_fp32")
    engine.warmup()
    cfg = BatchConfig.from_env()
    res = {"one-at-a-time": [], "batched": []}
    for rnd in range(a.rounds):
        for name in (["one-at-a-time", "batched"] if rnd % 2 == 0 else ["batched", "one-at-a-time"]):
            done, first = sequential(engine, prompts) if name == "one-at-a-time" else batched(engine, cfg, prompts)
            res[name].append((np.percentile(done, 50), np.percentile(done, 99), max(done), first))
    assert res["batched"][0][3] == res["one-at-a-time"][0][3], "first tokens differ"
    print(f"{a.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {a.rounds} rounds, {cfg}, "
          f"cpus {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.2f}")
    med = {n: [float(np.median([r[i] for r in rs])) * 1e3 for i in range(3)] for n, rs in res.items()}
    print("| prefill | ready p50 ms | ready p99 ms | all done ms |\n| --- | ---: | ---: | ---: |")
    for n, (p50, p99, tot) in med.items():
        print(f"| {n} | {p50:.0f} | {p99:.0f} | {tot:.0f} |")
    o, b = med["one-at-a-time"], med["batched"]
    print(f"batched / one-at-a-time: p50 {b[0] / o[0]:.2f}x, p99 {b[1] / o[1]:.2f}x, total {b[2] / o[2]:.2f}x; "
          f"first tokens equal")


if __name__ == "__main__":
    main()
