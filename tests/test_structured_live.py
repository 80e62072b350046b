"""Structured output and tools with the official `openai` client on the session's real servers (issue 28): 100 of
100 json_schema answers (nested objects, enums, arrays; whole and streamed; sampled, so the grammar is what keeps
them valid) parse and validate with `jsonschema`; json_object, regex and choice; a named tool's call round trip,
whole and streamed; the grammar-refusal 400s. Migration mid-JSON is in test_reliability.py (it needs two decode
servers). Nothing is faked: real prefill + decode tritonservers (conftest `topology`) and a real frontend.
"""
import concurrent.futures
import json
import re

import pytest

from test_openai import MODEL, _frontend

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "address", "active"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "active": {"type": "boolean"},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
TAGS = {"type": "object", "additionalProperties": False, "required": ["tags", "score"],
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                "items": {"enum": ["red", "green", "blue"]}},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}}}
ROWS = {"type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False, "required": ["k", "v"],
                  "properties": {"k": {"type": "string", "maxLength": 6},
                                 "v": {"type": "integer", "minimum": -50, "maximum": 50}}}}
SCHEMAS = {"person": PERSON, "nested": NESTED, "tags": TAGS, "rows": ROWS}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                   "properties": {"tz": {"type": "string", "maxLength": 20}}}}}


@pytest.fixture(scope="module")
def client(topology, engine_dir):
    fe = _frontend(topology, engine_dir, topology.base_port + 82)
    yield openai.OpenAI(base_url=fe.spec.url, api_key="unused", max_retries=0, timeout=180)
    fe.stop()


def _schema_format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _ask(client, name, seed, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Describe a {name} as JSON."}], max_tokens=256,
              temperature=1.0, seed=seed, response_format=_schema_format(name))
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
    text, reason = [], None
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            reason = ch.choices[0].finish_reason or reason
    return "".join(text), reason


def test_100_of_100_json_schema_answers_validate(client):
    jobs = [(name, seed, seed % 3 == 0) for seed in range(25) for name in SCHEMAS]  # 100, a third streamed
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda j: (j, _ask(client, *j)), jobs))
    bad = []
    for (name, seed, stream), (text, reason) in results:
        try:
            assert reason == "stop", f"finish_reason {reason}"  # the grammar ended it, not max_tokens
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except Exception as e:  # noqa: BLE001 -- collected, all shown
            bad.append(f"{name} seed {seed} stream {stream}: {e}: {text!r}")
    assert not bad, f"{len(bad)} of {len(jobs)} invalid:\n" + "\n".join(bad[:5])
    # sampled at temperature 1: the answers differ (the grammar constrains, it does not pick)
    assert len({text for _, (text, _) in results}) > 50


def test_json_object_regex_and_choice(client):
    msgs = [{"role": "user", "content": "Give me something."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=0.8, seed=1,
                                       response_format={"type": "json_object"})
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj, dict) and r.choices[0].finish_reason == "stop"
    pattern = r"[A-Z]{3}-[0-9]{4}"
    r = client.completions.create(model=MODEL, prompt="Ticket id:", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    colours = ["crimson", "teal", "ochre"]
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=1.0, seed=seed,
                                           extra_body={"guided_choice": colours})
        assert r.choices[0].message.content in colours
    # the vLLM >= 0.10 spelling and n > 1: every choice is constrained
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=1.0, seed=5, n=3,
                                       extra_body={"structured_outputs": {"choice": colours}})
    assert len(r.choices) == 3 and all(c.message.content in colours for c in r.choices)


def test_structured_output_refusals_are_400s(client):
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        dict(response_format={"type": "xml"}),
        dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}),
        dict(extra_body={"guided_regex": "(unclosed"}),
        dict(extra_body={"guided_choice": []}),
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
        dict(tool_choice="required"),
        dict(tools=[WEATHER, WEATHER]),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
        assert ei.value.body and ei.value.body.get("message"), kw
    # the server is fine afterwards
    assert client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).choices[0].message


def _call_args(call, tool):
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_tool_call_round_trip_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=128, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = _call_args(call, WEATHER)

    # streamed: the SDK's chunks accumulate to the same call (name first, then argument pieces)
    name, pieces, ids, reason = None, [], set(), None
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=named,
                                             max_tokens=128, temperature=0, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            assert tc.index == 0
            ids.add(tc.id) if tc.id else None
            name = (tc.function.name if tc.function and tc.function.name else name)
            pieces.append(tc.function.arguments or "" if tc.function else "")
        reason = ch.choices[0].finish_reason or reason
    assert reason == "tool_calls" and name == "get_weather" and len(ids) == 1
    assert json.loads("".join(pieces)) == args

    # the round trip: the call and its result go back through the chat template; the model answers in text
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="none",
                                        max_tokens=24, temperature=0)
    c2 = r2.choices[0]
    assert c2.message.content and not c2.message.tool_calls and c2.finish_reason in ("stop", "length")
    # the call and the result were in the prompt: more tokens than the question alone under the same tool_choice
    alone = client.chat.completions.create(model=MODEL, messages=msgs[:1], tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=1)
    assert r2.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_required_tool_choice_calls_one_of_the_tools(client):
    msgs = [{"role": "user", "content": "Use a tool."}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=128, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0].message
        tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
        _call_args(calls[0], tool)
    # auto: the model decides; whatever it wrote comes back as content or as calls, never as an error
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=16, temperature=0)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
