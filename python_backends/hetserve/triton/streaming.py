"""Turning a stream of generated token ids into Triton responses (shared by `llm` and `aggregated`)."""
from __future__ import annotations

import threading
import time
from typing import List, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from ..sampling import SamplingParams, TokenLogprobs
from ..tokenizer import IncrementalDetokenizer
from .common import PROMPT_LOGPROB_OUTPUTS, logprob_tensors, send_error, str_tensor
from .metrics import REGISTRY

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ChoiceSender:
    """The response sender shared by the n choices of one request: sends are serialised, and only the last
    choice to finish sends the FINAL flag (each choice's last response says finish_reason)."""

    def __init__(self, sender, n: int):
        self.sender, self.left = sender, n
        self._lock = threading.Lock()
        self.is_cancelled = getattr(sender, "is_cancelled", lambda: False)

    def send(self, response, flags: int = 0) -> None:
        with self._lock:
            if flags & FINAL:
                self.left -= 1
                if self.left > 0:
                    flags &= ~FINAL
            self.sender.send(response, flags=flags)


class TextStreamer:
    """Incremental detokenisation + stop strings, linear in the output length (IncrementalDetokenizer decodes a
    short window per step; stop strings are looked for in the new text plus the tail of the old that a stop
    string could start in). `push` returns False once generation should stop. `index`: the choice this stream
    is (n > 1: every response says sequence_index)."""

    def __init__(self, sender, tok, params: SamplingParams, eos_ids, model: str = "llm", index: Optional[int] = None):
        self.sender, self.tok, self.params, self.model = sender, tok, params, model
        self.index = index
        self.cum_logprob = 0.0
        self._prompt_lps: Optional[TokenLogprobs] = None  # sent with the next response
        self.eos_ids = set(eos_ids)
        self.ids: List[int] = []
        self.text = ""  # stable text emitted so far
        self._detok = IncrementalDetokenizer(tok, skip=self.eos_ids)
        self._stop_tail = max((len(s) for s in params.stop), default=1) - 1
        self.finish_reason: Optional[str] = None
        self.t0 = time.perf_counter()
        self.ttft: Optional[float] = None

    def _send(self, delta: str, new: List[int], final: bool, logprobs: Optional[TokenLogprobs] = None):
        tensors = [str_tensor("text_output", [delta]), pb_utils.Tensor("token_ids", np.asarray(new, np.int32)),
                   pb_utils.Tensor("output_ids", np.asarray(self.ids, np.int32))]
        if self.index is not None:
            tensors.append(pb_utils.Tensor("sequence_index", np.array([self.index], np.int32)))
        if logprobs is not None and len(logprobs):
            tensors += logprob_tensors(logprobs)
        if self._prompt_lps is not None:
            tensors += logprob_tensors(self._prompt_lps, PROMPT_LOGPROB_OUTPUTS)
            self._prompt_lps = None
        if final:
            tensors.append(str_tensor("finish_reason", [self.finish_reason or "stop"]))
            if self.params.wants_logprobs:
                tensors.append(pb_utils.Tensor("cum_log_probs", np.array([self.cum_logprob], np.float32)))
        self.sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if final else 0)
        if final and self.ttft is not None and len(self.ids) > 1:
            tpot = (time.perf_counter() - self.t0 - self.ttft) / (len(self.ids) - 1)
            REGISTRY.observe("hetserve_tpot_seconds", tpot, model=self.model)

    def prompt_logprobs(self, lps: TokenLogprobs) -> None:
        self._prompt_lps = lps

    def push(self, new: List[int], reason: Optional[str] = None, logprobs: Optional[TokenLogprobs] = None) -> bool:
        if self.ttft is None and new:
            self.ttft = time.perf_counter() - self.t0
            REGISTRY.observe("hetserve_ttft_seconds", self.ttft, model=self.model)
        self.ids.extend(int(t) for t in new)
        delta = self._detok.add(new)
        stop_hit = None
        if delta and self.params.stop:
            base = max(0, len(self.text) - self._stop_tail)  # a stop string ends in the new text
            hay = self.text[base:] + delta
            for s in self.params.stop:
                i = hay.find(s)
                if i >= 0 and (stop_hit is None or base + i < stop_hit):
                    stop_hit = base + i
        if stop_hit is not None:
            delta = delta[:max(0, stop_hit - len(self.text))]
            reason = "stop"
        self.text += delta
        if reason:
            self.finish_reason = reason
        if logprobs is not None:
            self.cum_logprob += float(sum(logprobs.logprob))
        self._send(delta, list(new), final=bool(reason), logprobs=logprobs)
        return reason is None

    def finish(self, reason: str):
        """Close the stream if generation ended without a final push."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self._send("", [], final=True)

    streaming = True  # one response per step; WholeAnswer-style subclasses answer once
    error_data = False  # errors also as data for a single-answer request (the client set errors.ERROR_DATA_PARAM)

    def fail(self, exc: BaseException):
        """End the stream with `exc` (typed, hetserve.errors): as data first when streaming, then the final Triton
        error of its kind."""
        self.finish_reason = "error"
        send_error(self.sender, exc, as_data=self.streaming or self.error_data)
