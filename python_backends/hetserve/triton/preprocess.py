"""preprocess: chat template + tokenizer.  text_input -> input_ids."""
from __future__ import annotations

import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config
from .common import RequestError, respond_each, scalar, tokenizer

log = logging.getLogger("hetserve.preprocess")


def prompt_limits():
    """(max tokens, max characters) of a prompt, read when asked (not at import); characters are checked before
    tokenizing, so a huge body cannot make the tokenizer do unbounded work."""
    tokens = config.get("HETSERVE_MAX_PROMPT_TOKENS")
    return tokens, config.get("HETSERVE_MAX_PROMPT_CHARS") or 16 * tokens


def tokenize_request(request):
    max_tokens, max_chars = prompt_limits()
    text = scalar(request, "text_input", None, str)
    if text is None:
        raise RequestError("missing input 'text_input'")
    if len(text) > max_chars:
        raise RequestError(f"prompt too long: {len(text)} characters > limit {max_chars}")
    if not text.strip():
        raise RequestError("empty prompt: 'text_input' must contain text")
    tok = tokenizer()
    if bool(scalar(request, "apply_chat_template", True)):
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text)
    if len(ids) > max_tokens:
        raise RequestError(f"prompt too long: {len(ids)} tokens > limit {max_tokens}")
    return np.asarray(ids, dtype=np.int32)


class TritonPythonModel:
    def initialize(self, args):
        tokenizer()

    def execute(self, requests):
        return respond_each(
            requests, lambda r: pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", tokenize_request(r))]),
            log, "preprocess")
