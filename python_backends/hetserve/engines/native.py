"""The native CPU engine: INT8 weights + activations, the whole forward pass in one C call (engines/native/).

Why: ONNX Runtime runs the INT8 graph one op at a time with its own feed/output buffers and, on CPUs without
AVX-512 VNNI, an 8-bit GEMM slower than its fp32 one at batch 16 (loadtest/README.md). hs_engine.c runs a step
for any mix of decode rows (1 token) and prefill rows (many) and writes each token's K/V straight into the
caller's per-sequence KV buffer (the decode batch rows, a prefill job's buffer): no padding, no copies.

Numerics (the `int8` precision of this engine): weights symmetric int8 per block of 16 or 32 inputs (per matrix:
NATIVE_BLOCKS), each block's scale a uint8 times a float32 per row (quantize_matrix), activations quantized per row
and block at run time, int32 dot products (llama.cpp's Q8_0 x Q8_0 scheme at Q8_0's 8.5 bits per weight, with
blocks of 16). Norms, RoPE, softmax and
attention in fp32; embeddings fp32; KV in the wire layout, fp32 in prefill jobs and fp16 in the decode batch.

Interface: native/hs_engine.h is the one definition of the C structs and calls; this module's binding is built
from it by cffi (ABI mode, the header's cdef section), so no layout is mirrored by hand. Every buffer is passed
with its length and the C side checks it against the shape (a mismatch is an error naming it, not an overwrite).

Build: the C source is compiled on first use for this CPU (AVX-512 VNNI, else AVX2 + FMA + F16C) with the system's
C compiler into HETSERVE_NATIVE_CACHE (a file lock makes concurrent servers wait for one compile); `hetserve build`
compiles it once up front. The packed weights are one file in the engine dir (`llm_native_int8.bin`, 64-byte
aligned tensors, index in `llm_native_int8.json`), memory-mapped read-only: servers on one host share the pages.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import config
from .build_plan import chunk_rows
from .cpu_clock import ENGINE_CPU

log = logging.getLogger("hetserve.native")

SRC_DIR = Path(__file__).resolve().parent / "native"
SOURCES = ("hs_engine.h", "hs_engine.c", "hs_gemm.h", "hs_simd.h", "hs_pack.h")
FORMAT = 2  # packed weight file layout (hs_gemm.h); bump when it changes (2: uint8 block scales)
ISA_FLAGS = {
    "avx512": ["-DHS_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2",
               "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
# /proc/cpuinfo flags each build needs
ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"},
                 "avx2": {"avx2", "fma", "f16c"}}
# Block size per matrix (inputs per scale; 16 or 32). 32 everywhere is llama.cpp's Q8_0. Held-out texts
# (engines/quality.py, teacher-forced vs FP32; SmolLM2-135M; uint8 block scales; loadtest/native_ab.py): all 32:
# mean KLD 0.00395, same top-1 95.5% (llama.cpp Q8_0: 0.00388 / 96.3%); 16 for qkv/down/lm_head: 0.00293 / 95.7%;
# all 16: 0.00251 / 95.8%. All 16 is the default: only it keeps the INT8 KLD under 0.7x Q8_0's
# (tests/test_quality.py); its step costs are in loadtest/README.md.
NATIVE_BLOCKS = {"qkv": 16, "o": 16, "gate_up": 16, "down": 16, "lm_head": 16}


class NativeUnavailable(RuntimeError):
    """The native engine cannot run here (CPU, compiler); the message says why."""


class NativeModelUnsupported(NativeUnavailable):
    """This model's shapes are ones the native engine does not handle (on any machine)."""


# ---- the library ------------------------------------------------------------------------------------------------
def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_isa() -> str:
    """The best build this CPU runs (HETSERVE_NATIVE_ISA forces one); NativeUnavailable if none."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"the native engine needs an x86-64 CPU (this is {platform.machine()})")
    flags = cpu_flags()
    want = config.get("HETSERVE_NATIVE_ISA")
    order = ["avx512", "avx2"] if want == "auto" else [want]
    for isa in order:
        if ISA_CPU_FLAGS[isa] <= flags:
            return isa
    raise NativeUnavailable(f"this CPU lacks {sorted(ISA_CPU_FLAGS[order[-1]] - flags)} "
                            f"(HETSERVE_NATIVE_ISA={want})")


def _cache_dir() -> Path:
    d = config.get("HETSERVE_NATIVE_CACHE")
    return Path(d) if d else Path(os.path.expanduser("~")) / ".cache" / "hetserve" / "native"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise NativeUnavailable("no C compiler (gcc/cc, or $CC) to build the native engine")
    return cc


def library_path(isa: str) -> Path:
    """Compile the engine for `isa` unless this exact source + flags + compiler is cached; returns the .so."""
    import fcntl

    cc = _compiler()
    flags = ["-O3", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno"] + ISA_FLAGS[isa]
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SRC_DIR / name).read_bytes())
    h.update(" ".join([cc] + flags).encode())
    try:
        h.update(subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C compiler {cc} does not run: {e}") from None
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"hs_engine_{isa}_{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another server may be compiling the same file
        try:
            if out.exists():
                return out
            tmp = out.with_suffix(f".tmp{os.getpid()}")
            cmd = [cc] + flags + ["-I", str(SRC_DIR), str(SRC_DIR / "hs_engine.c"), "-o", str(tmp), "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise NativeUnavailable(f"compiling the native engine failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
            os.replace(tmp, out)
            log.info("compiled the native engine for %s: %s", isa, out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def cdef_source() -> str:
    """The declarations of native/hs_engine.h between its cdef markers (what cffi parses)."""
    text = (SRC_DIR / "hs_engine.h").read_text()
    return text.split("/* cdef begin", 1)[1].split("/* cdef end */", 1)[0].split("*/", 1)[1]


_FFI = None
_LIBS: Dict[str, object] = {}
_LIBS_LOCK = threading.Lock()


def ffi():
    """The cffi FFI declared from hs_engine.h (one per process)."""
    global _FFI
    with _LIBS_LOCK:
        if _FFI is None:
            import cffi

            f = cffi.FFI()
            f.cdef(cdef_source())
            _FFI = f
        return _FFI


def library(isa: Optional[str] = None):
    """The loaded engine library for `isa` (default: pick_isa()), compiled if needed: a cffi lib whose functions
    and constants are hs_engine.h's (cffi releases the GIL while C runs)."""
    isa = isa or pick_isa()
    F = ffi()
    with _LIBS_LOCK:
        if isa not in _LIBS:
            path = library_path(isa)
            try:
                lib = F.dlopen(str(path))
            except OSError as e:  # a truncated / foreign file in the cache
                raise NativeUnavailable(f"cannot load {path} ({e}); delete it to rebuild") from None
            if lib.hs_abi() != lib.HS_ABI:
                raise NativeUnavailable(f"native engine ABI {lib.hs_abi()} != hs_engine.h's {lib.HS_ABI}: stale "
                                        f"build cache? delete {path}")
            _LIBS[isa] = lib
        return _LIBS[isa]


def error_text(lib, rc: int) -> str:
    """hs_error's name for a return code."""
    return ffi().string(lib.hs_error(rc)).decode()


class NativeCallRefused(ValueError):
    """hs_forward / hs_qgemm returned an error code (`code`, one of hs_engine.h's HS_E_*); nothing was written."""

    def __init__(self, what: str, code: int, text: str):
        super().__init__(f"{what}: {text}")
        self.code = code


def _ptr(ctype: str, a: Optional[np.ndarray]):
    F = ffi()
    return F.NULL if a is None else F.cast(ctype, a.ctypes.data)


def _f32(a: Optional[np.ndarray]) -> dict:
    """hs_f32 of a float32 array (p NULL, n 0 for None)."""
    if a is not None and (a.dtype != np.float32 or not a.flags.c_contiguous):
        raise TypeError(f"hs_f32 needs C-contiguous float32, got {a.dtype}")
    return {"p": _ptr("const float *", a), "n": 0 if a is None else a.size}


# ---- packing (hetserve build) ---------------------------------------------------------------------------------
def quantize_matrix(w: np.ndarray, bs: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [N, K] fp32 -> (packed q uint8 [N/16, K/4, 16, 4], packed block scales uint8 [N/16, K/bs, 16], row
    scales float32 [N]). Symmetric, 8.5 bits per weight at blocks of 16 (llama.cpp Q8_0's bytes at half its
    block): block b of row n has scale u[n, b] * d[n], d = max block absmax / (127 * 255), and u in 1..255 is the
    ceil, floor or nearest of absmax / (127 d) whichever reconstructs the block best (smallest squared error);
    q = round(w / scale) in [-127, 127], stored + 128 (loadtest/native_ab.py compares block sizes end to end).
    Packed by the C library's hs_pack_rows on every core when it runs here (the same bytes: tests/test_native.py),
    else by numpy (_quantize_rows) in cache-sized row chunks (build_plan.chunk_rows)."""
    N, K = w.shape
    if N % 16 or K % bs:
        raise ValueError(f"matrix {N}x{K}: N must be a multiple of 16 and K of the block size {bs}")
    qp = np.empty((N // 16, K // 4, 16, 4), np.uint8)
    sp = np.empty((N // 16, K // bs, 16), np.uint8)
    d = np.empty(N, np.float32)
    lib = _pack_library()
    if lib is not None:
        _pack_c(lib, np.ascontiguousarray(w, np.float32), bs, qp, sp, d)
        return qp, sp, d
    rows = chunk_rows(K, 16)
    for i in range(0, N, rows):
        j = min(N, i + rows)
        _quantize_rows(w[i:j], bs, qp[i // 16:j // 16], sp[i // 16:j // 16], d[i:j])
    return qp, sp, d


_PACK_LIB: list = []  # [lib or None] once known: a machine that cannot compile the engine packs with numpy
PACK_THREADS_MAX = 8


def _pack_library():
    if not _PACK_LIB:
        try:
            _PACK_LIB.append(library())
        except NativeUnavailable as e:
            log.info("packing INT8 weights with numpy (the native library does not run here: %s)", e)
            _PACK_LIB.append(None)
    return _PACK_LIB[0]


def _pack_c(lib, w: np.ndarray, bs: int, qp: np.ndarray, sp: np.ndarray, d: np.ndarray) -> None:
    """hs_pack_rows over row ranges (multiples of 16) on up to PACK_THREADS_MAX threads (cffi drops the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    N, K = w.shape
    args = (_f32(w), N, K, bs)
    bufs = (_ptr("uint8_t *", qp), qp.size, _ptr("uint8_t *", sp), sp.size, _ptr("float *", d), d.size)
    threads = max(1, min(PACK_THREADS_MAX, os.cpu_count() or 1, N // 16))
    step = -(-N // 16 // threads) * 16
    spans = [(i, min(N, i + step)) for i in range(0, N, step)]

    def one(span: Tuple[int, int]) -> None:
        rc = lib.hs_pack_rows(*args, span[0], span[1], *bufs)
        if rc != 0:
            raise NativeCallRefused(f"hs_pack_rows {N}x{K} block {bs}", rc, error_text(lib, rc))

    if len(spans) == 1:
        one(spans[0])
        return
    with ThreadPoolExecutor(len(spans), thread_name_prefix="hs-pack") as pool:
        list(pool.map(one, spans))


def _quantize_rows(w: np.ndarray, bs: int, qp: np.ndarray, sp: np.ndarray, d_out: np.ndarray) -> None:
    N, K = w.shape
    b = w.reshape(N, K // bs, bs).astype(np.float32)
    amax = np.abs(b).max(-1)  # [N, nb]
    d = (amax.max(-1) / (127.0 * 255.0)).astype(np.float32)  # [N]
    dsafe = np.where(d > 0, d, np.float32(1.0))[:, None]
    ideal = amax / np.float32(127.0) / dsafe
    best_q = best_u = best_e = None
    for rnd in (np.ceil, np.floor, np.rint):
        u = np.where(amax > 0, np.clip(rnd(ideal), 1, 255), 0).astype(np.float32)
        sc = u * d[:, None]
        q = np.clip(np.rint(b / np.where(sc > 0, sc, np.float32(1.0))[..., None]), -127, 127)
        e = np.square(q * sc[..., None] - b).sum(-1)
        if best_e is None:
            best_q, best_u, best_e = q, u, e
        else:
            better = e < best_e
            best_q = np.where(better[..., None], q, best_q)
            best_u, best_e = np.where(better, u, best_u), np.where(better, e, best_e)
    assert best_q is not None and best_u is not None
    qu = (best_q.reshape(N, K).astype(np.int16) + 128).astype(np.uint8)
    qp[...] = qu.reshape(N // 16, 16, K // 4, 4).transpose(0, 2, 1, 3)
    sp[...] = best_u.astype(np.uint8).reshape(N // 16, 16, K // bs).transpose(0, 2, 1)
    d_out[...] = d


def _fused(W: dict, names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(W[n], np.float32) for n in names], axis=0)


def native_matrices(ckpt) -> Iterator[Tuple[str, str, np.ndarray]]:
    """(tensor name, NATIVE_BLOCKS kind, W [N, K]) of every GEMM, in file order; one at a time (a generator), so
    packing holds one matrix in float32, not the model."""
    c, W = ckpt.config, ckpt.weights
    for li in range(c.num_layers):
        a, m = f"model.layers.{li}.self_attn.", f"model.layers.{li}.mlp."
        yield f"layer{li}.qkv", "qkv", _fused(W, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        yield f"layer{li}.o", "o", np.asarray(W[a + "o_proj.weight"], np.float32)
        yield f"layer{li}.gate_up", "gate_up", _fused(W, [m + "gate_proj.weight", m + "up_proj.weight"])
        yield f"layer{li}.down", "down", np.asarray(W[m + "down_proj.weight"], np.float32)
    lm = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    yield "lm_head", "lm_head", np.asarray(W[lm], np.float32)


def native_biases(ckpt) -> List[Tuple[str, np.ndarray]]:
    """(tensor name, bias [N]) of every GEMM that has one, fused like its matrix (native_matrices)."""
    c, W = ckpt.config, ckpt.weights
    out = []
    for li in range(c.num_layers):
        a, m = f"model.layers.{li}.self_attn.", f"model.layers.{li}.mlp."
        if c.qkv_bias:
            out.append((f"layer{li}.qkv.bias", _fused(W, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])))
        if c.o_bias:
            out.append((f"layer{li}.o.bias", np.asarray(W[a + "o_proj.bias"], np.float32)))
        if c.mlp_bias:
            out += [(f"layer{li}.gate_up.bias", _fused(W, [m + "gate_proj.bias", m + "up_proj.bias"])),
                    (f"layer{li}.down.bias", np.asarray(W[m + "down_proj.bias"], np.float32))]
    return out


def matrix_shapes(c) -> Dict[str, Tuple[int, int]]:
    """(N outputs, K inputs) of each NATIVE_BLOCKS kind of GEMM for config c (hs_engine.c's Layer / Model)."""
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            "o": (c.hidden_size, c.num_heads * c.head_dim), "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


def unsupported_reason(ckpt, blocks: Dict[str, int]) -> Optional[str]:
    """Why this checkpoint cannot be packed (None: it can). What the C build itself cannot run (head_dim, head
    groups) hs_model_check says when the packed model is loaded (the builder loads it at once)."""
    for kind, (N, K) in matrix_shapes(ckpt.config).items():
        if N % 16 or K % blocks[kind]:
            return f"{kind} matrix {N}x{K}: outputs must be a multiple of 16 and inputs of the block {blocks[kind]}"
    return None


def build_native_int8(ckpt, out_dir: Path, blocks: Optional[Dict[str, int]] = None,
                      name: str = "llm_native_int8") -> dict:
    """Write the packed INT8 weights (+ index) for `ckpt`; returns the manifest entry's fields."""
    blocks = dict(NATIVE_BLOCKS, **(blocks or {}))
    why = unsupported_reason(ckpt, blocks)
    if why:
        raise NativeModelUnsupported(f"checkpoint not supported by the native engine: {why}")
    c, W = ckpt.config, ckpt.weights
    index: Dict[str, list] = {}
    path, tmp = out_dir / f"{name}.bin", out_dir / f"{name}.bin.tmp"
    off = 0
    with open(tmp, "wb") as f:
        def put(key: str, arr: np.ndarray) -> None:
            nonlocal off
            arr = np.ascontiguousarray(arr)
            pad = (-off) % 64
            f.write(b"\0" * pad)
            off += pad
            index[key] = [off, arr.dtype.str, list(arr.shape)]
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))  # no copy of the array
            off += arr.nbytes

        put("embed", np.asarray(W["model.embed_tokens.weight"], np.float32))
        put("final_norm", np.asarray(W["model.norm.weight"], np.float32))
        for li in range(c.num_layers):
            p = f"model.layers.{li}."
            put(f"layer{li}.in_norm", np.asarray(W[p + "input_layernorm.weight"], np.float32))
            put(f"layer{li}.post_norm", np.asarray(W[p + "post_attention_layernorm.weight"], np.float32))
        for key, bvec in native_biases(ckpt):
            put(key, bvec)
        for key, kind, w in native_matrices(ckpt):
            qp, sp, dp = quantize_matrix(w, blocks[kind])
            put(key + ".q", qp)
            put(key + ".s", sp)
            put(key + ".d", dp)
            index[key + ".bs"] = [blocks[kind]]
    os.replace(tmp, path)
    meta = {"format": FORMAT, "blocks": blocks, "tensors": index}
    (out_dir / f"{name}.json").write_text(json.dumps(meta))
    desc = ", ".join(f"{k} {v}" for k, v in blocks.items())
    return {"file": path.name, "index": f"{name}.json", "backend": "native", "attention": "native",
            "precision": "int8", "kv_cache": "fp16 (decode batch; prefill writes fp32)",
            "weights": f"int8-symmetric, uint8 scale per block x float32 per row ({desc})",
            "compute": "int8 x int8 -> int32 (activations quantized per row and block)"}


# ---- the model at run time --------------------------------------------------------------------------------------
class NativeModel:
    """Packed weights mapped from the engine dir + the C model struct (hs_engine.h's hs_model, every tensor with
    its length). `run` is one hs_forward call; calls are serialized (one scratch per model)."""

    def __init__(self, engine_dir: Path, info: dict, cfg, isa: Optional[str] = None):
        from ..model import rope

        self.isa = isa or pick_isa()
        self.lib = library(self.isa)
        F = self.ffi = ffi()
        meta = json.loads((engine_dir / info["index"]).read_text())
        if meta.get("format") != FORMAT:
            raise NativeUnavailable(f"{info['index']}: packed format {meta.get('format')} != {FORMAT}: rebuild "
                                    "the engines (hetserve build --force)")
        self._map = np.memmap(engine_dir / info["file"], mode="r")
        t = meta["tensors"]

        def arr(key):
            o, dt, shape = t[key]
            n = int(np.prod(shape))
            return np.frombuffer(self._map, dtype=dt, count=n, offset=o).reshape(shape) if n else None

        self._qmats: Dict[str, object] = {}

        def qmat(key: str, N: int, K: int) -> dict:
            q, s, d = arr(key + ".q"), arr(key + ".s"), arr(key + ".d")
            self._qmats[key] = F.new("hs_qmat *", {
                "q": _ptr("const uint8_t *", q), "q_len": 0 if q is None else q.size,
                "s": _ptr("const uint8_t *", s), "s_len": 0 if s is None else s.size,
                "d": _f32(d), "N": N, "K": K, "bs": int(t[key + ".bs"][0])})
            return self._qmats[key][0]

        def bias(key):  # p NULL where the model has no such bias
            return _f32(arr(key) if key in t else None)

        c = cfg
        self.cfg = c
        L, C, H, KVH, D = c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        shapes = matrix_shapes(c)
        cos, sin = (np.ascontiguousarray(a, np.float32) for a in rope.tables(c.rope, D, c.max_position))
        self._keep = [cos, sin]  # the C struct points into them
        layers = F.new("hs_layer[]", max(L, 1))
        kinds = ("qkv", "o", "gate_up", "down")
        for li in range(L):
            y = layers[li]
            y.in_norm, y.post_norm = _f32(arr(f"layer{li}.in_norm")), _f32(arr(f"layer{li}.post_norm"))
            for kind in kinds:
                setattr(y, kind, qmat(f"layer{li}.{kind}", *shapes[kind]))
                setattr(y, kind + "_b", bias(f"layer{li}.{kind}.bias"))
            y.window = int(c.layer_windows[li])
        self._layers = layers
        self.model = F.new("hs_model *", {
            "L": L, "C": C, "H": H, "KVH": KVH, "D": D, "I": c.intermediate_size, "V": c.vocab_size,
            "max_pos": c.max_position, "eps": float(c.rms_norm_eps), "embed": _f32(arr("embed")),
            "final_norm": _f32(arr("final_norm")), "rope_cos": _f32(cos), "rope_sin": _f32(sin),
            "layers": layers, "n_layers": L})
        self.model.lm_head = qmat("lm_head", *shapes["lm_head"])
        rc = self.lib.hs_model_check(self.model)
        if rc:
            raise NativeModelUnsupported(f"native engine ({self.isa}) cannot run this model: "
                                         f"{error_text(self.lib, rc)}")
        self._scratch = self.lib.hs_scratch_new()
        if self._scratch == F.NULL:
            raise MemoryError("hs_scratch_new")
        self._lock = threading.Lock()
        self.kv_shape = (L, KVH, D)

    PROFILE_SECTIONS = ("norm", "quantize activations", "qkv gemm", "rope + kv write", "attention", "o gemm",
                        "gate_up gemm", "silu*up", "down gemm", "lm_head gemm")

    def profile(self) -> Dict[str, float]:
        """Seconds per section of hs_forward since the last call (then reset)."""
        out = np.zeros(len(self.PROFILE_SECTIONS), np.float64)
        with self._lock:
            n = self.lib.hs_profile(self._scratch, _ptr("double *", out), len(out))
        if n != len(out):
            raise RuntimeError(f"hs_profile: {n} sections, the binding names {len(out)}")
        return dict(zip(self.PROFILE_SECTIONS, out.tolist()))

    def close(self) -> None:
        with getattr(self, "_lock", threading.Lock()):
            if getattr(self, "_scratch", None) is not None:
                self.lib.hs_scratch_free(self._scratch)
                self._scratch = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def run(self, ids: np.ndarray, pos: np.ndarray, row: np.ndarray, kv_k: np.ndarray, kv_v: np.ndarray,
            lstride: np.ndarray, cap: np.ndarray, kv_len: np.ndarray, out_idx: np.ndarray, logits: np.ndarray,
            kv16: bool = False) -> np.ndarray:
        """One hs_forward: ids int64 [M], pos/row int32 [M], per-sequence kv_k/kv_v pointers (uint64 [R]),
        lstride int64 [R] (elements between layers), cap int32 [R] (positions per head), kv_len int64 [R]
        (elements each K and V buffer holds from its pointer), KV elements fp16 if kv16 else fp32, out_idx int32
        [n_out], logits float32 [>= n_out, V] (written). Every array's length goes with it and hs_forward checks
        them all before writing anything (NativeCallRefused)."""
        for name, a, dt in (("ids", ids, np.int64), ("pos", pos, np.int32), ("row", row, np.int32),
                            ("kv_k", kv_k, np.uint64), ("kv_v", kv_v, np.uint64), ("lstride", lstride, np.int64),
                            ("cap", cap, np.int32), ("kv_len", kv_len, np.int64), ("out_idx", out_idx, np.int32),
                            ("logits", logits, np.float32)):
            if a.dtype != dt or not a.flags.c_contiguous:
                raise TypeError(f"native run: {name} must be C-contiguous {np.dtype(dt).name}, got {a.dtype}")
        R = len(kv_k)
        if not (len(kv_v) == len(lstride) == len(cap) == len(kv_len) == R):
            raise ValueError(f"native run: per-sequence arrays differ in length ({len(kv_k)}, {len(kv_v)}, "
                             f"{len(lstride)}, {len(cap)}, {len(kv_len)})")
        F = self.ffi
        b = F.new("hs_batch *", {
            "ids": {"p": _ptr("const int64_t *", ids), "n": len(ids)},
            "pos": {"p": _ptr("const int32_t *", pos), "n": len(pos)},
            "row": {"p": _ptr("const int32_t *", row), "n": len(row)},
            "n_rows": R, "kv16": int(kv16), "kv_k": _ptr("void * const *", kv_k), "kv_v": _ptr("void * const *", kv_v),
            "lstride": _ptr("const int64_t *", lstride), "cap": _ptr("const int32_t *", cap),
            "kv_len": _ptr("const int64_t *", kv_len),
            "out_idx": {"p": _ptr("const int32_t *", out_idx), "n": len(out_idx)},
            "logits": _ptr("float *", logits), "logits_len": logits.size})
        with self._lock:
            if self._scratch is None:
                raise RuntimeError("native engine closed")
            with ENGINE_CPU.timed():
                rc = self.lib.hs_forward(self.model, self._scratch, b)
        if rc:
            raise NativeCallRefused("native engine refused the call", rc, error_text(self.lib, rc))
        return logits[:len(out_idx)]

    def qgemm(self, name: str, x: np.ndarray) -> np.ndarray:
        """x [M, K] float32 times the packed matrix `name` ("layer0.qkv", "lm_head", ...): the GEMM alone."""
        W = self._qmats[name]
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != W.K:
            raise ValueError(f"x must be [M, {W.K}], got {x.shape}")
        y = np.empty((x.shape[0], W.N), np.float32)
        with self._lock:
            if self._scratch is None:
                raise RuntimeError("native engine closed")
            rc = self.lib.hs_qgemm(self._scratch, self.model, W, x.shape[0], _f32(x), _ptr("float *", y), y.size)
        if rc:
            raise NativeCallRefused("native GEMM refused", rc, error_text(self.lib, rc))
        return y

    def run_sequences(self, seqs: Sequence[Tuple[Sequence[int], int, np.ndarray, np.ndarray]],
                      want: Optional[Sequence[bool]] = None) -> np.ndarray:
        """Each seq (ids, start, k, v): its tokens at positions start.. with K/V written into k, v ([L, KVH, cap, D]
        C-contiguous, float32 or, for every seq, float16; positions < start already hold its past). Returns logits
        [len(seqs), V] of each sequence's last token (rows whose `want` is False are left zero)."""
        R = len(seqs)
        lens = [len(s[0]) for s in seqs]
        M = sum(lens)
        ids = np.empty(M, np.int64)
        pos = np.empty(M, np.int32)
        row = np.empty(M, np.int32)
        kk, vv = np.empty(R, np.uint64), np.empty(R, np.uint64)
        lstride, cap, kv_len = np.empty(R, np.int64), np.empty(R, np.int32), np.empty(R, np.int64)
        t = 0
        out = []
        kv16 = bool(seqs) and seqs[0][2].dtype == np.float16
        for r, (tok, start, k, v) in enumerate(seqs):
            _check_kv(k, v, self.kv_shape, np.float16 if kv16 else np.float32)
            n = lens[r]
            ids[t:t + n] = tok
            pos[t:t + n] = np.arange(start, start + n)
            row[t:t + n] = r
            kk[r], vv[r] = k.ctypes.data, v.ctypes.data
            lstride[r], cap[r], kv_len[r] = k.shape[1] * k.shape[2] * k.shape[3], k.shape[2], k.size
            if n and (want is None or want[r]):
                out.append((r, t + n - 1))
            t += n
        logits = np.zeros((R, self.cfg.vocab_size), np.float32)
        if not M:
            return logits
        sel = np.asarray([o for _, o in out], np.int32)
        got = np.empty((max(1, len(sel)), self.cfg.vocab_size), np.float32)
        self.run(ids, pos, row, kk, vv, lstride, cap, kv_len, sel, got, kv16)
        for i, (r, _) in enumerate(out):
            logits[r] = got[i]
        return logits


def _check_kv(k: np.ndarray, v: np.ndarray, kv_shape, dtype=np.float32) -> None:
    L, H, D = kv_shape
    for a in (k, v):
        if (a.dtype != dtype or not a.flags.c_contiguous or not a.flags.writeable or a.ndim != 4
                or a.shape[0] != L or a.shape[1] != H or a.shape[3] != D):
            raise ValueError(f"KV buffer must be writable C-contiguous {np.dtype(dtype).name} [{L}, {H}, cap, {D}], "
                             f"got {a.dtype} {a.shape}")
    if k.shape != v.shape:
        raise ValueError(f"K and V buffers differ: {k.shape} vs {v.shape}")


# ---- Engine API on the native model (runtime.Engine delegates here) ----------------------------------------------
def prefill(model: NativeModel, ids: Sequence[int], past_k: Optional[np.ndarray] = None,
            past_v: Optional[np.ndarray] = None):
    """One sequence after an optional past [L, KVH, P, D]: (logits [V], new k, v [L, KVH, T, D])."""
    L, H, D = model.kv_shape
    P, T = (0 if past_k is None else int(past_k.shape[2])), len(ids)
    if T < 1:
        raise ValueError("prefill needs at least one token (its logits give the next token)")
    k = np.zeros((L, H, P + T, D), np.float32)
    v = np.zeros_like(k)
    if P:
        k[:, :, :P], v[:, :, :P] = past_k, past_v
    lo = model.run_sequences([(list(ids), P, k, v)])
    return lo[0], np.ascontiguousarray(k[:, :, P:]), np.ascontiguousarray(v[:, :, P:])


def mask_lengths(attention_mask: np.ndarray, P: int, T: int) -> Tuple[np.ndarray, np.ndarray]:
    """(past_lens, new_lens) of an additive mask of runtime.causal_mask's form (validated by the caller)."""
    m = np.asarray(attention_mask)
    B = m.shape[0]
    past = (m[:, 0, 0, :P] == 0).sum(axis=1) if P else np.zeros(B, np.int64)
    new = np.ones(B, np.int64)
    for t in range(1, T):  # a real token attends its predecessor; a padded one only itself
        new += (m[:, 0, t, P + t - 1] == 0) & (new == t)
    return past.astype(np.int64), new


def forward(model: NativeModel, input_ids, position_ids, attention_mask, past_key, past_value, last_index,
            name: str = "native"):
    """runtime.Engine.forward semantics (right-padded past and new tokens, causal_mask's masks): logits [B, V]
    at last_index, new k, v [B, L, KVH, T, D] (padded tokens' K/V left zero). With a past (a decode step, as the
    quality gate's teacher forcing runs them) the KV is held in fp16 like the decode server's NativeBatch, so the
    figures measure what it serves; without one (a prompt) in fp32 like the prefill server's jobs."""
    from .feeds import EngineError, causal_mask

    ids = np.ascontiguousarray(input_ids, np.int64)
    if ids.ndim != 2:
        raise EngineError(f"engine {name!r}: input_ids must be [B, T], got {ids.shape}")
    B, T = ids.shape
    P = int(past_key.shape[3])
    if np.asarray(attention_mask).shape != (B, 1, T, P + T):
        raise EngineError(f"engine {name!r}: attention_mask must be [B, 1, T, P + T] = {[B, 1, T, P + T]}, got "
                          f"{list(np.asarray(attention_mask).shape)}")
    past_lens, new_lens = mask_lengths(attention_mask, P, T)
    if (not np.array_equal(attention_mask, causal_mask(past_lens, new_lens, P, T))
            or not np.array_equal(np.asarray(position_ids)[np.arange(T)[None, :] < new_lens[:, None]],
                                  (past_lens[:, None] + np.arange(T)[None, :])[np.arange(T)[None, :]
                                                                               < new_lens[:, None]])):
        raise EngineError(f"engine {name!r} (native) takes causal masks over a right-padded past and right-padded "
                          "new tokens with matching positions (runtime.causal_mask)")
    last = np.asarray(last_index, np.int64)
    if np.any(last >= new_lens) or np.any(last < 0):
        raise EngineError(f"engine {name!r}: last_index must point at a real (unpadded) token")
    L, H, D = model.kv_shape
    dtype = np.float16 if P else np.float32
    bufs = []
    seqs = []
    for b in range(B):
        pl, nl = int(past_lens[b]), int(new_lens[b])
        k = np.zeros((L, H, pl + nl, D), dtype)
        v = np.zeros_like(k)
        k[:, :, :pl], v[:, :, :pl] = past_key[b, :, :, :pl], past_value[b, :, :, :pl]
        bufs.append((k, v))
        seqs.append((ids[b, :int(last[b]) + 1].tolist(), pl, k, v))
    logits = model.run_sequences(seqs)
    # tokens after last_index (padding-free rows whose last_index < new_len - 1) still need their KV
    tail = [(ids[b, int(last[b]) + 1:int(new_lens[b])].tolist(), int(past_lens[b]) + int(last[b]) + 1, *bufs[b])
            for b in range(B) if int(last[b]) + 1 < int(new_lens[b])]
    if tail:
        model.run_sequences(tail, want=[False] * len(tail))
    nk = np.zeros((B, L, H, T, D), np.float32)
    nv = np.zeros_like(nk)
    for b, (k, v) in enumerate(bufs):
        pl, nl = int(past_lens[b]), int(new_lens[b])
        nk[b, :, :, :nl], nv[b, :, :, :nl] = k[:, :, pl:], v[:, :, pl:]
    return logits, nk, nv
