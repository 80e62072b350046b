"""The one error model: typed errors created where a failure happens, carried as data between servers, mapped
once per adapter.

An error is a HetserveError: a kind (whose fault, and what the caller should do), a message for people, where it
happened, whether another server may succeed (`migrate`) and, for refusals, when to retry. The kind decides every
status, in one table (STATUS): Triton error code, HTTP status (OpenAI frontend), gRPC status.

  kind         fault         Triton       HTTP   gRPC               the caller
  bad_input    the client's  INVALID_ARG  400    INVALID_ARGUMENT   fixes the request
  overloaded   nobody's      UNAVAILABLE  503    UNAVAILABLE        retries later (Retry-After) or elsewhere
  unavailable  nobody's      UNAVAILABLE  503    UNAVAILABLE        retries later
  internal     ours          INTERNAL     500    INTERNAL           reports it; the server logged it

Across servers an error travels as data (to_wire / from_wire: JSON of these fields), never as a tag inside the
message to be parsed again: a streaming model sends it as the `error` output of a response (ERROR_OUTPUT) right
before its final Triton error response (which keeps Triton's own status and failure counters right; Triton's
streaming gRPC responses carry a message only), a BLS call reads the Triton error code. Anything that is not a
HetserveError is a bug or a failure of ours: `from_exception` makes it `internal`, never `bad_input`.

No Triton import here (the adapters in triton/, openai_api/ and client.py do the mapping).
"""
from __future__ import annotations

import json
from typing import ClassVar, Dict, Optional, Type

BAD_INPUT = "bad_input"
OVERLOADED = "overloaded"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"
KINDS = (BAD_INPUT, OVERLOADED, UNAVAILABLE, INTERNAL)
RETRYABLE = (OVERLOADED, UNAVAILABLE)

# kind -> (Triton error code name, HTTP status, gRPC status name)
STATUS: Dict[str, tuple] = {
    BAD_INPUT: ("INVALID_ARG", 400, "INVALID_ARGUMENT"),
    OVERLOADED: ("UNAVAILABLE", 503, "UNAVAILABLE"),
    UNAVAILABLE: ("UNAVAILABLE", 503, "UNAVAILABLE"),
    INTERNAL: ("INTERNAL", 500, "INTERNAL"),
}
# a Triton error code read back (BLS responses keep it) -> kind; codes not listed are internal
KIND_OF_TRITON_CODE = {"INVALID_ARG": BAD_INPUT, "UNAVAILABLE": OVERLOADED, "INTERNAL": INTERNAL}

ERROR_OUTPUT = "error"  # the output tensor (BYTES, one element: to_wire()) of a streamed error
# Request parameter (bool) of a client that reads a decoupled model's responses from a gRPC stream: it wants the
# typed error as data before the final Triton error even when it asked for one final answer (stream=false), as
# Triton's streaming gRPC keeps no status code. Without it a single-response request gets the Triton error alone
# (Triton's HTTP /generate takes exactly one response).
ERROR_DATA_PARAM = "hetserve_error_data"
DEFAULT_RETRY_S = 1.0


class HetserveError(Exception):
    """Base of every error hetserve raises on purpose. `where`: the component that failed ("decode step",
    "prefill", "kv_ingest"); `migrate`: another server may succeed with the same request; `retry_after_s`: for
    refusals, when to try again."""
    kind: ClassVar[str] = INTERNAL
    default_migrate: ClassVar[bool] = False

    def __init__(self, message: str, *, where: str = "", migrate: Optional[bool] = None,
                 retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.migrate = self.default_migrate if migrate is None else migrate
        self.retry_after_s = retry_after_s if retry_after_s is not None else (
            DEFAULT_RETRY_S if self.kind in RETRYABLE else None)

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE

    @property
    def triton_code(self) -> str:
        return STATUS[self.kind][0]

    @property
    def http_status(self) -> int:
        return STATUS[self.kind][1]

    @property
    def grpc_status(self) -> str:
        return STATUS[self.kind][2]

    def human(self) -> str:
        """The message as people read it in a Triton error: with the retry hint for refusals, and saying it is
        ours for internal ones (Triton 2.51's HTTP /generate answers every model error with 400: the text must
        not read as the client's fault)."""
        if self.retry_after_s is not None and self.retryable:
            return f"{self.message}; retry after {self.retry_after_s:.1f}s"
        if self.kind == INTERNAL:
            return f"internal error{' in ' + self.where if self.where else ''}: {self.message}"
        return self.message

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "where": self.where, "migrate": self.migrate,
                "retryable": self.retryable, "retry_after_s": self.retry_after_s}

    def to_wire(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, where={self.where!r})"


class RequestError(HetserveError, ValueError):
    """The request is wrong (bad_input): a clear message, and retrying it cannot help."""
    kind = BAD_INPUT


class Overloaded(HetserveError):
    """A refusal under load (queues, budgets, breaker): retry later, or on another server."""
    kind = OVERLOADED
    default_migrate = True


class Unavailable(HetserveError):
    """Nothing can serve the request now (no healthy decode server)."""
    kind = UNAVAILABLE


class InternalError(HetserveError):
    """Our failure (a bug, an engine error, a peer's internal error relayed)."""
    kind = INTERNAL


class EngineFailed(InternalError):
    """An engine call failed while serving a request (a decode step, a recompute): the server stays up and the
    request may succeed on another server, so the orchestrator migrates it."""
    default_migrate = True


_CLASS_OF_KIND: Dict[str, Type[HetserveError]] = {BAD_INPUT: RequestError, OVERLOADED: Overloaded,
                                                  UNAVAILABLE: Unavailable, INTERNAL: InternalError}


def from_exception(exc: BaseException, where: str = "") -> HetserveError:
    """`exc` as a HetserveError: itself when it is one, else `internal` (a bug or a library's failure is ours,
    whatever its Python type: a ValueError from an engine is not the client's fault)."""
    if isinstance(exc, HetserveError):
        if where and not exc.where:
            exc.where = where
        return exc
    return InternalError(f"{type(exc).__name__}: {exc}", where=where)


def kind_of_exception(exc: BaseException) -> str:
    return exc.kind if isinstance(exc, HetserveError) else INTERNAL


def from_dict(d: dict) -> HetserveError:
    kind = d.get("kind")
    cls = _CLASS_OF_KIND.get(kind if isinstance(kind, str) else "", InternalError)
    ra = d.get("retry_after_s")
    return cls(str(d.get("message", "")), where=str(d.get("where", "")), migrate=bool(d.get("migrate", False)),
               retry_after_s=float(ra) if isinstance(ra, (int, float)) else None)


def from_wire(raw: bytes) -> HetserveError:
    """The error a peer sent (to_wire); a payload that does not parse is itself an internal error."""
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not an object")
    except ValueError as e:
        return InternalError(f"unreadable error from a peer ({e}): {raw[:200]!r}")
    return from_dict(d)


def from_triton_code(code_name: str, message: str, where: str = "") -> HetserveError:
    """A Triton error read back with its code (BLS): the code gives the kind."""
    return _CLASS_OF_KIND[KIND_OF_TRITON_CODE.get(code_name, INTERNAL)](message, where=where)


def parse_failure(exc: BaseException, what: str = "request") -> HetserveError:
    """Reading a request's own fields failed: a ValueError there (bad UTF-8, a malformed number, a wrong shape)
    is the request's fault; anything else is ours."""
    if isinstance(exc, HetserveError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return RequestError(f"malformed {what}: {exc}")
    return from_exception(exc)
