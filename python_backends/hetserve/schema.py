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
from .sampling import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)

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
    Input("min_p", "FP32", SCALAR, _SP.min_p, (0.0, 1.0)),
    Input("presence_penalty", "FP32", SCALAR, _SP.presence_penalty, (-2.0, 2.0)),
    Input("frequency_penalty", "FP32", SCALAR, _SP.frequency_penalty, (-2.0, 2.0)),
    Input("repetition_penalty", "FP32", SCALAR, _SP.repetition_penalty, (0.0, 10.0)),
    Input("logit_bias_ids", "INT32", LIST, (), (0, MAX_LOGIT_BIAS), doc="token ids whose logits get a bias"),
    Input("logit_bias_values", "FP32", LIST, (), (0, MAX_LOGIT_BIAS), doc="the biases, aligned with the ids"),
    Input("return_log_probs", "BOOL", SCALAR, _SP.return_log_probs,
          doc="outputs output_log_probs (each token's logprob) and cum_log_probs"),
    Input("top_logprobs", "INT32", SCALAR, _SP.top_logprobs, (0, MAX_TOP_LOGPROBS),
          doc="outputs top_logprob_ids / top_logprob_values: the N most likely tokens at each step"),
    Input("guided_decoding_guide_type", "STRING", SCALAR,
          doc="structured output: json, json_schema, regex, ebnf_grammar or choice (hetserve.structured)"),
    Input("guided_decoding_guide", "STRING", SCALAR, doc="the schema / regex / grammar / JSON list of choices"),
    Input("sequence_index", "INT32", SCALAR, _SP.choice, (0, MAX_CHOICES - 1),
          doc="which choice of an n > 1 request this sequence is (keys its random stream)"),
    Input("return_prompt_log_probs", "BOOL", SCALAR, False,
          doc="outputs prompt_log_probs (+ prompt_top_logprob_*): each prompt token's logprob given the ones before"),
    Input("num_return_sequences", "INT32", SCALAR, 1, (1, MAX_CHOICES),
          doc="n choices from one prefill: the KV is sent once and forked on the decode server"),
    # routing (llm, prefill)
    Input("transport", "STRING", SCALAR, doc="KV transport (server default HETSERVE_KV_TRANSPORT)"),
    Input("kv_dtype", "STRING", SCALAR, doc="KV wire dtype (server default HETSERVE_KV_DTYPE)"),
    Input("decode_precision", "STRING", SCALAR, doc="decode engine precision (llm)"),
    # internal hops (operator ops are on the admin side channel, admin_channel.py, not in these schemas)
    Input("op", "STRING", SCALAR,
          doc="decode: generate|cancel|ingest|release|canary|stats|prefix; kv_ingest: ingest|caps|ping"),
    Input("request_id", "STRING", SCALAR),
    Input("decode_url", "STRING", SCALAR, doc="set by the orchestrator (internal_token) or an admin"),
    Input("internal_token", "STRING", SCALAR, doc="HMAC proving the llm -> prefill hop"),
    Input("skip_transfer", "BOOL", SCALAR, False),
    Input("prefix_cache", "BOOL", SCALAR, True),
    Input("kv_skip_tokens", "INT32", SCALAR, 0, (0, 1 << 24),
          doc="prefill (orchestrator): the decode server holds the KV of this many leading prompt tokens; send the "
              "rest only"),
    Input("kv_header", "STRING", SCALAR, doc="KV wire header (JSON)"),
    Input("kv_payload", "UINT8", LIST, doc="KV wire payload"),
    Input("ingest_token", "STRING", SCALAR,
          doc="op=ingest from kv_ingest proves it verified the KV (HMAC of the admin key); without it decode verifies"),
    Input("kv_remote", "STRING", SCALAR,
          doc="descriptor of KV the receiver pulls (nixl: agent metadata + registered range), instead of kv_payload"),
    Input("output_ids", "INT32", LIST, doc="tokens generated so far (decode: >= 1, or none with kv_sent=false: the "
                                           "decode server prefills the prompt and samples the first token)"),
    Input("token_ids", "INT32", LIST, doc="the newest token ids (postprocess, fed from llm's output)"),
    Input("precision", "STRING", SCALAR, doc="decode engine precision (decode)"),
    Input("kv_sent", "BOOL", SCALAR, True,
          doc="false: prefill could not send the KV (transfer_ok=false), so decode recomputes at once instead of "
              "waiting for it"),
    Input("kv_key", "STRING", SCALAR,
          doc="decode: the request id the KV was sent under, when it is not this request's (a choice of n)"),
    Input("kv_shares", "INT32", SCALAR, 1, (1, MAX_CHOICES),
          doc="decode: how many choices fork the KV sent under kv_key (copy on write in the block pool)"),
    Input("send_interval_ms", "INT32", SCALAR, 0, (0, 10000),
          doc="decode: send a stream's tokens at most this often (the last at once); 0: every step. The "
              "orchestrator asks for it when its client wants one final response (stream=false)"),
]
INPUTS: Dict[str, Input] = {i.name: i for i in _INPUTS}
assert len(INPUTS) == len(_INPUTS), "an input is defined twice"

SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_token_ids", "stop", "min_p",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_ids", "logit_bias_values",
            "return_log_probs", "top_logprobs", "guided_decoding_guide_type", "guided_decoding_guide")
# the per-choice inputs of the internal hops (a client asks for n with num_return_sequences)
CHOICE = ("sequence_index",)
PROMPT = ("text_input", "input_ids", "apply_chat_template")

# model -> (its inputs, the required ones); every other input of a model is optional
MODELS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "llm": (PROMPT + SAMPLING + ("num_return_sequences", "return_prompt_log_probs", "transport", "kv_dtype",
                                 "decode_precision", "stream"), ()),
    "aggregated": (PROMPT + SAMPLING, ()),
    "ensemble": (("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed"),
                 ("text_input",)),
    "preprocess": (("text_input", "apply_chat_template"), ("text_input",)),
    "postprocess": (("output_ids", "token_ids"), ("output_ids",)),
    "prefill": (("input_ids", "request_id", "decode_url", "internal_token", "transport",
                 "kv_dtype", "skip_transfer", "prefix_cache", "kv_skip_tokens", "num_return_sequences",
                 "return_prompt_log_probs")
                + SAMPLING, ()),
    "decode": (("op", "request_id", "kv_header", "kv_payload", "ingest_token", "input_ids",
                "output_ids", "precision", "kv_sent", "kv_key", "kv_shares", "send_interval_ms") + SAMPLING + CHOICE,
               ()),
    "kv_ingest": (("op", "request_id", "kv_header", "kv_payload", "kv_remote"), ()),
}


def inputs_of(model: str) -> List[Input]:
    return [INPUTS[n] for n in MODELS[model][0]]


def array(name: str, value) -> np.ndarray:
    """A value for input `name` as the array its model expects (lists for LIST inputs, one value otherwise)."""
    spec = INPUTS[name]
    if spec.dtype == "STRING":
        vals = value.reshape(-1).tolist() if isinstance(value, np.ndarray) else \
            value if isinstance(value, (list, tuple)) else [value]
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
    return [] if a is None else a.reshape(-1).astype(np.int64, copy=False).tolist()  # Python ints, at C speed


def float_list(t: Tensors, name: str) -> List[float]:
    a = t.get(name)
    return [] if a is None else a.reshape(-1).astype(np.float64, copy=False).tolist()


def sampling_params(t: Tensors, default_max_tokens: Optional[int] = None) -> SamplingParams:
    """The sampling inputs -> validated SamplingParams (defaults from the schema)."""
    d = {n: INPUTS[n].default for n in SAMPLING + CHOICE}
    bias_ids, bias_vals = int_list(t, "logit_bias_ids"), float_list(t, "logit_bias_values")
    bias_ids = [] if bias_ids == [-1] and not bias_vals else bias_ids  # the "none" placeholder (sampling_arrays)
    if len(bias_ids) != len(bias_vals):
        raise RequestError(f"logit_bias_ids ({len(bias_ids)}) and logit_bias_values ({len(bias_vals)}) must have "
                           "the same length")
    guide_type = scalar(t, "guided_decoding_guide_type", "", str) or ""
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
        min_p=scalar(t, "min_p", d["min_p"], float),
        presence_penalty=scalar(t, "presence_penalty", d["presence_penalty"], float),
        frequency_penalty=scalar(t, "frequency_penalty", d["frequency_penalty"], float),
        repetition_penalty=scalar(t, "repetition_penalty", d["repetition_penalty"], float),
        logit_bias=dict(zip(bias_ids, bias_vals)),
        return_log_probs=bool(scalar(t, "return_log_probs", d["return_log_probs"])),
        top_logprobs=scalar(t, "top_logprobs", d["top_logprobs"], int),
        choice=scalar(t, "sequence_index", d["sequence_index"], int),
        guide_type=guide_type,
        guide=(scalar(t, "guided_decoding_guide", "", str) or "") if guide_type else "",
    )
    try:
        return p.validate(MAX_TOKENS_LIMIT)
    except ValueError as e:
        raise RequestError(str(e)) from None


def sampling_arrays(p: SamplingParams, choice: bool = False) -> List[Tuple[str, np.ndarray]]:
    """SamplingParams -> (name, array) to forward to prefill/decode; inputs at their defaults are left out (the
    receiver reads the same defaults), with `choice` the sequence index too. Stop strings stay with the
    orchestrator (it detokenises); an empty stop_token_ids list travels as [-1] (Triton refuses zero-length
    inputs), which readers drop (token ids are >= 0)."""
    out = [(n, array(n, getattr(p, n))) for n in ("max_tokens", "temperature", "top_k", "top_p", "seed",
                                                   "ignore_eos")]
    out.append(("stop_token_ids", array("stop_token_ids", p.stop_token_ids or [-1])))
    for n in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "return_log_probs",
              "top_logprobs"):
        if getattr(p, n) != INPUTS[n].default:
            out.append((n, array(n, getattr(p, n))))
    if p.logit_bias:
        out += [("logit_bias_ids", array("logit_bias_ids", list(p.logit_bias))),
                ("logit_bias_values", array("logit_bias_values", list(p.logit_bias.values())))]
    if p.guide_type:
        out += [("guided_decoding_guide_type", array("guided_decoding_guide_type", p.guide_type)),
                ("guided_decoding_guide", array("guided_decoding_guide", p.guide))]
    if choice and p.choice:
        out.append(("sequence_index", array("sequence_index", p.choice)))
    return out


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
    start = getattr(hdr, "start", 0)
    if not isinstance(start, int) or start < 0 or not 0 < hdr.num_tokens <= max_position - start:
        raise RequestError(f"KV header claims {hdr.num_tokens} tokens from position {start!r}; the model context "
                           f"is {max_position}")


# ---- model_repository/*/config.pbtxt input blocks, generated from this schema -------------------------------
def config_input_block(model: str) -> str:
    """The `input [...]` block of `model`'s config.pbtxt as this schema defines it."""
    names, required = MODELS[model]
    items = []
    for n in names:
        spec = INPUTS[n]
        lines = [f"    # {spec.doc}"] if spec.doc else []
        lines += [f'    name: "{n}"', f"    data_type: TYPE_{spec.dtype}",
                 f"    dims: [ {', '.join(str(d) for d in spec.dims)} ]"]
        if n not in required:
            lines.append("    optional: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return "input [\n" + ",\n".join(items) + "\n]"


def write_config_inputs(repo: str, models=None) -> List[str]:
    """Rewrite the input blocks of model_repository's config.pbtxt files (non-ensemble models) from the schema;
    returns the models changed. `python -m hetserve.schema model_repository` after adding an input here."""
    import re
    from pathlib import Path

    changed = []
    for model in models or MODELS:
        path = Path(repo) / model / "config.pbtxt"
        text = path.read_text()
        if 'platform: "ensemble"' in text:
            continue
        m = re.search(r"(?ms)^input \[\n.*?^\]", text)
        if m is None:
            raise ValueError(f"{path}: no input block")
        new = text[:m.start()] + config_input_block(model) + text[m.end():]
        if new != text:
            path.write_text(new)
            changed.append(model)
    return changed


if __name__ == "__main__":
    import sys

    print("rewrote:", ", ".join(write_config_inputs(sys.argv[1] if len(sys.argv) > 1 else "model_repository"))
          or "nothing")
