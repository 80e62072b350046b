"""OpenAI tools / tool_choice in the frontend (issue 28): which tool-call format the checkpoint's chat template
speaks, the messages and tool list the template is given, the model's tool calls parsed back into OpenAI
`tool_calls` (whole and streamed), and the grammar that `required` / a named tool_choice puts on the sampler.

Formats (detect_format, from the chat template's text):

* ``hermes`` -- Hermes 2 Pro / Qwen2.5 / Qwen3: the template mentions ``<tool_call>``; the model writes
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (any number of them, possibly after text),
  and tool results go back as role ``tool`` messages, which the template wraps in ``<tool_response>``.
* ``llama3_json`` -- Llama 3.1 / 3.2 / 3.3: the template mentions ``<|python_tag|>``, or is a Llama 3 header
  template (``<|start_header_id|>``) that handles ``tools`` and ``"parameters"``; the model answers with
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``; several separated by ``;``) at the
  start of its reply, and tool results go back as role ``tool`` (the template's ``ipython``).
* ``fallback`` -- any other template (SmolLM2's, which knows nothing of tools, or one whose own tool format we do
  not parse): the tool definitions are written into the system message with instructions to answer in the Hermes
  ``<tool_call>`` format, earlier tool calls become ``<tool_call>`` text in the assistant message and tool
  results ``<tool_response>`` text in a user message, and the output is parsed as Hermes. That is what users of
  such a checkpoint expect from an OpenAI server (a best effort from the model, constrained by the grammar under
  ``required``) rather than a refusal; the template itself is given no ``tools``.

Everything here is pure text work (no servers): the app calls plan_tools() per request, renders
plan.messages / plan.template_tools through Tokenizer.apply_chat_template, appends plan.prompt_suffix, sends
plan.guide as the guided-decoding constraint, and turns the output into `tool_calls` with plan.parse() (whole) or
plan.stream_parser() (streamed).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .schema import MAX_TOOLS, MAX_TOOLS_CHARS, Message, NamedToolChoice, ToolDefinition, bad_request

HERMES, LLAMA3_JSON, FALLBACK = "hermes", "llama3_json", "fallback"
FORMATS = (HERMES, LLAMA3_JSON, FALLBACK)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HEAD_MAX = 512  # chars of a call's start searched for its name; a call whose name comes later is parsed whole
# a call's start: {"name": "<name>", "arguments"|"parameters": then the value's first character ({ or ")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{"])')


def detect_format(chat_template: Optional[str]) -> str:
    """The tool-call format a chat template speaks: HERMES, LLAMA3_JSON or FALLBACK (module docstring)."""
    t = chat_template or ""
    if TOOL_CALL_OPEN in t:
        return HERMES
    if PYTHON_TAG in t or ("<|start_header_id|>" in t and "tools" in t and '"parameters"' in t):
        return LLAMA3_JSON
    return FALLBACK


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- validation -----------------------------------------------------------------------------------------------
def _tool_dicts(tools: Optional[Sequence[Union[ToolDefinition, dict]]]) -> List[dict]:
    out = []
    for t in tools or []:
        if not isinstance(t, ToolDefinition):
            t = ToolDefinition.model_validate(t)
        out.append(t.model_dump(exclude_none=True))
    return out


def _choice(tool_choice) -> Union[str, dict, None]:
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    if isinstance(tool_choice, NamedToolChoice):
        return tool_choice.model_dump()
    return NamedToolChoice.model_validate(tool_choice).model_dump()


def validate_tools(tools, tool_choice) -> Tuple[List[dict], str, Optional[str]]:
    """-> (tool definitions as dicts, mode "none" | "auto" | "required" | "named", the named function or None).
    A 400 (ApiError) for: more than MAX_TOOLS tools or MAX_TOOLS_CHARS of them as JSON, two tools of one name,
    tool_choice "required" or a named function without tools, a name that is not among the tools, an unknown
    tool_choice string. OpenAI's defaults: "auto" with tools, "none" without."""
    try:
        defs = _tool_dicts(tools)
        choice = _choice(tool_choice)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise bad_request(f"invalid tools / tool_choice: {e}", "tools") from None
    if len(defs) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools per request, got {len(defs)}", "tools")
    if defs and len(json.dumps(defs)) > MAX_TOOLS_CHARS:
        raise bad_request(f"tool definitions longer than {MAX_TOOLS_CHARS} characters as JSON", "tools")
    names = [d["function"]["name"] for d in defs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad_request(f"tool names must be unique, repeated: {dup}", "tools")
    if choice is None:
        return defs, ("auto" if defs else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {choice!r}: use none, auto, required or "
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if choice != "none" and not defs:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        return defs, choice, None
    name = choice["function"]["name"]
    if not defs:
        raise bad_request("tool_choice names a function but the request has no tools", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools {names}",
                          "tool_choice")
    return defs, "named", name


# ---- rendering ------------------------------------------------------------------------------------------------
def _arguments_dict(args: Union[str, dict, None]) -> Any:
    """A call's arguments as the templates expect them (a dict, which they `tojson`); a string that is not JSON
    is passed on as the string."""
    if isinstance(args, dict):
        return args
    if not args:
        return {}
    try:
        return json.loads(args)
    except ValueError:
        return args


def _message_dict(m: Union[Message, dict]) -> dict:
    if isinstance(m, dict):
        m = Message.model_validate(m)
    d: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": _arguments_dict(c.function.arguments)}}
                           for c in m.tool_calls]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


def hermes_call_text(name: str, arguments: Any) -> str:
    return f'{TOOL_CALL_OPEN}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n' \
           f'{TOOL_CALL_CLOSE}'


def fallback_system_text(tools: List[dict]) -> str:
    """The tool instructions written into the system message for a template without tool support (Hermes's)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_messages(messages: Sequence[Union[Message, dict]], tools=None, tool_choice=None,
                    fmt: str = HERMES) -> Tuple[List[dict], Optional[List[dict]]]:
    """-> (message dicts, tools) to give Tokenizer.apply_chat_template(messages, tools=tools).

    Roles: developer -> system. HERMES / LLAMA3_JSON: assistant `tool_calls` with `arguments` as a dict (JSON
    string -> dict, as the templates `tojson` them; the key only on messages that have calls, since Llama's
    template tests `'tool_calls' in message`), role `tool` with tool_call_id and the called function's `name`
    (looked up from the earlier call; some templates print it); tools are the OpenAI definitions, None under
    tool_choice "none" (OpenAI: the model then calls nothing) or without tools. FALLBACK: only system / user /
    assistant text reaches the template (tools None): the tool instructions in the system message (appended to
    the client's own, or a new first message), calls as `<tool_call>` text, each run of tool results as one user
    message of `<tool_response>` blocks. Validation errors (bad tools / tool_choice) are 400s."""
    defs, mode, _ = validate_tools(tools, tool_choice)
    try:
        msgs = [_message_dict(m) for m in messages]
    except ValueError as e:
        raise bad_request(str(e).splitlines()[0] if str(e) else "invalid message", "messages") from None
    names = {}
    for m in msgs:
        for c in m.get("tool_calls") or ():
            names[c["id"]] = c["function"]["name"]
    for m in msgs:
        if m["role"] == "tool" and "name" not in m and m["tool_call_id"] in names:
            m["name"] = names[m["tool_call_id"]]
    offered = defs if mode != "none" else []
    if fmt != FALLBACK:
        return msgs, (offered or None)
    out: List[dict] = []
    if offered:
        sys_text = fallback_system_text(offered)
        if msgs and msgs[0]["role"] == "system":
            first = msgs.pop(0)
            sys_text = f"{first['content']}\n\n{sys_text}" if first["content"] else sys_text
        out.append({"role": "system", "content": sys_text})
    for m in msgs:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(hermes_call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("_tool_results", None)
    return out, None


# ---- the grammar for required / a named function -----------------------------------------------------------------
def call_schema(tools: List[dict], fmt: str = HERMES) -> dict:
    """JSON schema of one call of any of `tools`: {"name": const, "arguments" (LLAMA3_JSON: "parameters"): that
    tool's parameters schema}, one branch per tool (anyOf when more than one), name first (grammar engines emit
    properties in schema order, which lets the stream parser announce the name before the arguments)."""
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    branches = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "const": fn["name"]}, key: params},
                         "required": ["name", key], "additionalProperties": False})
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def guide_for(tools, tool_choice, fmt: str = HERMES) -> Optional[Tuple[str, str]]:
    """(guided_decoding_guide_type, guide) that makes the model call a tool: "json_schema" with call_schema() of
    all tools ("required") or of the named one; None for "auto" / "none" / no tools.

    Why a JSON schema of the call object and not a regex / EBNF of the whole `<tool_call>` block: every grammar
    engine compiles JSON schemas (tool parameter schemas are arbitrary JSON schema; turning them into a regex or
    EBNF ourselves would re-implement the engine's schema compiler, badly), and the wrapping is fixed text the
    frontend can supply itself: for HERMES / FALLBACK the prompt ends with prompt_suffix() = "<tool_call>\\n" and
    the parser is fed that same prefix (ToolPlan does both), so the model writes only the JSON object; the
    grammar ends after it, so exactly one call is made (OpenAI allows several under "required"; one is what a
    schema-constrained call can give). LLAMA3_JSON needs no wrapping: the bare object is the call."""
    defs, mode, name = validate_tools(tools, tool_choice)
    if mode == "required":
        chosen = defs
    elif mode == "named":
        chosen = [d for d in defs if d["function"]["name"] == name]
    else:
        return None
    return "json_schema", json.dumps(call_schema(chosen, fmt))


def prompt_suffix(fmt: str, forced: bool) -> str:
    """Text appended to the rendered prompt when the call is forced by the grammar (HERMES / FALLBACK: the
    opening tag the JSON-schema grammar does not produce); the parser must be fed it first."""
    return f"{TOOL_CALL_OPEN}\n" if forced and fmt != LLAMA3_JSON else ""


# ---- parsing a whole output -------------------------------------------------------------------------------------
def _parse_call(text: str) -> Optional[Tuple[str, str]]:
    """One call's JSON text -> (name, arguments JSON string), None when it is not a call. Lenient the way the
    stream parser is: the object may have text after it, or lack its closing brace once the arguments are
    complete."""
    s = text.strip()
    obj = None
    try:
        obj, _ = json.JSONDecoder().raw_decode(s)
    except ValueError:
        m = _HEAD.match(s)
        if m:
            try:
                args, _ = json.JSONDecoder().raw_decode(s, m.end())
                obj = {"name": json.loads(f'"{m.group(1)}"'), "arguments": args}
            except ValueError:
                return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, dict):
        return obj["name"], json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        return obj["name"], args
    return None


def _json_end(text: str, at: int) -> int:
    """Where the JSON value starting at `at` (after whitespace) ends; `at` when there is none whole."""
    i = at
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        return json.JSONDecoder().raw_decode(text, i)[1]
    except ValueError:
        return at


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, fmt: str = HERMES) -> Tuple[Optional[str], List[dict]]:
    """A complete output -> (content, tool_calls). content: the text that is not a call, stripped, None when
    there is none and calls were made ("" when there is neither); tool_calls: OpenAI's
    [{"id": "call_<hex>", "type": "function", "function": {"name", "arguments": JSON string}}]. A block that is
    not valid JSON (or not a call) stays in the content as it was written; nothing here raises."""
    calls: List[dict] = []
    if fmt == LLAMA3_JSON:
        s = text.lstrip()
        tagged = s.startswith(PYTHON_TAG)
        i = len(PYTHON_TAG) if tagged else 0
        dec = json.JSONDecoder()
        while True:
            while i < len(s) and (s[i].isspace() or (calls and s[i] == ";")):
                i += 1
            if i >= len(s) or s[i] != "{":
                break
            try:
                _, end = dec.raw_decode(s, i)
            except ValueError:
                end = len(s)  # not one whole object: a call only if its start and arguments are (cut off)
            got = _parse_call(s[i:end])
            if got is None:
                break
            calls.append(_call(*got))
            i = end
        content = (s[i:] if calls else text).strip()
        return (content or (None if calls else "")), calls
    parts: List[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            parts.append(text[pos:])
            break
        parts.append(text[pos:start])
        body_at = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, _json_end(text, body_at))  # a close tag inside the JSON is text
        body = text[body_at:] if end < 0 else text[body_at:end]
        stop = len(text) if end < 0 else end + len(TOOL_CALL_CLOSE)
        got = _parse_call(body)
        if got is None:
            parts.append(text[start:stop])
        else:
            calls.append(_call(*got))
        pos = stop
    content = "".join(parts).strip()
    return (content or (None if calls else "")), calls


# ---- parsing a streamed output ----------------------------------------------------------------------------------
class _Scan:
    """Incremental JSON structure scanner: depth and string state, one character at a time."""
    __slots__ = ("depth", "in_str", "esc")

    def __init__(self):
        self.depth, self.in_str, self.esc = 0, False, False

    def step(self, ch: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


def _partial_suffix(s: str, tag: str) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of `tag` (text to hold back)."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


class ToolStreamParser:
    """Text deltas of one choice -> OpenAI chat-chunk deltas.

    feed(text) / finish() return a list of deltas, each {"content": str} or {"tool_calls": [...]}: a call's first
    delta is {"index", "id", "type": "function", "function": {"name", "arguments": ""}}, then
    {"index", "function": {"arguments": piece}} as the arguments arrive (OpenAI's stream shape). Content streams
    while no call has begun; from "<tool_call>" (HERMES / FALLBACK) or a reply starting with "{" / <|python_tag|>
    (LLAMA3_JSON) text is held: once the call's start ({"name": "...", "arguments": {) is seen its name is sent
    and the arguments follow as written; a block whose start does not look like that is held until it ends and
    then parsed whole (a call, or content as written). Text that may be the start of a tag is held back until it
    is decided. Linear in the output: each character is scanned once.

    Content follows parse_tool_calls(): leading whitespace dropped, trailing whitespace held until more content
    follows, so the streamed content and calls equal the whole-text parse of the same output. One difference: a
    call whose start was sent cannot be taken back, so a call cut off (max_tokens) or with malformed arguments
    streams as a call with those arguments, where the whole-text parse leaves it in the content.

    `tool_calls` / `content` give the result so far (for the final usage / logging), `finish_reason(r)` the
    OpenAI finish reason ("tool_calls" when a call was made and the model stopped by itself)."""

    def __init__(self, fmt: str = HERMES, prefix: str = ""):
        self.fmt = fmt
        self.tool_calls: List[dict] = []
        self._content: List[str] = []
        self._out: List[dict] = []
        self._hold = ""  # undecided text (a possible tag start; or, before the first call, leading text)
        self._ws = ""  # trailing whitespace of the content, sent when more content follows
        self._started = False  # content sent
        self._state = "start" if fmt == LLAMA3_JSON else "text"
        self._reset_block()
        self._tagged: Optional[bool] = False  # LLAMA3_JSON: <|python_tag|> began the reply (None: decided, no)
        self._lead = ""  # LLAMA3_JSON: what came before the first call's "{"
        self._body_at = 0
        if prefix:
            self._feed(prefix)
            self._out = []

    @property
    def content(self) -> Optional[str]:
        c = "".join(self._content)
        return c or (None if self.tool_calls else "")

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    # -- public
    def feed(self, text: str) -> List[dict]:
        self._feed(text)
        return self._take()

    def finish(self) -> List[dict]:
        """Flush at the end of the output: held text becomes content, an open call is closed."""
        if self._state == "block":
            self._close_block(ended=False)
        elif self._state == "start":
            self._emit_content(self._lead)
        elif self._hold:
            self._emit_content(self._hold)
        self._hold = ""
        self._state = "done"
        return self._take()

    # -- output
    def _emit_content(self, s: str) -> None:
        if not self._started:
            s = s.lstrip()
            if not s:
                return
            self._started = True
        s = self._ws + s
        core = s.rstrip()
        self._ws = s[len(core):]
        if core:
            self._content.append(core)
            if self._out and "content" in self._out[-1]:
                self._out[-1]["content"] += core
            else:
                self._out.append({"content": core})

    def _emit_header(self, name: str) -> None:
        call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self.tool_calls.append(call)
        self._args: List[str] = []
        self._out.append({"tool_calls": [{"index": len(self.tool_calls) - 1, "id": call["id"], "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})

    def _emit_args(self, piece: str) -> None:
        if not piece:
            return
        self._args.append(piece)
        idx = len(self.tool_calls) - 1
        last = self._out[-1] if self._out else None
        prev = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
        if prev is not None and prev["index"] == idx and "id" not in prev:
            prev["function"]["arguments"] += piece
        else:
            self._out.append({"tool_calls": [{"index": idx, "function": {"arguments": piece}}]})

    def _take(self) -> List[dict]:
        out, self._out = self._out, []
        return out

    # -- states
    def _feed(self, text: str) -> None:
        while text:
            text = getattr(self, "_on_" + self._state)(text)

    def _on_done(self, text: str) -> str:
        return ""

    def _on_text(self, text: str) -> str:
        """Content until a <tool_call> tag (HERMES / FALLBACK), or everything (LLAMA3_JSON after its calls)."""
        if self.fmt == LLAMA3_JSON:
            self._emit_content(text)
            return ""
        s = self._hold + text
        at = s.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._hold = ""
            self._emit_content(s[:at])
            self._open_block()
            return s[at + len(TOOL_CALL_OPEN):]
        k = _partial_suffix(s, TOOL_CALL_OPEN)
        self._hold = s[len(s) - k:] if k else ""
        self._emit_content(s[:len(s) - k])
        return ""

    def _on_start(self, text: str) -> str:
        """LLAMA3_JSON before the first call: whitespace, an optional <|python_tag|>, whitespace, then "{" (a
        call, maybe) or content. What was seen is kept in _lead, given back as content when no call follows."""
        self._lead += text
        if self._tagged is False:
            st = self._lead.lstrip()
            if not st or (len(st) < len(PYTHON_TAG) and PYTHON_TAG.startswith(st)):
                return ""
            self._tagged = st.startswith(PYTHON_TAG)
            self._body_at = len(self._lead) - len(st) + (len(PYTHON_TAG) if self._tagged else 0)
            if not self._tagged:
                self._tagged = None  # decided: no tag
        r = self._lead[self._body_at:].lstrip()
        if not r:
            return ""
        if r[0] == "{":
            self._lead = self._lead[:len(self._lead) - len(r)]
            self._open_block()
            return r
        lead, self._lead = self._lead, ""
        self._state = "text"
        self._emit_content(lead)
        return ""

    def _on_between(self, text: str) -> str:
        """LLAMA3_JSON after a call: whitespace and ";" skipped; "{" starts the next call, anything else is
        content to the end."""
        i = 0
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return ""
        if text[i] == "{":
            self._open_block()
            return text[i:]
        self._state = "text"
        return text[i:]

    # -- a call block
    def _reset_block(self) -> None:
        self._pieces: List[str] = []
        self._head = ""
        self._phase = "head"  # head -> args -> tail, or held
        self._scan = _Scan()
        self._args_scan: Optional[_Scan] = None
        self._args_kind = ""
        self._args_str: List[str] = []

    def _open_block(self) -> None:
        self._state = "block"
        self._reset_block()
        self._hold = ""

    def _on_block(self, text: str) -> str:
        if self.fmt != LLAMA3_JSON:  # ended by the close tag, unless it is inside a JSON string of the call
            s = self._hold + text
            self._hold = ""
            sc = self._scan
            for i, ch in enumerate(s):
                if ch == "<" and not sc.in_str:
                    if s.startswith(TOOL_CALL_CLOSE, i):
                        self._consume(s[:i])
                        self._close_block(ended=True)
                        return s[i + len(TOOL_CALL_CLOSE):]
                    if TOOL_CALL_CLOSE.startswith(s[i:]):  # maybe the tag: decided by the next text
                        self._hold = s[i:]
                        self._consume(s[:i])
                        return ""
                sc.step(ch)
            self._consume(s)
            return ""
        # LLAMA3_JSON: the block is one JSON object, ended by its closing brace
        for i, ch in enumerate(text):
            self._scan.step(ch)
            if self._scan.depth == 0 and not self._scan.in_str:
                self._consume(text[:i + 1])
                self._close_block(ended=True)
                return text[i + 1:]
        self._consume(text)
        return ""

    def _consume(self, s: str) -> None:
        if not s:
            return
        self._pieces.append(s)
        if self._phase == "head":
            self._head += s
            m = _HEAD.match(self._head)
            if m:
                self._emit_header(json.loads(f'"{m.group(1)}"'))
                rest = self._head[m.end():]
                self._head = ""
                self._phase = "args"
                self._args_scan = _Scan()
                self._args_kind = rest[0]
                self._args_piece(rest)
            elif len(self._head) > _HEAD_MAX:
                self._head = ""
                self._phase = "held"
        elif self._phase == "args":
            self._args_piece(s)

    def _args_piece(self, s: str) -> None:
        """Arguments text as written, up to the end of the arguments value (an object: sent as it comes; a JSON
        string: collected and sent decoded when it ends)."""
        sc = self._args_scan
        assert sc is not None, "arguments scan starts when the arguments value does"
        end = len(s)
        for i, ch in enumerate(s):
            sc.step(ch)
            if sc.depth == 0 and not sc.in_str:
                end = i + 1
                self._phase = "tail"
                break
        if self._args_kind == "{":
            self._emit_args(s[:end])
        else:
            self._args_str.append(s[:end])
            if self._phase == "tail":
                self._emit_string_args()

    def _emit_string_args(self) -> None:
        raw = "".join(self._args_str)
        self._args_str = []
        try:
            val = json.loads(raw)
        except ValueError:
            val = raw
        self._emit_args(val if isinstance(val, str) else raw)

    def _close_block(self, ended: bool) -> None:
        """The block ended (its close tag / brace) or the output did (ended=False)."""
        body = "".join(self._pieces) + (self._hold if not ended else "")
        self._hold = ""
        if self._phase in ("args", "tail"):
            if self._args_kind == '"' and self._args_str:
                self._emit_string_args()
            self.tool_calls[-1]["function"]["arguments"] = "".join(self._args)
            self._state = "between" if self.fmt == LLAMA3_JSON else "text"
        else:
            got = _parse_call(body)
            if got is not None:
                self._emit_header(got[0])
                self._emit_args(got[1])
                self.tool_calls[-1]["function"]["arguments"] = got[1]
                self._state = "between" if self.fmt == LLAMA3_JSON else "text"
            elif self.fmt == LLAMA3_JSON:
                lead = self._lead if not self.tool_calls else ""
                self._state = "text"
                self._emit_content(lead + body)
            else:
                self._state = "text"
                self._emit_content(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if ended else ""))
        self._lead = ""
        self._reset_block()
        if not ended:
            self._state = "done"


# ---- per request ------------------------------------------------------------------------------------------------
@dataclass
class ToolPlan:
    """What a chat request's tools mean for the frontend (plan_tools). messages / template_tools go to
    Tokenizer.apply_chat_template(messages, tools=template_tools); prompt_suffix is appended to the rendered
    prompt; guide, when set, is the request's (guide_type, guide) -- one structured-output constraint per
    request, so a client's response_format alongside required / a named tool is a 400 the app raises; `active`:
    parse the output for calls (tools offered and tool_choice not "none")."""
    fmt: str
    mode: str
    messages: List[dict]
    template_tools: Optional[List[dict]]
    guide: Optional[Tuple[str, str]] = None
    prompt_suffix: str = ""
    active: bool = False
    tools: List[dict] = field(default_factory=list)

    def parse(self, text: str) -> Tuple[Optional[str], List[dict]]:
        """A whole output -> (content, tool_calls); the plain text (and no calls) when not active."""
        if not self.active:
            return text, []
        return parse_tool_calls(self.prompt_suffix + text, self.fmt)

    def stream_parser(self) -> Optional[ToolStreamParser]:
        """A fresh parser per choice (None when not active: stream the text as content)."""
        return ToolStreamParser(self.fmt, self.prompt_suffix) if self.active else None


def plan_tools(chat_template: Optional[str], messages: Sequence[Union[Message, dict]], tools=None,
               tool_choice=None) -> ToolPlan:
    """The ToolPlan of a chat request (400s for invalid tools / tool_choice / tool messages)."""
    fmt = detect_format(chat_template)
    defs, mode, _ = validate_tools(tools, tool_choice)
    msgs, template_tools = render_messages(messages, defs, tool_choice, fmt)
    guide = guide_for(defs, tool_choice, fmt)
    return ToolPlan(fmt=fmt, mode=mode, messages=msgs, template_tools=template_tools, guide=guide,
                    prompt_suffix=prompt_suffix(fmt, guide is not None), active=mode != "none", tools=defs)


__all__ = ["HERMES", "LLAMA3_JSON", "FALLBACK", "ToolPlan", "ToolStreamParser", "call_schema",
           "detect_format", "guide_for", "parse_tool_calls", "plan_tools", "prompt_suffix", "render_messages",
           "validate_tools"]
