#!/usr/bin/env bash
# One-shot check of the GPU path on a machine with an NVIDIA GPU (target: < 8 min on one H200).
#   1. install the GPU extras (tensorrt, onnxruntime-gpu, cuda-python, CUDA torch)
#   2. build TensorRT engines: prefill_fp16_trt, decode_int8_trt, decode_fp8_trt (sm >= 89), strongly typed QDQ
#   3. parity: TensorRT FP16 prefill vs the ONNX Runtime FP32 reference (tolerance below), same-top-1
#   4. the KLD gate (engines/quality.py) on the TensorRT decode engines, bounds of quality.BOUNDS
#   5. prefill + decode servers on TensorRT engines; KV handed over through Triton CUDA shared memory
#   6. short benchmark: TTFT and tok/s at 1 and 16 streams
# Exits non-zero on any failure. Without a GPU it stops at once with a clear message (exit 2).
# UNVERIFIED: no GPU has been lent to this project; this script has only been run on CPU (the no-GPU exit).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${HETSERVE_GPU_CHECK_DIR:-$ROOT/.hetserve/gpu_check}
BASE_PORT=${HETSERVE_GPU_CHECK_PORT:-18000}
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/python_backends${PYTHONPATH:+:$PYTHONPATH}"
fail() { echo "gpu_check: FAIL: $*" >&2; exit 1; }
step() { echo "== gpu_check [$1] $2 ($(( $(date +%s) - T0 ))s)"; }
T0=$(date +%s)

# -- 0. is there a GPU at all? (before installing anything)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi missing or lists no device): the GPU path" \
       "(TensorRT engines, CUDA KV handoff) cannot be checked here. Run this script on a machine with an" \
       "NVIDIA GPU and driver." >&2
  exit 2
fi
nvidia-smi -L

step 1 "install GPU extras"
if [ -z "${HETSERVE_GPU_CHECK_NO_INSTALL:-}" ]; then
  # onnxruntime-gpu provides the same `onnxruntime` module as the CPU wheel: replace, don't stack
  $PY -m pip uninstall -y -q onnxruntime >/dev/null 2>&1 || true
  $PY -m pip install -q -e "$ROOT[gpu]" || fail "pip install .[gpu]"
fi
$PY - <<'EOF' || fail "GPU runtime not usable"
from hetserve.engines.trt_runtime import gpu_status
ok, why = gpu_status()
print("gpu:", why)
raise SystemExit(0 if ok else 1)
EOF

step 2 "build engines (TensorRT)"
mkdir -p "$WORK"
$PY -m hetserve build --engine-dir "$WORK/engines" --tensorrt || fail "hetserve build --tensorrt"

step 3 "parity + KLD gate"
HETSERVE_ENGINE_DIR="$WORK/engines" $PY - <<'EOF' || fail "parity / KLD gate"
import os, sys
import numpy as np
from hetserve.engines.builder import load_tokenizer
from hetserve.engines.manifest import read_manifest
from hetserve.engines.quality import BOUNDS, compare, engine_quality, teacher_forced, token_matrix
from hetserve.engines.runtime import Engine

d = os.environ["HETSERVE_ENGINE_DIR"]
man = read_manifest(d)
trt = sorted(n for n, e in man["engines"].items() if e["backend"] == "tensorrt")
print("TensorRT engines:", trt)
need = {"prefill_fp16_trt", "decode_int8_trt"}
if not need <= set(trt):
    sys.exit(f"missing TensorRT engines: {sorted(need - set(trt))}")
bad = []
# parity: FP16 prefill logits vs the FP32 reference. Tolerance: max |dlogit| <= 0.25 per prompt (FP16 accumulates
# ~1e-3 relative over 30 layers; logits are O(10)), same argmax on >= 9/10 prompts, KLD <= 1e-3.
ref, f16 = Engine(d, "prefill_fp32"), Engine(d, "prefill_fp16_trt")
tok = load_tokenizer(d)
prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain photosynthesis to a child.", "Who wrote Romeo and Juliet?", "Why is the sky blue?",
           "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Describe a cat.", "Tip for Python?"]
same, worst, lr, lf = 0, 0.0, [], []
for p in prompts:
    ids = tok.encode(p)
    a, ka, va = ref.prefill(ids)
    b, kb, vb = f16.prefill(ids)
    worst = max(worst, float(np.abs(a - b).max()))
    same += int(a.argmax() == b.argmax())
    lr.append(a); lf.append(b)
q = compare(np.stack(lr), np.stack(lf), "parity")
print(f"parity prefill_fp16_trt vs fp32: max |dlogit| {worst:.4f} (<= 0.25), argmax {same}/10 (>= 9), "
      f"KLD {q.mean_kld:.2e} (<= 1e-3)")
if worst > 0.25 or same < 9 or q.mean_kld > 1e-3:
    bad.append("fp16 parity")
# KLD gate, held-out texts, TensorRT decode engines (bounds of their QDQ graphs on CPU)
res = engine_quality(d, [n for n in trt if n.startswith("decode_")], kv_dtypes=("fp16", "int8", "fp8"))
for n, r in res.items():
    key = n if n.startswith("kv:") else man["engines"][n]["weights"]  # int8_qdq / fp8_qdq
    bound = BOUNDS.get(key)
    ok = bound is None or r["mean_kld"] <= bound
    print(f"KLD {n:20s} {r['mean_kld']:.6f} (bound {bound}) same-top {r['same_top_pct']:.1f}% {'ok' if ok else 'FAIL'}")
    if not ok:
        bad.append(n)
sys.exit(f"failed: {bad}" if bad else 0)
EOF

step 4 "servers on TensorRT engines, CUDA shared memory KV handoff, benchmark"
DEC=decode_fp8_trt
$PY -c "import json,sys; m=json.load(open('$WORK/engines/manifest.json')); sys.exit(0 if '$DEC' in m['engines'] else 1)" \
  || DEC=decode_int8_trt
HETSERVE_ENGINE_DIR="$WORK/engines" HETSERVE_DEC="$DEC" HETSERVE_BASE="$BASE_PORT" $PY - <<'EOF' || fail "live check"
import os, statistics, sys, threading, time
import numpy as np
from hetserve import client
from hetserve.engines.manifest import read_manifest
from hetserve.kv import wire
from hetserve.topology import Topology

d, dec, base = os.environ["HETSERVE_ENGINE_DIR"], os.environ["HETSERVE_DEC"], int(os.environ["HETSERVE_BASE"])
prec = read_manifest(d)["engines"][dec]["precision"]
env = {"HETSERVE_PREFILL_ENGINE": "prefill_fp16_trt", "HETSERVE_DECODE_ENGINES": f"decode_fp32,{dec}",
       "HETSERVE_DECODE_PRECISION": prec, "HETSERVE_KV_DEVICE": "cuda:0", "HETSERVE_BREAKER_P99_MS": "60000"}
bad = []
with Topology(d, base_port=base, env=env, pin=False) as topo:  # __enter__ starts both and waits ready
    url = topo.prefill_grpc
    g = client.generate(url, "What is the capital of France?", max_tokens=16, decode_precision=prec, kv_dtype="fp16")
    print(f"generate ({prec} decode): {g.text!r} ttft {g.ttft_s * 1e3:.1f} ms")
    if not g.token_ids:
        bad.append("no tokens")
    # CUDA shared memory KV handoff: KV in a CUDA IPC region registered with the decode server
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm
    from hetserve.kv.transport import _ingest_inputs
    man = read_manifest(d)
    c = man["config"]
    k = np.random.default_rng(0).standard_normal((c["num_layers"], c["num_kv_heads"], 64, c["head_dim"]),
                                                  dtype=np.float32)
    hdr, payload = wire.encode(k, k, man["compat_hash"], "fp16")
    dc = grpcclient.InferenceServerClient(topo.decode_grpc)
    h = cudashm.create_shared_memory_region("gpu_check_kv", payload.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(h, [payload])
        dc.register_cuda_shared_memory("gpu_check_kv", cudashm.get_raw_handle(h), 0, payload.nbytes)
        rid, hh, p = _ingest_inputs("gpu-check-cuda-shm", hdr, payload.nbytes)
        p.set_shared_memory("gpu_check_kv", payload.nbytes)
        t = time.perf_counter()
        r = dc.infer("kv_ingest", [rid, hh, p])
        print(f"cuda_shm KV handoff: {payload.nbytes / 1e6:.1f} MB in {(time.perf_counter() - t) * 1e3:.1f} ms, "
              f"{int(r.as_numpy('kv_tokens')[0])} tokens verified by kv_ingest")
        dc.unregister_cuda_shared_memory("gpu_check_kv")
    finally:
        cudashm.destroy_shared_memory_region(h)
    for n in (1, 16):
        out, errs = [], []
        def one(i):
            try:
                out.append(client.generate(url, f"Tell me a fact about the number {i}.", max_tokens=64,
                                           ignore_eos=True, decode_precision=prec, kv_dtype="fp16"))
            except Exception as e:  # noqa: BLE001 - reported below
                errs.append(repr(e))
        t = time.perf_counter()
        th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        [x.start() for x in th]
        [x.join(300) for x in th]
        wall = time.perf_counter() - t
        if errs or len(out) != n:
            bad.append(f"{n} streams: {errs[:2]}")
            continue
        toks = sum(len(o.token_ids) for o in out)
        ttft = sorted(o.ttft_s * 1e3 for o in out)
        print(f"bench {n:2d} streams: {toks / wall:7.1f} tok/s, TTFT p50 {statistics.median(ttft):.1f} ms, "
              f"max {ttft[-1]:.1f} ms")
sys.exit(f"failed: {bad}" if bad else 0)
EOF
step done "all GPU checks passed"
