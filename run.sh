#!/usr/bin/env bash
# Set up + run the main job: build engines, start the prefill and decode Triton servers, stream an answer.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
exec hetserve up --prompt "${1:-What is the capital of France?}" "${@:2}"
