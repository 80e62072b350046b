"""llama.cpp (llama-cpp-python) as the quality and speed peer, made to run on CPUs with AMX.

On this project's 2-core box (Xeon with AMX-INT8), llama-cpp-python 0.3.36 segfaults in `llama_decode` on a Q8_0
model as soon as llama.cpp repacks its weights into the AMX "extra buffer type"; F32 models are fine. Loading
with `use_extra_bufts = False` (llama.cpp's `--no-repack`) avoids it, so every place that loads a model for a
comparison goes through here: the quality rows (engines/quality.py), the batched peer and the servers the
benchmarks start (`python -m hetserve.engines.llamacpp_compat <llama_cpp.server args>`). The peer then runs its
plain AVX-512 kernels, which is what it would do on any CPU without AMX; the benchmarks say so.
"""
from __future__ import annotations

import contextlib
import runpy
import sys


def _without_repack(p):
    p.use_extra_bufts = False
    return p


def model_params():
    """llama_model_default_params() without the extra (repacked) buffer types."""
    import llama_cpp

    return _without_repack(llama_cpp.llama_cpp.llama_model_default_params())


@contextlib.contextmanager
def no_repack():
    """Within the block, llama_cpp.Llama (and anything else calling llama_model_default_params) loads models
    without repacking. Patches the function in llama_cpp.llama_cpp and its re-export in llama_cpp."""
    import llama_cpp
    import llama_cpp.llama_cpp as raw

    orig = raw.llama_model_default_params

    def patched():
        return _without_repack(orig())

    raw.llama_model_default_params = llama_cpp.llama_model_default_params = patched
    try:
        yield
    finally:
        raw.llama_model_default_params = llama_cpp.llama_model_default_params = orig


def main() -> None:
    """`python -m hetserve.engines.llamacpp_compat ARGS`: llama-cpp-python's OpenAI server with ARGS, no repack."""
    sys.argv = ["llama_cpp.server"] + sys.argv[1:]
    with no_repack():
        runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
