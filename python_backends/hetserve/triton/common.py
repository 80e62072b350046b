"""Helpers shared by the Triton Python-backend models."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any, List, Optional

import numpy as np

import triton_python_backend_utils as pb_utils  # provided by the stub

from ..sampling import SamplingParams
from ..server import ADMIN_PARAM

MAX_TOKENS_LIMIT = int(os.environ.get("HETSERVE_MAX_TOKENS_LIMIT", "4096"))


class RequestError(ValueError):
    """Bad input: answered with INVALID_ARG and a clear message."""


def engine_dir() -> str:
    d = os.environ.get("HETSERVE_ENGINE_DIR")
    if not d:
        raise RuntimeError("HETSERVE_ENGINE_DIR is not set (start servers with `hetserve up`/`hetserve serve`)")
    return d


@lru_cache(maxsize=1)
def tokenizer():
    from ..engines.builder import load_tokenizer

    return load_tokenizer(engine_dir())


def inp(request, name: str) -> Optional[np.ndarray]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def scalar(request, name: str, default: Any = None, cast=None):
    a = inp(request, name)
    if a is None:
        return default
    if a.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(a.shape)}")
    v = a.reshape(-1)[0]
    if isinstance(v, (bytes, np.bytes_)):
        try:
            v = bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' is not valid UTF-8") from None
    elif isinstance(v, np.generic):
        v = v.item()
    if cast is not None:
        try:
            v = cast(v)
        except (TypeError, ValueError):
            raise RequestError(f"input '{name}' has an invalid value {v!r}") from None
    return v


def string_list(request, name: str) -> List[str]:
    a = inp(request, name)
    if a is None:
        return []
    out = []
    for v in a.reshape(-1):
        try:
            out.append(bytes(v).decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v))
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' is not valid UTF-8") from None
    return [s for s in out if s]


def int_list(request, name: str) -> List[int]:
    a = inp(request, name)
    return [] if a is None else [int(x) for x in a.reshape(-1)]


SAMPLING_INPUTS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_token_ids", "stop")


def check_prompt(ids: List[int], cfg, max_tokens: int = 0) -> List[int]:
    """Validate prompt token ids against the model: non-empty, in vocabulary, fits the context."""
    if not ids:
        raise RequestError("empty prompt: no input tokens")
    if min(ids) < 0 or max(ids) >= cfg.vocab_size:
        raise RequestError(f"token id out of range [0, {cfg.vocab_size})")
    if len(ids) + max_tokens > cfg.max_position:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model context "
                           f"of {cfg.max_position}")
    return ids


def check_kv_tokens(hdr, max_position: int) -> None:
    """A KV header may not claim more tokens than the model's context (a bogus count would size buffers)."""
    if not 0 < hdr.num_tokens <= max_position:
        raise RequestError(f"KV header claims {hdr.num_tokens} tokens; the model context is {max_position}")


def internal_token(purpose: str) -> str:
    """Proof that a BLS request comes from one of our own models on this server (stubs inherit the deployment
    admin key): an HMAC of the key and the hop, e.g. "kv_ingest -> decode" or "llm -> prefill"."""
    import hashlib
    import hmac

    from ..server import admin_key

    return hmac.new(admin_key().encode(), f"hetserve {purpose}".encode(), hashlib.sha256).hexdigest()


def internal_token_ok(token: str, purpose: str) -> bool:
    import hmac

    return bool(token) and hmac.compare_digest(token, internal_token(purpose))


INGEST_HOP = "kv_ingest -> decode"  # kv_ingest verified the KV; anyone else's ingest is verified by decode
PREFILL_HOP = "llm -> prefill"  # the orchestrator picked decode_url from its pool; clients may not choose it


def ingest_token() -> str:
    return internal_token(INGEST_HOP)


def ingest_token_ok(token: str) -> bool:
    return internal_token_ok(token, INGEST_HOP)


def is_admin(request) -> bool:
    """The request carries the deployment admin key as the request parameter ADMIN_PARAM."""
    import hmac

    from ..server import admin_key

    try:
        given = str(json.loads(request.parameters() or "{}").get(ADMIN_PARAM, ""))
    except Exception:
        given = ""
    return bool(given) and hmac.compare_digest(given, admin_key())


def require_admin(request, op: str) -> None:
    """Diagnostic/admin ops (`hetserve doctor`) run only for callers holding the deployment admin key."""
    if not is_admin(request):
        raise RequestError(f"op={op} is an admin op: send the deployment admin key (HETSERVE_ADMIN_KEY) as the "
                           f"request parameter '{ADMIN_PARAM}' (hetserve doctor does)")


def sampling_params(request, default_max_tokens: int = 64) -> SamplingParams:
    p = SamplingParams(
        max_tokens=scalar(request, "max_tokens", default_max_tokens, int),
        temperature=scalar(request, "temperature", 0.0, float),
        top_k=scalar(request, "top_k", 0, int),
        top_p=scalar(request, "top_p", 1.0, float),
        seed=scalar(request, "seed", 0, int),
        ignore_eos=bool(scalar(request, "ignore_eos", False)),
        stop_token_ids=int_list(request, "stop_token_ids"),
        stop=string_list(request, "stop"),
    )
    try:
        return p.validate(MAX_TOKENS_LIMIT)
    except ValueError as e:
        raise RequestError(str(e)) from None


def sampling_tensors(p: SamplingParams) -> list:
    """SamplingParams -> Triton input tensors (for forwarding to another model/server)."""
    return [
        ("max_tokens", np.array([p.max_tokens], np.int32)),
        ("temperature", np.array([p.temperature], np.float32)),
        ("top_k", np.array([p.top_k], np.int32)),
        ("top_p", np.array([p.top_p], np.float32)),
        ("seed", np.array([p.seed], np.uint64)),
        ("ignore_eos", np.array([p.ignore_eos], bool)),
        ("stop_token_ids", np.array(p.stop_token_ids or [-1], np.int32)),
    ]


def str_tensor(name: str, values) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([v.encode() if isinstance(v, str) else v for v in values],
                                          dtype=np.object_))


def error(msg: str, code=None) -> "pb_utils.TritonError":
    if code is None:
        code = pb_utils.TritonError.INVALID_ARG
    return pb_utils.TritonError(msg, code)


def error_response(msg: str, code=None) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=error(msg, code))


def classify(exc: Exception):
    """Exception -> Triton error code."""
    from ..reliability import BreakerOpen, NoDecodeServer
    from ..scheduler import Overloaded

    if isinstance(exc, (RequestError, ValueError)):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(exc, (Overloaded, BreakerOpen, NoDecodeServer)):
        return pb_utils.TritonError.UNAVAILABLE
    return pb_utils.TritonError.INTERNAL


def respond_each(requests, handle, log) -> list:
    """Non-decoupled execute(): one response per request; a failing request gets an error response
    (INVALID_ARG / UNAVAILABLE / INTERNAL) and never takes the others down."""
    out = []
    for r in requests:
        try:
            out.append(handle(r))
        except Exception as e:
            code = classify(e)
            if code == pb_utils.TritonError.INTERNAL:
                log.exception("request failed")
            out.append(error_response(str(e), code))
    return out


def json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()
