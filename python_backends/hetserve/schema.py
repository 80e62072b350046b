"""The tensor schema: every request input of every model, defined once (name, Triton data type, dims, default,
bound), and the models' input lists.

Read by the Triton adapters (triton/common: sampling params, scalars), the stages (typed requests from
tensors), the client (client.build_inputs: dtypes) and tests/test_schema.py, which checks every
model_repository/*/config.pbtxt against it. Sampling defaults and limits come from hetserve.sampling
(SamplingParams is the typed form of these inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from . import config
from .errors import RequestError
from .sampling import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

# read once: the bound is part of the schema a server process serves (its env is fixed at start)
MAX_TOKENS_LIMIT = config.get("HETSERVE_MAX_TOKENS_LIMIT")

# Triton data type (config.pbtxt TYPE_<x>) -> numpy dtype; STRING travels as "BYTES" on the client side
NUMPY = {"STRING": np.object_, "BOOL": np.bool_, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64,
         "UINT64": np.uint64, "FP32": np.float32}
SCALAR, LIST = (1,), (-1,)


@dataclass(frozen=True)
class Input:
    name: str
    dtype: str                 # Triton data type without the TYPE_ prefix
    dims: Tuple[int, ...]      # (1,) one value, (-1,) a list
    default: Any = None        # what a missing optional input means (None: no default, the stage decides)
    bound: Optional[Tuple[float, float]] = None  # values in [lo, hi] (lists: the length)
    doc: str = ""

    @property
    def np_dtype(self):
        return NUMPY[self.dtype]

    @property
    def client_dtype(self) -> str:
        return "BYTES" if self.dtype == "STRING" else self.dtype


_SP = SamplingParams
_INPUTS = [
    # prompt
    Input("text_input", "STRING", SCALAR, doc="prompt text"),
    Input("input_ids", "INT32", LIST, doc="prompt token ids (instead of text_input)"),
    Input("apply_chat_template", "BOOL", SCALAR, True),
    Input("stream", "BOOL", SCALAR, False, doc="false: one final response; true: one response per step"),
    # sampling (SamplingParams)
    Input("max_tokens", "INT32", SCALAR, _SP.max_tokens, (1, MAX_TOKENS_LIMIT)),
    Input("temperature", "FP32", SCALAR, _SP.temperature, (0.0, float("inf"))),
    Input("top_k", "INT32", SCALAR, _SP.top_k, (0, float("inf"))),
    Input("top_p", "FP32", SCALAR, _SP.top_p, (0.0, 1.0)),
    Input("seed", "UINT64", SCALAR, _SP.seed),
    Input("ignore_eos", "BOOL", SCALAR, _SP.ignore_eos),
    Input("stop_token_ids", "INT32", LIST, (), (0, MAX_STOP_TOKEN_IDS)),
    Input("stop", "STRING", LIST, (), (0, MAX_STOP_STRINGS)),
    # routing (llm, prefill)
    Input("transport", "STRING", SCALAR, doc="KV transport (server default HETSERVE_KV_TRANSPORT)"),
    Input("kv_dtype", "STRING", SCALAR, doc="KV wire dtype (server default HETSERVE_KV_DTYPE)"),
    Input("decode_precision", "STRING", SCALAR, doc="decode engine precision (llm)"),
    # internal hops (operator ops are on the admin side channel, admin_channel.py, not in these schemas)
    Input("op", "STRING", SCALAR, doc="decode: generate|ingest|release|canary|stats; kv_ingest: ingest|caps|ping"),
    Input("request_id", "STRING", SCALAR),
    Input("decode_url", "STRING", SCALAR, doc="set by the orchestrator (internal_token) or an admin"),
    Input("internal_token", "STRING", SCALAR, doc="HMAC proving the llm -> prefill hop"),
    Input("skip_transfer", "BOOL", SCALAR, False),
    Input("prefix_cache", "BOOL", SCALAR, True),
    Input("kv_header", "STRING", SCALAR, doc="KV wire header (JSON)"),
    Input("kv_payload", "UINT8", LIST, doc="KV wire payload"),
    Input("ingest_token", "STRING", SCALAR, doc="HMAC proving kv_ingest verified the KV"),
    Input("kv_remote", "STRING", SCALAR,
          doc="descriptor of KV the receiver pulls (nixl: agent metadata + registered range), instead of kv_payload"),
    Input("output_ids", "INT32", LIST, doc="tokens generated so far (decode: >= 1)"),
    Input("token_ids", "INT32", LIST, doc="the newest token ids (postprocess, fed from llm's output)"),
    Input("precision", "STRING", SCALAR, doc="decode engine precision (decode)"),
    Input("kv_sent", "BOOL", SCALAR, True,
          doc="false: prefill could not send the KV, so decode recomputes at once instead of waiting for it"),
]
INPUTS: Dict[str, Input] = {i.name: i for i in _INPUTS}
assert len(INPUTS) == len(_INPUTS), "an input is defined twice"

SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_token_ids", "stop")
PROMPT = ("text_input", "input_ids", "apply_chat_template")

# model -> (its inputs, the required ones); every other input of a model is optional
MODELS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "llm": (PROMPT + SAMPLING + ("transport", "kv_dtype", "decode_precision", "stream"), ()),
    "aggregated": (PROMPT + SAMPLING, ()),
    "ensemble": (("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed"),
                 ("text_input",)),
    "preprocess": (("text_input", "apply_chat_template"), ("text_input",)),
    "postprocess": (("output_ids", "token_ids"), ("output_ids",)),
    "prefill": (("input_ids", "request_id", "decode_url", "internal_token", "transport",
                 "kv_dtype", "skip_transfer", "prefix_cache") + SAMPLING, ()),
    "decode": (("op", "request_id", "kv_header", "kv_payload", "ingest_token", "input_ids",
                "output_ids", "precision", "kv_sent") + SAMPLING, ()),
    "kv_ingest": (("op", "request_id", "kv_header", "kv_payload", "kv_remote"), ()),
}


def inputs_of(model: str) -> List[Input]:
    return [INPUTS[n] for n in MODELS[model][0]]


def array(name: str, value) -> np.ndarray:
    """A value for input `name` as the array its model expects (lists for LIST inputs, one value otherwise)."""
    spec = INPUTS[name]
    if spec.dtype == "STRING":
        vals = value if isinstance(value, (list, tuple)) else [value]
        return np.array([v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogatepass") for v in vals],
                        dtype=np.object_)
    return np.asarray(value if isinstance(value, (list, tuple, np.ndarray)) else [value], dtype=spec.np_dtype)


# ---- reading a request (a mapping name -> numpy array of the inputs it carries) ---------------------------
Tensors = Mapping[str, Optional[np.ndarray]]


def _utf8(name: str, v) -> str:
    try:
        return bytes(v).decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v)
    except UnicodeDecodeError:
        raise RequestError(f"input '{name}' is not valid UTF-8") from None


def scalar(t: Tensors, name: str, default: Any = None, cast=None):
    """The one value of input `name`, `default` when absent. Bad shape or value -> RequestError."""
    a = t.get(name)
    if a is None:
        return default
    if a.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(a.shape)}")
    v = a.reshape(-1)[0]
    if isinstance(v, (bytes, np.bytes_)):
        v = _utf8(name, v)
    elif isinstance(v, np.generic):
        v = v.item()
    if cast is not None:
        try:
            v = cast(v)
        except (TypeError, ValueError):
            raise RequestError(f"input '{name}' has an invalid value {v!r}") from None
    return v


def string_list(t: Tensors, name: str) -> List[str]:
    a = t.get(name)
    return [] if a is None else [s for s in (_utf8(name, v) for v in a.reshape(-1)) if s]


def int_list(t: Tensors, name: str) -> List[int]:
    a = t.get(name)
    return [] if a is None else [int(x) for x in a.reshape(-1)]


def sampling_params(t: Tensors, default_max_tokens: Optional[int] = None) -> SamplingParams:
    """The sampling inputs -> validated SamplingParams (defaults from the schema)."""
    d = {n: INPUTS[n].default for n in SAMPLING}
    p = SamplingParams(
        max_tokens=scalar(t, "max_tokens", d["max_tokens"] if default_max_tokens is None else default_max_tokens,
                          int),
        temperature=scalar(t, "temperature", d["temperature"], float),
        top_k=scalar(t, "top_k", d["top_k"], int),
        top_p=scalar(t, "top_p", d["top_p"], float),
        seed=scalar(t, "seed", d["seed"], int),
        ignore_eos=bool(scalar(t, "ignore_eos", d["ignore_eos"])),
        stop_token_ids=int_list(t, "stop_token_ids"),
        stop=string_list(t, "stop"),
    )
    try:
        return p.validate(MAX_TOKENS_LIMIT)
    except ValueError as e:
        raise RequestError(str(e)) from None


def sampling_arrays(p: SamplingParams) -> List[Tuple[str, np.ndarray]]:
    """SamplingParams -> (name, array) to forward to prefill/decode. Stop strings stay with the orchestrator (it
    detokenises); an empty stop_token_ids list travels as [-1] (Triton refuses zero-length inputs), which
    readers drop (token ids are >= 0)."""
    out = [(n, array(n, getattr(p, n))) for n in SAMPLING if n not in ("stop", "stop_token_ids")]
    return out + [("stop_token_ids", array("stop_token_ids", p.stop_token_ids or [-1]))]


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
