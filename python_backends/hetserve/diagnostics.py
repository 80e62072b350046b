"""Server-side diagnostics: what the prefill and decode model processes run for `hetserve doctor` (over the admin
side channel, admin_channel.py) and kv_ingest's discarding of probe transfers. No Triton import, no CLI: the
client half (checks, report, formatting) is doctor.py.

prefill ops (prefill_op): info | ping | ping_decode | probe_link | kv_check
decode ops (stages/decode.py DecodeStage.admin_ops): info | verify
"""
from __future__ import annotations

import hashlib
import logging
import platform
import re
import time
import uuid
from functools import lru_cache
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from .kv import wire

PROBE_PREFIX = "hetserve-probe/"  # kv_ingest verifies and discards transfers whose request id starts with this
CHECK_PREFIX = "hetserve-doctor/"  # correctness transfers: normal path into decode's pending KV, taken by verify
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
TRT_MIN_SM = {"fp32": 0, "fp16": 53, "int8": 61, "bf16": 80, "fp8": 89}  # TensorRT support by compute capability
DEFAULT_SIZES = (128, 512, 2048)  # KV of this many tokens per link probe


def kv_digest(k: np.ndarray, v: np.ndarray) -> str:
    """sha256 (128 bits) of K then V as C-contiguous float32 bytes: equal digests == bit-identical KV."""
    h = hashlib.sha256()
    for a in (k, v):
        h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    return h.hexdigest()[:32]


def stats(secs: Sequence[float]) -> dict:
    if not secs:
        return {"n": 0}
    a = np.asarray(secs, dtype=np.float64)
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50) * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3),
            "min_ms": float(a.min() * 1e3), "max_ms": float(a.max() * 1e3)}


def _cuda_devices() -> List[dict]:
    try:
        from cuda.bindings import runtime as cudart  # type: ignore

        err, n = cudart.cudaGetDeviceCount()
        if int(err) != 0:
            return []
        out = []
        for i in range(n):
            _, p = cudart.cudaGetDeviceProperties(i)
            name = p.name.decode(errors="replace") if isinstance(p.name, bytes) else str(p.name)
            out.append({"index": i, "name": name.rstrip("\x00"), "sm": p.major * 10 + p.minor})
        return out
    except Exception as e:  # no CUDA bindings / runtime / driver: no devices to report
        logging.getLogger("hetserve.diagnostics").debug("no CUDA devices: %s", e)
        return []


@lru_cache(maxsize=1)
def runtime_info() -> dict:
    info = {"python": platform.python_version(), "numpy": np.__version__, "onnxruntime": None, "providers": [],
            "tensorrt": None, "cuda_devices": _cuda_devices()}
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["providers"] = list(ort.get_available_providers())
    except ImportError:
        pass
    try:
        import tensorrt  # type: ignore

        info["tensorrt"] = tensorrt.__version__
    except Exception as e:  # absent, or present without its CUDA libraries
        logging.getLogger("hetserve.diagnostics").debug("tensorrt not importable: %s", e)
    return info


def _ort_probe(prec: str) -> tuple:
    """Build and run a tiny MatMul(+Softmax) graph computing in `prec` on this process's onnxruntime.
    Returns (ok, providers or reason)."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto as TP
        from onnx import helper as oh
    except ImportError as e:
        return False, f"cannot probe: {e}"
    F = TP.FLOAT
    rng = np.random.default_rng(0)
    want: np.ndarray
    if prec == "int8":
        nodes = [oh.make_node("MatMulInteger", ["a", "b"], ["y32"]), oh.make_node("Cast", ["y32"], ["y"], to=F)]
        ins = [oh.make_tensor_value_info(n, TP.INT8, [4, 8] if n == "a" else [8, 4]) for n in ("a", "b")]
        feeds = {"a": rng.integers(-8, 8, (4, 8)).astype(np.int8), "b": rng.integers(-8, 8, (8, 4)).astype(np.int8)}
        want = feeds["a"].astype(np.float32) @ feeds["b"].astype(np.float32)
        tol = 0.0
    else:
        dt = {"fp32": F, "fp16": TP.FLOAT16, "bf16": TP.BFLOAT16, "fp8": TP.FLOAT8E4M3FN}[prec]
        nodes = [oh.make_node("Cast", ["a"], ["a_"], to=dt), oh.make_node("Cast", ["b"], ["b_"], to=dt),
                 oh.make_node("MatMul", ["a_", "b_"], ["m"]), oh.make_node("Cast", ["m"], ["y"], to=F)]
        ins = [oh.make_tensor_value_info(n, F, [4, 8] if n == "a" else [8, 4]) for n in ("a", "b")]
        feeds = {"a": rng.uniform(-1, 1, (4, 8)).astype(np.float32), "b": rng.uniform(-1, 1, (8, 4)).astype(np.float32)}
        want = feeds["a"] @ feeds["b"]
        tol = {"fp32": 1e-5, "fp16": 2e-2, "bf16": 0.1, "fp8": 0.5}[prec]
    g = oh.make_graph(nodes, f"probe_{prec}", ins, [oh.make_tensor_value_info("y", F, [4, 4])])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 21)])
    m.ir_version = 10
    provs = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
             if p in ort.get_available_providers()]
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        s = ort.InferenceSession(m.SerializeToString(), so, providers=provs)
        got = s.run(None, feeds)[0]
    except Exception as e:
        msg = re.sub(r"\[ONNXRuntimeError\] : \d+ : ", "", str(e).split("\n")[0])
        if msg.startswith("NOT_IMPLEMENTED"):
            msg = f"no {prec} MatMul kernel"
        elif "Type Error" in msg:
            msg = f"ONNX MatMul does not take {prec} inputs"
        return False, f"onnxruntime {'/'.join(provs)}: {msg[:120]}"
    err = float(np.abs(got - want).max())
    if err > tol:
        return False, f"onnxruntime {'/'.join(s.get_providers())}: result off by {err:.3g}"
    return True, f"onnxruntime {'/'.join(s.get_providers())}"


@lru_cache(maxsize=1)
def precision_support() -> Dict[str, dict]:
    """Per precision: can this process compute in it, and via what (or why not)."""
    rt = runtime_info()
    devs = rt["cuda_devices"] if rt["tensorrt"] else []
    out = {}
    for p in PRECISIONS:
        ok, how = _ort_probe(p)
        via, why = ([how] if ok else []), ([] if ok else [how])
        if devs:
            sm = max(d["sm"] for d in devs)
            if sm >= TRT_MIN_SM[p]:
                via.append(f"tensorrt {rt['tensorrt']} (sm_{sm})")
            else:
                why.append(f"tensorrt needs sm >= {TRT_MIN_SM[p]}, GPU is sm_{sm}")
        elif p in ("bf16", "fp8"):
            why.append(f"no TensorRT + CUDA GPU here (needs sm >= {TRT_MIN_SM[p]})")
        out[p] = {"supported": bool(via), "via": "; ".join(via), "reason": "" if via else "; ".join(why)}
    return out


def server_info(role: str, manifest: dict, loaded: Dict[str, str], **extra) -> dict:
    """The admin `info` answer. loaded: engine name -> precision of the engines this server runs."""
    c = manifest["config"]
    L, H, D = c["num_layers"], c["num_kv_heads"], c["head_dim"]
    per_tok = {dt: wire.payload_nbytes(dt, L, H, 2, D) - wire.payload_nbytes(dt, L, H, 1, D) for dt in wire.DTYPES}
    return {
        "role": role, "compat_hash": manifest["compat_hash"], "manifest_version": manifest.get("manifest_version"),
        "builder": manifest.get("build_key", {}).get("builder"), "built_at": manifest.get("built_at"),
        "source_hash": manifest.get("source_hash"), "model": c.get("name"), "kv_layout": manifest.get("kv_layout"),
        "wire_version": wire.WIRE_VERSION, "kv_wire_dtypes": sorted(wire.DTYPES), "kv_bytes_per_token": per_tok,
        "engines": {n: {"precision": e.get("precision"), "backend": e.get("backend"),
                        "sha256": (e.get("sha256") or "")[:16], "quality": e.get("quality")}
                    for n, e in manifest["engines"].items()},
        "kv_quality": manifest.get("kv_quality"),
        "loaded": dict(loaded), "runtime": runtime_info(), "precision": precision_support(), **extra}


def synthetic_kv(cfg, tokens: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    shape = (cfg.num_layers, cfg.num_kv_heads, tokens, cfg.head_dim)
    rng = np.random.default_rng(seed + tokens)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def probe_link(sender, url: str, transports: Sequence[str], compat_hash: str, cfg, tokens: Sequence[int],
               repeats: int = 3, kv_dtype: str = "fp16", timeout_s: float = 30.0, corrupt: bool = False,
               warmup: bool = True) -> dict:
    """Push synthetic KV of each size through each transport to kv_ingest (which verifies and discards it);
    one untimed 1-token warm-up transfer per transport (connection, shm registration), then `repeats` timed
    ones. corrupt=True flips a payload byte after encoding (the receiver must refuse it)."""
    if kv_dtype not in wire.DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; use one of {sorted(wire.DTYPES)}")
    from .kv.transport import TRANSPORTS

    if not transports or any(t not in TRANSPORTS for t in transports):
        raise ValueError(f"unknown transport in {list(transports)}; use {list(TRANSPORTS)}")
    if not 1 <= repeats <= 100:
        raise ValueError("repeats must be in [1, 100]")
    bad = [t for t in tokens if not 1 <= int(t) <= cfg.max_position]
    if not tokens or bad:
        raise ValueError(f"probe sizes must be token counts in [1, {cfg.max_position}], got {list(tokens)}")

    def rid():
        return f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"

    results, failed = [], set()
    wk, wv = synthetic_kv(cfg, 1)
    warm_hdr, warm_payload = wire.encode(wk, wv, compat_hash, kv_dtype)
    for tr in transports if warmup else ():
        try:
            sender.send(url, tr, rid(), warm_hdr, warm_payload, timeout_s)
        except Exception as e:
            results.append({"transport": tr, "tokens": 1, "bytes": int(warm_payload.nbytes), "seconds": [],
                            "error": str(e)})
            failed.add(tr)
    for T in tokens:
        k, v = synthetic_kv(cfg, int(T))
        hdr, payload = wire.encode(k, v, compat_hash, kv_dtype)
        if corrupt:
            payload[len(payload) // 2] ^= 0xFF  # the header's tag no longer matches
        for tr in transports:
            if tr in failed:
                continue
            secs: List[float] = []
            used: List[str] = []
            row: Dict[str, Any] = {"transport": tr, "tokens": int(T), "kv_dtype": kv_dtype,
                                   "bytes": int(payload.nbytes), "seconds": secs, "transport_used": used}
            try:
                for _ in range(repeats):
                    info = sender.send(url, tr, rid(), hdr, payload, timeout_s)
                    secs.append(float(info["seconds"]))
                    if info["transport"] not in used:
                        used.append(info["transport"])
            except Exception as e:
                row["error"] = str(e)
                failed.add(tr)
            if secs:
                med = float(np.median(secs))
                row.update(stats(secs), gbps=payload.nbytes / med / 1e9, mbps=payload.nbytes / med / 1e6)
            results.append(row)
        del payload
    return {"url": url, "results": results}


def ping_decode(client, n: int = 20, timeout_s: float = 10.0) -> dict:
    """n empty round trips to the decode server's kv_ingest (op=ping) over gRPC."""
    import tritonclient.grpc as grpcclient

    op = grpcclient.InferInput("op", [1], "BYTES")
    op.set_data_from_numpy(np.array([b"ping"], dtype=np.object_))
    secs = []
    for _ in range(max(1, min(int(n), 1000))):
        t0 = time.perf_counter()
        client.infer("kv_ingest", [op], client_timeout=timeout_s)
        secs.append(time.perf_counter() - t0)
    return stats(secs)


def kv_check(engine, sender, url: str, transport: str, kv_dtype: str, ids: List[int], compat_hash: str,
             timeout_s: float = 30.0) -> dict:
    """Prefill ids[:-1], encode the KV in kv_dtype and send it (normal path) to decode under a CHECK_PREFIX id.
    Returns the digests decode's op=verify must reproduce: `digest_source` (the prefill KV itself) and
    `digest_wire` (what the wire dtype decodes to; equal to the source for fp32)."""
    if len(ids) < 2:
        raise ValueError("kv_check needs a prompt of >= 2 tokens")
    if kv_dtype not in wire.DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; use one of {sorted(wire.DTYPES)}")
    _, k, v = engine.prefill(ids[:-1])
    hdr, payload = wire.encode(k, v, compat_hash, kv_dtype)
    out = {"request_id": f"{CHECK_PREFIX}{uuid.uuid4().hex[:12]}", "input_ids": [int(i) for i in ids],
           "kv_tokens": len(ids) - 1, "kv_dtype": kv_dtype, "transport": transport, "bytes": int(payload.nbytes),
           "mac": hdr.mac[:16], "digest_source": kv_digest(k, v), "digest_wire": kv_digest(*wire.decode(hdr, payload))}
    try:
        info = sender.send(url, transport, out["request_id"], hdr, payload, timeout_s)
        out.update(seconds=info["seconds"], transport_used=info["transport"])
    except Exception as e:
        out["error"] = str(e)
    return out


def verify_kv(engine, prompt: List[int], k: np.ndarray, v: np.ndarray) -> dict:
    """Decode side: next-token logits from the received KV (KV of prompt[:-1], then prompt[-1]) vs a full
    recompute of the prompt on the same engine."""
    if k.shape[2] != len(prompt) - 1:
        raise ValueError(f"received KV holds {k.shape[2]} tokens, expected {len(prompt) - 1} (prompt minus one)")
    recv = engine.prefill(prompt[-1:], k, v)[0]
    full = engine.prefill(prompt)[0]
    a, b = int(np.argmax(recv)), int(np.argmax(full))
    return {"digest": kv_digest(k, v), "kv_tokens": int(k.shape[2]), "engine": engine.name,
            "precision": engine.precision, "max_abs_diff": float(np.abs(recv - full).max()),
            "argmax_received": a, "argmax_full": b,
            "top1_gap": float(full[b] - full[a])}  # 0 when they agree; small when a near tie flipped


PREFILL_OPS = ("info", "ping", "ping_decode", "probe_link", "kv_check")


def _ids(args: dict) -> List[int]:
    raw = args.get("input_ids") or []
    if not isinstance(raw, list) or not all(isinstance(x, int) for x in raw):
        raise ValueError("'input_ids' must be a list of token ids")
    return raw


def prefill_op(stage, op: str, args: dict, tokenizer: Callable[[], Any]) -> dict:
    """The prefill model's admin ops. stage: its stages.prefill.PrefillStage (engine, sender, defaults); args:
    the JSON object of the admin request (decode_url, transport, kv_dtype, input_ids and the op's own
    arguments); tokenizer() loads the tokenizer (kv_check of a text prompt)."""
    eng, sender, dflt = stage.engine, stage.sender, stage.defaults
    url = str(args.get("decode_url") or dflt.decode_url)
    transport = str(args.get("transport") or dflt.transport)
    kv_dtype = str(args.get("kv_dtype") or dflt.kv_dtype)
    compat = args.get("compat_hash") or eng.compat_hash
    timeout_s = min(max(float(args.get("timeout_s", 30.0)), 0.1), 300.0)
    if op == "info":
        return server_info("prefill", eng.manifest, {eng.name: eng.precision},
                           defaults={"decode_url": dflt.decode_url, "transport": dflt.transport,
                                     "kv_dtype": dflt.kv_dtype})
    if op == "ping":
        return {"pong": True}
    if op == "ping_decode":  # empty round trips, then 1-token KV round trips per transport (the real KV path)
        n = max(1, min(int(args.get("n", 20)), 100))
        out = {"url": url, "empty": ping_decode(sender.client(url), n, timeout_s), "kv_1token": {}}
        if args.get("transports"):
            r = probe_link(sender, url, args["transports"], compat, eng.config, [1], n, kv_dtype, timeout_s)
            out["kv_1token"] = {row["transport"]: row for row in r["results"]}
        return out
    if op == "probe_link":
        # probe_link refuses sizes outside [1, max_position] and repeats outside [1, 100] with the reason
        return probe_link(sender, url, args.get("transports") or [transport], compat, eng.config,
                          [int(t) for t in args.get("tokens") or DEFAULT_SIZES], int(args.get("repeats", 3)),
                          kv_dtype, timeout_s, bool(args.get("corrupt", False)), bool(args.get("warmup", True)))
    if op == "kv_check":
        ids = _ids(args)
        if not ids:
            if not args.get("prompt"):
                raise ValueError("kv_check needs 'input_ids' or 'prompt' (text)")
            tok = tokenizer()
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": str(args["prompt"])}]))
        bad = [i for i in ids if not 0 <= i < eng.config.vocab_size]
        if bad or len(ids) >= eng.config.max_position:
            raise ValueError(f"kv_check prompt: token ids must be in [0, {eng.config.vocab_size}) and fewer than "
                             f"{eng.config.max_position}")
        return kv_check(eng, sender, url, transport, kv_dtype, ids, compat, timeout_s)
    raise ValueError(f"unknown prefill admin op {op!r}; use one of {list(PREFILL_OPS)}")
