#!/usr/bin/env python3
"""hetserve vs llama.cpp, side by side in one run. Not a CI test.

Systems: `hetserve` (our prefill + decode Triton servers), `llama.cpp` (the llama-cpp-python HTTP server,
`python -m llama_cpp.server`, same GGUF, `--n_threads 2 --n_threads_batch 2`) and `llama.cpp-batched`
(llama.cpp's own multi-sequence batching driven through the llama-cpp-python C API in a separate process:
what `llama-server -np N` would do, minus HTTP; the upper bound for a llama.cpp server with parallel slots).
llama-cpp-python's server has no `--n_parallel`: one lock around the model serves concurrent streams one
after another (`--interrupt_requests False` makes them queue instead of cancelling each other).

All get the same chat-templated prompts (token ids for hetserve and the batched engine, the same text for the
HTTP server, which tokenizes it to the same ids), the same fixed output length (hetserve `ignore_eos`,
llama.cpp `min_tokens` = `max_tokens`), greedy decoding, streaming. For each concurrency level (default
1, 4, 16 streams) every stream sends `--requests-per-stream` requests back to back; per level we report
aggregate output tok/s (all output tokens / wall time of the level), TTFT p50/p99 and TPOT p50. The
systems alternate per level (`--rounds` repeats; per-round medians are reported), so background load hits
them alike.

    python loadtest/bench_vs_llamacpp.py                       # starts all servers (ports 48000.. / 48500)
    python loadtest/bench_vs_llamacpp.py --ours 127.0.0.1:8001 --llama http://127.0.0.1:8080
    python loadtest/bench_vs_llamacpp.py --levels 16 --max-tokens 128 --rounds 3 --json out.json

hetserve: prefill server and decode server pinned to one core each (the local Topology), INT8 decode, fp16 KV
over shm, HETSERVE_MAX_BATCH=16, prefix cache on (loadtest/README.md has the config sweep).
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
from typing import Callable, Dict, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_backends"))

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three prime numbers.", "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Give me a tip for learning Python.", "Who wrote Romeo and Juliet?", "Describe a cat in one sentence.",
    "Why is the sky blue?", "How do airplanes stay in the air?", "Name a famous painting and its painter.",
    "What causes the seasons on Earth?", "Suggest a name for a bakery.", "How many legs does a spider have?",
    "What is the boiling point of water in Fahrenheit?",
]
LONG_SYSTEM = ("You are the customer support assistant of Northwind Travel. Be brief and polite, never invent "
               "prices or availability, and point customers to the booking page for any change to a booking. ") * 3


# ---- one request ----------------------------------------------------------------------------------
class Result(dict):
    """ttft_s, total_s, tokens, tpot_s, error"""


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


class LlamaBatched:
    """llama.cpp's own multi-sequence batching, in process (what `llama-server -np N` does, minus HTTP): all N
    prompts prefilled in one llama_decode, then one llama_decode per step for the N sequences; greedy. An upper
    bound for a llama.cpp server with parallel slots, which llama-cpp-python's server does not have."""

    def __init__(self, gguf: str, threads: int, max_seqs: int, n_ctx_per_seq: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx = max_seqs * n_ctx_per_seq
        cp.n_batch, cp.n_ubatch = min(cp.n_ctx, 2048), min(cp.n_ctx, 512)  # llama-server's defaults
        cp.n_seq_max = max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_batch = cp.n_batch
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_batch, 0, max_seqs)

    def _decode(self, items):
        """items: (token, pos, seq, want_logits) -> batch indices of the rows with logits, in order."""
        b, out = self.batch, []
        for i, (t, p, s, lo) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, int(lo)
            b.seq_id[i][0] = s
            if lo:
                out.append(i)
        b.n_tokens = len(items)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), (self.vocab,))))
                for i in out]

    def run(self, prompts: List[List[int]], max_tokens: int) -> List[Result]:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} prompt tokens > n_batch {self.n_batch}")
        toks = [[t] for t in self._decode(items)]
        ttft = time.perf_counter() - t0
        pos = [len(p) for p in prompts]
        for _ in range(max_tokens - 1):
            nxt = self._decode([(toks[s][-1], pos[s], s, True) for s in range(len(prompts))])
            for s, t in enumerate(nxt):
                toks[s].append(t)
                pos[s] += 1
        total = time.perf_counter() - t0
        return [Result(ttft_s=ttft, total_s=total, tokens=max_tokens,
                       tpot_s=(total - ttft) / max(1, max_tokens - 1)) for _ in prompts]


def _batched_worker(conn, *args):
    try:
        lb = LlamaBatched(*args)
        conn.send(("ready", None))
    except Exception as e:  # report, don't hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            conn.send(("ok", lb.run(*msg)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class BatchedProc:
    """LlamaBatched in its own process, like a server: the benchmark's client threads (gRPC polling threads
    included) must not steal cycles from llama.cpp's spinning worker threads."""

    def __init__(self, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_batched_worker, args=(child, *args), daemon=True)
        self.proc.start()
        self._call(None, wait_only=True)

    def _call(self, msg, wait_only=False):
        if not wait_only:
            self.conn.send(msg)
        if not self.conn.poll(900):
            raise TimeoutError("llama.cpp batched worker did not answer in 900 s")
        status, val = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"llama.cpp batched worker: {val}")
        return val

    def run(self, prompts: List[List[int]], max_tokens: int) -> List[Result]:
        return [Result(r) for r in self._call((prompts, max_tokens))]

    def close(self):
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


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


def run_batched_level(lb: "BatchedProc", prompts: List[List[int]], streams: int, per_stream: int,
                      max_tokens: int) -> dict:
    """`streams` sequences started together, `per_stream` times (closed loop, like run_level)."""
    results: List[Result] = []
    t0 = time.perf_counter()
    for j in range(per_stream):
        results += lb.run([prompts[(s + j * streams) % len(prompts)] for s in range(streams)], max_tokens)
    return summarize(results, time.perf_counter() - t0, streams)


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
    for k in ("requests", "errors", "output_tokens", "wall_s"):
        out[k] = sum(r[k] for r in rounds)
    out["tok_s_pooled"] = round(out["output_tokens"] / out["wall_s"], 1)
    for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms"):
        vals = [r[k] for r in rounds if r[k] is not None]
        out[k] = round(float(np.median(vals)), 1) if vals else None
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
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,4,16", help="concurrent streams per level (default 1,4,16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat each level (systems alternate)")
    ap.add_argument("--system-prompt", choices=["default", "long"], default="default",
                    help="default: the model's chat template system prompt; long: a shared ~100-token one")
    ap.add_argument("--systems", default="hetserve,llama.cpp,llama.cpp-batched",
                    help="any of hetserve, llama.cpp (its HTTP server), llama.cpp-batched (in-process, -np N ideal)")
    ap.add_argument("--ours", help="prefill server gRPC url of a running hetserve (else one is started)")
    ap.add_argument("--base-port", type=int, default=48000)
    ap.add_argument("--decode-precision", default="int8", choices=["int8", "fp32"])
    ap.add_argument("--kv-dtype", default="fp16", choices=["fp32", "fp16", "int8"])
    ap.add_argument("--transport", default="shm", choices=["grpc", "shm"])
    ap.add_argument("--max-batch", type=int, default=16, help="HETSERVE_MAX_BATCH of a started decode server")
    ap.add_argument("--no-metrics", dest="metrics", action="store_false",
                    help="turn hetserve's custom Triton metrics off (HETSERVE_METRICS=0); on by default")
    ap.add_argument("--metrics", dest="metrics", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ours-env", action="append", default=[], metavar="K=V", help="extra env for started servers")
    ap.add_argument("--llama", help="base url of a running llama-cpp-python server (else one is started)")
    ap.add_argument("--llama-port", type=int, default=48500)
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the one the engines were built from)")
    ap.add_argument("--engine-dir", default=os.environ.get("HETSERVE_ENGINE_DIR", str(REPO / ".hetserve" / "engines")))
    ap.add_argument("--target", type=float, default=1.5)
    ap.add_argument("--json", default=str(REPO / ".hetserve" / "bench" / "bench_vs_llamacpp.json"))
    a = ap.parse_args(argv)

    from hetserve.engines.builder import load_tokenizer
    from hetserve.engines.manifest import read_manifest

    levels = [int(x) for x in a.levels.split(",")]
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    tok = load_tokenizer(a.engine_dir)
    system = LONG_SYSTEM if a.system_prompt == "long" else None
    texts = [tok.apply_chat_template(([{"role": "system", "content": system}] if system else [])
                                     + [{"role": "user", "content": q}]) for q in QUESTIONS]
    ids = [tok.encode(t) for t in texts]
    gguf = a.gguf or read_manifest(a.engine_dir)["source"]
    print(f"prompts: {len(ids)} chat-templated, {min(map(len, ids))}-{max(map(len, ids))} tokens; "
          f"max_tokens {a.max_tokens} (fixed length); levels {levels}; {a.requests_per_stream} requests/stream; "
          f"gguf {gguf}", flush=True)

    topo = llama_proc = lb = None
    ours_opts = {"decode_precision": a.decode_precision, "kv_dtype": a.kv_dtype, "transport": a.transport}
    log_dir = Path(a.json).parent
    try:
        fns: Dict[str, Callable[[int], Result]] = {}
        if "hetserve" in systems:
            url = a.ours
            if not url:
                from hetserve.topology import Topology

                # the circuit breaker (p99 TTFT > 500 ms -> refuse) would shed this closed-loop saturation load
                # Custom metrics on (as in production); --no-metrics measures their cost.
                env = {"HETSERVE_MAX_BATCH": str(a.max_batch), "HETSERVE_DECODE_PRECISION": a.decode_precision,
                       "HETSERVE_DECODE_ENGINES": f"decode_{a.decode_precision}", "HETSERVE_BREAKER_P99_MS": "600000",
                       "HETSERVE_METRICS": "1" if a.metrics else "0"}
                env.update(kv.split("=", 1) for kv in a.ours_env)
                topo = Topology(a.engine_dir, base_port=a.base_port, env=env, log_dir=str(log_dir)).start()
                url = topo.prefill_grpc
            fns["hetserve"] = lambda i, url=url: run_ours(url, ids[i % len(ids)], a.max_tokens, ours_opts)
        if "llama.cpp-batched" in systems:
            lb = BatchedProc(gguf, a.llama_threads, max(levels), max(map(len, ids)) + a.max_tokens + 8)
            fns["llama.cpp-batched"] = lambda i, lb=lb: lb.run([ids[i % len(ids)]], a.max_tokens)[0]
        if "llama.cpp" in systems:
            lurl = a.llama
            if not lurl:
                llama_proc = start_llama(gguf, a.llama_port, a.llama_threads, 4096, log_dir / "llama.log")
                lurl = f"http://127.0.0.1:{a.llama_port}"
            fns["llama.cpp"] = lambda i, lurl=lurl: run_llama(lurl, texts[i % len(texts)], a.max_tokens)
        for name, fn in fns.items():  # warm both (lazy init, first-request costs)
            for i in range(2):
                fn(i)
            print(f"{name}: warm", flush=True)

        table: Dict[int, Dict[str, dict]] = {}
        for c in levels:
            per: Dict[str, List[dict]] = {n: [] for n in fns}
            for rnd in range(a.rounds):
                order = list(fns) if rnd % 2 == 0 else list(fns)[::-1]
                for name in order:
                    if name == "llama.cpp-batched":
                        r = run_batched_level(lb, ids, c, a.requests_per_stream, a.max_tokens)
                    else:
                        r = run_level(fns[name], c, a.requests_per_stream)
                    per[name].append(r)
                    print(f"  {c:>3} streams  {name:<9} {r['tok_s']:>7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']} ms "
                          f"p99 {r['ttft_p99_ms']} ms  TPOT p50 {r['tpot_p50_ms']} ms  errors {r['errors']}"
                          f"  load {os.getloadavg()[0]:.2f}", flush=True)
            table[c] = {n: merge(rs) for n, rs in per.items()}
        md = markdown(table, a.target)
        print("\n" + md)
        out = {"config": {"levels": levels, "max_tokens": a.max_tokens, "requests_per_stream": a.requests_per_stream,
                          "rounds": a.rounds, "system_prompt": a.system_prompt, "gguf": gguf,
                          "hetserve": dict(ours_opts, max_batch=a.max_batch, pinning="prefill cpu0, decode cpu1",
                                           started=not a.ours, metrics=a.metrics, env=a.ours_env),
                          "llama.cpp": {"server": "llama_cpp.server", "n_threads": a.llama_threads,
                                        "n_parallel": "n/a (llama-cpp-python serialises requests)"},
                          "llama.cpp-batched": {"in_process": True, "n_threads": a.llama_threads,
                                                "n_seq_max": max(levels), "kv_unified": True},
                          "cpus": len(os.sched_getaffinity(0)), "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "results": {str(c): v for c, v in table.items()}, "markdown": md}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {a.json}")
    finally:
        if lb is not None:
            lb.close()
        stop_proc(llama_proc)
        if topo is not None:
            topo.stop()


if __name__ == "__main__":
    main()
