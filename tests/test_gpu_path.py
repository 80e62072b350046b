"""The GPU path where it can be checked without a GPU: lazy imports, clear refusals, gpu_check.sh's no-GPU exit.
(The GPU path itself is unverified here: scripts/gpu_check.sh runs it on a GPU machine.)"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python_backends")}


def test_trt_runtime_imports_without_gpu_modules():
    code = ("import sys, hetserve.engines.trt_runtime, hetserve.engines.trt_builder; "
            "print(sorted(m for m in ('tensorrt', 'torch', 'cuda') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # nothing GPU-side is imported until a runner is made


def test_trt_runner_refuses_clearly(tmp_path):
    from hetserve.engines.trt_runtime import GpuUnavailable, TrtRunner, gpu_status

    ok, why = gpu_status()
    if ok:  # a GPU machine: a missing plan is a plain file error
        with pytest.raises(FileNotFoundError):
            TrtRunner(str(tmp_path / "missing.plan"))
    else:
        with pytest.raises(GpuUnavailable, match="cannot load TensorRT engine .*missing.plan: " + why.split(" (")[0]):
            TrtRunner(str(tmp_path / "missing.plan"))


def test_ort_cuda_provider_refused_without_onnxruntime_gpu(monkeypatch):
    import onnxruntime as ort

    from hetserve.engines.trt_runtime import GpuUnavailable, ort_providers

    assert ort_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="use cpu or cuda"):
        ort_providers("tpu")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert ort_providers("cuda:0")[0][0] == "CUDAExecutionProvider"
    else:
        with pytest.raises(GpuUnavailable, match="no CUDA provider.*onnxruntime-gpu"):
            ort_providers("cuda")


@pytest.mark.parametrize("stub", [False, True])
def test_gpu_check_fails_cleanly_without_gpu(tmp_path, stub):
    """stub=True puts a fake `nvidia-smi` that lists no device first on PATH (so this also holds on a machine
    with a GPU); stub=False is the real machine, only meaningful where there is no nvidia-smi."""
    env = dict(ENV, HETSERVE_GPU_CHECK_DIR=str(tmp_path / "w"))
    if stub:
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{tmp_path}:{env['PATH']}"
    elif shutil.which("nvidia-smi"):
        return  # a GPU machine: the stub case covers the message; the script itself is the GPU check
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "no NVIDIA GPU on this machine" in p.stderr and "cannot be checked here" in p.stderr
    assert not (tmp_path / "w").exists()  # stopped before installing or building anything
