"""hetserve.structured (issue 28): the grammar engine (llguidance) on the default model's real tokenizer."""
import json
import re

import numpy as np
import pytest

from hetserve import structured as S
from hetserve.errors import InternalError, RequestError

PAD = 64  # the model's vocab may exceed the tokenizer's: those ids must never be allowed

FILM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "thriller"]},
        "cast": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "lead": {"type": "boolean"}},
            "required": ["name", "lead"], "additionalProperties": False}},
    },
    "required": ["title", "year", "genre", "cast"], "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "qty": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
    },
    "required": ["id", "customer", "status", "qty"], "additionalProperties": False,
}
TOOL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "arguments": {"type": "object", "properties": {
                       "city": {"type": "string", "maxLength": 20}, "units": {"enum": ["metric", "imperial"]}},
                       "required": ["city", "units"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def env():
    from hetserve.model.checkpoint import load_checkpoint
    from hetserve.tokenizer import Tokenizer

    ck = load_checkpoint(None)
    tok = Tokenizer(ck.tokenizer_spec, ck.chat_template)
    eos = list(ck.config.eos_token_ids)
    assert tok.vocab_size == 49152 and ck.config.vocab_size >= tok.vocab_size
    comp = S.GrammarCompiler.for_tokenizer(tok, ck.config.vocab_size + PAD, eos)
    closers = np.zeros(comp.vocab_size, np.float32)  # ids whose text closes something: to end unbounded output
    for i in range(tok.vocab_size):
        t = tok.decode([i])
        if t and t[-1] in '}]"':
            closers[i] = 4.0
    return tok, comp, eos, closers


def generate(env, spec, seed, max_tokens=400, close_after=40, batch=False):
    """Argmax of masked random logits until EOS (ids after close_after prefer closing brackets / quotes)."""
    tok, comp, eos, closers = env
    m = S.Matcher(comp, spec)
    rng = np.random.default_rng(seed)
    out = []
    for step in range(max_tokens):
        x = rng.standard_normal(comp.vocab_size).astype(np.float32)
        x[eos] += 2.0
        if step >= close_after:
            x += closers
        if batch:
            xb = np.stack([np.zeros_like(x), x])
            S.mask_batch([None, m], xb)
            assert np.all(xb[0] == 0)  # an unconstrained row is left alone
            x = xb[1]
        else:
            m.mask_logits(x)
        assert np.all(np.isneginf(x[-PAD:])), "padding ids past the tokenizer must never be allowed"
        t = int(np.argmax(x))
        assert np.isfinite(x[t])
        m.accept(t)
        if t in eos:
            assert m.is_terminated()
            return tok.decode(out), m
        out.append(t)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("schema", [FILM, ORDER, TOOL], ids=["film", "order", "tool"])
def test_json_schema_output_validates(env, schema):
    jsonschema = pytest.importorskip("jsonschema")
    spec = S.GuideSpec.parse("json_schema", json.dumps(schema))
    for seed in range(3):
        text, m = generate(env, spec, seed, batch=seed == 1)
        obj = json.loads(text)
        jsonschema.validate(obj, schema)
        assert text == json.dumps(obj, ensure_ascii=False)  # json.dumps' layout (JSON_OPTIONS)


def test_json_any_object(env):
    spec = S.GuideSpec.parse("json", "")
    for seed in range(3):
        text, _ = generate(env, spec, seed, close_after=20)
        assert isinstance(json.loads(text), dict)


def test_regex_and_choice_and_ebnf(env):
    rx = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]{1,6})?"
    for seed in range(3):
        text, _ = generate(env, S.GuideSpec.parse("regex", rx), seed)
        assert re.fullmatch(rx, text), text
    choices = ["café au lait", "tea", "yes, please"]
    seen = {generate(env, S.GuideSpec.parse("choice", json.dumps(choices)), seed)[0] for seed in range(6)}
    assert seen <= set(choices) and seen
    for grammar in ('root ::= "yes" | "no" | "maybe"', 'start: ("yes" | "no" | "maybe")'):  # GBNF and Lark
        text, _ = generate(env, S.GuideSpec.parse("ebnf_grammar", grammar), 0)
        assert text in ("yes", "no", "maybe")


def test_eos_only_when_the_grammar_can_end(env):
    tok, comp, eos, _ = env
    m = S.Matcher(comp, S.GuideSpec.parse("json_schema", json.dumps(TOOL)))
    ids = tok.encode(json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "units": "metric"}}))
    for t in ids:
        x = np.zeros(comp.vocab_size)  # float64 too (hetserve.sampling's processed logits)
        m.mask_logits(x)
        assert np.isfinite(x[t]) and all(np.isneginf(x[e]) for e in eos)
        assert not m.is_terminated()
        m.accept(t)
    assert m.is_terminated() and m.can_end() and m.tokens_accepted == len(ids)
    x = np.zeros(comp.vocab_size, np.float32)
    m.mask_logits(x)
    assert set(np.flatnonzero(np.isfinite(x))) == set(eos)  # the grammar is done: only EOS
    with pytest.raises(S.GrammarViolation):
        m.accept(ids[0])
    m2 = S.Matcher(comp, S.GuideSpec.parse("json_schema", json.dumps(TOOL)))
    with pytest.raises(S.GrammarViolation) as e:  # EOS before the grammar may end
        m2.accept(eos[0])
    assert isinstance(e.value, InternalError)


def test_resume_gives_the_same_masks(env):
    tok, comp, eos, _ = env
    spec = S.GuideSpec.parse("json_schema", json.dumps(ORDER))
    inst = {"id": "ABC-1234", "customer": {"name": "Jo", "address": {"city": "Oslo", "zip": "01234"}},
            "status": "paid", "qty": [1, 22]}
    ids = tok.encode(json.dumps(inst)) + [eos[0]]
    full = S.Matcher(comp, spec)
    masks = []
    for t in ids:
        b = np.empty(comp.words, np.int32)
        full.fill_bitmask(b)
        masks.append(b)
        full.accept(t)
    for k in (0, 1, 5, len(ids) // 2, len(ids) - 1):  # k = 1: the prefill server sampled the first token
        m = S.Matcher.resume(comp, spec, ids[:k])
        assert m.tokens_accepted == k
        for j in range(k, len(ids)):
            b = np.empty(comp.words, np.int32)
            m.fill_bitmask(b)
            assert np.array_equal(b, masks[j]), (k, j)
            m.accept(ids[j])
        assert m.is_terminated()
    with pytest.raises(S.GrammarViolation):
        S.Matcher.resume(comp, spec, tok.encode('{"nope": 1}'))


def test_matcher_factory(env):
    from types import SimpleNamespace

    tok, comp, eos, _ = env
    make = S.matcher_factory(comp)
    m = make(SimpleNamespace(guide_type="choice", guide='["red", "green"]'), tok.encode("gr"))
    x = np.zeros(comp.vocab_size, np.float32)
    m.mask_logits(x)
    assert tok.decode(list(np.flatnonzero(np.isfinite(x)))).startswith("een") or np.isfinite(
        x[tok.encode("een")[0]])
    with pytest.raises(RequestError):
        make(SimpleNamespace(guide_type="grammar", guide="x"), ())


@pytest.mark.parametrize("type_,guide,msg", [
    ("xml", "", "unknown guide type"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "strin"}', "strin"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),  # refused, not silently ignored
    ("regex", "(a", "unclosed group"),
    ("regex", "(?=a)b", "look-around"),
    ("regex", "", "empty"),
    ("choice", '"a"', "list of strings"),
    ("choice", "[]", "list of strings"),
    ("choice", '["a", 1]', "list of strings"),
    ("ebnf_grammar", 'root ::= foo', "foo"),
    ("ebnf_grammar", "start: (", "ebnf_grammar"),
    ("json", '{"type": "object"}', "takes no guide"),
    ("regex", "a" * (S.MAX_GUIDE_BYTES + 1), "longer than"),
])
def test_invalid_specs_are_request_errors(type_, guide, msg):
    with pytest.raises(RequestError) as e:
        S.GuideSpec.parse(type_, guide)
    assert msg in str(e.value)
    assert e.value.http_status == 400


def test_compile_errors_and_bounded_cache(env):
    tok, _, eos, _ = env
    comp = S.GrammarCompiler.for_tokenizer(tok, None, eos, cache_entries=3)
    with pytest.raises(RequestError):  # a spec built without parse() is still checked by compile()
        comp.compile(S.GuideSpec("json_schema", '{"type": "strin"}'))
    specs = [S.GuideSpec.parse("regex", f"[a-z]{{{n}}}") for n in range(1, 7)]
    for s in specs:
        comp.compile(s)
        assert comp.cache_size() <= 3
    misses = comp.misses
    assert comp.compile(specs[-1]) is comp.compile(specs[-1]) and comp.misses == misses  # cached
    comp.compile(specs[0])  # evicted: compiled again
    assert comp.misses == misses + 1 and comp.cache_size() == 3
    m1, m2 = S.Matcher(comp, specs[-1]), S.Matcher(comp, specs[-1])  # one compiled grammar, separate states
    m1.accept(tok.encode("a")[0])
    assert m1.tokens_accepted == 1 and m2.tokens_accepted == 0
    x = np.zeros(comp.vocab_size, np.float32)
    m2.mask_logits(x)
    assert np.isfinite(x[tok.encode("a")[0]])
