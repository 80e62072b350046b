"""TensorRT 10 engine build (GPU only; UNVERIFIED here: no GPU is lent to this project, scripts/gpu_check.sh).

  prefill_fp16_trt   the FP32 standard-op graph, FP16 builder flag (weakly typed: TensorRT picks FP16 kernels).
  decode_fp8_trt     llm_fp8_qdq.onnx (quantize.py: E4M3 weights + calibrated E4M3 activations), sm >= 89
  decode_int8_trt    llm_int8_qdq.onnx (INT8 weight-only, per channel), any sm >= 61
Both decode plans are built STRONGLY_TYPED from their QDQ graphs: TensorRT takes every tensor's type from the
graph (no precision flags, no calibrator), so the plan's precision is the graph's -- the GEMMs behind Q/DQ run
in FP8/INT8 and nothing else is silently lowered. (The old path set BuilderFlag.INT8/FP8 on a graph without
Q/DQ nodes and no calibrator; TensorRT then kept those layers in FP16/FP32.)
Every plan has one optimization profile per phase, in trt_runtime.PROFILES order: 0 prefill, 1 decode.
"""
from __future__ import annotations

from pathlib import Path

from .trt_runtime import PROFILES

MAX_BATCH, MAX_SEQ = 32, 2048
PREFILL_BATCH = 4


def _shapes(cfg, phase: str):
    """{input: (min, opt, max)} for one phase."""
    L, KVH, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    if phase == "prefill":
        b, t, p = (1, 1, PREFILL_BATCH), (1, 256, MAX_SEQ), (0, 0, MAX_SEQ // 2)
    else:
        b, t, p = (1, MAX_BATCH // 2, MAX_BATCH), (1, 1, 1), (1, 256, MAX_SEQ)
    s = {}
    for n in ("input_ids", "position_ids"):
        s[n] = tuple((b[i], t[i]) for i in range(3))
    s["attention_mask"] = tuple((b[i], 1, t[i], p[i] + t[i]) for i in range(3))
    for n in ("past_key", "past_value"):
        s[n] = tuple((b[i], L, KVH, p[i], D) for i in range(3))
    s["last_index"] = tuple((b[i],) for i in range(3))
    return s


def build_plan(onnx_path: Path, plan_path: Path, cfg, precision: str, strongly_typed: bool):  # pragma: no cover
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errs}")
    config = builder.create_builder_config()
    if not strongly_typed and precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    for phase in PROFILES:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in _shapes(cfg, phase).items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT build failed for {onnx_path} ({precision})")
    plan_path.write_bytes(bytes(plan))


def build_trt_engines(fp32_onnx: Path, out: Path, cfg, log) -> dict:  # pragma: no cover - needs a GPU
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    sm = major * 10 + minor
    jobs = [("prefill_fp16_trt", fp32_onnx, "fp16", False)]
    jobs.append(("decode_int8_trt", out / "llm_int8_qdq.onnx", "int8_qdq", True))
    if sm >= 89:
        jobs.append(("decode_fp8_trt", out / "llm_fp8_qdq.onnx", "fp8_qdq", True))
    res = {}
    for name, src, prec, strong in jobs:
        plan = out / f"{name}.plan"
        log(f"  TensorRT {name} ({prec}{', strongly typed' if strong else ''}) from {src.name} ...")
        build_plan(src, plan, cfg, prec, strong)
        res[name] = {"file": plan.name, "backend": "tensorrt", "precision": f"{prec.split('_')[0]}_trt",
                     "weights": prec, "attention": "standard", "source_graph": src.name,
                     "strongly_typed": strong, "profiles": list(PROFILES)}
    return res
