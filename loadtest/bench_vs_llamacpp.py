#!/usr/bin/env python3
"""hetserve vs llama.cpp, side by side in one run. Not a CI test (needs `pip install llama-cpp-python`).

Systems: `hetserve` (our prefill + decode Triton servers), `llama.cpp` (the llama-cpp-python HTTP server,
`python -m llama_cpp.server`, the shipped GGUF, `--n_threads 2 --n_threads_batch 2`) and `llama.cpp-batched`
(llama.cpp's own multi-sequence batching driven through the llama-cpp-python C API in a separate process:
what `llama-server -np N` would do, minus HTTP; loadtest/llamacpp_peer.py). llama-cpp-python's server has no
`--n_parallel`: one lock around the model serves concurrent streams one after another
(`--interrupt_requests False` makes them queue instead of cancelling each other).

Equal precision: hetserve runs INT8 weights and activations (blocks of 16), so by default llama.cpp-batched gets a Q8_0
GGUF that this script makes itself from the shipped GGUF with llama.cpp's own quantizer
(`llama_model_quantize`, ftype 7 = MOSTLY_Q8_0, allow_requantize), cached in the output folder
(`--batched-gguf shipped` or a path to use another file). The HTTP server keeps the shipped GGUF.

All get the same chat-templated prompts (token ids for hetserve and the batched engine, the same text for the
HTTP server, which tokenizes it to the same ids), the same fixed output length (hetserve `ignore_eos`,
llama.cpp `min_tokens` = `max_tokens`), greedy decoding, streaming.

Closed loop (`--mode closed`): for each concurrency level (default 1, 4, 16 streams) every stream sends
`--requests-per-stream` requests back to back; per level: aggregate output tok/s (all output tokens / wall
time of the level), TTFT p50/p99, TPOT p50.
Open loop (`--mode open`): Poisson arrivals at each rate of `--rates` (requests/s), `--open-requests` per
rate, the same arrival times for every system in a round; TTFT counts from the scheduled arrival. Per rate:
TTFT p50/p99, TPOT p50/p99, aggregate tok/s and **goodput** = requests/s (over the run's wall time) that met
TTFT <= `--slo-ttft-ms` (500) and TPOT <= `--slo-tpot-ms` (100), the DistServe/aiperf convention; plus SLO
attainment and the highest rate with >= 90% attainment.
Systems alternate per point (`--rounds` repeats; per-round medians are reported), so background load hits
them alike, and before each point the box-quiet gate waits (up to `--quiet-wait-s`) until other work keeps
less than `--quiet-below` of the CPUs busy; the load seen is recorded.

    python loadtest/bench_vs_llamacpp.py                       # starts all servers (ports 48000.. / 48500)
    python loadtest/bench_vs_llamacpp.py --ours 127.0.0.1:8001 --llama http://127.0.0.1:8080
    python loadtest/bench_vs_llamacpp.py --mode open --rates 1,2,4,8 --open-requests 48 --rounds 3

hetserve: prefill server and decode server pinned to one core each (the local Topology), the native INT8 engine
for prefill and decode (`--prefill-engine` / `--decode-engine` for others), fp16 KV over shm,
HETSERVE_MAX_BATCH=16, prefix cache on, batched prefill (loadtest/README.md has the config sweep).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp_peer import BatchedProc, make_q8_0  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three prime numbers.", "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Give me a tip for learning Python.", "Who wrote Romeo and Juliet?", "Describe a cat in one sentence.",
    "Why is the sky blue?", "How do airplanes stay in the air?", "Name a famous painting and its painter.",
    "What causes the seasons on Earth?", "Suggest a name for a bakery.", "How many legs does a spider have?",
    "What is the boiling point of water in Fahrenheit?",
    # 48 more, so that no request of a run repeats a prompt (32 closed-loop requests at 16 streams, 64 per open
    # rate): a repeated prompt would be a full prefix-cache hit for hetserve and measure the cache, not prefill
    "What is the largest planet in our solar system?", "Write a short poem about autumn leaves.",
    "Explain how a rainbow forms.", "Name three kinds of clouds.", "Translate 'thank you' into French.",
    "What is 15 plus 27?", "Give me a tip for sleeping better.", "Who painted the Mona Lisa?",
    "Describe a dog in one sentence.", "Why do leaves change color?", "How does a refrigerator keep food cold?",
    "Name a famous composer and one of his works.", "What causes thunder?", "Suggest a name for a coffee shop.",
    "How many days are in a leap year?", "What is the freezing point of water in Celsius?",
    "What is the smallest prime number?", "Write a limerick about a frog.", "Explain gravity to a child.",
    "List three primary colors.", "Translate 'good night' into German.", "What is 9 times 8?",
    "Give me a tip for saving money.", "Who discovered penicillin?", "Describe the ocean in one sentence.",
    "Why is the ocean salty?", "How do bees make honey?", "Name a famous novel and its author.",
    "What causes ocean tides?", "Suggest a name for a pet turtle.", "How many continents are there?",
    "What is the speed of sound in air?", "What is the tallest mountain on Earth?",
    "Write a two-line rhyme about the moon.", "Explain what a volcano is.", "List three fruits that are red.",
    "Translate 'see you soon' into Italian.", "What is 100 divided by 4?", "Give me a tip for staying focused.",
    "Who invented the telephone?", "Describe a forest in one sentence.", "Why do we have day and night?",
    "How do fish breathe underwater?", "Name a famous scientist and a discovery.", "What causes earthquakes?",
    "Suggest a name for a book club.", "How many hours are in a week?", "What is the chemical symbol for gold?",
]
# Request k of a run gets prompt k of STYLES x QUESTIONS (512 distinct, ~37-44 tokens), and every point and round
# of the run starts where the previous one stopped (both systems of a round get the same prompts): no prompt is
# sent twice before 512 requests, so hetserve's prefix cache only ever shares the chat template's system prompt,
# as it would across real users, instead of replaying whole prompts it has seen.
STYLES = ["", "Briefly: ", "In one sentence: ", "Please answer: ", "Quick question. ", "Be concise. ",
          "Answer simply: ", "For a student: "]
LONG_SYSTEM = ("You are the customer support assistant of Northwind Travel. Be brief and polite, never invent "
               "prices or availability, and point customers to the booking page for any change to a booking. ") * 3


# ---- one request ----------------------------------------------------------------------------------
class Result(dict):
    """ttft_s, total_s, tokens, tpot_s, error"""


def prompt_ids(tok, system: Optional[str] = None) -> List[List[int]]:
    """The benchmark's 512 distinct chat-templated prompts (STYLES x QUESTIONS) as token ids."""
    return [tok.encode(tok.apply_chat_template(([{"role": "system", "content": system}] if system else [])
                                               + [{"role": "user", "content": st + q}]))
            for st in STYLES for q in QUESTIONS]


def server_env(prefill_engine: str, decode_engine: str, extra: List[str] = (), **env: str) -> Dict[str, str]:
    """A benchmark topology's server environment: the engines, INT8 decode, the circuit breaker out of the way
    (p99 TTFT > 500 ms -> refuse would shed closed-loop saturation load), then `env`, then K=V strings `extra`."""
    out = {"HETSERVE_DECODE_PRECISION": "int8", "HETSERVE_DECODE_ENGINES": decode_engine,
           "HETSERVE_PREFILL_ENGINE": prefill_engine, "HETSERVE_BREAKER_P99_MS": "600000", **env}
    out.update(kv.split("=", 1) for kv in extra)
    return out


def run_ours(url: str, ids: List[int], max_tokens: int, opts: dict) -> Result:
    from hetserve.client import stream

    t0 = time.perf_counter()
    ttft, n, t_last = None, 0, t0
    for c in stream(url, None, model="llm", input_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                    temperature=0.0, timeout_s=300, **opts):
        if c.token_ids:
            if ttft is None:
                ttft = c.t - t0
            n += len(c.token_ids)
            t_last = c.t
    return Result(ttft_s=ttft, total_s=time.perf_counter() - t0, tokens=n,
                  tpot_s=(t_last - t0 - ttft) / (n - 1) if ttft is not None and n > 1 else None)


def run_llama(url: str, text: str, max_tokens: int) -> Result:
    body = json.dumps({"prompt": text, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, n, t_last, finish = None, 0, t0, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ch = json.loads(data)["choices"][0]
            finish = ch.get("finish_reason") or finish
            if ch.get("text"):
                t = time.perf_counter()
                if ttft is None:
                    ttft = t - t0
                n += 1  # one SSE chunk per token (a multi-byte character may hold a chunk back)
                t_last = t
    tokens = max_tokens if finish == "length" else n
    return Result(ttft_s=ttft, total_s=time.perf_counter() - t0, tokens=tokens,
                  tpot_s=(t_last - t0 - ttft) / (n - 1) if ttft is not None and n > 1 else None)


# ---- one level ------------------------------------------------------------------------------------
def run_level(fn: Callable[[int], Result], streams: int, per_stream: int) -> dict:
    """`streams` concurrent clients, each sending `per_stream` requests back to back (prompt i, i+streams..)."""
    results: List[Result] = []
    lock = threading.Lock()

    def client(s: int):
        for j in range(per_stream):
            try:
                r = fn(s + j * streams)
            except Exception as e:  # count, keep going
                r = Result(ttft_s=None, total_s=0.0, tokens=0, tpot_s=None, error=str(e)[:200])
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as ex:
        list(ex.map(client, range(streams)))
    return summarize(results, time.perf_counter() - t0, streams)


def run_batched_level(lb: BatchedProc, prompts: List[List[int]], streams: int, per_stream: int,
                      max_tokens: int, base: int = 0) -> dict:
    """`streams` sequences started together, `per_stream` times (closed loop, like run_level; prompt
    base + s + j * streams)."""
    results: List[Result] = []
    t0 = time.perf_counter()
    for j in range(per_stream):
        results += [Result(r) for r in lb.run([prompts[(base + s + j * streams) % len(prompts)]
                                               for s in range(streams)], max_tokens)]
    return summarize(results, time.perf_counter() - t0, streams)


# ---- open loop ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slo:
    ttft_s: float = 0.5
    tpot_s: float = 0.1

    def met(self, r: dict) -> bool:
        return (not r.get("error") and r.get("ttft_s") is not None and r["ttft_s"] <= self.ttft_s
                and (r.get("tpot_s") is None or r["tpot_s"] <= self.tpot_s))


def poisson_schedule(rate: float, n: int, seed: int) -> List[float]:
    """n arrival offsets (s), exponential gaps of mean 1/rate, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [0.0] + list(np.cumsum(gaps[:-1]))


def run_open_level(fn: Callable[[int], Result], arrivals: List[float], max_inflight: int = 256) -> tuple:
    """Request k is sent at arrivals[k] (its own thread; at most max_inflight at once). TTFT and total time
    count from the scheduled arrival, so a late send (client lag) is charged to the system, not hidden."""
    results: List[Optional[Result]] = [None] * len(arrivals)

    def one(k: int):
        lag = time.perf_counter() - t0 - arrivals[k]
        try:
            r = fn(k)
        except Exception as e:  # count, keep going
            r = Result(ttft_s=None, total_s=0.0, tokens=0, tpot_s=None, error=str(e)[:200])
        if r.get("ttft_s") is not None:
            r["ttft_s"] += lag
        r["total_s"] += lag
        r["arrival_s"] = arrivals[k]
        results[k] = r

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_inflight) as ex:
        for k, t in enumerate(arrivals):
            time.sleep(max(0.0, t - (time.perf_counter() - t0)))
            ex.submit(one, k)
    return results, time.perf_counter() - t0


def summarize_open(results: List[dict], wall: float, rate: float, slo: Slo) -> dict:
    out = summarize([Result(r) for r in results], wall, 0)
    del out["streams"]
    ok = [r for r in results if not r.get("error") and r.get("ttft_s") is not None]
    tpot = np.array([r["tpot_s"] for r in ok if r.get("tpot_s") is not None]) * 1e3
    good = sum(slo.met(r) for r in results)
    out.update(rate=rate, good=good, goodput=round(good / wall, 3) if wall else 0.0,
               attainment=round(good / len(results), 3) if results else 0.0,
               tpot_p99_ms=round(float(np.percentile(tpot, 99)), 1) if tpot.size else None)
    return out


def summarize(results: List[Result], wall: float, streams: int) -> dict:
    ok = [r for r in results if not r.get("error") and r["ttft_s"] is not None]
    ttft = np.array([r["ttft_s"] for r in ok]) * 1e3
    tpot = np.array([r["tpot_s"] for r in ok if r["tpot_s"] is not None]) * 1e3
    toks = sum(r["tokens"] for r in ok)
    return {"streams": streams, "requests": len(results), "errors": len(results) - len(ok),
            "error_sample": next((r["error"] for r in results if r.get("error")), None),
            "output_tokens": toks, "wall_s": round(wall, 3), "tok_s": round(toks / wall, 1) if wall else 0.0,
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1) if ttft.size else None,
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1) if ttft.size else None,
            "tpot_p50_ms": round(float(np.percentile(tpot, 50)), 1) if tpot.size else None}


def merge(rounds: List[dict]) -> dict:
    """Several rounds of one level: medians of the per-round figures (robust to a round hit by a burst of
    background load), plus the pooled tok/s (all tokens / summed wall)."""
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    for k in ("requests", "errors", "output_tokens", "wall_s", "good"):
        if k in out:
            out[k] = sum(r[k] for r in rounds)
    out["tok_s_pooled"] = round(out["output_tokens"] / out["wall_s"], 1)
    for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput", "attainment"):
        if k not in out:
            continue
        vals = [r[k] for r in rounds if r.get(k) is not None]
        out[k] = round(float(np.median(vals)), 3 if k in ("goodput", "attainment") else 1) if vals else None
    out["rounds"] = rounds
    return out


# ---- servers --------------------------------------------------------------------------------------
def wait_http(url: str, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not up after {timeout:.0f}s")


def start_llama(gguf: str, port: int, threads: int, n_ctx: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hetserve.engines.llamacpp_compat", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
           "--interrupt_requests", "False"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 120)
    except Exception:
        p.kill()
        raise
    return p


def stop_proc(p: Optional[subprocess.Popen]):
    if p is not None and p.poll() is None:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def markdown(table: Dict[int, Dict[str, dict]], target: float) -> str:
    rows = ["| streams | system | agg. output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | requests (errors) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    notes = []
    for c, by in sorted(table.items()):
        for name, r in by.items():
            rows.append(f"| {c} | {name} | {r['tok_s']:.1f} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
                        f"{r['tpot_p50_ms']} | {r['requests']} ({r['errors']}) |")
        for peer in ("llama.cpp", "llama.cpp-batched"):
            if "hetserve" not in by or peer not in by or not by[peer]["tok_s"]:
                continue
            o, l = by["hetserve"], by[peer]
            ratio = o["tok_s"] / l["tok_s"]
            ttft_ok = o["ttft_p50_ms"] is not None and l["ttft_p50_ms"] is not None and \
                o["ttft_p50_ms"] <= l["ttft_p50_ms"]
            notes.append(f"- {c} streams: hetserve/{peer} aggregate tok/s = **{ratio:.2f}x**"
                         + (f" (target >= {target}x: {'met' if ratio >= target else 'NOT met'})" if c == 16 else "")
                         + f"; TTFT p50 {o['ttft_p50_ms']} vs {l['ttft_p50_ms']} ms "
                         + f"({'no worse' if ttft_ok else 'worse'})")
    return "\n".join(rows + [""] + notes)


def markdown_open(table: Dict[float, Dict[str, dict]], slo: Slo, goodput_target: float = 2.0) -> str:
    rows = [f"| rate req/s | system | goodput req/s (TTFT <= {slo.ttft_s * 1e3:.0f} ms, TPOT <= "
            f"{slo.tpot_s * 1e3:.0f} ms) | SLO attainment | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
            "agg. output tok/s | requests (errors) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    notes = []
    for rate, by in sorted(table.items()):
        for name, r in by.items():
            rows.append(f"| {rate:g} | {name} | {r['goodput']:.3f} | {r['attainment']:.0%} | {r['ttft_p50_ms']} | "
                        f"{r['ttft_p99_ms']} | {r['tpot_p50_ms']} | {r['tpot_p99_ms']} | {r['tok_s']:.1f} | "
                        f"{r['requests']} ({r['errors']}) |")
        if "hetserve" in by and "llama.cpp-batched" in by:
            o, l = by["hetserve"], by["llama.cpp-batched"]
            ratio = f"{o['goodput'] / l['goodput']:.2f}x" if l["goodput"] else ("inf" if o["goodput"] else "n/a")
            notes.append(f"- {rate:g} req/s: hetserve/llama.cpp-batched goodput = **{ratio}** "
                         f"({o['goodput']:.3f} vs {l['goodput']:.3f} req/s)")
    for name in sorted({n for by in table.values() for n in by}):
        pts = [(rate, by[name]) for rate, by in sorted(table.items()) if name in by]
        best = max(pts, key=lambda p: p[1]["goodput"])
        ok90 = [rate for rate, r in pts if r["attainment"] >= 0.9]
        notes.append(f"- {name}: max goodput {best[1]['goodput']:.3f} req/s (at {best[0]:g} req/s); highest rate "
                     f"with >= 90% SLO attainment: {max(ok90):g} req/s" if ok90 else
                     f"- {name}: max goodput {best[1]['goodput']:.3f} req/s (at {best[0]:g} req/s); no rate with "
                     ">= 90% SLO attainment")
    if all(n in {x for by in table.values() for x in by} for n in ("hetserve", "llama.cpp-batched")):
        g = {n: max(by[n]["goodput"] for by in table.values() if n in by) for n in ("hetserve", "llama.cpp-batched")}
        if g["llama.cpp-batched"]:
            r = g["hetserve"] / g["llama.cpp-batched"]
            notes.append(f"- max goodput hetserve/llama.cpp-batched = **{r:.2f}x** (target >= {goodput_target}x: "
                         f"{'met' if r >= goodput_target else 'NOT met'})")
    return "\n".join(rows + [""] + notes)


def quiet_gate(below: float, wait_s: float) -> dict:
    """The box-quiet gate (planner/measure.py's): wait until other work keeps < `below` of the CPUs busy."""
    if wait_s <= 0:
        return {}
    from hetserve.planner.measure import wait_for_quiet

    busy, waited = wait_for_quiet(below, wait_s)
    return {"cpu_busy": None if busy is None else round(busy, 3), "waited_s": round(waited, 1),
            "quiet": busy is not None and busy < below}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["closed", "open", "both"], default="both",
                    help="closed: fixed concurrency levels; open: Poisson arrivals at --rates (goodput)")
    ap.add_argument("--levels", default="1,4,16", help="closed loop: concurrent streams per level (default 1,4,16)")
    ap.add_argument("--rates", default="1,2,4,8", help="open loop: request rates (req/s) to sweep")
    ap.add_argument("--open-requests", type=int, default=32, help="open loop: requests per rate")
    ap.add_argument("--seed", type=int, default=0, help="open loop: arrival schedule seed (per round: seed+round)")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--goodput-target", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat each point (systems alternate)")
    ap.add_argument("--quiet-below", type=float, default=0.2,
                    help="box-quiet gate: CPU busy fraction (others' work) to wait for before each point")
    ap.add_argument("--quiet-wait-s", type=float, default=60.0, help="most seconds to wait per point (0: off)")
    ap.add_argument("--system-prompt", choices=["default", "long"], default="default",
                    help="default: the model's chat template system prompt; long: a shared ~100-token one")
    ap.add_argument("--systems", default="hetserve,llama.cpp,llama.cpp-batched",
                    help="any of hetserve, llama.cpp (its HTTP server), llama.cpp-batched (in-process, -np N ideal)")
    ap.add_argument("--ours", help="prefill server gRPC url of a running hetserve (else one is started)")
    ap.add_argument("--base-port", type=int, default=48000)
    ap.add_argument("--decode-precision", default="int8", choices=["int8", "fp32"])
    ap.add_argument("--decode-engine", default=None,
                    help="decode engine of a started decode server (default: decode_int8_native for int8, the "
                         "native INT8 engine; decode_int8 is the ONNX Runtime one; decode_fp32 for fp32)")
    ap.add_argument("--prefill-engine", default=None,
                    help="prefill engine of a started prefill server (default: prefill_int8_native for int8, as "
                         "llama.cpp prefills with its Q8_0 weights too; prefill_fp32 for fp32)")
    ap.add_argument("--kv-dtype", default="fp16", choices=["fp32", "fp16", "int8"])
    from hetserve.kv.transport.registry import NAMES as TRANSPORTS

    ap.add_argument("--transport", default="shm", choices=TRANSPORTS)
    ap.add_argument("--max-batch", type=int, default=16, help="HETSERVE_MAX_BATCH of a started decode server")
    ap.add_argument("--no-metrics", dest="metrics", action="store_false",
                    help="turn hetserve's custom Triton metrics off (HETSERVE_METRICS=0); on by default")
    ap.add_argument("--metrics", dest="metrics", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ours-env", action="append", default=[], metavar="K=V", help="extra env for started servers")
    ap.add_argument("--llama", help="base url of a running llama-cpp-python server (else one is started)")
    ap.add_argument("--llama-port", type=int, default=48500)
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--gguf", help="GGUF for the llama.cpp HTTP server (default: the one the engines were built from)")
    ap.add_argument("--batched-gguf", default="q8_0",
                    help="GGUF for llama.cpp-batched: q8_0 (made from --gguf with llama.cpp's quantizer; equal "
                         "precision to our INT8 decode), shipped (= --gguf), or a path")
    ap.add_argument("--engine-dir", default=os.environ.get("HETSERVE_ENGINE_DIR", str(REPO / ".hetserve" / "engines")))
    ap.add_argument("--target", type=float, default=1.5)
    ap.add_argument("--json", default=str(REPO / ".hetserve" / "bench" / "bench_vs_llamacpp.json"))
    a = ap.parse_args(argv)

    from hetserve.engines.manifest import load_tokenizer
    from hetserve.engines.manifest import read_manifest

    native = a.decode_precision == "int8"
    a.decode_engine = a.decode_engine or ("decode_int8_native" if native else f"decode_{a.decode_precision}")
    a.prefill_engine = a.prefill_engine or ("prefill_int8_native" if native else "prefill_fp32")

    levels = [int(x) for x in a.levels.split(",")] if a.mode != "open" else []
    rates = [float(x) for x in a.rates.split(",")] if a.mode != "closed" else []
    if any(r <= 0 for r in rates) or any(c < 1 for c in levels):
        ap.error("--rates must be > 0 and --levels >= 1")
    slo = Slo(a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    tok = load_tokenizer(a.engine_dir)
    system = LONG_SYSTEM if a.system_prompt == "long" else None
    ids = prompt_ids(tok, system)
    gguf = a.gguf or read_manifest(a.engine_dir)["source"]
    log_dir = Path(a.json).parent
    bgguf = {"q8_0": None, "shipped": gguf}.get(a.batched_gguf, a.batched_gguf)
    if "llama.cpp-batched" in systems and bgguf is None:
        t = time.perf_counter()
        bgguf = make_q8_0(gguf, str(log_dir))
        print(f"llama.cpp-batched GGUF: {bgguf} (Q8_0 by llama_model_quantize, {time.perf_counter() - t:.1f}s)")
    print(f"prompts: {len(ids)} chat-templated, {min(map(len, ids))}-{max(map(len, ids))} tokens; "
          f"max_tokens {a.max_tokens} (fixed length); mode {a.mode}; levels {levels}; rates {rates}; "
          f"gguf {gguf}", flush=True)

    topo = llama_proc = lb = None
    ours_opts = {"decode_precision": a.decode_precision, "kv_dtype": a.kv_dtype, "transport": a.transport}
    try:
        fns: Dict[str, Callable[[int], Result]] = {}
        if "hetserve" in systems:
            url = a.ours
            if not url:
                from hetserve.topology import Topology

                # Custom metrics on (as in production); --no-metrics measures their cost.
                env = server_env(a.prefill_engine, a.decode_engine, a.ours_env, HETSERVE_MAX_BATCH=str(a.max_batch),
                                 HETSERVE_DECODE_PRECISION=a.decode_precision,
                                 HETSERVE_METRICS="1" if a.metrics else "0")
                topo = Topology(a.engine_dir, base_port=a.base_port, env=env, log_dir=str(log_dir)).start()
                url = topo.prefill_grpc
            fns["hetserve"] = lambda i, url=url: run_ours(url, ids[i % len(ids)], a.max_tokens, ours_opts)
        if "llama.cpp-batched" in systems:
            lb = BatchedProc(bgguf, a.llama_threads, max(levels + [16]), max(map(len, ids)) + a.max_tokens + 8)
            fns["llama.cpp-batched"] = lambda i, lb=lb: Result(lb.run([ids[i % len(ids)]], a.max_tokens)[0])
        if "llama.cpp" in systems:
            lurl = a.llama
            if not lurl:
                llama_proc = start_llama(gguf, a.llama_port, a.llama_threads, 4096, log_dir / "llama.log")
                lurl = f"http://127.0.0.1:{a.llama_port}"
            fns["llama.cpp"] = lambda i, lurl=lurl: run_llama(lurl, texts[i % len(texts)], a.max_tokens)
        base = [0]  # first prompt of the next point (see STYLES)

        def take(n: int) -> int:
            b = base[0]
            base[0] += n
            return b

        for name, fn in fns.items():  # warm all (lazy init, first-request costs)
            for i in range(len(ids) - 2, len(ids)):
                fn(i)
            print(f"{name}: warm", flush=True)

        def point(label, run):
            gate = quiet_gate(a.quiet_below, a.quiet_wait_s)
            r = run()
            r["box"] = dict(gate, load_after=round(os.getloadavg()[0], 2))
            print(f"  {label:<26} {r['tok_s']:>7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms"
                  f"  TPOT p50 {r['tpot_p50_ms']} ms" + (f"  goodput {r['goodput']:.3f} req/s ({r['attainment']:.0%})"
                                                         if "goodput" in r else "")
                  + f"  errors {r['errors']}  load {os.getloadavg()[0]:.2f}", flush=True)
            return r

        table: Dict[int, Dict[str, dict]] = {}
        for c in levels:
            per: Dict[str, List[dict]] = {n: [] for n in fns}
            for rnd in range(a.rounds):
                b0 = take(c * a.requests_per_stream)
                for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                    if name == "llama.cpp-batched":
                        run = lambda: run_batched_level(lb, ids, c, a.requests_per_stream, a.max_tokens,  # noqa: E731
                                                        b0)
                    else:
                        run = lambda: run_level(lambda i: fns[name](b0 + i), c, a.requests_per_stream)  # noqa: E731
                    per[name].append(point(f"{c} streams {name}", run))
            table[c] = {n: merge(rs) for n, rs in per.items()}

        open_table: Dict[float, Dict[str, dict]] = {}
        for rate in rates:
            per = {n: [] for n in fns}
            for rnd in range(a.rounds):
                arrivals = poisson_schedule(rate, a.open_requests, a.seed + rnd)
                b0 = take(len(arrivals))
                for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                    if name == "llama.cpp-batched":
                        def run(arrivals=arrivals, b0=b0):
                            t0 = time.perf_counter()
                            res = lb.run_open([(t, ids[(b0 + k) % len(ids)]) for k, t in enumerate(arrivals)],
                                              a.max_tokens)
                            return summarize_open(res, time.perf_counter() - t0, rate, slo)
                    else:
                        def run(arrivals=arrivals, fn=fns[name], b0=b0):
                            res, wall = run_open_level(lambda k: fn(b0 + k), arrivals)
                            return summarize_open(res, wall, rate, slo)
                    per[name].append(point(f"{rate:g} req/s {name}", run))
            open_table[rate] = {n: merge(rs) for n, rs in per.items()}

        md = markdown(table, a.target) if table else ""
        md_open = markdown_open(open_table, slo, a.goodput_target) if open_table else ""
        print("\n" + md + ("\n\n" if md else "") + md_open)
        out = {"config": {"mode": a.mode, "levels": levels, "rates": rates, "open_requests": a.open_requests,
                          "seed": a.seed, "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms},
                          "max_tokens": a.max_tokens, "requests_per_stream": a.requests_per_stream,
                          "rounds": a.rounds, "system_prompt": a.system_prompt, "gguf": gguf,
                          "quiet_gate": {"below": a.quiet_below, "wait_s": a.quiet_wait_s},
                          "hetserve": dict(ours_opts, max_batch=a.max_batch, pinning="prefill cpu0, decode cpu1",
                                           decode_engine=a.decode_engine, prefill_engine=a.prefill_engine,
                                           started=not a.ours, metrics=a.metrics, env=a.ours_env),
                          "llama.cpp": {"server": "llama_cpp.server", "n_threads": a.llama_threads, "gguf": gguf,
                                        "n_parallel": "n/a (llama-cpp-python serialises requests)"},
                          "llama.cpp-batched": {"in_process": True, "n_threads": a.llama_threads, "gguf": bgguf,
                                                "n_seq_max": max(levels + [16]), "kv_unified": True},
                          "cpus": len(os.sched_getaffinity(0)), "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "results": {str(c): v for c, v in table.items()},
               "open_loop": {f"{r:g}": v for r, v in open_table.items()}, "markdown": md, "markdown_open": md_open}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
        print(f"\nwrote {a.json}")
    finally:
        if lb is not None:
            lb.close()
        stop_proc(llama_proc)
        if topo is not None:
            topo.stop()


if __name__ == "__main__":
    main()
