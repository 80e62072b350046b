"""The retry hint carried by overload refusals, one format for every hop.

Triton's streaming gRPC responses carry only an error *message* (no status code), and a Python model cannot set
HTTP headers, so the hint travels in the message text: "...; retry after 0.4s". The Triton adapters
(triton/common.error) append it to every refusal of a retryable kind (breaker open, no decode server, queues
full); the OpenAI frontend parses it back into a 503 with a `Retry-After` header; the Locust users sleep that long
before their next request.
"""
from __future__ import annotations

import math
import re
from typing import Optional

DEFAULT_S = 1.0
_HINT = re.compile(r"retry (?:in|after) (\d+(?:\.\d+)?)\s*s\b", re.I)


def hint(msg: str, seconds: float = DEFAULT_S) -> str:
    """`msg` with a retry hint (kept if it already has one)."""
    return msg if _HINT.search(msg) else f"{msg}; retry after {seconds:.1f}s"


def after_s(msg: str) -> Optional[float]:
    """Seconds from a hint in `msg`, None when there is none."""
    m = _HINT.search(msg or "")
    return float(m.group(1)) if m else None


def is_overload(msg: str) -> bool:
    """A refusal that means "try again later": a retryable kind, or an untagged message with a retry hint (the
    OpenAI frontend's own refusals)."""
    from .errors import RETRYABLE, kind_of

    kind = kind_of(msg)
    return kind in RETRYABLE or (kind is None and after_s(msg) is not None)


def header_value(msg: str) -> str:
    """HTTP Retry-After is whole seconds (RFC 9110): round the hint up, at least 1."""
    return str(max(1, math.ceil(after_s(msg) or DEFAULT_S)))
