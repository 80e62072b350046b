#!/usr/bin/env python3
"""Grammar-engine cost per decoded token at batch 16 (issue 28): xgrammar vs llguidance, on the default model's
real tokenizer (SmolLM2, 49152 ids), pinned to one core.

For each library: 16 matchers, each fed a stream of valid JSON instances of one of several schemas (nested
objects, enums, arrays, strings), token by token (the instance encoded with our tokenizer, then EOS; a slot that
finishes starts its next instance, so the batch stays at 16). Every step computes the 16 token bitmasks, with the
library's batch API (one thread) and with a plain loop over the matchers (single-threaded), then each matcher
accepts its next token. Reported: mean / p99 per batch step and per token (a step / 16 for the batch API; each
matcher's own call for the loop), the cost of applying the masks to [16, V] float32 logits with numpy, grammar
compile time (cold: first compile of the schema; cached: a second request for it), first-mask time, the cost of
replaying k generated tokens into a fresh matcher (resume after a migration), and the tokenizer-info build.
With hetserve.structured importable, its mask_batch (compute + apply) is measured on the same streams too.

    python3 loadtest/mask_cost.py                      # both libraries, 400 steps
    python3 loadtest/mask_cost.py --lib llguidance --steps 1000 --json /tmp/mask.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends"))

SCHEMAS = {
    "film": ({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer"},
            "genre": {"type": "string", "enum": ["drama", "comedy", "thriller", "documentary"]},
            "cast": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "role": {"type": "string"}},
                "required": ["name", "role"], "additionalProperties": False}, "minItems": 1, "maxItems": 4},
            "rating": {"type": "number"},
        },
        "required": ["title", "year", "genre", "cast", "rating"], "additionalProperties": False,
    }, [
        {"title": "The Long Night", "year": 1999, "genre": "drama",
         "cast": [{"name": "Ann Lee", "role": "lead"}, {"name": "Bo Chen", "role": "villain"}], "rating": 7.5},
        {"title": "Café Olé", "year": 2021, "genre": "comedy", "cast": [{"name": "Zoë", "role": "chef"}],
         "rating": 6},
    ]),
    "order": ({
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "customer": {"type": "object", "properties": {
                "name": {"type": "string"}, "email": {"type": "string"},
                "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                             "city": {"type": "string"},
                                                             "zip": {"type": "string"}},
                            "required": ["street", "city", "zip"], "additionalProperties": False}},
                "required": ["name", "email", "address"], "additionalProperties": False},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
            "gift": {"type": "boolean"},
        },
        "required": ["id", "customer", "items", "status", "gift"], "additionalProperties": False,
    }, [
        {"id": "ABC-1234", "customer": {"name": "Jo Smith", "email": "jo@example.com", "address": {
            "street": "1 Main St", "city": "Springfield", "zip": "12345"}},
         "items": [{"sku": "X-1", "qty": 2, "price": 9.99}, {"sku": "Y-22", "qty": 1, "price": 120}],
         "status": "paid", "gift": False},
        {"id": "QRS-0042", "customer": {"name": "Li Wei", "email": "li@example.org", "address": {
            "street": "22 Rue de la Paix", "city": "Paris", "zip": "75002"}},
         "items": [], "status": "pending", "gift": True},
    ]),
    "tool_call": ({
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search_web", "send_email"]},
            "arguments": {"type": "object", "properties": {
                "query": {"type": "string"}, "units": {"enum": ["metric", "imperial"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "limit": {"type": "integer"}}, "required": ["query"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    }, [
        {"name": "get_weather", "arguments": {"query": "Boston, MA", "units": "imperial"}},
        {"name": "search_web", "arguments": {"query": "best pizza in town \"near me\"",
                                             "tags": ["food", "local", "pizza"], "limit": 5}},
    ]),
    "records": ({
        "type": "object",
        "properties": {"rows": {"type": "array", "items": {"type": "object", "properties": {
            "k": {"type": "string"}, "v": {"type": "array", "items": {"type": "integer"}},
            "ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
            "required": ["k", "v", "ok", "note"], "additionalProperties": False}}},
        "required": ["rows"], "additionalProperties": False,
    }, [
        {"rows": [{"k": "alpha", "v": [1, 2, 3], "ok": True, "note": None},
                  {"k": "beta", "v": [], "ok": False, "note": "n/a"},
                  {"k": "gamma", "v": [10, 200, 3000], "ok": True, "note": "tab\there"}]},
    ]),
}


# the JSON layout both libraries are held to: json.dumps' default separators, no other whitespace (what
# hetserve.structured asks for; flexible whitespace lets a small model pad forever)
JSON_OPTS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def stats(xs):
    xs = sorted(xs)
    return {"mean_us": 1e6 * statistics.fmean(xs), "p50_us": 1e6 * xs[len(xs) // 2],
            "p99_us": 1e6 * xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))], "n": len(xs)}


def load_tokenizer():
    from hetserve.model.checkpoint import load_checkpoint
    from hetserve.tokenizer import Tokenizer

    ck = load_checkpoint(None)
    return Tokenizer(ck.tokenizer_spec, ck.chat_template), int(ck.config.vocab_size), list(ck.config.eos_token_ids)


# ---- the two libraries behind one small interface -----------------------------------------------------------------
class LLG:
    name = "llguidance"

    def __init__(self, tok, vocab, eos):
        import llguidance as llg
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)

        self.llg = llg
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tok._tok.to_str(), n_vocab=vocab, eos_token=eos)
        self.tokinfo_s = time.perf_counter() - t0
        self.executor = llg.LLExecutor(num_threads=1)
        self.cache = {}

    def compile(self, schema: dict):
        """grammar text + a template matcher (the cache keeps the template; a request deep-copies it)"""
        key = json.dumps(schema, sort_keys=True)
        if key in self.cache:
            return self.cache[key]
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTS)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        self.cache[key] = m
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill_batch(self, ms, bitmask):
        self.llg.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def fill_one(self, m, bitmask, i):
        self.llg.numpy.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m, t):
        if not m.consume_token(t):
            raise RuntimeError(m.get_error())

    def replay(self, m, ts):
        if not m.consume_tokens(ts):
            raise RuntimeError(m.get_error())

    def done(self, m):
        return m.is_stopped()


class XGR:
    name = "xgrammar"

    def __init__(self, tok, vocab, eos):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        t0 = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.tokinfo_s = time.perf_counter() - t0
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill_batch(self, ms, bitmask):
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def fill_one(self, m, bitmask, i):
        m.fill_next_token_bitmask(bitmask, i)

    def accept(self, m, t):
        if not m.accept_token(t):
            raise RuntimeError(f"token {t} refused")

    def replay(self, m, ts):
        for t in ts:
            self.accept(m, t)

    def done(self, m):
        return m.is_terminated()


def apply_masks(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """disallowed ids -> -inf, [B, V] float32 in place (the numpy path hetserve.structured uses)"""
    V = logits.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V].view(bool)
    np.putmask(logits, ~allowed, -np.inf)


class Slot:
    """One batch row: a matcher and the rest of its current token stream; starts the next instance when done."""

    def __init__(self, lib, streams, k):
        self.lib, self.streams, self.k = lib, streams, k
        self.start()

    def start(self):
        name, toks = self.streams[self.k % len(self.streams)]
        self.k += 1
        self.m = self.lib.matcher(self.lib.compiled[name])
        self.toks, self.pos = toks, 0

    def advance(self):
        self.lib.accept(self.m, self.toks[self.pos])
        self.pos += 1
        if self.pos == len(self.toks):
            assert self.lib.done(self.m), "stream ended but the grammar is not terminated"
            self.start()


def run_lib(lib, tok, vocab, eos, streams, steps, batch, out):
    r = {"tokenizer_info_s": lib.tokinfo_s}
    comp = {}
    for name, (schema, _) in SCHEMAS.items():
        t0 = time.perf_counter()
        c = lib.compile(schema)
        t1 = time.perf_counter()
        lib.compile(schema)
        t2 = time.perf_counter()
        m = lib.matcher(c)
        t3 = time.perf_counter()
        bm = np.full((1, (vocab + 31) // 32), -1, np.int32)
        lib.fill_one(m, bm, 0)
        t4 = time.perf_counter()
        comp[name] = {"cold_ms": 1e3 * (t1 - t0), "cached_ms": 1e3 * (t2 - t1), "new_matcher_ms": 1e3 * (t3 - t2),
                      "first_mask_ms": 1e3 * (t4 - t3)}
    lib.compiled = {name: lib.compile(schema) for name, (schema, _) in SCHEMAS.items()}
    r["compile"] = comp
    words = (vocab + 31) // 32
    for mode in ("batch", "loop"):
        slots = [Slot(lib, streams, i) for i in range(batch)]
        bitmask = np.full((batch, words), -1, np.int32)
        step_t, tok_t, apply_t = [], [], []
        logits = np.zeros((batch, vocab), np.float32)
        for _ in range(steps):
            ms = [s.m for s in slots]
            t0 = time.perf_counter()
            if mode == "batch":
                lib.fill_batch(ms, bitmask)
            else:
                for i, m in enumerate(ms):
                    a = time.perf_counter()
                    lib.fill_one(m, bitmask, i)
                    tok_t.append(time.perf_counter() - a)
            step_t.append(time.perf_counter() - t0)
            for i, s in enumerate(slots):  # the stream's next token must be allowed by the mask just computed
                t = s.toks[s.pos]
                assert (bitmask[i, t >> 5] >> (t & 31)) & 1, f"{lib.name}: token {t} masked out"
            a = time.perf_counter()
            apply_masks(logits, bitmask)
            apply_t.append(time.perf_counter() - a)
            logits.fill(0)
            for s in slots:
                s.advance()
        st = stats(step_t)
        r[mode] = {"step": st, "token": stats(tok_t) if tok_t else {k: (v / batch if k.endswith("us") else v)
                                                                     for k, v in st.items()}}
        if mode == "batch":
            r["apply_numpy"] = stats(apply_t)
    # resume: replay k tokens of one stream into a fresh matcher
    name, toks = max(streams, key=lambda s: len(s[1]))
    k = len(toks) - 1
    ts = []
    for _ in range(20):
        m = lib.matcher(lib.compiled[name])
        a = time.perf_counter()
        lib.replay(m, toks[:k])
        ts.append(time.perf_counter() - a)
    r["resume"] = {"tokens": k, "mean_ms": 1e3 * statistics.fmean(ts), "per_token_us": 1e6 * statistics.fmean(ts) / k}
    out[lib.name] = r


def run_hetserve(tok, vocab, eos, streams, steps, batch, out):
    """hetserve.structured end to end: mask_batch (bitmask + -inf into [B, V] logits) and accept."""
    from hetserve import structured as S

    comp = S.GrammarCompiler.for_tokenizer(tok, vocab, eos)
    specs = {n: S.GuideSpec.parse("json_schema", json.dumps(s)) for n, (s, _) in SCHEMAS.items()}

    class Lib:
        name = "hetserve.structured"
        compiled = specs

        def matcher(self, spec):
            return S.Matcher(comp, spec)

        def accept(self, m, t):
            m.accept(t)

        def done(self, m):
            return m.is_terminated()

    lib = Lib()
    slots = [Slot(lib, streams, i) for i in range(batch)]
    logits = np.zeros((batch, vocab), np.float32)
    step_t = []
    for _ in range(steps):
        logits.fill(0)
        a = time.perf_counter()
        S.mask_batch([s.m for s in slots], logits)
        step_t.append(time.perf_counter() - a)
        for i, s in enumerate(slots):
            assert np.isfinite(logits[i, s.toks[s.pos]])
            s.advance()
    st = stats(step_t)
    out[lib.name] = {"mask_batch_step": st, "mask_batch_token": {k: (v / batch if k.endswith("us") else v)
                                                                 for k, v in st.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", choices=["both", "llguidance", "xgrammar"], default="both")
    ap.add_argument("--steps", type=int, default=400, help="batch steps per mode")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU (default: the last one allowed)")
    ap.add_argument("--vocab", type=int, default=None, help="model vocab size (default: the model's; > tokenizer "
                    "pads)")
    ap.add_argument("--no-hetserve", action="store_true", help="skip measuring hetserve.structured.mask_batch")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    core = a.core if a.core is not None else cores[-1]
    os.sched_setaffinity(0, {core})
    tok, vocab, eos = load_tokenizer()
    vocab = a.vocab or vocab
    streams = []
    for name, (_, instances) in SCHEMAS.items():
        for inst in instances:
            streams.append((name, tok.encode(json.dumps(inst, ensure_ascii=False)) + [eos[0]]))
    out = {"core": core, "vocab": vocab, "tokenizer_vocab": tok.vocab_size, "eos": eos, "batch": a.batch,
           "steps": a.steps, "stream_tokens": [len(s[1]) for s in streams]}
    libs = {"llguidance": LLG, "xgrammar": XGR}
    for name in (libs if a.lib == "both" else [a.lib]):
        try:
            import importlib.metadata as md
            ver = md.version(name)
        except Exception:
            ver = "?"
        print(f"== {name} {ver}", flush=True)
        run_lib(libs[name](tok, vocab, eos), tok, vocab, eos, streams, a.steps, a.batch, out)
        out[name]["version"] = ver
        print(json.dumps(out[name], indent=1), flush=True)
    if not a.no_hetserve:
        try:
            run_hetserve(tok, vocab, eos, streams, a.steps, a.batch, out)
            print(json.dumps(out["hetserve.structured"], indent=1))
        except ImportError as e:
            print(f"(hetserve.structured not measured: {e})")
    print("\nper token at batch %d, one core (us): mean / p99" % a.batch)
    for name in ("llguidance", "xgrammar"):
        if name in out:
            r = out[name]
            print(f"  {name:11s} batch API {r['batch']['token']['mean_us']:7.1f} / {r['batch']['token']['p99_us']:7.1f}"
                  f"   loop {r['loop']['token']['mean_us']:7.1f} / {r['loop']['token']['p99_us']:7.1f}"
                  f"   step(batch API) {r['batch']['step']['mean_us']:7.0f} / {r['batch']['step']['p99_us']:7.0f}"
                  f"   compile cold {statistics.fmean(c['cold_ms'] for c in r['compile'].values()):.1f} ms"
                  f" cached {statistics.fmean(c['cached_ms'] for c in r['compile'].values()):.3f} ms"
                  f"   resume {r['resume']['per_token_us']:.1f} us/token")
    if "hetserve.structured" in out:
        r = out["hetserve.structured"]
        print(f"  hetserve.structured.mask_batch (compute + apply) per token {r['mask_batch_token']['mean_us']:.1f}"
              f" / {r['mask_batch_token']['p99_us']:.1f}, per step {r['mask_batch_step']['mean_us']:.0f}"
              f" / {r['mask_batch_step']['p99_us']:.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
