#!/usr/bin/env python3
"""The native INT8 engine's design choices, measured side by side in one process (loadtest/README.md, "native
INT8 engine"). Not a CI test. Pin it to one core for figures comparable to the servers:

    taskset -c 1 python loadtest/native_ab.py --rounds 5

  blocks   NATIVE_BLOCKS variants packed from the checkpoint into a temp dir -- all 32 (llama.cpp Q8_0's scheme),
           16 for qkv/down/lm_head, all 16 (the shipped one) -- each: held-out teacher-forced mean KLD and same
           top-1 vs the FP32 engine (engines/quality.py convention, fp16 KV cache as decode serves), and the
           decode step at batch 1 and 16 (medians of interleaved rounds)
  kvcache  the decode batch's KV held in fp32 vs fp16: the attention section of a batch-16 step (contexts 64, 192)
  prefill  ms per prompt token of a budgeted batched prefill (PrefillBatcher, default BatchConfig) of the same
           prompts: prefill_int8_native (ragged) vs prefill_fp32 (ONNX Runtime, padded)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {"all 32 (Q8_0)": dict(qkv=32, o=32, gate_up=32, down=32, lm_head=32),
            "16 for qkv/down/lm_head": dict(qkv=16, o=32, gate_up=32, down=16, lm_head=16),
            "all 16 (shipped)": dict(qkv=16, o=16, gate_up=16, down=16, lm_head=16)}


class _Facade:
    """Engine.forward / empty_past over a NativeModel (engines/quality.teacher_forced needs only these)."""

    def __init__(self, model, cfg):
        self.native, self.config = model, cfg

    def forward(self, *a):
        from hetserve.engines import native

        return native.forward(self.native, *a)

    def empty_past(self, batch):
        c = self.config
        return np.zeros((batch, c.num_layers, c.num_kv_heads, 0, c.head_dim), np.float32)


def step_ms(model, batch: int, ctx: int, dtype, steps: int = 12, section: str = "") -> float:
    """Median ms of a decode step of `batch` rows at context `ctx` (or of one profile section of it)."""
    L, H, D = model.kv_shape
    rng = np.random.default_rng(0)
    kv = [(rng.standard_normal((L, H, ctx + steps + 1, D)).astype(dtype) * 0.5,
           rng.standard_normal((L, H, ctx + steps + 1, D)).astype(dtype) * 0.5) for _ in range(batch)]
    model.run_sequences([([5], ctx, k, v) for k, v in kv])  # first-call allocations outside the timing
    model.profile()
    ts = []
    for s in range(steps):
        t = time.perf_counter()
        model.run_sequences([([5], ctx + 1 + s, k, v) for k, v in kv])
        ts.append(time.perf_counter() - t)
    if section:
        return model.profile()[section] / steps * 1e3
    return statistics.median(ts) * 1e3


def prefill_ms_per_token(engine, prompts) -> float:
    from hetserve.stages.prefill_batch import BatchConfig, PrefillBatcher

    done = []
    b = PrefillBatcher(engine, BatchConfig(), done.append, lambda j, e: sys.exit(f"prefill failed: {e}"),
                       start=False)
    for p in prompts:
        b.submit(p, use_prefix=False)
    t = time.perf_counter()
    while len(done) < len(prompts):
        b.step()
    dt = time.perf_counter() - t
    b.close()
    return dt * 1e3 / sum(map(len, prompts))


def main(argv=None) -> None:
    import bench_vs_llamacpp as bench

    from hetserve.engines import native, quality
    from hetserve.engines.builder import default_engine_dir
    from hetserve.engines.manifest import load_tokenizer
    from hetserve.engines.manifest import read_manifest
    from hetserve.engines.runtime import Engine
    from hetserve.model.checkpoint import LlamaConfig, load_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="blocks,kvcache,prefill")
    a = ap.parse_args(argv)
    d = a.engine_dir or default_engine_dir()
    man = read_manifest(Path(d))
    cfg = LlamaConfig.from_dict(man["config"])
    parts = set(a.parts.split(","))
    rounds = range(a.rounds)

    if "blocks" in parts:
        ckpt = load_checkpoint(man["source"])
        ids = quality.token_matrix(load_tokenizer(d))
        ref = quality.teacher_forced(Engine(d, quality.REFERENCE, threads=1), ids)
        with tempfile.TemporaryDirectory(prefix="hetserve-native-ab-") as tmp:
            models = {}
            for i, (label, blocks) in enumerate(VARIANTS.items()):
                info = native.build_native_int8(ckpt, Path(tmp), blocks, name=f"v{i}")
                models[label] = native.NativeModel(Path(tmp), info, cfg)
            qual = {n: quality.compare(ref, quality.teacher_forced(_Facade(m, cfg), ids), "eval")
                    for n, m in models.items()}
            times = {(n, b): [] for n in models for b in (1, 16)}
            for r in rounds:
                for n in (list(models) if r % 2 == 0 else list(models)[::-1]):
                    for b in (1, 16):
                        times[(n, b)].append(step_ms(models[n], b, 64, np.float16))
            print(f"\nblocks (held-out texts, {qual[next(iter(qual))].tokens} tokens; step: context 64, fp16 KV, "
                  f"medians of {a.rounds} interleaved rounds)")
            print("| blocks | mean KLD | same top-1 | step ms, batch 1 | step ms, batch 16 |")
            print("| --- | ---: | ---: | ---: | ---: |")
            for n, q in qual.items():
                print(f"| {n} | {q.mean_kld:.5f} | {q.same_top_pct:.1f}% | "
                      f"{statistics.median(times[(n, 1)]):.2f} | {statistics.median(times[(n, 16)]):.2f} |")
            for m in models.values():
                m.close()

    if "kvcache" in parts:
        m = native.NativeModel(Path(d), man["engines"]["decode_int8_native"], cfg)
        att = {(dt, ctx): [] for dt in ("fp32", "fp16") for ctx in (64, 192)}
        for r in rounds:
            for dt in (("fp32", "fp16") if r % 2 == 0 else ("fp16", "fp32")):
                for ctx in (64, 192):
                    att[(dt, ctx)].append(step_ms(m, 16, ctx, np.float32 if dt == "fp32" else np.float16,
                                                  section="attention"))
        print(f"\nkvcache: attention ms of a batch-16 step (medians of {a.rounds} interleaved rounds)")
        print("| KV cache | context 64 | context 192 |\n| --- | ---: | ---: |")
        for dt in ("fp32", "fp16"):
            print(f"| {dt} | {statistics.median(att[(dt, 64)]):.2f} | {statistics.median(att[(dt, 192)]):.2f} |")
        m.close()

    if "prefill" in parts:
        tok = load_tokenizer(d)
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in bench.QUESTIONS]
        engines = {n: Engine(d, n, threads=1) for n in ("prefill_int8_native", "prefill_fp32")}
        ms = {n: [] for n in engines}
        for r in rounds:
            batch = prompts[(r * 16) % 48:(r * 16) % 48 + 16]  # 16 prompts (~600 tokens) a round, as one wave
            for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                ms[n].append(prefill_ms_per_token(engines[n], batch))
        print(f"\nprefill: ms per prompt token, 16 prompts through PrefillBatcher (medians of {a.rounds} rounds)")
        print("| engine | ms / token |\n| --- | ---: |")
        for n, v in ms.items():
            print(f"| {n} | {statistics.median(v):.3f} |")


if __name__ == "__main__":
    main()
