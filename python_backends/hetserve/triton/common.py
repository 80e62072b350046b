"""Helpers shared by the Triton Python-backend models."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, List, Optional, cast

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by the stub

from .. import config, errors, schema
from ..errors import RequestError  # noqa: F401  (re-exported: the adapters raise it)
from ..sampling import SamplingParams, TokenLogprobs
from ..schema import MAX_TOKENS_LIMIT, check_kv_tokens, check_prompt  # noqa: F401  (re-exported)
from ..server import ADMIN_PARAM


class RequestTensors:
    """A request's inputs as the mapping hetserve.schema reads (name -> numpy array, None when absent)."""

    def __init__(self, request):
        self.request = request

    def get(self, name: str, default=None):
        t = pb_utils.get_input_tensor_by_name(self.request, name)
        return default if t is None else t.as_numpy()


def tensors_of(request, model: str) -> dict:
    """Every input of `model` (hetserve.schema.MODELS) the request carries, as numpy arrays: one pass over the
    request's inputs (get_input_tensor_by_name scans them all for each of the model's ~20 names)."""
    wanted = _inputs_of(model)
    return {t.name(): t.as_numpy() for t in request.inputs() if t.name() in wanted}


@lru_cache(maxsize=None)
def _inputs_of(model: str) -> frozenset:
    return frozenset(schema.MODELS[model][0])


def engine_dir() -> str:
    d = config.get("HETSERVE_ENGINE_DIR")
    if not d:
        raise RuntimeError("HETSERVE_ENGINE_DIR is not set (start servers with `hetserve up`/`hetserve serve`)")
    return d


@lru_cache(maxsize=1)
def tokenizer():
    from ..engines.manifest import load_tokenizer

    return load_tokenizer(engine_dir())


def grammar_matchers(cfg):
    """Structured output's MatcherFactory for this process's model (hetserve.structured): one compiler per
    process, built from the engine directory's tokenizer, the model's vocab size and every EOS id."""
    from ..structured import GrammarCompiler, matcher_factory

    return matcher_factory(GrammarCompiler.for_tokenizer(tokenizer(), cfg.vocab_size, cfg.eos_token_ids))


def _tensors(request) -> "schema.Tensors":
    # RequestTensors is read through .get only, which is all schema's readers use of a Mapping
    return cast("schema.Tensors", RequestTensors(request))


def inp(request, name: str) -> Optional[np.ndarray]:
    return RequestTensors(request).get(name)


def scalar(request, name: str, default: Any = None, cast=None):
    return schema.scalar(_tensors(request), name, default, cast)


def string_list(request, name: str) -> List[str]:
    return schema.string_list(_tensors(request), name)


def int_list(request, name: str) -> List[int]:
    return schema.int_list(_tensors(request), name)


@lru_cache(maxsize=8)
def internal_token(purpose: str) -> str:
    """Proof that a BLS request comes from one of our own models on this server (stubs inherit the deployment
    admin key): an HMAC of the key and the hop, e.g. "kv_ingest -> decode" or "llm -> prefill". Computed once per
    hop (the key is fixed for the process's life)."""
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


def request_parameters(request) -> dict:
    """The request's parameters (Triton gives them as a JSON object); ValueError when they are not one."""
    p = json.loads(request.parameters() or "{}")
    if not isinstance(p, dict):
        raise ValueError(f"request parameters are not a JSON object: {type(p).__name__}")
    return p


def kv_transport_of(request) -> str:
    """The KV transport a sender named in its request parameter (kv/transport/control.TRANSPORT_PARAM); 'grpc'
    for senders that name none (plain tritonclient calls). RequestError for an unknown one."""
    from ..kv.transport import NAMES
    from ..kv.transport.control import TRANSPORT_PARAM

    try:
        t = request_parameters(request).get(TRANSPORT_PARAM, "grpc")
    except ValueError:
        raise RequestError("malformed request parameters") from None
    if t not in NAMES:
        raise RequestError(f"unknown KV transport {t!r} in parameter {TRANSPORT_PARAM}; use one of {list(NAMES)}")
    return t


def is_admin(request) -> bool:
    """The request carries the deployment admin key as the request parameter ADMIN_PARAM."""
    import hmac

    from ..server import admin_key

    try:
        given = str(request_parameters(request).get(ADMIN_PARAM, ""))
    except (ValueError, TypeError, AttributeError):  # parameters that are not a JSON object: no key
        given = ""
    return bool(given) and hmac.compare_digest(given, admin_key())


def start_admin_channel(addr: Optional[str], name: str, handlers):
    """Start this model's admin side channel (admin_channel.py) on `addr` (HETSERVE_PREFILL_ADMIN /
    HETSERVE_DECODE_ADMIN, set by the launcher; None or "off": no channel). A port that cannot be bound is
    logged, not fatal: serving goes on, and `hetserve doctor` reports the channel unreachable."""
    import logging

    from ..admin_channel import AdminServer
    from ..server import admin_key

    if not addr or addr == "off":
        return None
    try:
        return AdminServer(addr, admin_key(), handlers, name=name).start()
    except (OSError, ValueError) as e:
        logging.getLogger("hetserve.admin").error("%s admin channel not started on %s (%s): hetserve doctor "
                                                  "cannot reach this server", name, addr, e)
        return None


def sampling_params(request, default_max_tokens: Optional[int] = None) -> SamplingParams:
    return schema.sampling_params(_tensors(request), default_max_tokens)


def sampling_tensors(p: SamplingParams) -> list:
    """SamplingParams -> (name, array) pairs for forwarding to another model/server."""
    return schema.sampling_arrays(p)


LOGPROB_OUTPUTS = ("output_log_probs", "top_logprob_ids", "top_logprob_values")
PROMPT_LOGPROB_OUTPUTS = ("prompt_log_probs", "prompt_top_logprob_ids", "prompt_top_logprob_values")


def logprob_tensors(lps: TokenLogprobs, names=LOGPROB_OUTPUTS) -> list:
    """(logprob [k], top ids [k, N], top logprobs [k, N]) of a run of k tokens as output tensors `names`."""
    n_top = len(lps.top_ids[0]) if lps.top_ids else 0
    return [pb_utils.Tensor(n, a) for n, a in zip(names, lps.arrays(n_top))]


def logprobs_of(get) -> Optional[TokenLogprobs]:
    """TokenLogprobs from a response's outputs (`get(name)` -> array or None), None when it has none."""
    lp = get("output_log_probs")
    if lp is None:
        return None
    return TokenLogprobs.from_arrays(lp, get("top_logprob_ids"), get("top_logprob_values"))


def str_tensor(name: str, values) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([v.encode() if isinstance(v, str) else v for v in values],
                                          dtype=np.object_))


FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def error_of(exc: BaseException, where: str = "") -> "pb_utils.TritonError":
    """Any exception -> the TritonError of its kind (hetserve.errors: the one mapping; not a HetserveError ->
    INTERNAL), with the human message (retry hint included for refusals)."""
    e = errors.from_exception(exc, where)
    return pb_utils.TritonError(e.human(), getattr(pb_utils.TritonError, e.triton_code))


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=error_of(exc))


def error_tensor(exc: BaseException) -> "pb_utils.Tensor":
    """The error as data: the `error` output (hetserve.errors.ERROR_OUTPUT) holding to_wire()."""
    return pb_utils.Tensor(errors.ERROR_OUTPUT, np.array([errors.from_exception(exc).to_wire()], dtype=np.object_))


def send_error(sender, exc: BaseException, as_data: bool = True) -> None:
    """End a decoupled stream with `exc`: first a response carrying it as data (as_data; our stream readers
    raise the typed error from it: Triton's streaming gRPC keeps no status code), then the final Triton error
    response (its code gives HTTP/gRPC clients their status and Triton its failure count). as_data=False for a
    single-response request (Triton's /generate wants exactly one). A client already gone is not an error."""
    try:
        if as_data:
            sender.send(pb_utils.InferenceResponse([error_tensor(exc)]), flags=0)
        sender.send(error_response(exc), flags=FINAL)
    except Exception as e:  # the stream is closed (client cancelled) or was answered already
        import logging

        logging.getLogger("hetserve.triton").info("error response not sent (%s): %s", e, exc)


def log_if_ours(log, exc: BaseException, what: str, request_id: str = "") -> None:
    """An internal failure (ours) is logged with its traceback and the request id; a client's bad input or an
    overload refusal is the caller's to see, not a server error."""
    if errors.kind_of_exception(exc) == errors.INTERNAL:
        log.error("%s failed (request %s): %s", what, request_id or "-", exc, exc_info=exc)


def wants_error_data(r) -> bool:
    """The caller wants typed errors as data, the `error` output (request parameter errors.ERROR_DATA_PARAM):
    a stream reader of the llm, or the llm's own BLS hop to prefill."""
    try:
        return request_parameters(r).get(errors.ERROR_DATA_PARAM) is True
    except ValueError:  # unreadable parameters: the plain Triton error
        return False


def raise_bls_failure(model: str, resp) -> None:
    """Raise the failure a BLS response carries: the typed error as data (the `error` output, kind intact), else
    its Triton error (bls_error)."""
    data = pb_utils.get_output_tensor_by_name(resp, errors.ERROR_OUTPUT)
    if data is not None:
        raise errors.from_wire(bytes(data.as_numpy().reshape(-1)[0]))
    if resp.has_error():
        raise bls_error(model, resp)


def bls_error(model: str, resp) -> errors.HetserveError:
    """A BLS response's Triton error as a typed error. Triton 2.51's BLS reports every error code as INTERNAL
    (triton-inference-server/server#7804), so a caller that must keep the kind asks the model for its `error`
    output (the failure as data; llm._bls, kv_ingest -> decode) and this is what is left for anything else."""
    err = resp.error()
    code = next((n for n in ("INVALID_ARG", "UNAVAILABLE", "INTERNAL", "NOT_FOUND", "UNSUPPORTED", "CANCELLED")
                 if getattr(pb_utils.TritonError, n, None) == err.code()), "INTERNAL")
    return errors.from_triton_code(code, err.message(), where=model)


def respond_each(requests, handle, log, what: str = "request") -> list:
    """Non-decoupled execute(): one response per request; a failing request gets an error response of its
    kind and never takes the others down; our own failures are logged with the request id."""
    out = []
    for r in requests:
        try:
            out.append(handle(r))
        except Exception as e:
            log_if_ours(log, e, what, r.request_id())
            out.append(error_response(e))
    return out


def json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()
