"""Token sampling: greedy, temperature, top-k, top-p, seeded and reproducible.

The random stream is keyed by (seed, step), so a token is the same whichever process samples it (prefill
samples the first token, decode the rest; a migrated request resumes identically).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import numpy as np

from .errors import RequestError


class SamplingError(RequestError):
    pass


# Stop conditions are checked on every token of every sequence: their number and length are bounded.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: List[int] = field(default_factory=list)
    stop: List[str] = field(default_factory=list)

    def validate(self, max_tokens_limit: int) -> "SamplingParams":
        if not (1 <= self.max_tokens <= max_tokens_limit):
            raise SamplingError(f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not np.isfinite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise SamplingError(f"seed must be >= 0, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise SamplingError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        return self

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def sample(logits: np.ndarray, p: SamplingParams, step: int) -> int:
    if p.temperature == 0.0 or p.top_k == 1:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < x.shape[0]:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max()
    probs = np.exp(x)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs)
        csum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(csum, p.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    rng = np.random.Generator(np.random.PCG64([p.seed, step]))
    return int(rng.choice(probs.shape[0], p=probs))


def is_stop_token(tok: int, p: SamplingParams, eos_ids) -> bool:
    return tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids)
