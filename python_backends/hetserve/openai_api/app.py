"""OpenAI-compatible HTTP frontend (FastAPI on uvicorn) over the prefill server's `llm` model.

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (stream true/false, SSE), GET /health.
The one model it serves is named after the checkpoint the engines were built from (served_model_name): GGUF
`general.name` (the file name without .gguf when the GGUF has none), an HF checkpoint's directory name, unless
`--served-model-name` or HETSERVE_OPENAI_MODEL (which wins) names it; a request for any other model is a 404.
The frontend tokenizes (chat template from the engine manifest, same tokenizer as the servers) so it can count
prompt tokens and refuse over-long prompts before anything reaches Triton; `llm` gets `input_ids`.

Limits (each refusal is an OpenAI-shaped error): body bytes (413), prompt characters and tokens (400), requests
in flight (503 + Retry-After), and the model context (prompt + max_tokens, 400).
For streams the first token is awaited before the response starts, so an error before it (bad input, overload)
is a real HTTP status; after it, an error is sent as a final `data: {"error": ...}` event.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, List, Optional, Tuple

import orjson
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' string annotations here
from fastapi.responses import ORJSONResponse as JSONResponse  # orjson: the responses' JSON, ~5x stdlib
from fastapi.responses import StreamingResponse

from .. import config
from ..sampling import TokenLogprobs
from .backend import Delta, TritonLLM
from .responses import Choice, TokenTexts, best, chat_logprobs, completion_logprobs, echo_logprobs
from .schema import ApiError, ChatRequest, CompletionRequest, GenRequest, Usage, bad_request, new_id, now, parse
from .tools import ToolPlan, plan_tools

log = logging.getLogger("hetserve.openai")


@dataclass
class FrontendConfig:
    triton_url: str = "127.0.0.1:8001"  # prefill server gRPC
    engine_dir: str = ""  # tokenizer + chat template + context length (the servers' engine dir)
    model_name: Optional[str] = None  # None: the checkpoint's name (served_model_name)
    host: str = "127.0.0.1"
    port: int = 8080
    max_concurrent: int = 64
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 64 * 1024
    default_max_tokens: int = 256
    step_timeout_s: float = 60.0

    @classmethod
    def from_env(cls, served_model_name: Optional[str] = None, **kw) -> "FrontendConfig":
        """The settings from HETSERVE_* variables, then `kw` (those not None). The model name: HETSERVE_OPENAI_MODEL
        when set (non-empty), else `served_model_name` (--served-model-name), else None: the checkpoint's name."""
        env_name = config.get("HETSERVE_OPENAI_MODEL") or None
        if env_name and served_model_name and served_model_name != env_name:
            log.warning("HETSERVE_OPENAI_MODEL=%r wins over --served-model-name %r", env_name, served_model_name)
        base = dict(triton_url=config.get("HETSERVE_OPENAI_TRITON_URL"),
                    engine_dir=config.get("HETSERVE_ENGINE_DIR") or "",
                    model_name=env_name or served_model_name or None,
                    max_concurrent=config.get("HETSERVE_OPENAI_MAX_CONCURRENT"),
                    max_body_bytes=config.get("HETSERVE_OPENAI_MAX_BODY_BYTES"),
                    max_prompt_chars=config.get("HETSERVE_OPENAI_MAX_PROMPT_CHARS"),
                    default_max_tokens=config.get("HETSERVE_OPENAI_DEFAULT_MAX_TOKENS"))
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)


def served_model_name(manifest: dict) -> str:
    """The name a build's checkpoint is served under: a GGUF's file name without .gguf (and without a split's
    -0000N-of-0000M: what the user passed, and what llama.cpp's server reports; `general.name` is often an internal
    run name, and two quantizations of one model share it), an HF checkpoint's directory name, else the name the
    loader recorded in the manifest's config."""
    src = Path(str(manifest.get("source") or "").rstrip("/"))
    if src.suffix == ".gguf":
        return re.sub(r"-\d{5}-of-\d{5}$", "", src.stem)
    if src.name:
        return src.name
    return str((manifest.get("config") or {}).get("name") or "").strip() or "model"


class Model:
    """Tokenizer, chat template and context length of the served model (from the engine manifest)."""

    def __init__(self, engine_dir: str):
        from ..engines.builder import default_engine_dir
        from ..engines.manifest import load_tokenizer, read_manifest

        d = engine_dir or default_engine_dir()
        man = read_manifest(d)
        if man is None:
            raise FileNotFoundError(f"{d}: no manifest.json (run `hetserve build` or pass --engine-dir)")
        self.tok = load_tokenizer(d)
        self.context = int(man["config"]["max_position"])
        self.name = served_model_name(man)


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Frontend:
    def __init__(self, cfg: FrontendConfig):
        self.model = Model(cfg.engine_dir)
        self.cfg = cfg if cfg.model_name else replace(cfg, model_name=self.model.name)
        self.llm = TritonLLM(cfg.triton_url, max_concurrent=cfg.max_concurrent, step_timeout_s=cfg.step_timeout_s)
        self.texts = TokenTexts(self.model.tok)

    # ---- request -> GenRequest ------------------------------------------------------------------
    def _check_model(self, name: str):
        if name != self.cfg.model_name:
            raise ApiError(404, f"The model '{name}' does not exist (served: '{self.cfg.model_name}')",
                           param="model", code="model_not_found")

    def _tokens(self, text: str, param: str) -> List[int]:
        if len(text) > self.cfg.max_prompt_chars:
            raise bad_request(f"prompt is {len(text)} characters; the limit is {self.cfg.max_prompt_chars}", param)
        return self.model.tok.encode(text)

    def _gen(self, r, ids: List[int], max_tokens: Optional[int], param: str, chat: bool,
             response_format=None, forced_guide: Optional[Tuple[str, str]] = None) -> Tuple[GenRequest, "Shape"]:
        """forced_guide: the grammar tool_choice required / a named tool imposes (hetserve.openai_api.tools)."""
        if not ids:
            raise bad_request("empty prompt", param)
        vocab = self.model.tok.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise bad_request(f"token id out of range [0, {vocab})", param)
        room = self.model.context - len(ids)
        if room < 1:
            raise bad_request(f"prompt is {len(ids)} tokens; this model's context is {self.model.context}", param)
        if max_tokens is None:
            max_tokens = min(self.cfg.default_max_tokens, room)
        elif max_tokens > room:
            raise bad_request(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                              f"{self.model.context} tokens", "max_tokens")
        if chat:
            if r.top_logprobs and not r.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
            want_lp, top = bool(r.logprobs), int(r.top_logprobs or 0)
            best_of = r.n
        else:
            want_lp, top = r.logprobs is not None, int(r.logprobs or 0)
            best_of = r.best_of or r.n
            if best_of < r.n:
                raise bad_request(f"best_of ({best_of}) must be >= n ({r.n})", "best_of")
            if best_of > r.n and r.stream:
                raise bad_request("best_of > n cannot be streamed (the best choices are known at the end)", "best_of")
        bad = [t for t in (r.logit_bias or {}) if t >= vocab]
        if bad:
            raise bad_request(f"logit_bias: token id {bad[0]} out of range [0, {vocab})", "logit_bias")
        try:
            guide_type, guide = r.guide(response_format)
        except ValueError as e:
            raise bad_request(str(e), "response_format") from None
        if forced_guide is not None:
            if guide_type:
                raise bad_request("tool_choice required / a named function constrains the output already; it "
                                  "cannot be combined with response_format or guided_* fields", "tool_choice")
            guide_type, guide = forced_guide
        gen = GenRequest(input_ids=ids, max_tokens=max_tokens,
                         temperature=1.0 if r.temperature is None else r.temperature,
                         top_p=1.0 if r.top_p is None else r.top_p, top_k=r.top_k or 0,
                         seed=random.getrandbits(63) if r.seed is None else r.seed,  # OpenAI: no seed = random
                         stop=list(r.stop or []), ignore_eos=r.ignore_eos, min_p=r.min_p,
                         presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                         repetition_penalty=r.repetition_penalty, logit_bias=dict(r.logit_bias or {}),
                         return_log_probs=want_lp or best_of > r.n, top_logprobs=top, num_return_sequences=best_of,
                         guided_decoding_guide_type=guide_type, guided_decoding_guide=guide,
                         stream=bool(r.stream))
        return gen, Shape(chat, r.n, best_of, want_lp, top)

    def chat_request(self, body) -> tuple:
        r = parse(ChatRequest, body)
        self._check_model(r.model)
        plan = plan_tools(self.model.tok.chat_template, r.messages, r.tools, r.tool_choice)  # 400s its own
        # the client's message text (content parts checked by plan_tools); tool definitions have their own bound
        # (MAX_TOOLS_CHARS), also where the fallback format writes them into the system message
        if sum(len(m.text()) for m in r.messages) > self.cfg.max_prompt_chars:
            raise bad_request(f"messages exceed {self.cfg.max_prompt_chars} characters", "messages")
        try:
            text = self.model.tok.apply_chat_template(plan.messages, add_generation_prompt=True,
                                                      tools=plan.template_tools) + plan.prompt_suffix
        except ValueError as e:  # the template's raise_exception (e.g. roles out of order), jinja's own errors
            raise bad_request(f"the model's chat template refused the messages: {e}", "messages") from None
        mt = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        gen, shape = self._gen(r, self._tokens(text, "messages"), mt, "messages", True, r.response_format,
                               forced_guide=plan.guide)
        shape.tools = plan if plan.active else None
        return r, gen, shape

    def completion_request(self, body) -> tuple:
        r = parse(CompletionRequest, body)
        self._check_model(r.model)
        p = r.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            p = p[0]
        ids = self._tokens(p, "prompt") if isinstance(p, str) else [int(x) for x in p]
        gen, shape = self._gen(r, ids, r.max_tokens, "prompt", False)
        if r.echo:
            shape.echo = p if isinstance(p, str) else self.model.tok.decode(ids)
            shape.prompt_ids = ids
            gen.return_prompt_log_probs = shape.want_logprobs
        return r, gen, shape

    # ---- responses ------------------------------------------------------------------------------
    async def collect(self, gen: GenRequest, shape: "Shape") -> Tuple[List[Choice], Usage]:
        choices = {i: Choice(i) for i in range(shape.best_of)}
        n = 0
        async for d in self.llm.generate(gen):
            c = choices.get(d.index)
            if c is None:
                raise ApiError(500, f"llm answered for choice {d.index} of {shape.best_of}", "server_error",
                               code="internal_error")
            c.add(d.text, d.token_ids, d.logprobs, d.finish_reason)
            n += len(d.token_ids)
            shape.prompt_logprobs = d.prompt_logprobs or shape.prompt_logprobs
        out = list(choices.values())
        for c in out:
            c.finish_reason = c.finish_reason or "stop"
        if shape.best_of > shape.n:
            out = best(out, shape.n)
        return out, Usage(len(gen.input_ids), n)

    def _logprobs(self, shape: "Shape", ids, lps, offset: int = 0) -> Optional[dict]:
        if not shape.want_logprobs:
            return None
        if shape.chat:
            return chat_logprobs(self.texts, ids, lps, shape.top)
        return completion_logprobs(self.texts, ids, lps, shape.top, offset)

    def chat_body(self, rid, choices: List[Choice], usage, shape: "Shape") -> dict:
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.cfg.model_name,
                "choices": [self._chat_choice(c, shape) for c in choices], "usage": usage.as_dict()}

    def _chat_choice(self, c: Choice, shape: "Shape") -> dict:
        text, reason = "".join(c.text), c.finish_reason
        message: dict = {"role": "assistant", "content": text}
        if shape.tools is not None:
            content, calls = shape.tools.parse(text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": c.index, "message": message, "logprobs": self._logprobs(shape, c.ids, c.logprobs),
                "finish_reason": reason}

    def _echo_logprobs(self, shape: "Shape", gen: Optional[dict]) -> Optional[dict]:
        """Completions echo + logprobs: the prompt's tokens (the first without a logprob) lead the answer's."""
        if gen is None or not shape.echo:
            return gen
        return echo_logprobs(self.texts, shape.prompt_ids, shape.prompt_logprobs, shape.top, gen)

    def completion_body(self, rid, choices: List[Choice], usage, shape: "Shape") -> dict:
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.cfg.model_name,
                "choices": [{"index": c.index, "text": shape.echo + "".join(c.text),
                             "logprobs": self._echo_logprobs(shape, self._logprobs(shape, c.ids, c.logprobs,
                                                                                   len(shape.echo))),
                             "finish_reason": c.finish_reason} for c in choices],
                "usage": usage.as_dict()}

    async def sse(self, rid: str, r, gen: GenRequest, shape: "Shape", first: Delta,
                  rest: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
        """SSE chunks; `first` was already received (so errors before it became HTTP statuses)."""
        chat = shape.chat
        created, model = now(), self.cfg.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(r.stream_options and r.stream_options.include_usage)
        usage = Usage(len(gen.input_ids), 0)
        offsets = {i: len(shape.echo) for i in range(shape.n)}

        parsers = {i: shape.tools.stream_parser() for i in range(shape.n)} if shape.tools is not None else {}

        def chunk(i: int, text: Optional[str], reason: Optional[str], role: bool = False, logprobs=None,
                  delta: Optional[dict] = None) -> dict:
            if chat:
                if delta is None:
                    delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": None, **delta} if "tool_calls" in delta else \
                        {"role": "assistant", "content": delta.get("content") or ""}
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return c

        try:
            d = first
            started: set = set()
            finished: set = set()
            if shape.echo:
                shape.prompt_logprobs = first.prompt_logprobs
                lp = echo_logprobs(self.texts, shape.prompt_ids, shape.prompt_logprobs, shape.top, {
                    "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}) \
                    if shape.want_logprobs else None
                for i in range(shape.n):
                    yield _sse(chunk(i, shape.echo, None, logprobs=lp))
            while True:
                usage.completion_tokens += len(d.token_ids)
                i = d.index
                role = chat and i not in started
                lp = self._logprobs(shape, d.token_ids, d.logprobs, offsets.get(i, 0)) if d.token_ids else None
                parser = parsers.get(i)
                if parser is not None:  # tools: content and call deltas; logprobs ride on the step's first
                    deltas = parser.feed(d.text) + (parser.finish() if d.finish_reason else [])
                    for k, delta in enumerate(deltas or ([{}] if role or lp else [])):
                        yield _sse(chunk(i, None, None, role=role, logprobs=lp if k == 0 else None, delta=delta))
                        started.add(i)
                        role = False
                elif d.text or role or lp:
                    yield _sse(chunk(i, d.text, None, role=role, logprobs=lp))
                    started.add(i)
                offsets[i] = offsets.get(i, 0) + len(d.text)
                if d.finish_reason:
                    reason = parser.finish_reason(d.finish_reason) if parser is not None else d.finish_reason
                    yield _sse(chunk(i, None if chat else "", reason))
                    finished.add(i)
                    if len(finished) >= shape.n:
                        break
                d = await rest.__anext__()
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                            "usage": usage.as_dict()})
            yield b"data: [DONE]\n\n"
        except ApiError as e:
            yield _sse(e.body())
            yield b"data: [DONE]\n\n"
        except StopAsyncIteration:
            yield _sse({"error": {"message": "generation ended without a finish reason", "type": "server_error",
                                  "param": None, "code": "upstream_error"}})
        finally:
            await rest.aclose()  # on client disconnect this cancels the Triton request -> decode frees it


@dataclass
class Shape:
    """How a request's answer is shaped: chat or completions, n choices (best_of generated), logprobs asked,
    top-N alternatives, the echoed prompt (completions echo=true)."""
    chat: bool
    n: int
    best_of: int
    want_logprobs: bool
    top: int
    echo: str = ""
    prompt_ids: List[int] = field(default_factory=list)  # echo: the prompt's tokens (their logprobs lead)
    prompt_logprobs: Optional[TokenLogprobs] = None  # echo + logprobs, from the first response
    tools: Optional[ToolPlan] = None  # chat with tools offered: the output is parsed for calls


def create_app(cfg: FrontendConfig) -> FastAPI:
    fe = Frontend(cfg)
    cfg = fe.cfg  # with the model name resolved

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await fe.llm.close()

    app = FastAPI(title="hetserve OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.frontend = fe

    def err_response(e: ApiError, rid: Optional[str] = None):
        headers = {"Retry-After": e.retry_after} if e.retry_after else {}
        if rid:
            headers["X-Request-Id"] = rid
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return err_response(e)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return err_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _bad_method(request, e):
        return err_response(ApiError(405, f"method {request.method} not allowed on {request.url.path}"))

    async def read_json(request: Request):
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > cfg.max_body_bytes:
            # read (and drop) a moderately oversized body before answering: refusing mid-upload resets the
            # connection and the client sees ECONNRESET instead of the 413; past 8x the cap just close
            if int(n) <= 8 * cfg.max_body_bytes:
                async for _ in request.stream():
                    pass
            raise ApiError(413, f"request body over {cfg.max_body_bytes} bytes", code="body_too_large")
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > cfg.max_body_bytes:
                raise ApiError(413, f"request body over {cfg.max_body_bytes} bytes", code="body_too_large")
        try:
            return orjson.loads(bytes(buf))
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"request body is not valid JSON: {e}") from None

    async def watch_disconnect(request: Request, task: asyncio.Task):
        while not task.done():
            if await request.is_disconnected():
                task.cancel()  # aborts the generator -> cancels the Triton request
                return
            await asyncio.sleep(0.2)

    async def serve(request: Request, chat: bool):
        rid = new_id("chatcmpl" if chat else "cmpl")
        body = await read_json(request)
        r, gen, shape = fe.chat_request(body) if chat else fe.completion_request(body)
        gen.request_id = rid
        if not r.stream:
            task = asyncio.ensure_future(fe.collect(gen, shape))
            watcher = asyncio.ensure_future(watch_disconnect(request, task))
            try:
                choices, usage = await task
            except asyncio.CancelledError:
                return JSONResponse({}, status_code=499)  # nobody is listening any more
            except ApiError as e:
                return err_response(e, rid)
            finally:
                watcher.cancel()
            out = (fe.chat_body if chat else fe.completion_body)(rid, choices, usage, shape)
            return JSONResponse(out, headers={"X-Request-Id": rid})
        agen = fe.llm.generate(gen)
        try:
            first = await agen.__anext__()
        except ApiError as e:
            await agen.aclose()
            return err_response(e, rid)
        return StreamingResponse(fe.sse(rid, r, gen, shape, first, agen), media_type="text/event-stream",
                                 headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "hetserve"}]}

    @app.get("/v1/models/{name:path}")  # a served name may hold a '/' (org/model)
    async def model(name: str):
        fe._check_model(name)
        return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "hetserve"}

    @app.get("/health")
    async def health():
        ok = await fe.llm.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable", "triton": cfg.triton_url},
                            status_code=200 if ok else 503)

    return app


def serve(cfg: FrontendConfig, ready_cb=None) -> int:
    """Run uvicorn in the foreground (SIGINT/SIGTERM stop it)."""
    import uvicorn

    from ..logs import setup

    setup("openai")
    app = create_app(cfg)
    cfg = app.state.frontend.cfg  # the model name resolved (ready_cb prints it)
    ucfg = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, limit_concurrency=cfg.max_concurrent * 2 + 16)
    server = uvicorn.Server(ucfg)
    if ready_cb is not None:
        ready_cb(cfg)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found: make
    # that a no-op so a stopped frontend exits 0 like the Triton servers' launcher
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0
