"""Quality gate: teacher-forced KL divergence and same-top-1 of every engine and KV wire dtype vs the FP32 engine.

Convention of llama.cpp `perplexity --kl-divergence`: each text is cut to N_TOKENS tokens; the first half is
context, and every position of the second half is scored with KLD(P_fp32 || P_x) = sum p_fp32 (log p_fp32 -
log p_x) over the vocabulary and with "same top-1" (argmax equal). We report the mean KLD over all scored
tokens, its 99th percentile, and the same-top-1 %.

Two kinds of rows:
  engine   the engine under test runs the whole text (context as one prefill call, then one decode step per
           scored token), like llama.cpp evaluating a quantized GGUF: weight + activation error of that engine.
  kv:DT    FP32 prefill of the context, its KV encoded to wire dtype DT and decoded again (kv/wire.py, exactly
           what the decode server receives), then FP32 decode steps: the error the KV handoff adds.
Figures in the manifest use EVAL_TEXTS (held out); TUNE_TEXTS are for calibration and choosing options.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from .quality_texts import EVAL_TEXTS, TEXTS_VERSION, TUNE_TEXTS

N_TOKENS = 120  # per text: 60 context + 60 scored (every built-in text has >= 123 tokens)
CTX = N_TOKENS // 2
REFERENCE = "prefill_fp32"  # the standard-op FP32 graph, present in every build

# Upper bounds on mean KLD per row (held-out texts); the build records figures, tests/test_quality.py checks
# them. Chosen from measured values with headroom, so a regression (wrong scale scheme, a graph bug) fails.
BOUNDS = {
    "fp32": 1e-6, "kv:fp32": 1e-6, "kv:fp16": 1e-4, "kv:int8": 3e-4,
    "kv:fp8": 2e-3, "int8": 0.003, "int8_qdq": 0.01, "fp8_qdq": 0.04,
}


@dataclass(frozen=True)
class Quality:
    mean_kld: float
    p99_kld: float
    same_top_pct: float
    tokens: int
    texts: str  # which text set + version ("eval/qt1")

    def to_dict(self) -> dict:
        return {k: (round(v, 7) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def token_matrix(tokenizer, texts: Sequence[str] = EVAL_TEXTS, n_tokens: int = N_TOKENS) -> np.ndarray:
    rows = [tokenizer.encode(t)[:n_tokens] for t in texts]
    short = [i for i, r in enumerate(rows) if len(r) < n_tokens]
    if short:
        raise ValueError(f"texts {short} have fewer than {n_tokens} tokens")
    return np.asarray(rows, dtype=np.int64)


COMPARE_THREADS_MAX = 4


def compare(ref_logits: np.ndarray, logits: np.ndarray, texts: str, chunk: int = 32) -> Quality:
    """ref_logits, logits: [..., V] for the same scored positions, compared in float64 row chunks (1 MiB a position
    at a 128k vocabulary) on up to COMPARE_THREADS_MAX threads (numpy releases the GIL). KLD(P || Q) = sum p (x - y)
    - lse(x) + lse(y) for logits x, y: two exponentials a position instead of three (1B gate: 4.4 s a row before)."""
    from concurrent.futures import ThreadPoolExecutor

    rp = ref_logits.reshape(-1, ref_logits.shape[-1])
    rq = logits.reshape(-1, logits.shape[-1])

    def part(i: int):
        x, y = rp[i:i + chunk].astype(np.float64), rq[i:i + chunk].astype(np.float64)
        mx, my = x.max(axis=-1, keepdims=True), y.max(axis=-1, keepdims=True)
        ex = np.exp(x - mx)
        sx = ex.sum(axis=-1)
        lse_x = mx[:, 0] + np.log(sx)
        lse_y = my[:, 0] + np.log(np.exp(y - my).sum(axis=-1))
        x -= y  # x - y, in place: one chunk buffer less
        kld = (ex * x).sum(axis=-1) / sx - lse_x + lse_y
        return np.maximum(kld, 0.0), rp[i:i + chunk].argmax(-1) == rq[i:i + chunk].argmax(-1)

    starts = range(0, rp.shape[0], chunk)
    with ThreadPoolExecutor(max(1, min(COMPARE_THREADS_MAX, os.cpu_count() or 1, len(starts)))) as pool:
        parts = list(pool.map(part, starts))
    k, sm = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return Quality(float(k.mean()), float(np.percentile(k, 99)), float(sm.mean() * 100), int(k.size), texts)


def _step_inputs(ids_col: np.ndarray, pos: int, past: int):
    from .feeds import causal_mask

    B = ids_col.shape[0]
    return (ids_col[:, None], np.full((B, 1), pos, dtype=np.int64), causal_mask([past] * B, [1] * B, past, 1),
            np.zeros(B, dtype=np.int64))


def teacher_forced(decode_engine, ids: np.ndarray, prefill_engine=None,
                   kv_roundtrip: Optional[Callable[[np.ndarray, np.ndarray], tuple]] = None,
                   ctx: int = CTX) -> np.ndarray:
    """Logits [N, T-ctx, V] predicting tokens ctx..T-1 of every row of ids [N, T] (batched over rows).

    prefill_engine (default: decode_engine) runs the context in one call; kv_roundtrip(k, v) -> (k, v) is applied
    per sequence to its context KV ([L, KVH, ctx, D]) before decoding, as the KV handoff would. A decode engine
    opened as a score view (standard-op graph, fp32 KV; open_for_scoring) scores every position in one call: the
    same computation as one step per token (no KV of the scored tokens is quantized on either path).
    """
    from .feeds import causal_mask

    pre = prefill_engine or decode_engine
    N, T = ids.shape
    if _scores(decode_engine) and pre is decode_engine and kv_roundtrip is None:
        return whole_text(decode_engine, ids, ctx)[0]
    lo, k, v = pre.forward(ids[:, :ctx], np.tile(np.arange(ctx), (N, 1)), causal_mask([0] * N, [ctx] * N, 0, ctx),
                           pre.empty_past(N), pre.empty_past(N), np.full(N, ctx - 1))
    if kv_roundtrip is not None:
        k, v = _roundtrip(kv_roundtrip, k, v)
    if _scores(decode_engine):
        return np.concatenate([lo[:, None], scored_after(decode_engine, ids, ctx, k, v)], axis=1)
    out = [lo]
    for t in range(ctx, T - 1):
        x, pos, mask, last = _step_inputs(ids[:, t], t, t)
        lo, nk, nv = decode_engine.forward(x, pos, mask, k, v, last)
        k, v = np.concatenate([k, nk], axis=3), np.concatenate([v, nv], axis=3)
        out.append(lo)
    return np.stack(out, axis=1)


def _scores(engine) -> bool:
    return bool(getattr(engine, "_score_view", False))


def _roundtrip(rt, k: np.ndarray, v: np.ndarray):
    pairs = [rt(k[i], v[i]) for i in range(k.shape[0])]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def whole_text(engine, ids: np.ndarray, ctx: int = CTX):
    """Score view, one call over ids[:, :T-1]: (logits [N, T-ctx, V] at positions ctx-1..T-2, and the context's
    K/V [N, L, KVH, ctx, D], what a prefill of the context alone returns: attention is causal)."""
    from .feeds import causal_mask

    N, T = ids.shape
    n = T - 1
    rows = (np.arange(N)[:, None] * n + np.arange(ctx - 1, n)[None, :]).ravel()
    lo, k, v = engine.score(ids[:, :n], np.tile(np.arange(n), (N, 1)), causal_mask([0] * N, [n] * N, 0, n),
                            engine.empty_past(N), engine.empty_past(N), rows)
    ctx_kv = (np.ascontiguousarray(k[:, :, :, :ctx]), np.ascontiguousarray(v[:, :, :, :ctx]))
    return lo.reshape(N, n - ctx + 1, -1), *ctx_kv


def scored_after(engine, ids: np.ndarray, ctx: int, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Score view: logits [N, T-1-ctx, V] at positions ctx..T-2, the tokens ids[:, ctx:T-1] in one call after the
    context's K/V (k, v)."""
    from .feeds import causal_mask

    N, T = ids.shape
    S = T - 1 - ctx
    lo, _, _ = engine.score(ids[:, ctx:T - 1], np.tile(np.arange(ctx, T - 1), (N, 1)),
                            causal_mask([ctx] * N, [S] * N, ctx, S), k, v, np.arange(N * S))
    return lo.reshape(N, S, -1)


def wire_roundtrip(dtype: str, compat_hash: str = "quality"):
    from ..kv import wire

    def rt(k, v):
        hdr, payload = wire.encode(k, v, compat_hash, dtype, key=b"quality")  # in-process: no deployment key
        return wire.decode(hdr, payload)
    return rt


def engine_quality(engine_dir: str, names: Sequence[str], kv_dtypes: Sequence[str] = ("fp16", "int8"),
                   texts: Sequence[str] = EVAL_TEXTS, set_name: str = "eval", threads: int = 0,
                   log: Optional[Callable[[str], None]] = None) -> Dict[str, dict]:
    """{engine name | "kv:<dtype>": Quality dict} vs decode_fp32 on `texts` (the build calls this)."""
    from .manifest import load_tokenizer

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    ids = token_matrix(load_tokenizer(engine_dir), texts)
    tag = f"{set_name}/{TEXTS_VERSION}"
    ref_eng = open_for_scoring(engine_dir, REFERENCE, threads)
    if _scores(ref_eng):  # one call for the reference, one per KV dtype (their context is the reference's)
        ref, k_ctx, v_ctx = whole_text(ref_eng, ids)
        got = np.empty_like(ref)  # one buffer for every KV row (each is 0.3 GiB at a 128k vocabulary)
        got[:, :1] = ref[:, :1]  # the context's own last logits: computed before any KV handoff
    else:
        ref = teacher_forced(ref_eng, ids)
    res = {}
    for dt in kv_dtypes:
        if _scores(ref_eng):
            k, v = _roundtrip(wire_roundtrip(dt), k_ctx, v_ctx)
            got[:, 1:] = scored_after(ref_eng, ids, CTX, k, v)
        else:
            got = teacher_forced(ref_eng, ids, kv_roundtrip=wire_roundtrip(dt))
        res[f"kv:{dt}"] = compare(ref, got, tag).to_dict()
        log(f"  quality kv:{dt}: {_fmt(res[f'kv:{dt}'])}")
    if REFERENCE in names:
        res[REFERENCE] = compare(ref, ref, tag).to_dict()
    del ref_eng  # one engine in memory at a time (at 1B the reference alone maps 2.3 GiB)
    gc.collect()
    from .native import NativeUnavailable

    for n in names:
        if n == REFERENCE:
            continue
        try:
            eng = open_for_scoring(engine_dir, n, threads)
        except NativeUnavailable as e:  # packed, but this machine cannot run it: say so, measure the rest
            res[n] = {"unavailable": str(e)}
            log(f"  quality {n}: not measured here ({e})")
            continue
        got = teacher_forced_per_core(eng, ids, lambda name=n: open_for_scoring(engine_dir, name, threads))
        res[n] = compare(ref, got, tag).to_dict()
        log(f"  quality {n}: {_fmt(res[n])}")
        del eng
        gc.collect()
    return res


NATIVE_ENGINES_MAX = 4


def teacher_forced_per_core(eng, ids: np.ndarray, reopen: Callable[[], object]) -> np.ndarray:
    """teacher_forced(eng, ids), with the rows of a native engine (which runs a call on one core) split over one
    engine per core on threads (cffi releases the GIL): its rows are independent sequences, each computed exactly
    as in one batch (tests/test_native.py), so the logits are the same. 1B gate: 32 s on one core of two."""
    from concurrent.futures import ThreadPoolExecutor

    k = min(os.cpu_count() or 1, NATIVE_ENGINES_MAX, len(ids))
    if getattr(eng, "attention", None) != "native" or k < 2:
        return teacher_forced(eng, ids)
    extra = [reopen() for _ in range(k - 1)]
    try:
        parts = np.array_split(np.arange(len(ids)), k)
        with ThreadPoolExecutor(k, thread_name_prefix="gate-native") as pool:
            outs = list(pool.map(lambda job: teacher_forced(job[0], ids[job[1]]), zip([eng] + extra, parts)))
    finally:
        for e in extra:
            e.native.close()
    return np.concatenate(outs)


def open_for_scoring(engine_dir: str, name: str, threads: int = 0):
    """The engine, as a score view when it is a standard-op ONNX Runtime graph (teacher forcing in one call)."""
    from .manifest import read_manifest, resolve_engine
    from .runtime import Engine

    man = read_manifest(engine_dir) or {}
    info = man.get("engines", {}).get(resolve_engine(man, name) or name, {})
    view = info.get("backend") == "onnxruntime" and info.get("attention", "standard") == "standard"
    return Engine(engine_dir, name, threads=threads, score_view=view)


def _fmt(q: dict) -> str:
    return (f"mean KLD {q['mean_kld']:.6f}, p99 {q['p99_kld']:.5f}, same top-1 {q['same_top_pct']:.1f}% "
            f"({q['tokens']} tokens, {q['texts']})")


# --- llama.cpp on the same texts (comparison row; needs llama-cpp-python) -------------------------------------

def llamacpp_quantize(src_gguf: str, dst_gguf: str, ftype: int) -> None:
    """llama.cpp's own quantizer (ftype 7 = Q8_0, 0 = all F32); allow_requantize because the shipped GGUF is
    already quantized (Q4_1 layers, Q8_0 embedding)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(src_gguf.encode(), dst_gguf.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src_gguf} -> {dst_gguf}, ftype {ftype}) returned {rc}")


def llamacpp_logits(gguf_path: str, ids: np.ndarray, ctx: int = CTX, threads: int = 1) -> np.ndarray:
    """Teacher-forced logits [N, T-ctx, V] from llama.cpp (logits_all) on the same token ids as teacher_forced."""
    import llama_cpp

    from .llamacpp_compat import no_repack

    with no_repack():  # AMX repacking of Q8_0 segfaults here (llamacpp_compat)
        llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=ids.shape[1] + 8, n_batch=ids.shape[1],
                              logits_all=True, n_threads=threads, verbose=False)
    out = []
    for row in ids:
        llm.reset()
        llm.eval(row.tolist())
        out.append(np.array(llm.scores[ctx - 1:ids.shape[1] - 1], dtype=np.float32))
    del llm
    return np.stack(out)


def llamacpp_rows(engine_dir: str, work_dir: str, texts: Sequence[str] = EVAL_TEXTS, set_name: str = "eval",
                  threads: int = 1) -> Dict[str, dict]:
    """Q8_0 vs our FP32 engine and vs llama.cpp's own F32 (same GGUF source, same token ids)."""
    import os

    from .manifest import load_tokenizer, read_manifest
    from .runtime import Engine

    src = read_manifest(engine_dir)["source"]
    ids = token_matrix(load_tokenizer(engine_dir), texts)
    tag = f"{set_name}/{TEXTS_VERSION}"
    paths = {}
    for name, ft in (("f32", 0), ("q8_0", 7)):
        paths[name] = os.path.join(work_dir, f"model-{name}.gguf")
        if not os.path.exists(paths[name]):
            llamacpp_quantize(src, paths[name], ft)
    ours = teacher_forced(Engine(engine_dir, REFERENCE, threads=threads), ids)
    f32 = llamacpp_logits(paths["f32"], ids, threads=threads)
    q8 = llamacpp_logits(paths["q8_0"], ids, threads=threads)
    return {"llamacpp_q8_0_vs_llamacpp_f32": compare(f32, q8, tag).to_dict(),
            "llamacpp_q8_0_vs_hetserve_fp32": compare(ours, q8, tag).to_dict(),
            "llamacpp_f32_vs_hetserve_fp32": compare(ours, f32, tag).to_dict()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hetserve.engines.quality",
                                 description="KLD / same-top-1 of engines and KV wire dtypes vs the FP32 engine")
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--engines", nargs="*", default=None, help="default: every decode_* ONNX Runtime engine")
    ap.add_argument("--kv-dtypes", nargs="*", default=["fp16", "int8"])
    ap.add_argument("--texts", choices=["eval", "tune"], default="eval")
    ap.add_argument("--llamacpp", metavar="WORK_DIR", help="also llama.cpp Q8_0 (GGUFs written to WORK_DIR)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from .manifest import read_manifest

    texts = EVAL_TEXTS if a.texts == "eval" else TUNE_TEXTS
    man = read_manifest(a.engine_dir)
    names = a.engines if a.engines is not None else [
        n for n, e in man["engines"].items() if n.startswith("decode_") and e["backend"] == "onnxruntime"]
    res = engine_quality(a.engine_dir, names, a.kv_dtypes, texts, a.texts, a.threads)
    if a.llamacpp:
        res.update(llamacpp_rows(a.engine_dir, a.llamacpp, texts, a.texts, a.threads))
    print(f"{'row':34s} {'mean KLD':>10s} {'p99 KLD':>9s} {'same top-1':>10s}")
    for n, q in res.items():
        print(f"{n:34s} {q['mean_kld']:10.6f} {q['p99_kld']:9.5f} {q['same_top_pct']:9.2f}%")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
