"""Reading the retry hint of an overload refusal back from text, for clients that only get text.

Refusals are typed (hetserve.errors.Overloaded / Unavailable carry `retry_after_s` as data, and the OpenAI
frontend turns it into `Retry-After`). A plain Triton client (HTTP /generate, perf_analyzer, the Locust users)
sees only the Triton error message, which HetserveError.human() ends with "; retry after N s": these helpers read
that back.
"""
from __future__ import annotations

import math
import re
from typing import Optional

DEFAULT_S = 1.0
_HINT = re.compile(r"retry (?:in|after) (\d+(?:\.\d+)?)\s*s\b", re.I)


def after_s(msg: str) -> Optional[float]:
    """Seconds from a hint in `msg`, None when there is none."""
    m = _HINT.search(msg or "")
    return float(m.group(1)) if m else None


def is_overload(msg: str) -> bool:
    """A Triton error message of a refusal (retryable kinds carry the hint; nothing else does)."""
    return after_s(msg) is not None


def header_value(seconds: Optional[float]) -> str:
    """HTTP Retry-After is whole seconds (RFC 9110): round up, at least 1."""
    return str(max(1, math.ceil(seconds or DEFAULT_S)))
