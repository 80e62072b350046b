#!/usr/bin/env python3
"""The serving plane's floor (issue 27): what one Triton Python-backend request costs on this box when the model
does nothing, measured like loadtest/stack_cpu.py (CPU of the tritonserver and its stubs from /proc, closed-loop
clients, no think time), so the stack's figure can be read as hops x this floor + our own work.

One tritonserver (the same binary, Python backend and settings as `hetserve up`, unpinned), a temporary model
repository of three models that do no work:
  echo        non-decoupled; returns text_input as text_output
  echo_dec    decoupled; one response with the FINAL flag through its response sender (as `llm` answers a
              stream=false request)
  bls_echo    decoupled; calls `echo` over BLS, then answers as echo_dec (the `llm` -> `prefill` hop)
Per model: N closed-loop clients POST /v2/models/<model>/generate {"text_input": ...} for --duration s after
--warmup s; printed: req/s and CPU ms per request of the tritonserver and of each stub, --rounds times, models
alternating, then the median per model.

    python3 loadtest/hop_floor.py                    # 32 clients, 15 s windows, 2 rounds
    python3 loadtest/hop_floor.py --clients 32 --rounds 3 --json /tmp/floor.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python_backends"))

import stack_cpu  # noqa: E402  (its /proc readers and closed-loop client)

MODELS = ("echo", "echo_dec", "bls_echo")

_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
{decoupled}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

_MODEL = {
    "echo": '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("text_output",
                pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy())]) for r in requests]
''',
    "echo_dec": '''import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output",
                pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy())]), flags=FINAL)
        return None
''',
    "bls_echo": '''import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            got = pb_utils.InferenceRequest(model_name="echo", requested_output_names=["text_output"],
                                            inputs=[pb_utils.get_input_tensor_by_name(r, "text_input")]).exec()
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(
                got, "text_output")]), flags=FINAL)
        return None
''',
}


def write_repository(root: Path) -> None:
    for name in MODELS:
        d = root / name / "1"
        d.mkdir(parents=True)
        (d / "model.py").write_text(_MODEL[name])
        dec = "model_transaction_policy { decoupled: true }" if name != "echo" else ""
        (root / name / "config.pbtxt").write_text(_CONFIG.format(name=name, decoupled=dec))


def stub_roles(server_pid: int) -> Dict[int, str]:
    """pid -> role: the tritonserver, and each stub by the model it serves (its command line names it)."""
    roles = {server_pid: "tritonserver"}
    for pid in stack_cpu.descendants(server_pid):
        cmd = " ".join(stack_cpu._cmdline(pid))
        roles[pid] = next((f"{m} stub" for m in MODELS if f"/{m}/1/model.py" in cmd), "other")
    return roles


def measure(a, server_pid: int, model: str) -> dict:
    """One closed-loop window on `model`: req/s and CPU ms per request by role."""
    path = stack_cpu.Path_(model, f"http://127.0.0.1:{a.port}/v2/models/{model}/generate",
                           lambda c, n: {"text_input": f"hello from client {c}, request {n}"}, lambda r: None)
    roles = stub_roles(server_pid)
    snap: Dict[str, Dict[int, float]] = {}

    def cpu_now() -> Dict[int, float]:
        return {pid: stack_cpu.cpu_s(pid) or 0.0 for pid in roles}

    r = asyncio.run(stack_cpu.closed_loop(path, a.clients, a.warmup, a.duration, 60.0,
                                          lambda: snap.__setitem__("a", cpu_now()),
                                          lambda: snap.__setitem__("b", cpu_now())))
    n = r["ok"]
    by_role: Dict[str, float] = {}
    for pid, role in roles.items():
        by_role[role] = by_role.get(role, 0.0) + snap["b"].get(pid, 0.0) - snap["a"].get(pid, 0.0)
    ms = {role: 1e3 * s / max(n, 1) for role, s in by_role.items() if s > 0}
    return {"model": model, "req_s": n / r["window_s"], "errors": r["errors"], "total_ms": sum(ms.values()),
            "ms": ms}


def main(argv=None) -> int:
    from hetserve.server import prepare_backend_dir, stub_environment, tritonserver_binary

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=47900, help="HTTP port (gRPC +1, metrics +2)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="hop_floor-"))
    write_repository(work / "repo")
    log = open(work / "tritonserver.log", "w")
    cmd = [tritonserver_binary(), f"--model-repository={work / 'repo'}", "--model-control-mode=explicit",
           f"--backend-directory={prepare_backend_dir()}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
           "--metrics-address=127.0.0.1", f"--http-port={a.port}", f"--grpc-port={a.port + 1}",
           f"--metrics-port={a.port + 2}", "--log-verbose=0",
           "--backend-config=python,shm-default-byte-size=16777216",
           "--backend-config=python,shm-growth-byte-size=16777216",
           f"--backend-config=python,shm-region-prefix-name=hopfloor{os.getpid()}_"] + \
        [f"--load-model={m}" for m in MODELS]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=stub_environment())
    results: List[dict] = []
    try:
        import urllib.request

        deadline = time.time() + 120
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{a.port}/v2/health/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"tritonserver did not become ready (log {work / 'tritonserver.log'})")
            time.sleep(0.5)
        for rnd in range(1, a.rounds + 1):
            for m in MODELS:
                row = {"round": rnd, **measure(a, proc.pid, m)}
                results.append(row)
                print(f"round {rnd} {m:9s} {row['req_s']:7.1f} req/s  CPU {row['total_ms']:.3f} ms/request  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in sorted(row["ms"].items(), key=lambda kv: -kv[1]))
                      + (f"  errors {row['errors']}" if row["errors"] else ""), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    print("\nmedian over rounds (CPU ms per request, tritonserver + stubs):")
    for m in MODELS:
        rows = [r for r in results if r["model"] == m]
        print(f"  {m:9s} {statistics.median(r['total_ms'] for r in rows):.3f} ms   "
              f"{statistics.median(r['req_s'] for r in rows):.0f} req/s")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
