"""TensorRT engine build (GPU only). Prefill FP16; decode FP8 on Hopper+ (sm >= 89) else INT8 (QDQ-free,
FP16 fallback layers). Optimisation profiles cover batch 1..max_batch and sequence 1..max_seq."""
from __future__ import annotations

from pathlib import Path

MAX_BATCH, MAX_SEQ = 32, 2048


def _profile(builder, config, cfg, decode: bool):  # pragma: no cover - needs a GPU
    p = builder.create_optimization_profile()
    L, KVH, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    tmin, topt, tmax = (1, 1, 1) if decode else (1, 256, MAX_SEQ)
    bmax = MAX_BATCH if decode else 4
    pmax = MAX_SEQ if decode else MAX_SEQ // 2
    p.set_shape("input_ids", (1, tmin), (bmax // 2 or 1, topt), (bmax, tmax))
    p.set_shape("position_ids", (1, tmin), (bmax // 2 or 1, topt), (bmax, tmax))
    p.set_shape("attention_mask", (1, 1, tmin, tmin), (bmax // 2 or 1, 1, topt, topt + 256),
                (bmax, 1, tmax, tmax + pmax))
    for n in ("past_key", "past_value"):
        p.set_shape(n, (1, L, KVH, 0, D), (bmax // 2 or 1, L, KVH, 256, D), (bmax, L, KVH, pmax, D))
    p.set_shape("last_index", (1,), (bmax // 2 or 1,), (bmax,))
    config.add_optimization_profile(p)


def build_plan(onnx_path: Path, plan_path: Path, cfg, precision: str, decode: bool):  # pragma: no cover
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errs}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    elif precision == "fp8":
        config.set_flag(trt.BuilderFlag.FP8)
    _profile(builder, config, cfg, decode)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT build failed for {onnx_path} ({precision})")
    plan_path.write_bytes(bytes(plan))


def build_trt_engines(fp32_onnx: Path, out: Path, cfg, log) -> dict:  # pragma: no cover - needs a GPU
    from cuda.bindings import runtime as cudart  # type: ignore

    _, prop = cudart.cudaGetDeviceProperties(0)
    sm = prop.major * 10 + prop.minor
    dec_prec = "fp8" if sm >= 89 else "int8"
    res = {}
    for name, prec, decode in (("prefill_fp16_trt", "fp16", False), (f"decode_{dec_prec}_trt", dec_prec, True)):
        plan = out / f"{name}.plan"
        log(f"  TensorRT {name} ({prec}) ...")
        build_plan(fp32_onnx, plan, cfg, prec, decode)
        res[name] = {"file": plan.name, "backend": "tensorrt", "precision": prec, "weights": prec}
    return res
