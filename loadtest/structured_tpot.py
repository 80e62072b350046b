#!/usr/bin/env python3
"""TPOT with and without a JSON schema at 16 concurrent streams (issue 28), side by side in one run.

Starts the real stack on loopback (prefill + decode tritonservers pinned one core each, as `hetserve up` does,
and the OpenAI frontend), then alternates rounds: 16 concurrent streaming chat requests without a constraint,
then the same 16 with `response_format: json_schema` (strict), and so on for --rounds. Per request TPOT = (time of
the last token - time of the first) / (tokens - 1), from the SSE chunks as the client sees them; the report gives
p50/p99 per condition over all rounds, the ratio, how many schema answers parsed and validated (jsonschema), and
the decode server's per-token grammar cost from its metrics when it exposes it.

    python3 loadtest/structured_tpot.py --rounds 3 --max-tokens 64
    python3 loadtest/structured_tpot.py --engine-dir .hetserve/engines --json /tmp/tpot.json

Both conditions ask for the same max_tokens; unconstrained requests use ignore_eos so every stream runs its full
length (a schema answer ends when its JSON does, so its streams are shorter: TPOT is per token and compared at
the same concurrency, the batch is kept full by issuing the next request as soon as one ends: closed loop).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from openai_stack import DEFAULT_ENGINE_DIR, openai_stack, pct

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"},
        "genre": {"type": "string", "enum": ["drama", "comedy", "thriller", "documentary"]},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "role": {"type": "string", "maxLength": 30}},
            "required": ["name", "role"], "additionalProperties": False}, "minItems": 2, "maxItems": 4},
        "rating": {"type": "number"},
    },
    "required": ["title", "year", "genre", "cast", "rating"],
    "additionalProperties": False,
}
PROMPT = "Describe a film you like as JSON with its title, year, genre, cast and rating."


async def one(client, model, schema: bool, max_tokens: int):
    kw = dict(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
              temperature=0.7, stream=True)
    if schema:
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": "film", "schema": SCHEMA, "strict": True}}
    else:
        kw["extra_body"] = {"ignore_eos": True}
    times, text = [], []
    async for ch in await client.chat.completions.create(**kw):
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(ch.choices[0].delta.content)
    return times, "".join(text)


async def window(client, model, schema: bool, streams: int, requests: int, max_tokens: int):
    """Closed loop: `streams` clients, `requests` requests in all."""
    left = [requests]
    out = []

    async def worker():
        while left[0] > 0:
            left[0] -= 1
            out.append(await one(client, model, schema, max_tokens))
    await asyncio.gather(*(worker() for _ in range(streams)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32, help="requests per condition per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--base-port", type=int, default=23000)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    env = {"HETSERVE_BREAKER_P99_MS": "600000", "HETSERVE_MAX_BATCH": str(max(16, a.streams))}
    with openai_stack(a.engine_dir, a.base_port, env, static_decode=True) as (_, url):
        tpot: dict = {False: [], True: []}
        valid = [0, 0]
        asyncio.run(_rounds(a, url, tpot, valid))  # one event loop: the async client lives in it
        out = {c: {"p50_ms": 1e3 * pct(tpot[c], 50), "p99_ms": 1e3 * pct(tpot[c], 99),
                   "mean_ms": 1e3 * statistics.mean(tpot[c]), "n": len(tpot[c])} for c in (False, True)}
        report = {"streams": a.streams, "rounds": a.rounds, "max_tokens": a.max_tokens,
                  "plain": out[False], "schema": out[True],
                  "ratio_p50": out[True]["p50_ms"] / out[False]["p50_ms"],
                  "ratio_p99": out[True]["p99_ms"] / out[False]["p99_ms"],
                  "schema_valid": f"{valid[0]}/{valid[1]}", "load": os.getloadavg()}
        print(json.dumps(report, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1))
        return 0


async def _rounds(a, url: str, tpot: dict, valid: list) -> None:
    """Alternating rounds, plain then schema, into tpot[schema] (seconds per token) and valid [ok, of]."""
    import jsonschema
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    for r in range(a.rounds):
        for schema in (False, True):
            res = await window(client, model, schema, a.streams, a.requests, a.max_tokens)
            for times, text in res:
                if len(times) > 1:
                    tpot[schema].append((times[-1] - times[0]) / (len(times) - 1))
                if schema:
                    valid[1] += 1
                    try:
                        jsonschema.validate(json.loads(text), SCHEMA)
                        valid[0] += 1
                    except (ValueError, jsonschema.ValidationError) as e:
                        print(f"  invalid answer ({e.__class__.__name__}): {text[:120]!r}", file=sys.stderr)
            print(f"round {r + 1} {'schema' if schema else 'plain '}: {len(res)} requests, TPOT p50 "
                  f"{1e3 * pct(tpot[schema], 50):.1f} ms so far", flush=True)
    await client.close()


if __name__ == "__main__":
    sys.exit(main())
