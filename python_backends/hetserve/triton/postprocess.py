"""postprocess: stateless incremental detokenisation.

Given all generated ids so far (`output_ids`) and how many are new (`token_ids`), returns the text delta.
A trailing incomplete UTF-8 character is held back until the token that completes it arrives.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ..tokenizer import text_delta
from .common import RequestError, error_response, inp, str_tensor, tokenizer


class TritonPythonModel:
    def initialize(self, args):
        tokenizer()

    def execute(self, requests):
        out = []
        tok = tokenizer()
        for r in requests:
            ids = inp(r, "output_ids")
            new = inp(r, "token_ids")
            if ids is None:
                out.append(error_response(RequestError("missing input 'output_ids'")))
                continue
            all_ids = [int(x) for x in ids.reshape(-1)]
            n = 0 if new is None else int(new.size)
            out.append(pb_utils.InferenceResponse([str_tensor("text_output", [text_delta(tok, all_ids, n)])]))
        return out
