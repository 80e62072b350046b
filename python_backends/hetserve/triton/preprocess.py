"""preprocess: chat template + tokenizer.  text_input -> input_ids."""
from __future__ import annotations

import os

import numpy as np

import triton_python_backend_utils as pb_utils

from .common import RequestError, error_response, scalar, tokenizer

MAX_PROMPT_TOKENS = int(os.environ.get("HETSERVE_MAX_PROMPT_TOKENS", "4096"))
# checked before tokenizing, so a huge body cannot make the tokenizer do unbounded work
MAX_PROMPT_CHARS = int(os.environ.get("HETSERVE_MAX_PROMPT_CHARS", str(16 * MAX_PROMPT_TOKENS)))


def tokenize_request(request):
    text = scalar(request, "text_input", None, str)
    if text is None:
        raise RequestError("missing input 'text_input'")
    if len(text) > MAX_PROMPT_CHARS:
        raise RequestError(f"prompt too long: {len(text)} characters > limit {MAX_PROMPT_CHARS}")
    if not text.strip():
        raise RequestError("empty prompt: 'text_input' must contain text")
    tok = tokenizer()
    if bool(scalar(request, "apply_chat_template", True)):
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise RequestError(f"prompt too long: {len(ids)} tokens > limit {MAX_PROMPT_TOKENS}")
    return np.asarray(ids, dtype=np.int32)


class TritonPythonModel:
    def initialize(self, args):
        tokenizer()

    def execute(self, requests):
        out = []
        for r in requests:
            try:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", tokenize_request(r))]))
            except RequestError as e:
                out.append(error_response(str(e)))
        return out
