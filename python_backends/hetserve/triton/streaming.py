"""Turning a stream of generated token ids into Triton responses (shared by `llm` and `aggregated`)."""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from ..sampling import SamplingParams
from ..tokenizer import stable_text
from .common import send_error, str_tensor
from .metrics import REGISTRY

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TextStreamer:
    """Incremental detokenisation + stop strings. `push` returns False once generation should stop."""

    def __init__(self, sender, tok, params: SamplingParams, eos_ids, model: str = "llm"):
        self.sender, self.tok, self.params, self.model = sender, tok, params, model
        self.eos_ids = set(eos_ids)
        self.ids: List[int] = []
        self.text = ""  # stable text emitted so far
        self.finish_reason: Optional[str] = None
        self.t0 = time.perf_counter()
        self.ttft: Optional[float] = None

    def _send(self, delta: str, new: List[int], final: bool):
        tensors = [str_tensor("text_output", [delta]), pb_utils.Tensor("token_ids", np.asarray(new, np.int32)),
                   pb_utils.Tensor("output_ids", np.asarray(self.ids, np.int32))]
        if final:
            tensors.append(str_tensor("finish_reason", [self.finish_reason or "stop"]))
        self.sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if final else 0)
        if final and self.ttft is not None and len(self.ids) > 1:
            tpot = (time.perf_counter() - self.t0 - self.ttft) / (len(self.ids) - 1)
            REGISTRY.observe("hetserve_tpot_seconds", tpot, model=self.model)

    def push(self, new: List[int], reason: Optional[str] = None) -> bool:
        if self.ttft is None and new:
            self.ttft = time.perf_counter() - self.t0
            REGISTRY.observe("hetserve_ttft_seconds", self.ttft, model=self.model)
        self.ids.extend(int(t) for t in new)
        visible = [t for t in self.ids if t not in self.eos_ids]
        cur = stable_text(self.tok, visible)
        delta = cur[len(self.text):] if cur.startswith(self.text) else ""
        stop_hit = None
        for s in self.params.stop:
            i = (self.text + delta).find(s)
            if i >= 0 and (stop_hit is None or i < stop_hit):
                stop_hit = i
        if stop_hit is not None:
            delta = (self.text + delta)[len(self.text):stop_hit] if stop_hit >= len(self.text) else ""
            reason = "stop"
        self.text += delta
        if reason:
            self.finish_reason = reason
        self._send(delta, list(new), final=bool(reason))
        return reason is None

    def finish(self, reason: str):
        """Close the stream if generation ended without a final push."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self._send("", [], final=True)

    streaming = True  # one response per step; WholeAnswer-style subclasses answer once

    def fail(self, exc: BaseException):
        """End the stream with `exc` (typed, hetserve.errors): as data first when streaming, then the final Triton
        error of its kind."""
        self.finish_reason = "error"
        send_error(self.sender, exc, as_data=self.streaming)
