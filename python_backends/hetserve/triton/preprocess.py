"""preprocess: chat template + tokenizer.  text_input -> input_ids."""
from __future__ import annotations

import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from ..tokenizer import encode_prompt
from .common import respond_each, scalar, tokenizer

log = logging.getLogger("hetserve.preprocess")


def tokenize_request(request):
    ids = encode_prompt(tokenizer(), scalar(request, "text_input", None, str),
                        bool(scalar(request, "apply_chat_template", True)))
    return np.asarray(ids, dtype=np.int32)


class TritonPythonModel:
    def initialize(self, args):
        tokenizer()

    def execute(self, requests):
        return respond_each(
            requests, lambda r: pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", tokenize_request(r))]),
            log, "preprocess")
