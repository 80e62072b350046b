"""NVIDIA aiperf, the same command line, against hetserve's OpenAI endpoint and llama.cpp's OpenAI server.

Starts both at equal precision (hetserve: `hetserve up` = prefill + decode Triton servers + the OpenAI frontend,
decoding with the INT8 engine; llama.cpp: llama_cpp.server through `python -m hetserve.engines.llamacpp_compat`
(no AMX repacking, which segfaults on Q8_0 here) with --n_threads 2 on a Q8_0 GGUF made from the shipped one by
llama.cpp's own quantizer, loadtest/llamacpp_peer.make_q8_0), then runs `aiperf profile` against each,
alternating, `--rounds` times, and prints a markdown table of per-system medians over the rounds plus the
hetserve / llama.cpp ratio. Not part of CI (needs aiperf in its own venv, see loadtest/README.md).

    python3 -m venv .hetserve/aiperf-venv && .hetserve/aiperf-venv/bin/pip install aiperf
    python3 loadtest/aiperf_vs_llamacpp.py --rounds 2 --concurrency 4 --requests 16
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the name hetserve serves the default GGUF under
METRICS = [("request_throughput", "req/s"), ("output_token_throughput", "out tok/s"),
           ("time_to_first_token", "TTFT p50 ms", "p50"), ("time_to_first_token", "TTFT p99 ms", "p99"),
           ("inter_token_latency", "ITL p50 ms", "p50"), ("request_latency", "latency p50 ms", "p50")]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")


def tokenizer_dir(engine_dir: Path, out: Path) -> Path:
    """aiperf counts tokens with a HF tokenizer: give it ours (tokenizer.json) so nothing is downloaded."""
    d = out / "tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(engine_dir / "tokenizer.json", d / "tokenizer.json")
    return d


def aiperf_cmd(a, url: str, tok: Path, art: Path) -> list:
    return [a.aiperf, "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tok), "--concurrency", str(a.concurrency), "--request-count", str(a.requests),
            "--warmup-request-count", str(a.warmup), "--prompt-input-tokens-mean", str(a.isl),
            "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(a.osl),
            "--prompt-output-tokens-stddev", "0",
            # exactly OSL tokens from both: aiperf sends max_completion_tokens, which llama_cpp.server ignores (it ran
            # to 570 tokens), and it knows min_tokens, not ignore_eos
            "--extra-inputs", f"max_tokens:{a.osl}", "--extra-inputs", f"min_tokens:{a.osl}",
            "--extra-inputs", "ignore_eos:true", "--random-seed", "1",
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--output-artifact-dir", str(art)]


def read_metrics(art: Path) -> dict:
    f = next(art.rglob("profile_export_aiperf.json"))
    data = json.loads(f.read_text())
    recs = data.get("records", data)
    out = {}
    for m in METRICS:
        name, label = m[0], m[1]
        stat = m[2] if len(m) > 2 else "avg"
        rec = recs.get(name) if isinstance(recs, dict) else None
        if rec is not None:
            out[label] = rec.get(stat)
    out["errors"] = (recs.get("error_request_count") or {}).get("avg", 0) if isinstance(recs, dict) else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default=str(ROOT / ".hetserve" / "aiperf-venv" / "bin" / "aiperf"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--base-port", type=int, default=46000)
    ap.add_argument("--llama-port", type=int, default=46900)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (hetserve: one core per server)")
    ap.add_argument("--out", default=str(ROOT / ".hetserve" / "bench" / "aiperf"))
    ap.add_argument("--precision", choices=["int8", "fp32"], default="int8",
                    help="int8: hetserve INT8 decode vs llama.cpp Q8_0 (equal precision); fp32: FP32 decode vs the "
                         "shipped GGUF")
    ap.add_argument("--breaker-p99-ms", type=int, default=60000, help="hetserve's breaker threshold for the run")
    a = ap.parse_args(argv)

    from hetserve.engines.builder import default_engine_dir
    from hetserve.model import default_checkpoint_path

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(Path(default_engine_dir()), out)
    # a local tokenizer dir needs no hub (aiperf 0.13 mis-handles local paths under HF_HUB_OFFLINE=1)
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    logs = {n: open(out / f"{n}.log", "wb") for n in ("hetserve", "llama.cpp")}
    gguf = str(default_checkpoint_path())
    if a.precision == "int8":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from llamacpp_peer import make_q8_0

        gguf = make_q8_0(gguf, str(out))
    print(f"hetserve decode {a.precision}; llama.cpp GGUF {gguf}", file=sys.stderr)
    hs = subprocess.Popen([sys.executable, "-m", "hetserve", "up", "--base-port", str(a.base_port), "--prompt", ""],
                          # the latency breaker (default: open at p99 TTFT > 500 ms) would shed part of a closed-loop
                          # run on this 2-core box as 503s; the benchmark measures serving, llama.cpp queues instead
                          env={**os.environ, "HETSERVE_DECODE_PRECISION": a.precision,
                               "HETSERVE_BREAKER_P99_MS": str(a.breaker_p99_ms)},
                          stdout=logs["hetserve"], stderr=subprocess.STDOUT, start_new_session=True)
    ll = subprocess.Popen([sys.executable, "-m", "hetserve.engines.llamacpp_compat", "--model", gguf,
                           "--host", "127.0.0.1", "--port", str(a.llama_port), "--n_threads", str(a.threads),
                           "--n_threads_batch", str(a.threads), "--n_ctx", "2048", "--model_alias", MODEL,
                           "--interrupt_requests", "False"],  # default True: a new request aborts the running one
                          stdout=logs["llama.cpp"], stderr=subprocess.STDOUT, start_new_session=True)
    urls = {"hetserve": f"http://127.0.0.1:{a.base_port + 80}", "llama.cpp": f"http://127.0.0.1:{a.llama_port}"}
    results = {n: [] for n in urls}
    try:
        wait_http(urls["hetserve"] + "/health", 600, hs)
        wait_http(urls["llama.cpp"] + "/v1/models", 300, ll)
        for r in range(a.rounds):
            for name in (list(urls) if r % 2 == 0 else list(reversed(urls))):  # alternate who goes first
                art = out / f"{name}-round{r}"
                shutil.rmtree(art, ignore_errors=True)
                cmd = aiperf_cmd(a, urls[name], tok, art)
                print("$ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                (out / f"{name}-round{r}.log").write_text(p.stdout + p.stderr)
                if p.returncode != 0:
                    raise RuntimeError(f"aiperf against {name} failed ({p.returncode}):\n{p.stderr[-3000:]}")
                results[name].append(read_metrics(art))
                print(f"round {r} {name}: {results[name][-1]}", file=sys.stderr)
    finally:
        for p in (hs, ll):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in (hs, ll):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    labels = [m[1] for m in METRICS]
    med = {n: {k: statistics.median([x[k] for x in rs if x.get(k) is not None] or [float("nan")])
               for k in labels + ["errors"]} for n, rs in results.items()}
    print(f"\nprecision {a.precision}; {a.rounds} rounds, concurrency {a.concurrency}, {a.requests} requests/round, ISL {a.isl}, OSL {a.osl}"
          " (medians over rounds)\n")
    print("| system | " + " | ".join(labels) + " | errors |")
    print("|---" * (len(labels) + 2) + "|")
    for n in urls:
        print(f"| {n} | " + " | ".join(f"{med[n][k]:.2f}" for k in labels) + f" | {med[n]['errors']:.0f} |")
    print("| hetserve / llama.cpp | " + " | ".join(
        f"{med['hetserve'][k] / med['llama.cpp'][k]:.2f}x" if med["llama.cpp"][k] else "-" for k in labels) + " | |")
    (out / "summary.json").write_text(json.dumps({"args": vars(a), "rounds": results, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
