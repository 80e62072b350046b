#!/usr/bin/env python3
"""Waves of N distinct prompts sent at once to a fresh local topology: every request's TTFT (sorted) and the CPU
seconds each server process used per wave. The probe behind loadtest/README.md "Prefill (prefill server)": the
last first token of a wave is what bounds TTFT p99 in the closed-loop benchmark.

    python loadtest/prefill_wave.py                                   # native INT8 prefill + decode
    python loadtest/prefill_wave.py --env HETSERVE_PREFIX_BLOCK_TOKENS=16 --env HETSERVE_PREFILL_SEND_THREADS=0

Waves alternate max_tokens 1 (prefill only) and 64 (decode streams relayed while later prompts prefill); every
wave uses prompts not sent before (bench_vs_llamacpp's 512), so the prefix cache shares only the chat template.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def server_cpu(topo) -> dict:
    """{process label: CPU seconds} of the topology's tritonservers and their Python backend stubs."""
    from hetserve.server import cpu_seconds_by_pid

    out = {}
    for server in topo.processes():
        for pid, sec in cpu_seconds_by_pid(server.proc.pid).items():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:  # gone meanwhile
                continue
            model = next((Path(c).parts[-3] for c in cmd if c.endswith("/model.py")), None)
            out[f"{model or server.spec.role + ' tritonserver'}:{pid}"] = sec
    return out


def main(argv=None) -> None:
    import bench_vs_llamacpp as bench

    from hetserve.client import stream
    from hetserve.engines.manifest import load_tokenizer
    from hetserve.topology import Topology

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=str(REPO / ".hetserve" / "engines"))
    ap.add_argument("--prefill-engine", default="prefill_int8_native")
    ap.add_argument("--decode-engine", default="decode_int8_native")
    ap.add_argument("--n", type=int, default=16, help="prompts per wave")
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--base-port", type=int, default=47000)
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra server environment")
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.engine_dir)
    ids = bench.prompt_ids(tok)
    env = bench.server_env(a.prefill_engine, a.decode_engine, a.env, HETSERVE_MAX_BATCH="16")
    opts = {"decode_precision": "int8", "kv_dtype": "fp16", "transport": "shm"}
    nxt = [len(ids) - 2]

    def one(url, i, out, max_tokens):
        t0 = time.perf_counter()
        for c in stream(url, None, model="llm", input_ids=ids[i % len(ids)], max_tokens=max_tokens,
                        ignore_eos=True, temperature=0.0, timeout_s=300, **opts):
            if c.token_ids:
                out[i] = c.t - t0
                break

    with Topology(a.engine_dir, base_port=a.base_port, env=env) as topo:
        for i in range(2):  # warm-up
            one(topo.prefill_grpc, nxt[0] + i, {}, 4)
        for w in range(a.waves):
            max_tokens = 1 if w % 2 == 0 else 64
            first, out = w * a.n, {}
            c0 = server_cpu(topo)
            th = [threading.Thread(target=one, args=(topo.prefill_grpc, first + i, out, max_tokens))
                  for i in range(a.n)]
            t = time.perf_counter()
            for x in th:
                x.start()
            for x in th:
                x.join()
            wall = time.perf_counter() - t
            c1 = server_cpu(topo)
            ttft = " ".join(f"{v * 1e3:.0f}" for v in sorted(out.values()))
            print(f"wave {w} ({a.n} prompts, max_tokens {max_tokens}): TTFT ms {ttft} | wall {wall:.2f} s", flush=True)
            print("    CPU s: " + ", ".join(f"{k.split(':')[0]} {c1[k] - c0[k]:.2f}" for k in sorted(c1)
                                        if k in c0 and c1[k] - c0[k] > 0.02), flush=True)
            time.sleep(1)


if __name__ == "__main__":
    main()
