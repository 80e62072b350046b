"""GPU runtimes for built engines: TensorRT 10 plans (TrtRunner) and ONNX Runtime's CUDA provider.

Imported lazily: nothing here imports tensorrt / torch / cuda at module import, so `import
hetserve.engines.trt_runtime` works on CPU-only installs; the GPU modules load when a runner is created.

TrtRunner (TensorRT 10 API): a plan built by trt_builder.py has one optimization profile per phase
(PROFILES: 0 = prefill, T >= 1 and small batch; 1 = decode, T = 1 and batch up to MAX_BATCH). One execution
context per profile; `run(feeds)` picks the context by the phase of the call, sets input shapes
(set_input_shape), binds every I/O tensor by name (set_tensor_address) to torch CUDA buffers and launches
execute_async_v3 on a torch CUDA stream. Same interface as runtime.Engine's ONNX Runtime path: numpy feeds in,
numpy (logits, present_key, present_value) out.

UNVERIFIED: no GPU has been lent to this project; scripts/gpu_check.sh is the check to run on one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import config

PROFILES = ("prefill", "decode")  # optimization profile index = position here (trt_builder builds them so)


class GpuUnavailable(RuntimeError):
    """No usable NVIDIA GPU / TensorRT / CUDA runtime; the message says which part is missing."""


def gpu_status() -> Tuple[bool, str]:
    """(usable, reason) for the TensorRT path, without raising: what `hetserve doctor` and gpu_check print."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed (pip install 'hetserve[gpu]')"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch (no NVIDIA GPU or driver)"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False, "tensorrt is not installed (pip install 'hetserve[gpu]')"
    p = torch.cuda.get_device_properties(0)
    return True, f"{p.name}, sm {p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB"


def phase_of(feeds: Dict[str, np.ndarray]) -> str:
    """decode when every row feeds one new token and there is past KV; else prefill."""
    return "decode" if feeds["input_ids"].shape[1] == 1 and feeds["past_key"].shape[3] > 0 else "prefill"


@dataclass
class _Ctx:
    context: object
    profile: int


class TrtRunner:
    """A deserialized TensorRT plan with one execution context per optimization profile."""

    def __init__(self, plan_path: str, device: int = 0):
        ok, why = gpu_status()
        if not ok:
            raise GpuUnavailable(f"cannot load TensorRT engine {plan_path}: {why}")
        import tensorrt as trt
        import torch

        self._trt, self._torch = trt, torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        with open(plan_path, "rb") as f:
            self.engine = self._runtime.deserialize_cuda_engine(f.read())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {plan_path} (built by another TensorRT version?)")
        self.names: List[str] = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.names if n not in self.inputs]
        self.stream = torch.cuda.Stream(self.device)
        self._ctx: Dict[str, _Ctx] = {}
        n_prof = self.engine.num_optimization_profiles
        for i, phase in enumerate(PROFILES[:n_prof]):
            c = self.engine.create_execution_context()
            c.set_optimization_profile_async(i, self.stream.cuda_stream)
            self._ctx[phase] = _Ctx(c, i)
        self.stream.synchronize()

    def _torch_dtype(self, name: str):
        trt, torch = self._trt, self._torch
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64,
                trt.int32: torch.int32, trt.bfloat16: torch.bfloat16}[self.engine.get_tensor_dtype(name)]

    def profile_range(self, phase: str, name: str):
        """(min, opt, max) shapes of input `name` in the phase's profile (for clear shape errors)."""
        return self.engine.get_tensor_profile_shape(name, self._ctx[phase].profile)

    def run(self, feeds: Dict[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        torch = self._torch
        phase = phase_of(feeds)
        ctx = self._ctx.get(phase) or self._ctx["prefill"]
        c = ctx.context
        keep = []  # device buffers must outlive the launch
        with torch.cuda.stream(self.stream):
            for n in self.inputs:
                x = feeds[n]
                lo, _, hi = self.engine.get_tensor_profile_shape(n, ctx.profile)
                if any(s < a or s > b for s, a, b in zip(x.shape, lo, hi)):
                    raise ValueError(f"{n} shape {tuple(x.shape)} outside the {phase} profile [{tuple(lo)}, "
                                     f"{tuple(hi)}] of this TensorRT engine")
                t = torch.from_numpy(np.ascontiguousarray(x)).to(self.device, self._torch_dtype(n),
                                                                 non_blocking=False)
                c.set_input_shape(n, tuple(t.shape))
                c.set_tensor_address(n, t.data_ptr())
                keep.append(t)
            outs = {}
            for n in self.outputs:
                shape = tuple(c.get_tensor_shape(n))
                t = torch.empty(shape, dtype=self._torch_dtype(n), device=self.device)
                c.set_tensor_address(n, t.data_ptr())
                outs[n] = t
            if not c.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError(f"TensorRT execute_async_v3 failed ({phase} profile)")
        self.stream.synchronize()
        lo, k, v = (outs[n].float().cpu().numpy() for n in ("logits", "present_key", "present_value"))
        return lo, k, v


def ort_providers(device: Optional[str] = None) -> list:
    """ONNX Runtime providers for an engine: CUDA EP (onnxruntime-gpu) when HETSERVE_ORT_DEVICE=cuda[:N],
    else CPU. Asking for CUDA where the installed onnxruntime has no CUDA EP is an error, not a silent CPU run."""
    device = device or config.get("HETSERVE_ORT_DEVICE")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if not device.startswith("cuda"):
        raise ValueError(f"HETSERVE_ORT_DEVICE={device!r}: use cpu or cuda[:N]")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise GpuUnavailable(f"HETSERVE_ORT_DEVICE={device} but onnxruntime {ort.__version__} has no CUDA "
                             f"provider (have {ort.get_available_providers()}; install onnxruntime-gpu)")
    dev_id = int(device.split(":", 1)[1]) if ":" in device else 0
    return [("CUDAExecutionProvider", {"device_id": dev_id}), "CPUExecutionProvider"]
