"""Typed requests and responses of the stages, and the interfaces through which a stage talks to its
neighbours. No Triton import: the adapters in hetserve/triton/ convert tensors <-> these, the unit tests
(tests/test_stages.py) implement the interfaces with in-process fakes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Protocol

import numpy as np

from ..errors import InternalError
from ..sampling import SamplingParams, TokenLogprobs


# ---- orchestrator (llm) ------------------------------------------------------------------------------------
@dataclass
class GenerateRequest:
    """One generation as the orchestrator sees it: the prompt is already token ids."""
    prompt: List[int]
    params: SamplingParams
    precision: Optional[str]         # decode engine precision (None: the decode server's default)
    transport: Optional[str] = None  # KV transport (None: prefill's default)
    kv_dtype: Optional[str] = None   # KV wire dtype (None: prefill's default)
    request_id: str = ""             # the client's id (Triton request id), the prefix of the internal one
    n: int = 1                       # choices (num_return_sequences), all from one prefill
    prompt_logprobs: bool = False    # return_prompt_log_probs


@dataclass
class PrefillJob:
    request_id: str
    prompt: List[int]
    params: SamplingParams
    decode_url: str                  # the pool member that will decode (prefill pushes the KV there)
    transport: Optional[str] = None
    kv_dtype: Optional[str] = None
    n: int = 1                       # choices: the first token of each is sampled from the one prefill
    prompt_logprobs: bool = False    # also the prompt tokens' logprobs
    kv_skip_tokens: int = 0          # decode_url holds these leading tokens' KV (the router): send the rest only


@dataclass
class PrefillResult:
    first_token: int
    transfer_ok: bool = True         # false: the KV did not reach decode (decode must recompute)
    transport_used: str = ""
    first_tokens: List[int] = field(default_factory=list)   # n > 1: one per choice (first_token = [0])
    first_logprobs: List[TokenLogprobs] = field(default_factory=list)  # per choice, when asked
    prompt_logprobs: Optional[TokenLogprobs] = None  # of prompt tokens 1.., when asked

    def choice_first(self, i: int) -> int:
        return self.first_tokens[i] if self.first_tokens else self.first_token

    def choice_logprobs(self, i: int) -> Optional[TokenLogprobs]:
        return self.first_logprobs[i] if i < len(self.first_logprobs) else None


@dataclass
class DecodeRequest:
    """op=generate on a decode server: continue `output_ids` (>= 1 token) after `prompt`."""
    request_id: str
    prompt: List[int]
    output_ids: List[int]
    params: SamplingParams
    precision: Optional[str] = None
    kv_sent: bool = True             # false: do not wait for transferred KV, recompute at once
    kv_key: Optional[str] = None     # a choice of n: the request id the shared KV was sent under
    kv_shares: int = 1               # ... and how many choices fork it
    send_interval_s: float = 0.0     # decode sends tokens at most this often (0: every step; a whole answer)


@dataclass
class TokenChunk:
    token_ids: List[int]
    finish_reason: Optional[str] = None  # set on the final chunk
    logprobs: Optional[TokenLogprobs] = None  # aligned with token_ids, when the request asked for them


class PrefillClient(Protocol):
    def prefill(self, job: PrefillJob) -> PrefillResult: ...


class DecodeStream(Protocol):
    """One generate request streaming from one decode server. responses() raises a HetserveError: DecodeFailed
    (server gone, stalled), the decode model's own typed error (hetserve.errors; `migrate` says whether another
    server may succeed: an overload refusal, an engine failure) or RequestError (its verdict stands)."""

    def start(self, req: DecodeRequest) -> None: ...

    def responses(self, timeout_s: float) -> Iterator[TokenChunk]: ...

    def close(self, cancel: bool = False) -> None: ...


class DecodeClient(Protocol):
    def open(self, url: str) -> DecodeStream: ...

    def release(self, url: str, request_id: str) -> None:
        """Best effort, off the caller's thread: drop KV pushed to `url` for a request that will not decode."""


class TokenSink(Protocol):
    """Where generated tokens go (the adapter detokenises and answers the client). push() returns False once
    generation should stop (stop string, final reason); finish_reason is set once the stream is closed.
    streaming False: the client gets one final answer, so decode may send tokens in batches (send_interval)."""
    finish_reason: Optional[str]

    @property
    def streaming(self) -> bool: ...

    def push(self, token_ids: List[int], reason: Optional[str] = None,
             logprobs: Optional[TokenLogprobs] = None) -> bool: ...

    def finish(self, reason: str) -> None: ...

    def cancelled(self) -> bool: ...

    def prompt_logprobs(self, lps: TokenLogprobs) -> None:
        """The prompt's logprobs, to go out with the first response."""

    def choice(self, i: int) -> "TokenSink":
        """The sink of choice i of an n > 1 request (choice(0) may be this one)."""


class Pool(Protocol):  # reliability.DecodePool
    def pick(self, exclude=(), cost=None) -> str: ...

    def release(self, url: str) -> None: ...

    def hold(self, url: str) -> None: ...

    def mark_down(self, url: str, why: str) -> None: ...

    def transport_for(self, url: str, requested: Optional[str]) -> str: ...


class Breaker(Protocol):  # reliability.CircuitBreaker
    def allow(self) -> None: ...

    def record(self, latency_s: float) -> None: ...

    def record_failure(self, overloaded: bool) -> None: ...

    def release_probe(self) -> None: ...


class Metrics(Protocol):  # triton.metrics.Registry
    def inc(self, name: str, value: float = 1.0, **labels) -> None: ...


class NoMetrics:
    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        pass


class DecodeFailed(InternalError):
    """The decode server failed, went away or stalled mid-stream: move the request to another one."""
    default_migrate = True


# ---- decode server -------------------------------------------------------------------------------------------
@dataclass
class DecodeCall:
    """One request to the decode model, typed (DecodeStage.from_tensors builds it from the inputs)."""
    op: str
    request_id: Optional[str] = None
    prompt: List[int] = field(default_factory=list)
    output_ids: List[int] = field(default_factory=list)
    params: Optional[SamplingParams] = None   # op=generate only
    precision: Optional[str] = None
    kv_sent: bool = True
    kv_key: Optional[str] = None      # the KV was sent under this id (a choice of n), not request_id
    kv_shares: int = 1                # choices forking that KV
    send_interval_s: float = 0.0      # answer no more often than this (PacedReply); 0: every step
    kv_header: Optional[bytes] = None
    kv_payload: Optional[np.ndarray] = None
    ingest_token: str = ""
    transport: str = "grpc"           # op=ingest: the KV transport it came over (metric label)


class Reply(Protocol):
    """The decode adapter's answer channel for one request (a Triton response sender). Exactly one final
    answer per request: tokens(..., final=True), json() or error()."""

    def tokens(self, token_ids: List[int], finish_reason: Optional[str] = None, final: bool = False,
               logprobs: Optional[TokenLogprobs] = None) -> None: ...

    def json(self, obj: dict) -> None: ...

    def error(self, exc: BaseException) -> None: ...

    def cancelled(self) -> bool: ...
