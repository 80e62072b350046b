"""OpenAI request schema (pydantic) and the typed generation request the frontend sends to `llm`.

Only what we serve is accepted; a field we cannot honour (README "OpenAI fields": completions `suffix`, streamed
best_of) is a 400 naming the field rather than being silently ignored. Unknown extra fields are
ignored, as OpenAI-compatible servers do (clients and benchmark tools send vendor extensions).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP = 4  # OpenAI's own limit on stop sequences
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's own limit
MAX_CHOICES = 16  # n and best_of (hetserve.sampling.MAX_CHOICES: each choice holds a decode batch row)


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status + {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, retry_after: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(msg: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, msg, param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Message(BaseModel):
    """One chat message. `tool_calls` (assistant) and `tool_call_id` (role tool) carry OpenAI tool use; the
    frontend renders them through the checkpoint's chat template (hetserve.openai_api.tools.render_messages)."""
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List["ToolCall"]] = Field(default=None, max_length=128)
    tool_call_id: Optional[str] = Field(default=None, max_length=256)

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"unsupported role {v!r} (system, developer, user, assistant, tool)")
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed on assistant messages, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        """Content as text: a string, or the text parts of a content-part list (images etc. are refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            out.append(part["text"])
        return "".join(out)


MAX_TOOLS = 128  # tools per request
MAX_TOOL_SCHEMA_CHARS = 64 * 1024  # one function's `parameters` as JSON
MAX_TOOLS_CHARS = 256 * 1024  # all tool definitions together as JSON
_FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"  # OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64 (and dots)


class FunctionDefinition(BaseModel):
    """A tool's function: name, description, JSON-schema `parameters` (absent: takes no arguments)."""
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=_FUNCTION_NAME)
    description: Optional[str] = Field(default=None, max_length=MAX_TOOL_SCHEMA_CHARS)
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v):
        if v is not None and len(json.dumps(v)) > MAX_TOOL_SCHEMA_CHARS:
            raise ValueError(f"parameters schema longer than {MAX_TOOL_SCHEMA_CHARS} characters as JSON")
        return v


class ToolDefinition(BaseModel):
    """An entry of ChatRequest.tools: {"type": "function", "function": {...}}."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(BaseModel):
    """A call's function: name and arguments, a JSON string as OpenAI sends it (a JSON object is accepted too)."""
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    arguments: Union[str, Dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    """An entry of an assistant message's tool_calls."""
    model_config = ConfigDict(extra="ignore")
    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


# ChatRequest.tool_choice: "none" | "auto" | "required" | NamedToolChoice
ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]

Message.model_rebuild()


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2 ** 63)
    stop: Optional[Union[str, List[str]]] = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: Optional[str] = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    # extensions (vLLM / TensorRT-LLM spelling), used by benchmark tools to fix output lengths and by clients
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    # structured output, vLLM's spellings (response_format is the OpenAI way)
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[Dict[str, Any]] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_CHARS} characters")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if not v:
            return {}
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        out = {}
        for k, b in v.items():
            if not str(k).isdigit():
                raise ValueError(f"keys are token ids, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"token {k}: bias {b} outside [-100, 100]")
            out[int(k)] = float(b)
        return out

    def guide(self, response_format: Optional[Dict[str, Any]] = None) -> Tuple[str, str]:
        """(guided_decoding_guide_type, guide) of the request's structured-output fields, ("", "") for none;
        more than one constraint is refused."""
        found: List[Tuple[str, str, str]] = []
        rf = response_format or {}
        if rf.get("type") == "json_object":
            found.append(("response_format", "json", ""))
        elif rf.get("type") == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema' object")
            found.append(("response_format", "json_schema", json.dumps(js.get("schema") or {"type": "object"})))
        elif rf.get("type") not in (None, "text"):
            raise ValueError(f"response_format type {rf.get('type')!r}: use text, json_object or json_schema")
        so = dict(self.structured_outputs or {})
        def field_or(own, key):
            return own if own is not None else so.get(key)

        for name, kind, val in (("guided_json", "json_schema", field_or(self.guided_json, "json")),
                                ("guided_regex", "regex", field_or(self.guided_regex, "regex")),
                                ("guided_choice", "choice", field_or(self.guided_choice, "choice")),
                                ("guided_grammar", "ebnf_grammar", field_or(self.guided_grammar, "grammar"))):
            if val is not None and val != "":  # an empty list / dict is a malformed constraint, not none
                text = val if isinstance(val, str) and kind != "choice" else json.dumps(val)
                if kind == "choice" and not (isinstance(val, list) and val and all(isinstance(c, str) for c in val)):
                    raise ValueError("guided_choice must be a non-empty list of strings")
                found.append((name, kind, text))
        if len(found) > 1:
            raise ValueError(f"one structured-output constraint per request, got {[f[0] for f in found]}")
        return (found[0][1], found[0][2]) if found else ("", "")


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[List[ToolDefinition]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # accepted: the model may make several calls under "auto"
    response_format: Optional[Dict[str, Any]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)


class CompletionRequest(_Common):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)  # legacy: the number of top alternatives
    best_of: Optional[int] = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported (no fill-in-the-middle template is known for this model)")
        return v


def parse(model_cls, body: Any):
    """JSON body -> request model, or a 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        raise bad_request(f"{loc}: {msg}" if loc else msg, param=loc or None) from None


@dataclass
class GenRequest:
    """What the frontend asks of `llm`: prompt token ids + sampling (llm validates the ranges again); the field
    names are llm's inputs (hetserve.schema)."""
    input_ids: List[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: List[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    return_log_probs: bool = False
    top_logprobs: int = 0
    num_return_sequences: int = 1
    guided_decoding_guide_type: str = ""
    guided_decoding_guide: str = ""
    return_prompt_log_probs: bool = False
    # false: llm answers once, at the end (decode then sends its tokens in batches, far fewer messages on every
    # hop); the choices of n > 1 always stream (each response names its choice)
    stream: bool = True

    def params(self) -> dict:
        """Keyword arguments for hetserve.client.build_inputs (inputs at their defaults left out)."""
        p = dict(input_ids=self.input_ids, max_tokens=self.max_tokens, temperature=self.temperature,
                 top_p=self.top_p, top_k=self.top_k, seed=self.seed, ignore_eos=self.ignore_eos,
                 stream=self.stream or self.num_return_sequences > 1)
        if self.stop:
            p["stop"] = self.stop
        for name, default in (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0), ("return_log_probs", False), ("top_logprobs", 0),
                              ("num_return_sequences", 1), ("return_prompt_log_probs", False)):
            if getattr(self, name) != default:
                p[name] = getattr(self, name)
        if self.logit_bias:
            p["logit_bias_ids"] = list(self.logit_bias)
            p["logit_bias_values"] = list(self.logit_bias.values())
        if self.guided_decoding_guide_type:
            p["guided_decoding_guide_type"] = self.guided_decoding_guide_type
            p["guided_decoding_guide"] = self.guided_decoding_guide
        return p


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
