"""What a build makes for a checkpoint of a given size, and how much memory it needs (checked before it starts).

Small models (FP32 weights <= LARGE_FP32_BYTES) get every engine, the A/B baselines included. Larger ones get the
engines a deployment serves: the FP32 prefill/reference graph with the checkpoint's own 16-bit values when they are
16-bit (exact: the same math as FP32 weights, half the memory; onnx_weights.Exact16Codec), the INT8 decode graph,
the native INT8 engine, and the QDQ graphs TensorRT builds from when this build has TensorRT (or `--qdq yes`).
The fp32 fused decode graph and the INT8 standard-op graph (each one more full copy of the weights, only used for
A/B runs) are recorded as `unbuilt` with the engine served in their place; skipped QDQ graphs are recorded as
`unbuilt` with no fallback (a server configured for one refuses to start, naming why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from ..model.checkpoint import Checkpoint, expected_tensors

GiB = 1 << 30
# Above this the FP32 graph would not leave room for the rest of a build on a 24 GiB development box with a
# decode server beside it (a Llama-3.2-1B shape is 4.6 GiB of FP32 weights; SmolLM2-135M 0.5 GiB).
LARGE_FP32_BYTES = 2 * GiB
PREFILL_WEIGHTS = ("auto", "fp32", "exact16")
QDQ_CHOICES = ("auto", "yes", "no")
# The QDQ graphs (TensorRT's input for decode_int8_trt / decode_fp8_trt; ONNX Runtime runs them slowly on a CPU).
# At 1B they and their calibration and gate rows were 132 s of a 405 s build (loadtest/README.md).
QDQ_ENGINES = ("decode_int8_qdq", "decode_fp8_qdq")

# Elementwise conversions of a weight matrix (quantization) run over row chunks of about this many bytes of
# float32: their temporaries stay in L2 and come from malloc's heap (the builder sends allocations over 1 MiB to
# mmap, each then faulted in page by page). Native INT8 packing of a 16384 x 2048 matrix on one core: 2048-row
# chunks 18 Mweights/s, 128 KiB chunks (16 rows) 38.
CHUNK_BYTES = 128 << 10


def chunk_rows(K: int, multiple: int = 1) -> int:
    """Rows of K float32 values per conversion chunk: a multiple of `multiple`, at least one."""
    return max(multiple, CHUNK_BYTES // (4 * K) // multiple * multiple)


# A/B engines left out of large builds, with the engine that serves in their place (runtime.load_engine)
BASELINE_FALLBACKS = {"decode_fp32": "decode_fp32_standard", "decode_int8_standard": "decode_int8"}
# What servers run for a large model unless the operator says otherwise (manifest `serving`; manifest.configured_
# engines): INT8 native prefill and decode over one mapped weight file. The 16-bit FP32 graph casts every weight
# per call (a reference and fallback, not a serving engine), and loading an FP32 decode engine next to INT8 would
# only cost memory.
LARGE_SERVING = {"HETSERVE_PREFILL_ENGINE": "prefill_int8_native", "HETSERVE_DECODE_ENGINES": "decode_int8_native",
                 "HETSERVE_AGGREGATED_DECODE_ENGINE": "decode_int8_native"}


class BuildRefused(RuntimeError):
    """The machine cannot hold this build (raised before anything is written)."""


@dataclass
class BuildPlan:
    params: int
    largest: int  # elements of the largest tensor
    vocab: int
    prefill_exact16: bool
    baselines: bool
    qdq: bool = True  # the QDQ INT8 / FP8 graphs (QDQ_ENGINES)
    unbuilt: Dict[str, dict] = field(default_factory=dict)
    serving: Dict[str, str] = field(default_factory=dict)  # engine settings' defaults for this model (manifest)

    def estimate_bytes(self) -> int:
        """Peak resident memory of the build, as measured (loadtest/README.md, 1B and 3B): interpreter and
        libraries, the reference graph's weights mapped while it calibrates and gates (2 or 4 bytes a weight),
        its per-call float32 transients (~3x the largest tensor: the embedding / LM head) and the gate's two
        logits buffers (600 positions x vocabulary)."""
        ref = self.params * (2 if self.prefill_exact16 else 4)
        return GiB + ref + 3 * 4 * self.largest + 2 * 600 * 4 * self.vocab

    def describe(self) -> str:
        return (f"{self.params / 1e9:.2f}B parameters; prefill/reference weights "
                f"{'16-bit (exact checkpoint values)' if self.prefill_exact16 else 'fp32'}; "
                f"A/B baselines {'built' if self.baselines else 'skipped'}; "
                f"QDQ graphs {'built' if self.qdq else 'skipped'}; "
                f"estimated peak memory {self.estimate_bytes() / GiB:.1f} GiB")


def plan_build(ckpt: Checkpoint, prefill_weights: str = "auto", qdq: str = "auto",
               tensorrt: bool = False) -> BuildPlan:
    """qdq: auto (build the QDQ graphs for small models and whenever TensorRT builds from them) | yes | no."""
    if prefill_weights not in PREFILL_WEIGHTS:
        raise ValueError(f"prefill weights {prefill_weights!r}: one of {PREFILL_WEIGHTS}")
    if qdq not in QDQ_CHOICES:
        raise ValueError(f"qdq {qdq!r}: one of {QDQ_CHOICES}")
    if qdq == "no" and tensorrt:
        raise ValueError("--qdq no with TensorRT: its decode engines are built from the QDQ graphs")
    shapes = expected_tensors(ckpt.config)
    sizes = [_numel(s) for s in shapes.values()]
    params = sum(sizes)
    large = params * 4 > LARGE_FP32_BYTES
    plan = BuildPlan(params=params, largest=max(sizes), vocab=ckpt.config.vocab_size,
                     prefill_exact16=prefill_weights == "exact16" or (prefill_weights == "auto" and large),
                     baselines=not large, qdq=qdq == "yes" or (qdq == "auto" and (tensorrt or not large)))
    if large:
        why = (f"A/B baseline not built: FP32 weights {params * 4 / GiB:.1f} GiB > {LARGE_FP32_BYTES / GiB:.0f} GiB "
               "(each baseline is one more full copy)")
        plan.unbuilt = {n: {"reason": why, "fallback": fb} for n, fb in BASELINE_FALLBACKS.items()}
        plan.serving = dict(LARGE_SERVING)
    if not plan.qdq:
        why = ("QDQ graph not built (--qdq no)" if qdq == "no" else
               f"QDQ graph not built: it is TensorRT's input and this build has no TensorRT, and at "
               f"{params / 1e9:.2f}B parameters it would add about 40% to the build; `hetserve build --qdq yes` "
               "builds and quality-gates it")
        plan.unbuilt.update({n: {"reason": why, "fallback": None} for n in QDQ_ENGINES})
    return plan


def check_memory(plan: BuildPlan, available: Optional[int] = None) -> None:
    """Refuse, before writing anything, a build that the machine's available memory cannot hold."""
    avail = mem_available() if available is None else available
    need = plan.estimate_bytes()
    if avail and need > avail:
        raise BuildRefused(f"this build needs about {need / GiB:.1f} GiB of memory and {avail / GiB:.1f} GiB is "
                           f"available ({plan.describe()}); free memory or build on a larger machine")


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
