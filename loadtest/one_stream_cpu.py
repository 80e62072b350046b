#!/usr/bin/env python3
"""One stream through a fresh local topology (native INT8 prefill + decode, fp16 KV over shm): the client's TPOT
per request and the decode server's CPU per output token by process and thread name (/proc), i.e. where a
one-stream token's time goes on the decode core. The probe behind loadtest/README.md "native INT8 engine".

    python loadtest/one_stream_cpu.py                      # 6 requests x 128 tokens
    python loadtest/one_stream_cpu.py --env HETSERVE_DECODE_ENGINES=decode_int8
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def thread_cpu(pgid: int) -> collections.Counter:
    """{"<pid> <process> / <thread name>": CPU seconds} over the process group's processes and their threads."""
    from hetserve.server import cpu_seconds_by_pid

    tck = os.sysconf("SC_CLK_TCK")
    out: collections.Counter = collections.Counter()
    for pid in cpu_seconds_by_pid(pgid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:  # gone meanwhile
            continue
        model = next((Path(c).parts[-3] for c in cmd if c.endswith("/model.py")), None)
        proc = f"{model} stub" if model else Path(cmd[0]).name
        for t in tasks:
            try:
                fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
                name = (t / "comm").read_text().strip()
            except OSError:
                continue
            out[f"{pid} {proc} / {name}"] += (int(fields[11]) + int(fields[12])) / tck  # utime + stime
    return out


def main(argv=None) -> None:
    import bench_vs_llamacpp as bench

    from hetserve.client import stream
    from hetserve.engines.manifest import load_tokenizer
    from hetserve.topology import Topology

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=str(REPO / ".hetserve" / "engines"))
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--base-port", type=int, default=47200)
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra server environment")
    a = ap.parse_args(argv)
    tok = load_tokenizer(a.engine_dir)
    ids = bench.prompt_ids(tok)
    env = bench.server_env("prefill_int8_native", "decode_int8_native", a.env)
    opts = {"decode_precision": "int8", "kv_dtype": "fp16", "transport": "shm"}

    def one(i: int, n: int) -> list:
        return [c.t for c in stream(topo.prefill_grpc, None, model="llm", input_ids=ids[i], max_tokens=n,
                                    ignore_eos=True, temperature=0.0, timeout_s=120, **opts) if c.token_ids]

    with Topology(a.engine_dir, base_port=a.base_port, env=env) as topo:
        decode = next(p for p in topo.processes() if p.spec.role == "decode")
        for i in range(2):  # warm-up
            one(i, 8)
        c0, tpot = thread_cpu(decode.proc.pid), []
        for r in range(a.requests):
            ts = one(10 + r, a.tokens)
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1) * 1e3)
        c1 = thread_cpu(decode.proc.pid)
    n = a.requests * a.tokens
    print(f"TPOT ms per request: {', '.join(f'{x:.2f}' for x in tpot)}; median {statistics.median(tpot):.2f}")
    print(f"decode server CPU per output token ({a.requests} x {a.tokens} tokens):")
    per = {k: (c1[k] - c0.get(k, 0.0)) * 1e3 / n for k in c1}
    for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
        if v >= 0.005:
            print(f"  {v:7.3f} ms  {k}")
    print(f"  {sum(per.values()):7.3f} ms  total")


if __name__ == "__main__":
    main()
