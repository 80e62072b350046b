#!/usr/bin/env python3
"""Multi-turn conversations against the real stack (issue 29's workload): KV-aware routing against plain
least-loaded routing, side by side in one run (each in a fresh stack, the same conversations and arrivals).

Starts 1 prefill + N decode tritonservers (cluster.LocalCluster, as `hetserve up --decode-servers N` does) and
the OpenAI frontend, then runs conversations that arrive as a Poisson process (--rate per second), each turn a
streaming chat request sent when the previous answer is complete, the answer appended to the history:
  rag   turn 1: a shared system prompt + a ~1,300-token document + a question; turns 2..T: short follow-ups
  chat  every turn a user message of 100-300 tokens: the history grows to ~2k tokens by turn 4
Per request: TTFT and TPOT from the SSE chunks the client sees, prompt tokens from the usage chunk. Per run: the
servers' counters over the run (KV bytes sent to decode, prefix-cache hit tokens on the prefill server and on
the decode servers, prompts prefilled on each side), so the KV bytes moved per request and the prefix hit rate
come from the servers, not from a model of them.

    python3 loadtest/multiturn.py --conversations 12 --rate 0.1 --json /tmp/multiturn.json   # this 2-core box
    python3 loadtest/multiturn.py --routing on --decode-servers 2 --turns 4 --max-tokens 32
    python3 loadtest/multiturn.py --env HETSERVE_LOCAL_PREFILL_MAX_TOKENS=128   # a routing setting, both runs

Report: TTFT p50/p99 and TPOT p50 by kind and turn (1 vs >= 2), goodput (share of requests with TTFT <= --slo-ttft
and TPOT <= --slo-tpot), KV bytes per request, prefix hit tokens per prompt token. Text is seeded word salad from
a fixed vocabulary (the numbers depend on token counts, not on meaning); greedy answers with ignore_eos, so every
answer has --max-tokens tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

from openai_stack import DEFAULT_ENGINE_DIR, openai_stack, pct

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are were has have had not "
         "but all its their more one two new other some time system data model server memory network cache power "
         "energy river valley mountain city harbour market report study result method value table figure index "
         "north south east west early late small large high low first last long short open closed public local "
         "water light stone iron glass paper cotton grain trade route bridge tower castle church school garden "
         "season winter summer spring autumn morning evening council treaty battle army fleet king queen law").split()
SYSTEM = ("You are a careful assistant for an engineering team. Answer from the documents and the conversation, "
          "say when something is not in them, keep answers short, and cite the section a fact comes from. ") * 3
COUNTERS = ("hetserve_kv_transfer_bytes_total", "hetserve_kv_prefix_hit_tokens_total",
            "hetserve_prefill_requests_total", "hetserve_kv_prefix_lookups_total", "hetserve_kv_prefix_hits_total",
            "hetserve_decode_prefix_hit_tokens_total", "hetserve_decode_prefill_tokens_total",
            "hetserve_prefill_placement_total", "hetserve_router_lookups_total")


def words(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        w = rng.choice(WORDS)
        out.append(w.capitalize() + "." if i % 17 == 16 else w)
    return " ".join(out)


def conversation(rng: random.Random, kind: str, turns: int) -> List[str]:
    """The user messages of one conversation."""
    if kind == "rag":
        doc = words(rng, 1000)
        msgs = [f"Document:\n{doc}\n\nQuestion: what does the document say about the {rng.choice(WORDS)}?"]
        msgs += [f"And what about the {rng.choice(WORDS)} {rng.choice(WORDS)}?" for _ in range(turns - 1)]
        return msgs
    return [words(rng, rng.randint(80, 230)) + "?" for _ in range(turns)]


def scrape(urls: List[str]) -> Dict[str, float]:
    """COUNTERS summed over the servers (placement split by its `where` label, lookups by `result`)."""
    tot: Dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m and m.group(1) in COUNTERS:
                name = m.group(1)
                where = re.search(r'(?:where|result)="(\w+)"', m.group(2) or "")
                if where:
                    name += "." + where.group(1)
                tot[name] = tot.get(name, 0.0) + float(m.group(3))
    return tot


async def turn(client, model: str, messages: list, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, text, usage = [], [], None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(ch.choices[0].delta.content)
    return {"ttft_s": times[0] - t0 if times else float("nan"),
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
            "prompt_tokens": usage.prompt_tokens if usage else 0, "text": "".join(text)}


async def run_all(a, url: str) -> List[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    rng = random.Random(a.seed)
    plans = [(("rag", "chat")[i % 2], conversation(rng, ("rag", "chat")[i % 2], a.turns))
             for i in range(a.conversations)]
    arrivals, t = [], 0.0
    for _ in plans:
        arrivals.append(t)
        t += rng.expovariate(a.rate)
    results: List[dict] = []
    start = time.perf_counter()

    async def converse(ci: int, kind: str, users: List[str]) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[ci] - time.perf_counter()))
        messages = [{"role": "system", "content": SYSTEM}]
        for ti, u in enumerate(users):
            messages.append({"role": "user", "content": u})
            r = await turn(client, model, messages, a.max_tokens)
            messages.append({"role": "assistant", "content": r.pop("text")})
            results.append({"conversation": ci, "kind": kind, "turn": ti + 1, **r})
    await asyncio.gather(*(converse(i, k, u) for i, (k, u) in enumerate(plans)))
    await client.close()
    return results


def report(a, results: List[dict], counters: Dict[str, float], wall_s: float) -> dict:
    def group(rows):
        ttft = [r["ttft_s"] for r in rows]
        tpot = [r["tpot_s"] for r in rows if r["tpot_s"] == r["tpot_s"]]
        good = sum(1 for r in rows if r["ttft_s"] <= a.slo_ttft and r["tpot_s"] <= a.slo_tpot)
        return {"n": len(rows), "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
                "tpot_p50_ms": 1e3 * pct(tpot, 50), "goodput_share": good / len(rows) if rows else float("nan"),
                "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows) if rows else 0}
    out: Dict[str, dict] = {}
    for kind in ("rag", "chat", "all"):
        rows = [r for r in results if kind == "all" or r["kind"] == kind]
        out[kind] = {"turn 1": group([r for r in rows if r["turn"] == 1]),
                     "turns >= 2": group([r for r in rows if r["turn"] >= 2])}
    n = len(results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    return {"groups": out, "requests": n, "wall_s": wall_s,
            "goodput_req_per_s": sum(1 for r in results if r["ttft_s"] <= a.slo_ttft and r["tpot_s"] <= a.slo_tpot)
            / wall_s,
            "kv_bytes_per_request": counters.get("hetserve_kv_transfer_bytes_total", 0.0) / max(n, 1),
            "prefix_hit_tokens_per_prompt_token":
                (counters.get("hetserve_kv_prefix_hit_tokens_total", 0.0)
                 + counters.get("hetserve_decode_prefix_hit_tokens_total", 0.0)) / max(prompt_tokens, 1),
            "prefix_hit_per_tier": {
                "prefill": counters.get("hetserve_kv_prefix_hit_tokens_total", 0.0) / max(prompt_tokens, 1),
                "decode": counters.get("hetserve_decode_prefix_hit_tokens_total", 0.0) / max(prompt_tokens, 1)},
            "prefill_requests": counters.get("hetserve_prefill_requests_total", 0.0),
            "prefilled_on_decode": counters.get("hetserve_prefill_placement_total.decode", 0.0),
            "router_lookups_found": counters.get("hetserve_router_lookups_total.found", 0.0),
            "router_lookups": (counters.get("hetserve_router_lookups_total.found", 0.0)
                               + counters.get("hetserve_router_lookups_total.none", 0.0)),
            "counters": counters, "load": os.getloadavg(),
            "settings": {k: v for k, v in vars(a).items() if k != "json"}}


def one_run(a, routing: bool) -> dict:
    env = {"HETSERVE_BREAKER_P99_MS": "600000", "HETSERVE_KV_ROUTING": "1" if routing else "0",
           **dict(kv.split("=", 1) for kv in a.env)}
    with openai_stack(a.engine_dir, a.base_port, env, n_decode=a.decode_servers,
                      n_prefill=a.prefill_servers) as (cluster, url):
        servers = ([f"127.0.0.1:{a.base_port + 10 * j + 2}" for j in range(a.prefill_servers)]
                   + [cluster.decode_metrics(i) for i in range(a.decode_servers)])
        before = scrape(servers)
        t0 = time.perf_counter()
        results = asyncio.run(run_all(a, url))
        wall = time.perf_counter() - t0
        after = scrape(servers)
    rep = report(a, results, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}, wall)
    print(f"---- routing {'on (KV-aware)' if routing else 'off (least loaded)'}")
    for kind, g in rep["groups"].items():
        for name, st in g.items():
            print(f"{kind:5s} {name:10s} n={st['n']:3d}  TTFT p50 {st['ttft_p50_ms']:7.0f} ms  p99 "
                  f"{st['ttft_p99_ms']:7.0f} ms  TPOT p50 {st['tpot_p50_ms']:6.1f} ms  goodput "
                  f"{100 * st['goodput_share']:5.1f}%  prompt {st['prompt_tokens_mean']:6.0f} tokens")
    tiers = rep["prefix_hit_per_tier"]
    print(f"KV bytes moved per request {rep['kv_bytes_per_request'] / 1e6:.2f} MB; prefix hit tokens per prompt "
          f"token {rep['prefix_hit_tokens_per_prompt_token']:.2f} (prefill {tiers['prefill']:.2f}, decode "
          f"{tiers['decode']:.2f}); prefilled on decode {rep['prefilled_on_decode']:.0f} of {rep['requests']}; "
          f"router lookups {rep['router_lookups']:.0f} ({rep['router_lookups_found']:.0f} found more); "
          f"goodput {rep['goodput_req_per_s']:.3f} req/s over {wall:.0f} s; load {rep['load']}")
    return {"report": rep, "requests": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--decode-servers", type=int, default=2)
    ap.add_argument("--prefill-servers", type=int, default=1, help="> 1: behind nginx (least_conn)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.1, help="conversations starting per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft", type=float, default=0.5, help="goodput: TTFT bound, s")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="goodput: TPOT bound, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-port", type=int, default=24000)
    ap.add_argument("--routing", choices=("both", "on", "off"), default="both",
                    help="KV-aware routing on, off (least loaded, every prompt prefilled on the prefill server), or "
                         "both one after the other (each in a fresh stack)")
    ap.add_argument("--env", action="append", default=[], metavar="HETSERVE_X=V",
                    help="server settings for both runs, e.g. HETSERVE_LOCAL_PREFILL_MAX_TOKENS=128 (repeatable)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    runs = {}
    for routing in ((False, True) if a.routing == "both" else (a.routing == "on",)):
        runs["on" if routing else "off"] = one_run(a, routing)
    if len(runs) == 2:
        off, on = runs["off"]["report"], runs["on"]["report"]

        def ratio(x, y):
            return x / y if y else float("inf")
        t_off, t_on = off["groups"]["all"]["turns >= 2"], on["groups"]["all"]["turns >= 2"]
        s_off, s_on = off["groups"]["all"]["turn 1"], on["groups"]["all"]["turn 1"]
        print(f"==== KV-aware vs least-loaded, same run: turns >= 2 TTFT p50 {t_off['ttft_p50_ms']:.0f} -> "
              f"{t_on['ttft_p50_ms']:.0f} ms ({ratio(t_off['ttft_p50_ms'], t_on['ttft_p50_ms']):.2f}x lower); "
              f"KV bytes per request {off['kv_bytes_per_request'] / 1e6:.2f} -> {on['kv_bytes_per_request'] / 1e6:.2f}"
              f" MB ({ratio(off['kv_bytes_per_request'], on['kv_bytes_per_request']):.1f}x lower); goodput "
              f"{off['goodput_req_per_s']:.3f} -> {on['goodput_req_per_s']:.3f} req/s "
              f"({ratio(on['goodput_req_per_s'], off['goodput_req_per_s']):.2f}x); turn 1 TTFT p50 "
              f"{s_off['ttft_p50_ms']:.0f} -> {s_on['ttft_p50_ms']:.0f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
