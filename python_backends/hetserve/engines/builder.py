"""checkpoint -> ONNX -> engines (+ manifest). Cached: an engine dir whose manifest matches is reused.

CPU (always):  prefill_fp32 (ONNX Runtime FP32), decode_int8 (ONNX Runtime, INT8 MatMulNBits weights);
               prefill_int8_native / decode_int8_native (engines/native.py: one file of packed INT8 weights, the
               C engine compiled for this CPU) when the checkpoint's shapes suit it.
GPU (when `tensorrt` imports and a CUDA device exists): prefill_fp16_trt, decode_int8_trt / decode_fp8_trt.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

from .. import config
from ..model.checkpoint import load_checkpoint
from .build_plan import QDQ_ENGINES, BuildPlan, GiB, check_memory, mem_available, plan_build
from .manifest import KV_LAYOUT, MANIFEST_VERSION, compat_hash, read_manifest, write_manifest

# 11: graphs written tensor by tensor by codecs (onnx_weights.py), 16-bit exact prefill weights for large models,
#     FP8 lm_head in float, the lm_head after an Identity (score views); 10: `unbuilt` engines with their fallback;
# 9: config semantics (rope types, biases, sliding windows, qwen2);
# 8: native uint8 block scales; 7: native quality on its fp16 KV cache; 6: native INT8 engine;
# 5: INT8 scheme, QDQ, quality
BUILDER_VERSION = 11


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def default_engine_dir() -> str:
    if config.is_set("HETSERVE_ENGINE_DIR"):
        return config.get("HETSERVE_ENGINE_DIR")
    return str(Path.cwd() / ".hetserve" / "engines")


def gpu_available() -> bool:
    try:
        import tensorrt  # noqa: F401
        from cuda.bindings import runtime as cudart  # type: ignore

        err, n = cudart.cudaGetDeviceCount()
        return int(err) == 0 and n > 0
    except Exception as e:  # no TensorRT / CUDA bindings / driver: the CPU engines only
        logging.getLogger("hetserve.build").debug("no GPU for the builder: %s", e)
        return False


def build_engines(checkpoint: Optional[str], out_dir: str, tensorrt: Optional[bool] = None,
                  force: bool = False, log: Optional[Callable[[str], None]] = None,
                  prefill_weights: str = "auto", qdq: str = "auto") -> dict:
    """prefill_weights: auto | fp32 | exact16; qdq: auto | yes | no (build_plan.py). Raises build_plan.BuildRefused,
    before writing anything, when the machine's available memory cannot hold the build."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _mmap_large_allocations()
    log(f"[1/{STEPS}] loading checkpoint {checkpoint or '(default SmolLM2-135M-Instruct GGUF)'}")
    ckpt = load_checkpoint(checkpoint)
    chash = compat_hash(ckpt.source_hash, ckpt.config)
    use_trt = gpu_available() if tensorrt is None else tensorrt
    plan = plan_build(ckpt, prefill_weights, qdq, bool(use_trt))
    key = {"compat_hash": chash, "builder": BUILDER_VERSION, "tensorrt": bool(use_trt),
           "prefill_exact16": plan.prefill_exact16, "qdq": plan.qdq}
    old = read_manifest(out)
    if not force and old and old.get("build_key") == key and "kv_quality" in old and all(
            (out / e["file"]).exists() for e in old["engines"].values()):
        log(f"engines up to date in {out} (compat {chash}); nothing to build")
        return old

    log(f"  {plan.describe()}; available {mem_available() / GiB:.1f} GiB")
    check_memory(plan)
    # Built into a sibling temporary directory and moved in only when complete: a failure or Ctrl-C at any
    # moment leaves the previous engines as they were and no partial files behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        with build_log(tmp / "build.log") as file_log:
            def both(msg: str) -> None:
                log(msg)
                file_log.info(msg)
            manifest = _build_into(tmp, ckpt, plan, key, chash, bool(use_trt), both, t0)
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"done in {time.time() - t0:.1f}s -> {out} (compat {chash}; library logs in {out / 'build.log'})")
    return manifest


@contextlib.contextmanager
def build_log(path: Path):
    """The build's full log in the engine dir: its own step lines (with times) and every library log (ONNX Runtime's
    quantization module basicConfig()s the root logger at INFO on import), none of it on the console."""
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s [%(levelname)s] %(message)s"))
    saved = []
    for name in ("onnxruntime", "hetserve.build"):
        lg = logging.getLogger(name)
        saved.append((lg, lg.propagate, lg.level))
        lg.addHandler(h)
        lg.propagate = False
        lg.setLevel(logging.INFO)
    try:
        yield logging.getLogger("hetserve.build")
    finally:
        for lg, propagate, level in saved:
            lg.removeHandler(h)
            lg.propagate, lg.level = propagate, level
        h.close()


def _install(tmp: Path, out: Path) -> None:
    """Move a finished build into `out`; the manifest goes first and comes back last, so an interrupted move reads
    as "not built" (next build redoes it), never as a manifest vouching for files it did not write."""
    (out / "manifest.json").unlink(missing_ok=True)
    for f in sorted(tmp.iterdir()):
        if f.name != "manifest.json":
            os.replace(f, out / f.name)  # servers that have the old file open keep reading the old inode
    os.replace(tmp / "manifest.json", out / "manifest.json")


STEPS = 6


def _bar(desc: str, total: int):
    """A progress bar on an interactive terminal (nothing in logs and pipes): returns (update(n), close())."""
    if not sys.stderr.isatty():
        return (lambda n: None), (lambda: None)
    from tqdm import tqdm

    b = tqdm(total=total, desc=f"  {desc}", unit="layer", leave=False, file=sys.stderr)
    return b.update, b.close


def _write(log, t0, desc: str, build, ckpt, path: Path, codec) -> None:
    log(f"  {desc} -> {path.name}  +{time.time() - t0:.1f}s")
    update, close = _bar(desc, ckpt.config.num_layers)
    try:
        build(ckpt, path, codec, update)
    finally:
        close()
        _trim_heap()


def _glibc():
    """The C library when it is glibc (its allocator has the knobs below), else None: then only memory differs."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _mmap_large_allocations() -> None:
    """Allocations over HETSERVE_BUILD_MMAP_THRESHOLD_MB straight from mmap, so they go back to the OS when freed:
    glibc otherwise serves tensors of tens of MB from its heap and keeps the holes (1B quality gate peak 4.6 ->
    3.7 GiB at 1 MiB); each one is a fresh mapping, though, whose pages fault in again (time)."""
    mb = int(config.get("HETSERVE_BUILD_MMAP_THRESHOLD_MB"))
    libc = _glibc()
    if libc is not None and mb > 0:
        libc.mallopt(-3, mb << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, mb << 20)  # M_TRIM_THRESHOLD


def _trim_heap() -> None:
    """Give freed heap back to the OS between steps: glibc keeps the holes of a step's freed tensors (tens of MB
    each) mapped, ~2 GiB after a 1B graph, which would count against the next step's peak."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _build_into(out: Path, ckpt, plan: BuildPlan, key: dict, chash: str, use_trt: bool, log, t0: float) -> dict:
    from .onnx_fused import build_fused_graph
    from .onnx_graph import build_graph
    from .onnx_weights import Exact16Codec, Float32Codec
    from .quantize import INT8_SCHEME

    log(f"[2/{STEPS}] prefill / reference graph (standard ONNX ops, {ckpt.config.num_layers} layers)  "
        f"+{time.time() - t0:.1f}s")
    ref_codec = Exact16Codec() if plan.prefill_exact16 else Float32Codec()
    fp32 = out / "llm_fp32.onnx"
    _write(log, t0, "fp32 compute, " + ("weights as stored in the checkpoint" if plan.prefill_exact16
                                          else "fp32 weights"), build_graph, ckpt, fp32, ref_codec)
    ref = {"file": fp32.name, "backend": "onnxruntime", "precision": "fp32", "attention": "standard",
           "weights": "fp32"}
    if plan.prefill_exact16:  # fp32 math on the checkpoint's exact values
        ref.update(weights=f"checkpoint values, exact ({ref_codec.describe()}), cast to fp32 per call",
                   compact=True)
    engines = {"prefill_fp32": ref, "decode_fp32_standard": dict(ref)}  # one graph, both roles

    log(f"[3/{STEPS}] INT8 decode graphs ({INT8_SCHEME.describe()})  +{time.time() - t0:.1f}s")
    int8_info = {"backend": "onnxruntime", "precision": "int8", "weights": INT8_SCHEME.describe(),
                 "compute": "int8 (accuracy_level 4)"}
    gqa8 = out / "llm_gqa_int8.onnx"
    _write(log, t0, "fused (GroupQueryAttention) graph, INT8 weights", build_fused_graph, ckpt, gqa8,
           INT8_SCHEME.codec())
    engines["decode_int8"] = dict(int8_info, file=gqa8.name, attention="gqa")
    if plan.baselines:  # A/B baselines: the fused graph in fp32, the standard-op graph in INT8
        gqa32, int8 = out / "llm_gqa_fp32.onnx", out / "llm_int8.onnx"
        _write(log, t0, "fused graph, fp32 weights", build_fused_graph, ckpt, gqa32, Float32Codec())
        _write(log, t0, "standard-op graph, INT8 weights", build_graph, ckpt, int8, INT8_SCHEME.codec())
        engines["decode_fp32"] = {"file": gqa32.name, "backend": "onnxruntime", "precision": "fp32",
                                  "weights": "fp32", "attention": "gqa"}
        engines["decode_int8_standard"] = dict(int8_info, file=int8.name, attention="standard")
    unbuilt = dict(plan.unbuilt)

    log(f"[4/{STEPS}] QDQ graphs for TensorRT + native INT8 engine  +{time.time() - t0:.1f}s")
    if plan.qdq:
        engines.update(_build_qdq(ckpt, fp32, bool(ref.get("compact")), out, log, t0))
    else:
        log(f"  {plan.unbuilt[QDQ_ENGINES[0]]['reason']}")
    native, native_unbuilt = _build_native(ckpt, out, log, t0)
    _trim_heap()
    engines.update(native)
    unbuilt.update(native_unbuilt)
    if use_trt:  # pragma: no cover - needs a GPU
        from .trt_builder import build_trt_engines

        log(f"[5/{STEPS}] building TensorRT engines  +{time.time() - t0:.1f}s")
        engines.update(build_trt_engines(fp32, out, ckpt.config, log))
    else:
        log(f"[5/{STEPS}] TensorRT engines skipped (no GPU/tensorrt)")
    log(f"[6/{STEPS}] tokenizer, manifest, quality gate  +{time.time() - t0:.1f}s")
    from ..tokenizer import Tokenizer

    Tokenizer(ckpt.tokenizer_spec, ckpt.chat_template)._tok.save(str(out / "tokenizer.json"))
    for e in engines.values():
        e["kv_dtype"] = "fp32"
        e["sha256"] = _sha256(out / e["file"])
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "build_key": key,
        "compat_hash": chash,
        "source": ckpt.source,
        "source_hash": ckpt.source_hash,
        "config": ckpt.config.to_dict(),
        "kv_layout": KV_LAYOUT,
        "tokenizer": {"file": "tokenizer.json", "bos_token_id": ckpt.tokenizer_spec.get("bos_token_id"),
                      "eos_token_id": ckpt.tokenizer_spec.get("eos_token_id"),
                      "add_bos": ckpt.tokenizer_spec.get("add_bos", False)},
        "chat_template": ckpt.chat_template,
        "engines": engines,
        "unbuilt": unbuilt,  # {name: {reason, fallback}}: engines this build does not have (runtime.load_engine)
        "serving": plan.serving,  # engine settings' defaults for this model's size (manifest.configured_engines)
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - t0, 1),
    }
    write_manifest(out, manifest)
    _add_quality(out, manifest, log, t0)
    return manifest


# FP8 E4M3 keeps 3 mantissa bits: its weight rounding alone (weight-only, per channel) costs KLD 0.030 on SmolLM2-135M
# (INT8 blocks: 0.0027). Measured variants (held-out texts, 600 tokens): W8A8 everything 0.051; W8A8 with lm_head in
# float 0.029 (ModelOpt's default FP8 recipe also leaves lm_head unquantized); + down_proj 0.022; + v_proj 0.022;
# per-token dynamic activation scales 0.046 (no gain over per tensor); weight-only with lm_head in float 0.015 (but
# no FP8 GEMM on Hopper). Chosen: W8A8 with lm_head in float.
FP8_KEEP = ("lm_head",)


def _build_qdq(ckpt, ref_graph: Path, ref_compact: bool, out: Path, log, t0) -> dict:
    """QDQ INT8 / FP8 decode graphs of the standard-op graph (what TensorRT builds; ONNX Runtime runs them)."""
    from ..tokenizer import Tokenizer
    from .onnx_graph import build_graph
    from .onnx_weights import QdqCodec
    from .quality_texts import TUNE_TEXTS
    from .quantize import calibrate_matmul_inputs

    amax = calibrate_matmul_inputs(ref_graph, ref_compact, Tokenizer(ckpt.tokenizer_spec, ckpt.chat_template),
                                   TUNE_TEXTS)
    res = {}
    for kind, weights in (("int8", "int8-symmetric-per-channel, weight-only (W8A32/A16)"),
                          ("fp8", "fp8-e4m3-per-channel, activations fp8-e4m3 per tensor (W8A8); lm_head in float")):
        f = out / f"llm_{kind}_qdq.onnx"
        _write(log, t0, f"standard-op graph, QDQ {kind.upper()}", build_graph, ckpt, f,
               QdqCodec(kind, amax, keep=FP8_KEEP if kind == "fp8" else ()))
        res[f"decode_{kind}_qdq"] = {"file": f.name, "backend": "onnxruntime", "precision": f"{kind}_qdq",
                                     "weights": weights, "attention": "standard", "format": "qdq",
                                     "compact": True}
    return res


NATIVE_FALLBACKS = {"prefill_int8_native": "prefill_fp32", "decode_int8_native": "decode_int8"}


def _build_native(ckpt, out: Path, log, t0) -> Tuple[dict, dict]:
    """The native INT8 engine: packed weights (any machine), and the C library compiled now for this CPU so the
    servers' first start does not pay for it (a CPU or compiler that cannot build it only logs why). Returns
    (engines, unbuilt): a checkpoint the native engine does not implement is recorded with its reason and the
    engine served in its place, so a server configured for it still starts (runtime.load_engine)."""
    from .native import NativeModel, NativeModelUnsupported, NativeUnavailable, build_native_int8

    log(f"  native INT8 engine (engines/native.py)  +{time.time() - t0:.1f}s")

    def unbuilt(e: Exception) -> Tuple[dict, dict]:
        log(f"  native INT8 engine skipped: {e}; {', '.join(f'{n} -> {fb}' for n, fb in NATIVE_FALLBACKS.items())}")
        return {}, {n: {"reason": str(e), "fallback": fb} for n, fb in NATIVE_FALLBACKS.items()}

    try:
        info = build_native_int8(ckpt, out)
    except NativeModelUnsupported as e:  # refused before writing anything
        return unbuilt(e)
    try:
        NativeModel(out, info, ckpt.config).close()  # compiles the library, checks the shapes against it
    except NativeModelUnsupported as e:
        for f in (info["file"], info["index"]):
            (out / f).unlink(missing_ok=True)
        return unbuilt(e)
    except NativeUnavailable as e:  # packed for any machine; this one cannot run it (the quality gate skips it)
        log(f"  native engine packed, but it cannot run on this machine: {e}")
    # one file, two roles (as prefill_fp32 / decode_fp32_standard share theirs); a decode server that cannot
    # run it loads `fallback` instead (runtime.load_engine)
    return {n: dict(info, fallback=fb) for n, fb in NATIVE_FALLBACKS.items()}, {}


def _add_quality(out: Path, manifest: dict, log, t0) -> None:
    """Teacher-forced KLD / same-top-1 vs the FP32 engine (held-out texts) per engine and KV wire dtype."""
    from .quality import REFERENCE, engine_quality

    log(f"  quality gate (engines/quality.py, held-out texts)  +{time.time() - t0:.1f}s")
    eng = manifest["engines"]
    ref_file = eng[REFERENCE]["file"]
    same = [n for n, e in eng.items() if e["file"] == ref_file]  # the reference graph itself: KLD 0 by definition
    todo = [n for n, e in eng.items() if n.startswith("decode_") and n not in same]  # TensorRT ones too (GPU)
    q = engine_quality(str(out), [REFERENCE] + todo, kv_dtypes=("fp16", "int8", "fp8"), log=log)
    for n in same:
        eng[n]["quality"] = dict(q[REFERENCE], reference=REFERENCE)
    for n in todo:
        eng[n]["quality"] = dict(q[n], reference=REFERENCE)
    manifest["kv_quality"] = {k.split(":", 1)[1]: dict(v, reference=REFERENCE) for k, v in q.items()
                              if k.startswith("kv:")}
    write_manifest(out, manifest)
