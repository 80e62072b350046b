"""OpenAI request schema (pydantic) and the typed generation request the frontend sends to `llm`.

Only what we serve is accepted; a field we cannot honour (n > 1, logprobs, tools, penalties != 0, non-text
response formats) is a 400 naming the field rather than being silently ignored. Unknown extra fields are
ignored, as OpenAI-compatible servers do (clients and benchmark tools send vendor extensions).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 4  # OpenAI's own limit on stop sequences
MAX_STOP_CHARS = 256


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
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"unsupported role {v!r} (system, developer, user, assistant)")
        return v

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


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2 ** 64)
    stop: Optional[Union[str, List[str]]] = None
    n: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logprobs: Optional[Any] = None
    # extensions (vLLM / TensorRT-LLM spelling), used by benchmark tools to fix output lengths
    top_k: Optional[int] = Field(default=None, ge=0)
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_CHARS} characters")
        return [s for s in stops if s]

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v):
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[List[Any]] = None
    response_format: Optional[Dict[str, Any]] = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("tools are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _fmt(cls, v):
        if v and v.get("type") not in (None, "text"):
            raise ValueError("only response_format type 'text' is supported")
        return v


class CompletionRequest(_Common):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    echo: bool = False
    suffix: Optional[str] = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
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
    """What the frontend asks of `llm`: prompt token ids + sampling (llm validates the ranges again)."""
    input_ids: List[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: List[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""

    def params(self) -> dict:
        """Keyword arguments for hetserve.client.build_inputs."""
        p = dict(input_ids=self.input_ids, max_tokens=self.max_tokens, temperature=self.temperature,
                 top_p=self.top_p, top_k=self.top_k, seed=self.seed, ignore_eos=self.ignore_eos, stream=True)
        if self.stop:
            p["stop"] = self.stop
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
