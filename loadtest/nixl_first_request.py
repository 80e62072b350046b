#!/usr/bin/env python3
"""What the first nixl requests wait for, with and without HETSERVE_KV_PREPARE (README, "KV transports").
Not a CI test.

    python loadtest/nixl_first_request.py --engine-dir .hetserve/engines

First the cost of one NIXL agent in a fresh process (import + UCX backend), then, per setting, a fresh local
cluster (one prefill server, --decode-servers decode servers, the grpc default transport), --settle-s seconds
after it is ready, two rounds of --streams concurrent greedy streams over nixl: TTFT of each stream. Settings run
one after the other on the same ports.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))

AGENT_START = ("import time; t = time.perf_counter(); from hetserve.kv.transport.nixl_pull import _make_agent; "
               "_make_agent('probe'); print(f'{time.perf_counter() - t:.2f}')")


def _ttfts(url: str, ids, n: int) -> list:
    from hetserve.client import stream

    def one(_):
        t0 = time.perf_counter()
        for _chunk in stream(url, None, input_ids=ids, max_tokens=8, ignore_eos=True, timeout_s=120,
                             transport="nixl"):
            return round(time.perf_counter() - t0, 2)

    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        return sorted(ex.map(one, range(n)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", default=os.environ.get("HETSERVE_ENGINE_DIR", str(REPO / ".hetserve" / "engines")))
    ap.add_argument("--base-port", type=int, default=26500)
    ap.add_argument("--decode-servers", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--settings", default="default,nixl", help="HETSERVE_KV_PREPARE values to compare")
    a = ap.parse_args()
    from hetserve.cluster import LocalCluster

    env = {**os.environ, "PYTHONPATH": str(REPO / "python_backends")}
    took = subprocess.run([sys.executable, "-c", AGENT_START], capture_output=True, text=True, env=env, timeout=120)
    print(f"one NIXL agent in a fresh process: {took.stdout.strip().splitlines()[-1]} s")
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2] * 4
    for setting in a.settings.split(","):
        c = LocalCluster(a.engine_dir, base_port=a.base_port, n_decode=a.decode_servers,
                         env={"HETSERVE_KV_PREPARE": setting, "HETSERVE_HEALTH_INTERVAL_S": "1",
                              "HETSERVE_SNAPSHOT_DIR": tempfile.mkdtemp()})
        c.start()
        try:
            time.sleep(a.settle_s)
            first = _ttfts(c.prefill_grpc, ids, a.streams)
            second = _ttfts(c.prefill_grpc, ids, a.streams)
        finally:
            c.stop()
        print(f"HETSERVE_KV_PREPARE={setting}: TTFT of {a.streams} concurrent nixl streams, first round {first} s, "
              f"second round {second} s")


if __name__ == "__main__":
    main()
