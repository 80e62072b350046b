"""`hetserve doctor`: preflight check of a prefill/decode server pair, with clear PASS/FAIL lines.

Sections (each check prints PASS, WARN, FAIL or SKIP; the exit code is 1 when any check FAILs):
  servers    both servers reachable and ready; Triton version from the server metadata
  precision  what each server can run (fp32/fp16/bf16/int8/fp8), asked of the server itself (`op=info`)
  versions   compat hash, manifest, wire format and engine agreement between prefill and decode
  latency    ping-pong p50/p99: client -> prefill, client -> decode, prefill -> decode (measured on prefill)
  link       KV-sized synthetic transfers pushed by the prefill server through each transport into decode's
             kv_ingest (header + HMAC tag verified there, then discarded): MB/s and GB/s; and the refusal of a
             transfer with a wrong compat hash and of one with a corrupted payload
  kv         correctness set: prompt KV -> wire (fp32/fp16/int8) -> each transport -> decode, which decodes it
             and returns a digest (fp32 must be bit-exact) and its next-token logits from the received KV vs a
             full recompute of the prompt (max |diff| per dtype; int8: argmax agreement)

The module has two halves: the client (Doctor, format_text) and the helpers the Triton models call for their
doctor ops (prefill: info|ping|ping_decode|probe_link|kv_check, decode: info|verify, kv_ingest: ping and
discarding PROBE_PREFIX transfers). Nothing here imports Triton's python backend.
"""
from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Sequence

import numpy as np

from .client import admin_parameters
from .kv import wire
from .kv.transport.registry import CPU_NAMES as CPU_TRANSPORTS  # link/kv probes by default: grpc, shm, nixl

PROBE_PREFIX = "hetserve-probe/"  # kv_ingest verifies and discards transfers whose request id starts with this
CHECK_PREFIX = "hetserve-doctor/"  # correctness transfers: normal path into decode's pending KV, taken by op=verify
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
TRT_MIN_SM = {"fp32": 0, "fp16": 53, "int8": 61, "bf16": 80, "fp8": 89}  # TensorRT support by compute capability
# max |logit diff| (received KV vs full recompute on decode); int8 also needs argmax agreement (or a near tie)
THRESHOLDS = {"fp32": 1e-4, "fp16": 1e-2, "int8": 1.5}
DEFAULT_SIZES = (128, 512, 2048)  # KV of this many tokens per link probe
DEFAULT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")


class DoctorError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------
# server side: called from the Triton models' doctor ops
# ---------------------------------------------------------------------------------------------------------
def kv_digest(k: np.ndarray, v: np.ndarray) -> str:
    """sha256 (128 bits) of K then V as C-contiguous float32 bytes: equal digests == bit-identical KV."""
    h = hashlib.sha256()
    for a in (k, v):
        h.update(memoryview(np.ascontiguousarray(a, dtype=np.float32)).cast("B"))
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
    except Exception:
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
    except Exception:
        pass
    return info


def _ort_probe(prec: str) -> tuple:
    """Build and run a tiny MatMul(+Softmax) graph computing in `prec` on this process's onnxruntime.
    Returns (ok, providers or reason)."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto as TP, helper as oh
    except ImportError as e:
        return False, f"cannot probe: {e}"
    F = TP.FLOAT
    rng = np.random.default_rng(0)
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
    """The `op=info` answer. loaded: engine name -> precision of the engines this server runs."""
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


def synthetic_kv(cfg, tokens: int, seed: int = 0):
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
    warm_hdr, warm_payload = wire.encode(*synthetic_kv(cfg, 1), compat_hash, kv_dtype)
    for tr in transports if warmup else ():
        try:
            sender.send(url, tr, rid(), warm_hdr, warm_payload, timeout_s)
        except Exception as e:
            results.append({"transport": tr, "tokens": 1, "bytes": int(warm_payload.nbytes), "seconds": [],
                            "error": str(e)})
            failed.add(tr)
    for T in tokens:
        hdr, payload = wire.encode(*synthetic_kv(cfg, int(T)), compat_hash, kv_dtype)
        if corrupt:
            payload[len(payload) // 2] ^= 0xFF  # the header's tag no longer matches
        for tr in transports:
            if tr in failed:
                continue
            row = {"transport": tr, "tokens": int(T), "kv_dtype": kv_dtype, "bytes": int(payload.nbytes),
                   "seconds": [], "transport_used": []}
            try:
                for _ in range(repeats):
                    info = sender.send(url, tr, rid(), hdr, payload, timeout_s)
                    row["seconds"].append(float(info["seconds"]))
                    if info["transport"] not in row["transport_used"]:
                        row["transport_used"].append(info["transport"])
            except Exception as e:
                row["error"] = str(e)
                failed.add(tr)
            if row["seconds"]:
                med = float(np.median(row["seconds"]))
                row.update(stats(row["seconds"]), gbps=payload.nbytes / med / 1e9, mbps=payload.nbytes / med / 1e6)
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


def prefill_op(model, op: str, args: dict, url: str, transport: str, kv_dtype: str, ids: List[int]) -> dict:
    """The prefill model's doctor ops. model: the prefill TritonPythonModel (engine, sender, defaults)."""
    eng = model.engine
    compat = args.get("compat_hash") or eng.compat_hash
    timeout_s = float(args.get("timeout_s", 30.0))
    if op == "info":
        return server_info("prefill", eng.manifest, {eng.name: eng.precision},
                           defaults={"decode_url": model.default_url, "transport": model.default_transport,
                                     "kv_dtype": model.default_kv_dtype})
    if op == "ping":
        return {"pong": True}
    if op == "ping_decode":  # empty round trips, then 1-token KV round trips per transport (the real KV path)
        n = max(1, min(int(args.get("n", 20)), 100))
        out = {"url": url, "empty": ping_decode(model.sender.client(url), n, timeout_s), "kv_1token": {}}
        if args.get("transports"):
            r = probe_link(model.sender, url, args["transports"], compat, eng.config, [1], n, kv_dtype, timeout_s)
            out["kv_1token"] = {row["transport"]: row for row in r["results"]}
        return out
    if op == "probe_link":
        return probe_link(model.sender, url, args.get("transports") or [transport], compat, eng.config,
                          [int(t) for t in args.get("tokens") or DEFAULT_SIZES], int(args.get("repeats", 3)),
                          kv_dtype, timeout_s, bool(args.get("corrupt", False)), bool(args.get("warmup", True)))
    if op == "kv_check":
        if not ids:
            if not args.get("prompt"):
                raise ValueError("kv_check needs 'input_ids' or doctor_args {\"prompt\": text}")
            from .triton.common import tokenizer  # only inside the prefill server

            tok = tokenizer()
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": str(args["prompt"])}]))
        bad = [i for i in ids if not 0 <= i < eng.config.vocab_size]
        if bad or len(ids) >= eng.config.max_position:
            raise ValueError(f"kv_check prompt: token ids must be in [0, {eng.config.vocab_size}) and fewer than "
                             f"{eng.config.max_position}")
        return kv_check(eng, model.sender, url, transport, kv_dtype, ids, compat, timeout_s)
    raise ValueError(f"unknown op {op!r}; use 'prefill' or one of {list(PREFILL_OPS)}")


def parse_args_json(raw: Optional[str]) -> dict:
    """doctor_args input: a JSON object (or empty)."""
    if not raw:
        return {}
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"doctor_args is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("doctor_args must be a JSON object")
    return d


# ---------------------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Check:
    section: str
    name: str
    status: str  # PASS | WARN | FAIL | SKIP
    detail: str
    data: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.section}/{self.name}"


@dataclass
class Report:
    prefill_url: str
    decode_url: str
    checks: List[Check] = field(default_factory=list)
    sections: Dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.status == "FAIL" for c in self.checks)

    def counts(self) -> Dict[str, int]:
        out = {s: 0 for s in ("PASS", "WARN", "FAIL", "SKIP")}
        for c in self.checks:
            out[c.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "prefill_url": self.prefill_url, "decode_url": self.decode_url,
                "seconds": round(self.seconds, 3), "summary": self.counts(),
                "checks": [asdict(c) | {"id": c.id} for c in self.checks], "sections": self.sections}


def _err(e: Exception) -> str:
    msg = e.message() if hasattr(e, "message") and callable(e.message) else str(e)
    return " ".join(str(msg).split())


class Doctor:
    """Runs the checks against live servers; every network call has a timeout, so a dead server fails fast."""

    def __init__(self, prefill_url: str, decode_url: str, link_url: Optional[str] = None,
                 sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3, transports: Sequence[str] = CPU_TRANSPORTS,
                 probe_dtype: str = "fp16", kv_dtypes: Sequence[str] = ("fp32", "fp16", "int8"),
                 prompts: Sequence[str] = DEFAULT_PROMPTS, ping_n: int = 20, timeout_s: float = 10.0,
                 probe_compat_hash: Optional[str] = None, log=None):
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.link_url = link_url or decode_url  # the decode server as the prefill server reaches it
        self.sizes, self.repeats, self.transports = list(sizes), int(repeats), list(transports)
        self.probe_dtype, self.kv_dtypes, self.prompts = probe_dtype, list(kv_dtypes), list(prompts)
        self.ping_n, self.timeout_s, self.probe_compat_hash = int(ping_n), float(timeout_s), probe_compat_hash
        self.log = log or (lambda s: None)
        self._clients: Dict[str, object] = {}
        self._dead: Dict[str, str] = {}  # transport -> error, when its link probe never reached kv_ingest
        self.report = Report(prefill_url, decode_url)

    # ---- plumbing -------------------------------------------------------------------------------------
    def _client(self, url):
        import tritonclient.grpc as grpcclient

        if url not in self._clients:
            self._clients[url] = grpcclient.InferenceServerClient(url)
        return self._clients[url]

    def close(self):
        for c in self._clients.values():
            try:
                c.close()
            except Exception:
                pass
        self._clients.clear()

    def _add(self, section, name, status, detail, **data) -> Check:
        c = Check(section, name, status, detail, data)
        self.report.checks.append(c)
        self.log(format_check(c))
        return c

    def _inputs(self, op, args, params):
        from .client import build_inputs

        return build_inputs(None, op=op, doctor_args=json.dumps(args or {}), **params)

    def _prefill(self, op, args=None, timeout_s=None, **params) -> dict:
        r = self._client(self.prefill_url).infer("prefill", self._inputs(op, args, params),
                                                 client_timeout=timeout_s or self.timeout_s,
                                                 parameters=admin_parameters())
        out = r.as_numpy("doctor_json")
        if out is None:
            raise DoctorError(f"prefill op={op}: response has no doctor_json (server too old for doctor?)")
        return json.loads(out.reshape(-1)[0])

    def _kv_ingest_ping(self):
        import tritonclient.grpc as grpcclient

        op = grpcclient.InferInput("op", [1], "BYTES")
        op.set_data_from_numpy(np.array([b"ping"], dtype=np.object_))
        self._client(self.decode_url).infer("kv_ingest", [op], client_timeout=self.timeout_s)

    def _decode(self, op, args=None, timeout_s=None, **params) -> dict:
        """One request to the decoupled `decode` model over a gRPC stream; its single final response."""
        from .client import stream_once

        t = timeout_s or self.timeout_s
        try:
            r = stream_once(self.decode_url, "decode", self._inputs(op, args, params), t,
                            parameters=admin_parameters())
        except TimeoutError:
            raise DoctorError(f"decode op={op}: no response within {t:.0f}s") from None
        except Exception as e:
            raise DoctorError(f"decode op={op}: {_err(e)}") from None
        out = r.as_numpy("doctor_json")
        if out is None:
            raise DoctorError(f"decode op={op}: response has no doctor_json (server too old for doctor?)")
        return json.loads(out.reshape(-1)[0])

    def _ping(self, fn) -> dict:
        secs = []
        for _ in range(self.ping_n):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        return stats(secs)

    # ---- checks ---------------------------------------------------------------------------------------
    def check_servers(self) -> Dict[str, bool]:
        up = {}
        for role, url, models in (("prefill", self.prefill_url, ["prefill"]),
                                  ("decode", self.decode_url, ["kv_ingest", "decode"])):
            try:
                c = self._client(url)
                if not c.is_server_live(client_timeout=self.timeout_s):
                    raise DoctorError("server is not live")
                meta = c.get_server_metadata(as_json=True, client_timeout=self.timeout_s)
                missing = [m for m in models if not c.is_model_ready(m, client_timeout=self.timeout_s)]
            except Exception as e:
                self._add("servers", role, "FAIL", f"{role} server at {url} unreachable: {_err(e)}", url=url)
                up[role] = False
                continue
            ver = meta.get("version", "?")
            self.report.sections.setdefault("servers", {})[role] = {"url": url, "triton": ver,
                                                                    "name": meta.get("name")}
            if missing:
                self._add("servers", role, "FAIL", f"{role} server at {url} (Triton {ver}): model(s) "
                          f"{', '.join(missing)} not ready", url=url, triton=ver)
                up[role] = False
            else:
                self._add("servers", role, "PASS", f"Triton {ver} at {url}; {', '.join(models)} ready",
                          url=url, triton=ver)
                up[role] = True
        return up

    def check_precision(self, up) -> Dict[str, dict]:
        infos = {}
        for role in ("prefill", "decode"):
            if not up[role]:
                self._add("precision", role, "SKIP", f"{role} server unreachable")
                continue
            try:
                info = self._prefill("info") if role == "prefill" else self._decode("info")
            except Exception as e:
                self._add("precision", role, "FAIL", f"{role} op=info failed: {_err(e)}")
                continue
            infos[role] = info
            self.report.sections.setdefault("precision", {})[role] = info
            sup = info["precision"]
            loaded = info["loaded"]
            bad = sorted({p for p in loaded.values() if not sup.get(p, {}).get("supported")})
            yes = [p for p in PRECISIONS if sup[p]["supported"]]
            if bad:
                self._add("precision", role, "FAIL", f"loaded engine precision(s) {bad} not runnable here",
                          supported=yes)
            else:
                self._add("precision", role, "PASS", f"runs {', '.join(yes)}; loaded "
                          f"{', '.join(f'{n} ({p})' for n, p in loaded.items())}", supported=yes)
        return infos

    def check_versions(self, infos) -> bool:
        srv = self.report.sections.get("servers", {})
        if set(infos) != {"prefill", "decode"}:
            self._add("versions", "agreement", "SKIP", "needs op=info from both servers")
            return False
        p, d = infos["prefill"], infos["decode"]
        tv = (srv.get("prefill", {}).get("triton"), srv.get("decode", {}).get("triton"))
        keys = ("compat_hash", "manifest_version", "wire_version", "kv_layout", "builder", "built_at", "source_hash")
        self.report.sections["versions"] = {"triton": {"prefill": tv[0], "decode": tv[1]},
                                            **{k: {"prefill": p.get(k), "decode": d.get(k)} for k in keys}}
        self._add("versions", "triton", "PASS" if tv[0] == tv[1] else "WARN",
                  f"Triton {tv[0]} on both" if tv[0] == tv[1] else f"Triton prefill {tv[0]} != decode {tv[1]}")
        ok = p["compat_hash"] == d["compat_hash"]
        self._add("versions", "compat_hash", "PASS" if ok else "FAIL",
                  f"{p['compat_hash']} on both" if ok else
                  f"compat hash mismatch: prefill {p['compat_hash']} != decode {d['compat_hash']} (engines built "
                  "from different checkpoints/configs; decode would refuse every KV transfer)")
        keys = ("manifest_version", "wire_version", "kv_layout")
        diff = [f"{k} prefill {p.get(k)} != decode {d.get(k)}" for k in keys if p.get(k) != d.get(k)]
        self._add("versions", "manifest", "FAIL" if diff else "PASS", "; ".join(diff) or
                  f"manifest v{p['manifest_version']}, wire v{p['wire_version']}, layout {p['kv_layout']}, "
                  f"builder {p.get('builder')} on both")
        shared = sorted(set(p["engines"]) & set(d["engines"]))
        differ = [n for n in shared if p["engines"][n]["sha256"] != d["engines"][n]["sha256"]]
        bw = p.get("builder") != d.get("builder")
        self._add("versions", "engines", "WARN" if differ or bw else "PASS",
                  (f"engines with the same name differ: {differ}; " if differ else "") +
                  (f"builder prefill {p.get('builder')} != decode {d.get('builder')}; " if bw else "") +
                  f"prefill runs {sorted(p['loaded'])}, decode runs {sorted(d['loaded'])}"
                  + ("" if differ else f"; {len(shared)} shared engine(s) identical (sha256)"))
        return ok and not diff

    def check_quality(self, infos) -> None:
        """Build-time KLD / same-top-1 vs FP32 (engines/quality.py) of the loaded engines and the KV wire dtypes,
        from each server's manifest; FAIL above quality.BOUNDS, WARN when a manifest has no figures."""
        from .engines.quality import BOUNDS

        for role, info in infos.items():
            rows = {n: (info["engines"].get(n, {}).get("quality"), p) for n, p in info["loaded"].items()}
            if role == "decode":
                rows.update({f"kv:{dt}": (q, f"kv:{dt}") for dt, q in (info.get("kv_quality") or {}).items()})
            for n, (q, key) in rows.items():
                if not q:
                    self._add("quality", f"{role}/{n}", "WARN" if n.startswith("decode_") else "SKIP",
                              "no quality figures in the manifest (rebuild with this hetserve)")
                    continue
                bound = BOUNDS.get(key)
                bad = bound is not None and q["mean_kld"] > bound
                self._add("quality", f"{role}/{n}", "FAIL" if bad else "PASS",
                          f"mean KLD {q['mean_kld']:.6f} (bound {bound}), same top-1 {q['same_top_pct']:.1f}% vs "
                          f"{q.get('reference', 'fp32')}, {q['tokens']} held-out tokens", **q)

    def check_latency(self, up):
        rows = {}
        for name, role, fn in (("client->prefill", "prefill", lambda: self._prefill("ping")),
                               ("client->decode", "decode", self._kv_ingest_ping),
                               ("prefill->decode", "both", None)):
            if (role == "both" and not (up["prefill"] and up["decode"])) or (role != "both" and not up[role]):
                self._add("latency", name, "SKIP", "server unreachable")
                continue
            try:
                if fn is None:
                    res = self._prefill("ping_decode", {"n": self.ping_n, "timeout_s": self.timeout_s,
                                                        "transports": self.transports},
                                        decode_url=self.link_url, kv_dtype=self.probe_dtype,
                                        timeout_s=self.timeout_s * (self.ping_n + 1) * (1 + len(self.transports)))
                    got = {name: res["empty"]}
                    got.update({f"{name}:{tr}": r for tr, r in res["kv_1token"].items()})
                else:
                    got = {name: self._ping(fn)}
            except Exception as e:
                self._add("latency", name, "FAIL", f"{name} ping failed: {_err(e)}")
                continue
            for n, st in got.items():
                rows[n] = st
                if st.get("error"):
                    self._add("latency", n, "FAIL", f"{n} failed: {st['error']}")
                else:
                    what = f"1-token {st['kv_dtype']} KV ({st['bytes'] / 1e3:.0f} KB): " if "bytes" in st else ""
                    self._add("latency", n, "PASS", f"{what}p50 {st['p50_ms']:.2f} ms, p99 {st['p99_ms']:.2f} ms "
                              f"(n={st['n']})", **{k: st[k] for k in ("n", "p50_ms", "p99_ms", "min_ms", "max_ms")})
        self.report.sections["latency"] = rows

    def _probe(self, args, timeout_s=None, **params) -> dict:
        n = max(1, len(args.get("tokens", [1]))) * (args.get("repeats", 1) + 1) * len(self.transports) + 1
        return self._prefill("probe_link", dict(args, timeout_s=self.timeout_s), decode_url=self.link_url,
                             timeout_s=timeout_s or self.timeout_s * n, **params)

    def check_link(self):
        try:
            res = self._probe({"tokens": self.sizes, "repeats": self.repeats, "transports": self.transports,
                               "compat_hash": self.probe_compat_hash}, kv_dtype=self.probe_dtype)
        except Exception as e:
            self._add("link", "probe", "FAIL", f"prefill op=probe_link failed: {_err(e)}")
            return
        rows = res["results"]
        self.report.sections["link"] = {"kv_dtype": self.probe_dtype, "repeats": self.repeats, "rows": rows}
        for tr in self.transports:
            mine = [r for r in rows if r["transport"] == tr]
            errs = [r for r in mine if r.get("error")]
            if errs:
                self._add("link", tr, "FAIL", f"{tr} transfer of {errs[0]['bytes']} B to {self.link_url} "
                          f"failed: {errs[0]['error']}")
                if "KV refused" not in errs[0]["error"]:  # never reached kv_ingest: don't retry it below
                    self._dead[tr] = errs[0]["error"]
                continue
            fell = sorted({u for r in mine for u in r.get("transport_used", []) if u != tr})
            best = max(mine, key=lambda r: r.get("gbps", 0.0))
            ok = all(r.get("gbps", 0) > 0 for r in mine)
            status = "FAIL" if not ok else ("WARN" if fell else "PASS")
            self._add("link", tr, status, f"{best['gbps']:.2f} GB/s ({best['mbps']:.0f} MB/s) at "
                      f"{best['tokens']} tokens ({best['bytes'] / 1e6:.1f} MB {self.probe_dtype}), p50 "
                      f"{best['p50_ms']:.1f} ms" + (f"; fell back to {fell} (staging region full)" if fell else ""),
                      gbps=best["gbps"])
        # safety: decode must refuse a wrong compat hash and a corrupted payload (garbled output otherwise)
        expect = {"wrong_hash": ({"compat_hash": "0" * 32}, "hash mismatch"),
                  "corrupted": ({"corrupt": True}, "checksum mismatch")}
        live = [t for t in self.transports if t not in self._dead]
        for name, (extra, needle) in expect.items():
            if not live:
                self._add("link", f"refuse_{name}", "SKIP", "no transport reached kv_ingest")
                continue
            try:
                r = self._probe({"tokens": [16], "repeats": 1, "transports": live[:1], "warmup": False, **extra})
                err = next((x.get("error", "") for x in r["results"] if x.get("error")), "")
            except Exception as e:
                self._add("link", f"refuse_{name}", "FAIL", f"probe failed: {_err(e)}")
                continue
            m = re.search(r"KV refused for request \S+: (.*)", err)
            if needle in err:
                self._add("link", f"refuse_{name}", "PASS", f"decode refused it: {(m.group(1) if m else err)[:140]}")
            elif not err:
                self._add("link", f"refuse_{name}", "FAIL", f"decode ACCEPTED a {name.replace('_', ' ')} transfer")
            else:
                self._add("link", f"refuse_{name}", "FAIL", f"expected a refusal mentioning {needle!r}, got: {err}")

    def check_kv(self):
        try:
            pending0 = self._decode("info").get("pending")
        except Exception as e:
            self._add("kv", "set", "FAIL", f"decode op=info failed: {_err(e)}")
            return
        rows = []
        for tr in self.transports:
            for dt in self.kv_dtypes:
                if tr in self._dead:
                    self._add("kv", f"{tr}/{dt}", "SKIP", f"{tr} did not reach kv_ingest (link/{tr})")
                    continue
                per = []
                for text in self.prompts:
                    per.append(self._kv_one(tr, dt, text))
                    if per[-1].get("error"):  # one failure says it; don't repeat it per prompt
                        break
                rows += per
                self._judge_kv(tr, dt, per)
        self.report.sections["kv"] = {"thresholds": THRESHOLDS, "rows": rows}
        try:
            pending1 = self._decode("info").get("pending")
            ok = pending0 is None or pending1 is None or pending1 <= pending0
            self._add("kv", "pending", "PASS" if ok else "FAIL",
                      f"decode pending KV entries before {pending0}, after {pending1}"
                      + ("" if ok else " (doctor transfers left KV behind)"))
        except Exception as e:
            self._add("kv", "pending", "FAIL", f"decode op=info failed: {_err(e)}")

    def _kv_one(self, tr, dt, text) -> dict:
        row = {"transport": tr, "kv_dtype": dt, "prompt": text}
        try:
            sent = self._prefill("kv_check", {"prompt": text, "timeout_s": self.timeout_s,
                                              "compat_hash": self.probe_compat_hash},
                                 decode_url=self.link_url, transport=tr, kv_dtype=dt, timeout_s=self.timeout_s * 3)
            row.update(sent)
            if sent.get("error"):
                return row
            got = self._decode("verify", {"timeout_s": self.timeout_s}, timeout_s=self.timeout_s * 2,
                               request_id=sent["request_id"], input_ids=sent["input_ids"])
            row["decode"] = got
            row["exact"] = got["digest"] == sent["digest_wire"]
            row["bit_exact_source"] = got["digest"] == sent["digest_source"]
        except Exception as e:
            row["error"] = _err(e)
        return row

    def _judge_kv(self, tr, dt, per):
        name = f"{tr}/{dt}"
        errs = [r for r in per if r.get("error")]
        if errs:
            self._add("kv", name, "FAIL", f"{errs[0]['error']}")
            return
        n = len(per)
        exact = sum(r["exact"] for r in per)
        src = sum(r["bit_exact_source"] for r in per)
        diff = max(r["decode"]["max_abs_diff"] for r in per)
        agree = sum(r["decode"]["argmax_received"] == r["decode"]["argmax_full"] for r in per)
        gap = max(r["decode"]["top1_gap"] for r in per)
        thr = THRESHOLDS[dt]
        why = []
        if exact < n:
            why.append(f"decoded KV differs from what was sent ({n - exact}/{n})")
        if dt == "fp32" and src < n:
            why.append(f"fp32 round trip not bit-exact ({n - src}/{n})")
        if diff > thr:
            why.append(f"max |dlogit| {diff:.2e} > {thr:g}")
        if agree < n and (dt != "int8" or gap > diff):
            why.append(f"argmax differs from full recompute ({n - agree}/{n}, top-1 gap {gap:.3f})")
        note = f"{'bit-exact' if dt == 'fp32' else 'lossless wire'} {exact}/{n}, max |dlogit| {diff:.2e} " \
               f"(<= {thr:g}), argmax {agree}/{n}" + (f" (near tie, gap {gap:.3f})" if agree < n else "") + \
               f", {per[0]['bytes'] / 1e3:.0f} KB for {per[0]['kv_tokens']} tokens"
        self._add("kv", name, "FAIL" if why else "PASS", "; ".join(why) if why else note,
                  max_abs_diff=diff, exact=exact, argmax_agree=agree, n=n)

    def run(self) -> Report:
        t0 = time.perf_counter()
        try:
            up = self.check_servers()
            infos = self.check_precision(up)
            self.check_versions(infos)
            self.check_quality(infos)
            self.check_latency(up)
            if up["prefill"] and up["decode"]:
                self.check_link()
                self.check_kv()
            else:
                down = " and ".join(r for r in ("prefill", "decode") if not up[r])
                for s in ("link", "kv"):
                    self._add(s, "all", "SKIP", f"{down} server unreachable")
        finally:
            self.close()
        self.report.seconds = time.perf_counter() - t0
        return self.report


# ---------------------------------------------------------------------------------------------------------
# text output
# ---------------------------------------------------------------------------------------------------------
def format_check(c: Check) -> str:
    return f"[{c.status}] {c.id:<28} {c.detail}"


def _table(header, rows) -> List[str]:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return ["  " + "  ".join(str(x).ljust(n) for x, n in zip(r, w)).rstrip() for r in [header] + rows]


def format_text(rep: Report) -> str:
    out = [f"hetserve doctor: prefill {rep.prefill_url}, decode {rep.decode_url}"]
    by = {}
    for c in rep.checks:
        by.setdefault(c.section, []).append(c)
    s = rep.sections
    for sec in ("servers", "precision", "versions", "latency", "link", "kv"):
        out.append(f"\n== {sec}")
        if sec == "precision":
            for role, info in s.get("precision", {}).items():
                loaded = {}
                for n, p in info["loaded"].items():
                    loaded.setdefault(p, []).append(n)
                out.append(f"  {role} server (onnxruntime {info['runtime']['onnxruntime']}, providers "
                           f"{', '.join(info['runtime']['providers'])}, tensorrt {info['runtime']['tensorrt']}, "
                           f"GPUs {len(info['runtime']['cuda_devices'])}):")
                out += ["  " + x for x in _table(
                    ["precision", "runs", "engines loaded", "via / why not"],
                    [[p, "yes" if v["supported"] else "no", ",".join(loaded.get(p, [])) or "-",
                      v["via"] or v["reason"]] for p, v in info["precision"].items()])]
        if sec == "link" and "link" in s:
            L = s["link"]
            out.append(f"  synthetic {L['kv_dtype']} KV, median of {L['repeats']} (prefill -> decode kv_ingest, "
                       "HMAC verified, discarded)")
            out += _table(["transport", "tokens", "MB", "p50 ms", "MB/s", "GB/s"],
                          [[r["transport"], r["tokens"], f"{r['bytes'] / 1e6:.2f}",
                            f"{r['p50_ms']:.1f}" if "p50_ms" in r else "-",
                            f"{r['mbps']:.0f}" if "mbps" in r else "-",
                            f"{r['gbps']:.3f}" if "gbps" in r else r.get("error", "-")[:60]]
                           for r in L["rows"]])
        for c in by.get(sec, []):
            out.append(format_check(c))
    n = rep.counts()
    out.append(f"\nsummary: {n['PASS']} PASS, {n['WARN']} WARN, {n['FAIL']} FAIL, {n['SKIP']} SKIP in "
               f"{rep.seconds:.1f}s -> {'PASS' if rep.ok else 'FAIL'}")
    return "\n".join(out)


def main(args) -> int:
    """Entry point of `hetserve doctor` (argparse namespace from cli.py)."""
    d = Doctor(args.prefill_url, args.decode_url, link_url=args.link_url, sizes=args.sizes, repeats=args.repeats,
               transports=args.transports, probe_dtype=args.probe_dtype, kv_dtypes=args.kv_dtypes,
               ping_n=args.ping, timeout_s=args.timeout, probe_compat_hash=args.probe_compat_hash,
               prompts=args.prompt or DEFAULT_PROMPTS)
    rep = d.run()
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        print(format_text(rep))
    sys.stdout.flush()
    return 0 if rep.ok else 1
