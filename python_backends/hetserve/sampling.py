"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, grammar masks, logprobs;
seeded and reproducible.

The random stream is keyed by (seed, step[, choice]), so a token is the same whichever process samples it
(prefill samples the first token, decode the rest; a migrated request resumes identically) and each of the n
choices of one request draws its own stream (choice 0 draws what an n=1 request draws).

Order of the logit processors (vLLM's and HF's): logit bias, repetition penalty (prompt + output tokens),
presence / frequency penalties (output tokens), grammar mask, then temperature, top-k, top-p, min-p. Logprobs
are the model's own log-softmax (before any processor), as vLLM returns them by default: what a client compares
with another server or an evaluation harness expects.

A `TokenSampler` holds one sequence's state (its prompt ids for the repetition penalty, counts of its output
tokens, its grammar matcher); it is rebuilt from prompt + tokens so far wherever the sequence continues.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import RequestError


class SamplingError(RequestError):
    pass


# Stop conditions are checked on every token of every sequence: their number and length are bounded.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64
MAX_TOP_LOGPROBS = 20        # OpenAI's bound
MAX_LOGIT_BIAS = 300         # OpenAI's bound on entries
MAX_CHOICES = 16             # n (num_return_sequences) per request: each choice holds a decode batch row


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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    return_log_probs: bool = False
    top_logprobs: int = 0
    choice: int = 0              # which of the request's n choices (keys its random stream)
    guide_type: str = ""         # structured output (hetserve.structured): "" = unconstrained
    guide: str = ""

    def validate(self, max_tokens_limit: int) -> "SamplingParams":
        if not (1 <= self.max_tokens <= max_tokens_limit):
            raise SamplingError(f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not np.isfinite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not np.isfinite(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not np.isfinite(v) or not -2.0 <= v <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {v}")
        if not np.isfinite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if t < 0 or not np.isfinite(b) or not -100.0 <= b <= 100.0:
                raise SamplingError(f"logit_bias: token {t} bias {b}: ids >= 0, biases in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 0 <= self.choice < MAX_CHOICES:
            raise SamplingError(f"choice index must be in [0, {MAX_CHOICES}), got {self.choice}")
        if self.seed < 0:
            raise SamplingError(f"seed must be >= 0, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise SamplingError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        return self

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise SamplingError(f"logit_bias: token id {bad[0]} is out of range [0, {vocab_size})")

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def wants_logprobs(self) -> bool:
        return self.return_log_probs or self.top_logprobs > 0

    def for_choice(self, i: int) -> "SamplingParams":
        from dataclasses import replace

        return replace(self, choice=i, logit_bias=dict(self.logit_bias), stop=list(self.stop),
                       stop_token_ids=list(self.stop_token_ids))

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TokenLogprobs:
    """Logprobs of a run of sampled tokens, aligned with them: the token's own logprob and the top-N
    alternatives (ids, logprobs) per token (N = top_logprobs, may be 0)."""
    logprob: List[float] = field(default_factory=list)
    top_ids: List[List[int]] = field(default_factory=list)
    top_values: List[List[float]] = field(default_factory=list)

    def extend(self, other: Optional["TokenLogprobs"]) -> None:
        if other is not None:
            self.logprob += other.logprob
            self.top_ids += other.top_ids
            self.top_values += other.top_values

    def __len__(self) -> int:
        return len(self.logprob)

    def arrays(self, n_top: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logprob [k] f32, top ids [k, n_top] i32, top logprobs [k, n_top] f32)."""
        k = len(self.logprob)
        ids = np.asarray(self.top_ids, np.int32).reshape(k, n_top) if n_top else np.zeros((k, 0), np.int32)
        vals = np.asarray(self.top_values, np.float32).reshape(k, n_top) if n_top else np.zeros((k, 0), np.float32)
        return np.asarray(self.logprob, np.float32), ids, vals

    @classmethod
    def from_arrays(cls, lp, ids, vals) -> "TokenLogprobs":
        lp = np.asarray(lp, np.float32).reshape(-1)
        k = lp.shape[0]
        ids = np.asarray(ids if ids is not None else np.zeros((k, 0)), np.int32).reshape(k, -1)
        vals = np.asarray(vals if vals is not None else np.zeros((k, 0)), np.float32).reshape(k, -1)
        return cls(lp.tolist(), ids.tolist(), vals.tolist())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprobs(logits: np.ndarray, tok: int, n_top: int) -> TokenLogprobs:
    ls = log_softmax(logits)
    out = TokenLogprobs([float(ls[tok])])
    if n_top:
        top = np.argpartition(-ls, n_top - 1)[:n_top]
        top = top[np.argsort(-ls[top], kind="stable")]
        out.top_ids.append([int(i) for i in top])
        out.top_values.append([float(ls[i]) for i in top])
    else:
        out.top_ids.append([])
        out.top_values.append([])
    return out


def _rng(p: SamplingParams, step: int) -> np.random.Generator:
    key = [p.seed, step] if p.choice == 0 else [p.seed, step, p.choice]
    return np.random.Generator(np.random.PCG64(key))


def _draw(x: np.ndarray, p: SamplingParams, step: int) -> int:
    """Temperature, top-k, top-p, min-p and the seeded draw over processed logits x (float64, -inf = banned)."""
    if p.temperature == 0.0 or p.top_k == 1:
        return int(np.argmax(x))
    x = x / p.temperature
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
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return int(_rng(p, step).choice(probs.shape[0], p=probs))


def sample(logits: np.ndarray, p: SamplingParams, step: int) -> int:
    """One token from raw logits with no per-sequence state (no penalties, no grammar)."""
    if not p.logit_bias and (p.temperature == 0.0 or p.top_k == 1):
        return int(np.argmax(logits))
    x = logits.astype(np.float64)
    for t, b in p.logit_bias.items():
        if t < x.shape[0]:
            x[t] += b
    return _draw(x, p, step)


class TokenSampler:
    """One sequence's sampler: penalties over its prompt / output tokens and its grammar matcher (an object with
    mask_logits(logits) and accept(token), hetserve.structured.Matcher), kept in step with the tokens it is
    told about. `output` are the tokens already generated (a resumed sequence)."""

    def __init__(self, p: SamplingParams, prompt: Sequence[int] = (), output: Sequence[int] = (),
                 matcher=None):
        self.p = p
        self.matcher = matcher
        self._prompt_ids = (np.unique(np.asarray(prompt, np.int64)) if p.repetition_penalty != 1.0 and len(prompt)
                            else np.zeros(0, np.int64))
        self._counts: Dict[int, int] = {}
        for t in output:
            self._count(int(t))

    def _count(self, tok: int) -> None:
        self._counts[tok] = self._counts.get(tok, 0) + 1

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The processed logits (float64 copy) the draw sees."""
        p = self.p
        x = logits.astype(np.float64)
        V = x.shape[0]
        for t, b in p.logit_bias.items():
            if t < V:
                x[t] += b
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, np.fromiter(self._counts, np.int64, len(self._counts)))
            seen = seen[seen < V]
            v = x[seen]
            x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            c = np.fromiter(self._counts.values(), np.float64, len(self._counts))
            keep = ids < V
            x[ids[keep]] -= p.presence_penalty + p.frequency_penalty * c[keep]
        if self.matcher is not None:
            self.matcher.mask_logits(x)
        return x

    def next(self, logits: np.ndarray, step: int) -> Tuple[int, Optional[TokenLogprobs]]:
        """Sample the token at `step` (index in the output) and take it into the state; with logprobs asked,
        its TokenLogprobs (of the raw logits)."""
        p = self.p
        if self.matcher is None and not p.penalised and not p.logit_bias:
            tok = sample(logits, p, step)
        else:
            tok = _draw(self.process(logits), p, step)
        self.accept(tok)
        return tok, (token_logprobs(logits, tok, p.top_logprobs) if p.wants_logprobs else None)

    def accept(self, tok: int) -> None:
        if self.p.penalised:
            self._count(tok)
        if self.matcher is not None:
            self.matcher.accept(tok)

    @property
    def grammar_done(self) -> bool:
        """The grammar reached an end state (only EOS may follow)."""
        return self.matcher is not None and bool(self.matcher.is_terminated())


# builds a sequence's grammar matcher from (params, tokens so far); set by the server that has a grammar engine
MatcherFactory = Callable[[SamplingParams, Sequence[int]], object]


def is_stop_token(tok: int, p: SamplingParams, eos_ids) -> bool:
    return tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids)
