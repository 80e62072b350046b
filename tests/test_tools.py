"""OpenAI tools / tool_choice in the frontend (hetserve.openai_api.tools, issue 28): format detection, rendering
through chat templates (jinja, checked against transformers' renderer), whole and streamed parsing of the model's
calls, the grammar for required / named tool_choice. Fast, no servers.

The Hermes and Llama 3 templates below are written for these tests in the shapes those checkpoints' templates
have (Qwen2.5 / Hermes 2 Pro: a <tools> system block, <tool_call> in assistant turns, tool results as
<tool_response> in a user turn; Llama 3.1/3.2: tools as JSON in the first user turn, calls as
{"name", "parameters"}, results in an ipython turn, one call per message); SmolLM2's is the default GGUF's own.
"""
import json
import random

import pytest

from hetserve.openai_api import tools as T
from hetserve.openai_api.schema import ApiError, ChatRequest, Message, NamedToolChoice, ToolDefinition

HERMES_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.' }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- set first_user_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}{{- raise_exception('only single tool-calls at once') }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}
{{- tool_call.arguments | tojson }}{{- '}<|eom_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C or °F) <b>now</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]

CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "Checking the time too.", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


@pytest.fixture(scope="module")
def base_tok():
    """The default GGUF's tokenizer (SmolLM2, whose template knows nothing of tools)."""
    from hetserve.model.checkpoint import load_checkpoint
    from hetserve.tokenizer import Tokenizer

    ck = load_checkpoint(None)
    return Tokenizer(ck.tokenizer_spec, ck.chat_template)


def _with_template(tok, template):
    import copy

    t = copy.copy(tok)
    t.chat_template = template
    t._template = None
    return t


# ---- detection ---------------------------------------------------------------------------------------------------
def test_detect_format(base_tok):
    assert T.detect_format(HERMES_TEMPLATE) == T.HERMES
    assert T.detect_format(LLAMA3_TEMPLATE) == T.LLAMA3_JSON
    assert T.detect_format("{{ '<|python_tag|>' }}") == T.LLAMA3_JSON
    assert T.detect_format(base_tok.chat_template) == T.FALLBACK
    assert T.detect_format(None) == T.FALLBACK and T.detect_format("") == T.FALLBACK
    # a template with its own, other tool format (Mistral's [TOOL_CALLS]) is not given tools
    assert T.detect_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}{% endif %}[TOOL_CALLS]") == T.FALLBACK


# ---- validation --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,choice,msg", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    (None, "required", "needs tools"),
    ([], "auto", "needs tools"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "no tools"),
    (TOOLS, "sometimes", "tool_choice 'sometimes'"),
    ([WEATHER, WEATHER], "auto", "unique"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(T.MAX_TOOLS + 1)], "auto", "at most"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "invalid tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 70000}}}], "auto",
     "invalid tools"),
    ([{"type": "function", "function": {"name": f"f{i}", "description": "d" * 60000}} for i in range(5)], "auto",
     "characters"),
])
def test_validation_400(tools, choice, msg):
    with pytest.raises(ApiError) as e:
        T.validate_tools(tools, choice)
    assert e.value.status == 400 and msg in e.value.message, e.value.message
    assert e.value.param in ("tools", "tool_choice")


def test_validation_modes():
    assert T.validate_tools(TOOLS, None)[1:] == ("auto", None)
    assert T.validate_tools(None, None)[1:] == ("none", None)
    assert T.validate_tools(None, "none")[1:] == ("none", None)
    assert T.validate_tools(TOOLS, "required")[1:] == ("required", None)
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    defs, mode, name = T.validate_tools([ToolDefinition.model_validate(WEATHER), TIME], named)
    assert (mode, name) == ("named", "get_time") and defs[0] == WEATHER


def test_message_schema():
    with pytest.raises(ValueError):
        Message.model_validate({"role": "tool", "content": "x"})  # no tool_call_id
    with pytest.raises(ValueError):
        Message.model_validate({"role": "user", "content": "x", "tool_calls": CONVERSATION[2]["tool_calls"]})
    m = Message.model_validate(CONVERSATION[2])
    assert m.tool_calls[0].function.arguments == '{"city": "Paris"}' and m.text() == ""
    ChatRequest.model_validate({"model": "m", "messages": CONVERSATION})


# ---- rendering ---------------------------------------------------------------------------------------------------
def test_render_messages_native():
    msgs, tools = T.render_messages(CONVERSATION, TOOLS, "auto", T.HERMES)
    assert tools == TOOLS
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert msgs[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"}
    assert "tool_calls" not in msgs[1]
    # tool_choice none: the model is not offered the tools; history still rendered
    msgs2, tools2 = T.render_messages(CONVERSATION, TOOLS, "none", T.HERMES)
    assert tools2 is None and msgs2 == msgs


def test_render_hermes_through_template(base_tok):
    tok = _with_template(base_tok, HERMES_TEMPLATE)
    msgs, tools = T.render_messages(CONVERSATION, TOOLS, "auto", T.HERMES)
    text = tok.apply_chat_template(msgs, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # tojson as transformers: no HTML escaping, non-ASCII kept
    assert json.dumps(WEATHER, ensure_ascii=False) in text and "<b>now</b>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in text
    assert "Checking the time too.\n<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # no tools: the same template renders the plain chat
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_render_llama3_through_template(base_tok):
    tok = _with_template(base_tok, LLAMA3_TEMPLATE)
    conv = CONVERSATION[:4]
    msgs, tools = T.render_messages(conv, TOOLS, "auto", T.LLAMA3_JSON)
    text = tok.apply_chat_template(msgs, tools=tools)
    assert text.startswith("<|im_start|><|start_header_id|>system")  # bos_token is SmolLM2's
    assert "Environment: ipython" in text and json.dumps(WEATHER, indent=4, ensure_ascii=False) in text
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}<|eot_id|>' in text
    # the template's own refusal (two calls in one message) is a ValueError naming it
    two = [conv[1], {"role": "assistant", "tool_calls": CONVERSATION[2]["tool_calls"] + CONVERSATION[4]["tool_calls"]}]
    with pytest.raises(ValueError, match="single tool-calls"):
        tok.apply_chat_template(T.render_messages(two, TOOLS, "auto", T.LLAMA3_JSON)[0], tools=TOOLS)
    # without tools the template runs as before (tools=None is what it sees)
    assert "Environment" not in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_render_fallback_smollm(base_tok):
    """SmolLM2's template has no tools: instructions in the system message, calls and results as text."""
    msgs, tools = T.render_messages(CONVERSATION, TOOLS, "auto", T.FALLBACK)
    assert tools is None and all(set(m) == {"role", "content"} for m in msgs)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == T.hermes_call_text("get_weather", {"city": "Paris"})
    assert msgs[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'
    assert msgs[4]["content"].startswith("Checking the time too.\n<tool_call>")
    text = base_tok.apply_chat_template(msgs)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "SmolLM" not in text
    assert text.endswith("<|im_start|>assistant\n")
    # consecutive tool results share one user turn; no system message of the client's: a new one first
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": CONVERSATION[2]["tool_calls"] + CONVERSATION[4]["tool_calls"]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a"},
            {"role": "tool", "tool_call_id": "call_2", "content": "b"}]
    msgs, _ = T.render_messages(conv, TOOLS, "required", T.FALLBACK)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[3]["content"] == "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
    assert msgs[2]["content"].count("<tool_call>") == 2
    # tool_choice none: no instructions, the SmolLM default system prompt stays
    msgs, _ = T.render_messages(conv[:1], TOOLS, "none", T.FALLBACK)
    assert "SmolLM" in base_tok.apply_chat_template(msgs)


def test_smollm_plain_render_unchanged(base_tok):
    """The environment change (transformers' tojson / undefined handling) keeps plain chats as they were."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert base_tok.apply_chat_template(msgs) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n" \
                                                 "<|im_start|>assistant\n"


@pytest.mark.parametrize("template,fmt,conv", [(HERMES_TEMPLATE, T.HERMES, CONVERSATION),
                                               (LLAMA3_TEMPLATE, T.LLAMA3_JSON, CONVERSATION[:4])])
def test_render_matches_transformers(base_tok, template, fmt, conv):
    """Tokenizer.apply_chat_template with tools renders what transformers' own renderer does."""
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    tok = _with_template(base_tok, template)
    msgs, tools = T.render_messages(conv, TOOLS, "auto", fmt)
    ours = tok.apply_chat_template(msgs, tools=tools)
    rendered = cu.render_jinja_template([msgs], tools=tools, chat_template=template, add_generation_prompt=True,
                                        bos_token="<|im_start|>", eos_token="<|im_end|>")
    theirs = rendered[0][0] if isinstance(rendered, tuple) else rendered[0]
    assert ours == theirs


# ---- whole-output parsing ----------------------------------------------------------------------------------------
def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES_OUTPUTS = [
    # (text, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>'
     '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.",
     [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "a}b\\"{<tool_call>"}}</tool_call> done',
     "done", [("get_weather", {"city": 'a}b"{<tool_call>'})]),
    ('<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>', None,
     [("get_weather", {"city": "Rome"})]),  # key order the stream parser cannot announce early
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>', None,
     [("get_time", {"tz": "UTC"})]),  # arguments as a JSON string
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),  # no closing tag (EOS right after the JSON)
    ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("  plain answer  \n", "plain answer", []),
    ("", "", []),
    # invalid JSON: left in the content as written
    ("<tool_call>\n{name: get_weather}\n</tool_call>", "<tool_call>\n{name: get_weather}\n</tool_call>", []),
    ('A <tool_call>not json</tool_call> B <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "A <tool_call>not json</tool_call> B", [("get_time", {})]),
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    ("text <tool_call> unfinished", "text <tool_call> unfinished", []),
]

LLAMA_OUTPUTS = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('\n {"name": "get_weather", "arguments": {"city": "x;{}"}}\n{"name": "get_time", "parameters": {}} thanks',
     "thanks", [("get_weather", {"city": "x;{}"}), ("get_time", {})]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_weather", "parameters": {"city": }}', '{"name": "get_weather", "parameters": {"city": }}', []),
    ("The weather is {sunny}.", "The weather is {sunny}.", []),
    ("Sure: {\"name\": \"get_time\", \"parameters\": {}}", "Sure: {\"name\": \"get_time\", \"parameters\": {}}", []),
    ('{"name": "get_time", "parameters": {}} {"oops": 1}', '{"oops": 1}', [("get_time", {})]),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("  ", "", []),
]

CASES = [(T.HERMES, *c) for c in HERMES_OUTPUTS] + [(T.LLAMA3_JSON, *c) for c in LLAMA_OUTPUTS] + \
        [(T.FALLBACK, *c) for c in HERMES_OUTPUTS[:3]]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_whole(fmt, text, content, calls):
    got_content, got = T.parse_tool_calls(text, fmt)
    assert got_content == content
    assert _calls(got) == calls
    assert all(c["id"].startswith("call_") and len(c["id"]) > 10 and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == len(got)


# ---- streamed parsing --------------------------------------------------------------------------------------------
def _run_stream(fmt, pieces, prefix=""):
    p = T.ToolStreamParser(fmt, prefix)
    deltas = []
    for piece in pieces:
        deltas += p.feed(piece)
    deltas += p.finish()
    return p, deltas


def _assemble(deltas):
    """What an OpenAI client makes of the deltas (checking their shape on the way)."""
    content, calls = "", []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:  # a call's first delta: index, id, type, name, arguments ""
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
            assert tc["id"].startswith("call_") and tc["function"]["name"]
            calls.append([tc["function"]["name"], ""])
        else:
            assert tc["index"] == len(calls) - 1 and set(tc["function"]) == {"arguments"}
            calls[-1][1] += tc["function"]["arguments"]
    return content, [(n, json.loads(a)) for n, a in calls]


def _splits(text, rng):
    yield [text]
    yield list(text)  # one character at a time
    for cut in range(len(text) + 1):  # every two-piece split
        yield [text[:cut], text[cut:]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 6)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


# announced calls with malformed arguments: streamed as calls (test_stream_cut_off_call_streams_as_call)
STREAM_DIFFERS = {'{"name": "get_weather", "parameters": {"city": }}'}


@pytest.mark.parametrize("fmt,text,content,calls", [c for c in CASES if c[1] not in STREAM_DIFFERS])
def test_parse_stream_equals_whole(fmt, text, content, calls):
    rng = random.Random(text)
    for pieces in _splits(text, rng):
        p, deltas = _run_stream(fmt, pieces)
        got_content, got_calls = _assemble(deltas)
        assert got_content == (content or ""), pieces
        assert got_calls == calls, pieces
        assert p.content == content and _calls(p.tool_calls) == calls
        assert p.finish_reason("stop") == ("tool_calls" if calls else "stop") and p.finish_reason("length") == "length"


def test_stream_content_before_call_is_not_held():
    p = T.ToolStreamParser(T.HERMES)
    assert p.feed("Hello there") == [{"content": "Hello there"}]
    assert p.feed(" <tool") == []  # may be the tag
    assert p.feed("kit> ok") == [{"content": " <toolkit> ok"}]
    assert p.feed("\n<tool_call>\n{\"name\": \"get_time\", ") == []
    d = p.feed('"arguments": {"tz": ')
    assert d[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert d[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"tz": '}}]}
    assert p.feed('"UTC"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"UTC"}'}}]}]
    assert p.feed("}\n</tool_call>") == [] and p.finish() == []
    assert p.tool_calls[0]["function"]["arguments"] == '{"tz": "UTC"}'


def test_stream_llama_plain_text_not_held():
    p = T.ToolStreamParser(T.LLAMA3_JSON)
    assert p.feed(" ") == [] and p.feed("Hi") == [{"content": "Hi"}]
    assert p.feed(" {x}") == [{"content": " {x}"}]


def test_stream_cut_off_call_streams_as_call():
    """A call whose start was announced cannot be taken back: cut off by max_tokens, it stays a call."""
    p, deltas = _run_stream(T.HERMES, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'])
    assert p.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert p.finish_reason("length") == "length"


def test_stream_linear():
    """Long outputs one character at a time: time grows linearly (a quadratic parser would take ~100x)."""
    import time

    def run(n):
        text = "x" * n + '<tool_call>\n{"name": "f", "arguments": {"s": "' + "y" * n + '"}}\n</tool_call>'
        t0 = time.perf_counter()
        _run_stream(T.HERMES, list(text))
        _run_stream(T.LLAMA3_JSON, list('{"name": "f", "parameters": {"s": "' + "y" * n + '"}}'))
        return time.perf_counter() - t0

    import gc

    # The collector's full passes scan the whole heap of the test process (large late in a CI run) and come more
    # often the more the parser allocates: that is the process, not the parser's complexity. Time without it.
    gc.collect()
    gc.disable()
    try:
        run(1000)
        small, big = min(run(2000) for _ in range(3)), min(run(20000) for _ in range(3))
    finally:
        gc.enable()
    assert big < 30 * small, (small, big)


# ---- required / named: the grammar -------------------------------------------------------------------------------
def test_guide_for():
    jsonschema = pytest.importorskip("jsonschema")
    assert T.guide_for(TOOLS, "auto") is None and T.guide_for(TOOLS, "none") is None
    assert T.guide_for(TOOLS, None) is None
    kind, text = T.guide_for(TOOLS, "required", T.HERMES)
    schema = json.loads(text)
    assert kind == "json_schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}, {"name": "get_time", "arguments": {}}]
    bad = [{"name": "get_weather", "arguments": {"unit": "c"}}, {"name": "nope", "arguments": {}},
           {"name": "get_weather", "parameters": {"city": "Paris"}}, {"arguments": {}},
           {"name": "get_weather", "arguments": {"city": "P", "unit": "k"}}]
    for o in ok:
        jsonschema.validate(o, schema)
    for o in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(o, schema)
    # named: only that function; Llama's key is "parameters"
    _, text = T.guide_for(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, T.LLAMA3_JSON)
    schema = json.loads(text)
    assert list(schema["properties"]) == ["name", "parameters"]  # name first: announced before the arguments
    jsonschema.validate({"name": "get_weather", "parameters": {"city": "Paris"}}, schema)
    for o in ({"name": "get_time", "parameters": {}}, {"name": "get_weather", "arguments": {"city": "Paris"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(o, schema)
    with pytest.raises(ApiError):
        T.guide_for(TOOLS, {"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("template,fmt", [(HERMES_TEMPLATE, T.HERMES), (LLAMA3_TEMPLATE, T.LLAMA3_JSON),
                                          (None, T.FALLBACK)])
def test_plan_forced_call(base_tok, template, fmt):
    """required: the prompt ends where the grammar's JSON begins; the JSON the grammar allows parses as the call,
    whole and streamed."""
    jsonschema = pytest.importorskip("jsonschema")
    tok = _with_template(base_tok, template) if template else base_tok
    conv = [{"role": "user", "content": "Weather in Paris?"}]
    plan = T.plan_tools(tok.chat_template, conv, TOOLS, "required")
    assert plan.fmt == fmt and plan.active and plan.guide[0] == "json_schema"
    prompt = tok.apply_chat_template(plan.messages, tools=plan.template_tools) + plan.prompt_suffix
    key = "parameters" if fmt == T.LLAMA3_JSON else "arguments"
    if fmt == T.LLAMA3_JSON:
        assert plan.prompt_suffix == "" and prompt.endswith("<|end_header_id|>\n\n")
    else:
        assert prompt.endswith("<|im_start|>assistant\n<tool_call>\n")
    out = json.dumps({"name": "get_weather", key: {"city": "Paris"}})
    jsonschema.validate(json.loads(out), json.loads(plan.guide[1]))
    content, calls = plan.parse(out)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris"})]
    for pieces in ([out], list(out)):
        p = plan.stream_parser()
        deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
        assert _assemble(deltas) == ("", [("get_weather", {"city": "Paris"})])


def test_plan_none_and_auto(base_tok):
    plan = T.plan_tools(HERMES_TEMPLATE, [{"role": "user", "content": "hi"}], TOOLS, "none")
    assert not plan.active and plan.guide is None and plan.template_tools is None and plan.stream_parser() is None
    assert plan.parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')[1] == []
    plan = T.plan_tools(HERMES_TEMPLATE, [{"role": "user", "content": "hi"}], TOOLS, None)
    assert plan.mode == "auto" and plan.active and plan.guide is None and plan.prompt_suffix == ""
    assert plan.template_tools == TOOLS
    plan = T.plan_tools(HERMES_TEMPLATE, [{"role": "user", "content": "hi"}], None, None)
    assert plan.mode == "none" and not plan.active


def test_a_close_tag_inside_a_json_string_is_argument_text_whole_and_streamed():
    # seen live: a sampled argument string held "</tool_call>"; the call must end at its own close tag
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b", "unit": "c"}}\n</tool_call>'
    want = '{"city": "a</tool_call>b", "unit": "c"}'
    content, calls = T.parse_tool_calls(text, T.HERMES)
    assert content is None and [c["function"]["arguments"] for c in calls] == [want]
    for step in (1, 2, 5, len(text)):
        p = T.ToolStreamParser(T.HERMES)
        for i in range(0, len(text), step):
            p.feed(text[i:i + step])
        p.finish()
        assert [c["function"]["arguments"] for c in p.tool_calls] == [want] and p.content is None, step
