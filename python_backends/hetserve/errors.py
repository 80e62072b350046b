"""Error kinds that cross servers, defined once.

Triton's streaming gRPC responses carry only an error *message* (no status code) and a Python model cannot set
HTTP headers, so the kind travels in the message as a stable tag, "[hetserve:overloaded] pending KV full ...":
the Triton adapters emit it (triton/common.error), the orchestrator, the client, the OpenAI frontend and the
load tests read it back with `parse`. The human message stays as it was; retryable kinds also carry the retry
hint (retry.py). Errors raised by Triton itself (unknown model, transport torn down) have no tag.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

BAD_INPUT = "bad_input"        # the request is wrong: INVALID_ARG / HTTP 400; retrying it cannot help
OVERLOADED = "overloaded"      # breaker open, queues/budgets full: UNAVAILABLE / 503 + Retry-After
UNAVAILABLE = "unavailable"    # no healthy decode server: UNAVAILABLE / 503 + Retry-After
INTERNAL = "internal"          # a bug or an engine failure: INTERNAL / 500
KINDS = (BAD_INPUT, OVERLOADED, UNAVAILABLE, INTERNAL)
RETRYABLE = (OVERLOADED, UNAVAILABLE)

_TAG = re.compile(r"\[hetserve:(%s)\]\s*" % "|".join(KINDS))


class RequestError(ValueError):
    """Bad input: answered with INVALID_ARG and a clear message."""


def tag(kind: str, msg: str) -> str:
    """`msg` tagged with `kind`; a tag it already carries (from another hop) is replaced, never stacked."""
    if kind not in KINDS:
        raise ValueError(f"unknown error kind {kind!r}")
    return f"[hetserve:{kind}] {strip(msg)}"


def parse(msg: str) -> Tuple[Optional[str], str]:
    """(kind or None when untagged, the message without its tag). A hop may have prefixed the tagged message
    ("decode at host:port: [hetserve:...] ..."), so the tag is looked for anywhere."""
    m = _TAG.search(msg or "")
    return (m.group(1) if m else None), strip(msg)


def strip(msg: str) -> str:
    return _TAG.sub("", msg or "")


def kind_of(msg: str) -> Optional[str]:
    return parse(msg)[0]


def is_retryable(msg: str) -> bool:
    return kind_of(msg) in RETRYABLE


def kind_of_exception(exc: BaseException) -> str:
    """Our exception types -> kind (one mapping for every adapter)."""
    from .reliability import BreakerOpen, NoDecodeServer
    from .scheduler import Overloaded

    if isinstance(exc, (Overloaded, BreakerOpen)):
        return OVERLOADED
    if isinstance(exc, NoDecodeServer):
        return UNAVAILABLE
    if isinstance(exc, ValueError):  # RequestError, SamplingError, wire errors raised as ValueError
        return BAD_INPUT
    return kind_of(str(exc)) or INTERNAL  # a peer's error relayed ("decode refused KV: [...]") keeps its kind


def exception_for(msg: str, kind: Optional[str]) -> Exception:
    """A peer's tagged error message -> the local exception of the same kind (e.g. decode's overload refusal
    becomes Overloaded in the orchestrator, so it tries another decode server)."""
    from .reliability import NoDecodeServer
    from .scheduler import Overloaded

    text = strip(msg)
    if kind == OVERLOADED:
        return Overloaded(text)
    if kind == UNAVAILABLE:
        return NoDecodeServer(text)
    if kind == BAD_INPUT:
        return RequestError(text)
    return RuntimeError(text)
