"""The tensor schema (hetserve/schema.py) against every model_repository/*/config.pbtxt, and the error kinds
(hetserve/errors.py) as the client, retry and OpenAI frontend read them. No server."""
import re
from pathlib import Path

import numpy as np
import pytest

from hetserve import errors, retry, schema

REPO = Path(__file__).resolve().parents[1] / "model_repository"


def _config_inputs(text: str) -> dict:
    """name -> (data_type, dims, optional) of a config.pbtxt's `input [...]` block (both the one-field-per-line
    and the one-line `{ name: ... }` layouts used in model_repository)."""
    text = re.sub(r"#[^\n]*", "", text)
    m = re.search(r"\binput\s*\[(.*?)\]\s*output\s*\[", text, re.S)
    assert m, "no input block"
    out = {}
    for body in re.findall(r"\{([^{}]*)\}", m.group(1)):
        name = re.search(r'name:\s*"([^"]+)"', body).group(1)
        dtype = re.search(r"data_type:\s*TYPE_(\w+)", body).group(1)
        dims = tuple(int(x) for x in re.search(r"dims:\s*\[([^\]]*)\]", body).group(1).split(","))
        opt = re.search(r"optional:\s*(true|false)", body)
        out[name] = (dtype, dims, bool(opt and opt.group(1) == "true"))
    return out


def _models():
    return sorted(p.parent.name for p in REPO.glob("*/config.pbtxt"))


def test_every_model_is_in_the_schema():
    assert set(_models()) == set(schema.MODELS)


@pytest.mark.parametrize("model", _models())
def test_config_inputs_match_the_schema(model):
    got = _config_inputs((REPO / model / "config.pbtxt").read_text())
    names, required = schema.MODELS[model]
    assert sorted(got) == sorted(names), f"{model}: config.pbtxt and schema list different inputs"
    for name, (dtype, dims, optional) in got.items():
        spec = schema.INPUTS[name]
        assert dtype == spec.dtype, f"{model}.{name}: TYPE_{dtype} in config.pbtxt, {spec.dtype} in the schema"
        assert dims == spec.dims, f"{model}.{name}: dims {dims} in config.pbtxt, {spec.dims} in the schema"
        assert optional == (name not in required), f"{model}.{name}: optional flag differs"


def test_schema_reads_and_writes_each_input_with_its_dtype():
    for spec in schema.INPUTS.values():
        value = {"STRING": "x", "BOOL": True}.get(spec.dtype, 1)
        arr = schema.array(spec.name, value)
        assert arr.dtype == np.dtype(spec.np_dtype) and arr.shape == (1,)


def test_sampling_params_defaults_bounds_and_forwarding():
    p = schema.sampling_params({})
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.ignore_eos) == (64, 0.0, 0, 1.0, 0, False)
    with pytest.raises(errors.RequestError, match="max_tokens"):
        schema.sampling_params({"max_tokens": np.array([0], np.int32)})
    with pytest.raises(errors.RequestError, match="exactly one value"):
        schema.sampling_params({"top_k": np.array([1, 2], np.int32)})
    with pytest.raises(errors.RequestError, match="UTF-8"):
        schema.sampling_params({"stop": np.array([b"\xff"], np.object_)})
    fwd = dict(schema.sampling_arrays(p))
    assert fwd["stop_token_ids"].tolist() == [-1] and fwd["seed"].dtype == np.uint64
    back = schema.sampling_params(fwd)
    assert back.stop_token_ids == [-1] and back.max_tokens == 64


def test_client_build_inputs_uses_the_schema_dtypes():
    pytest.importorskip("tritonclient.grpc")
    from hetserve.client import build_inputs

    ins = {i.name(): i.datatype() for i in build_inputs("hi", max_tokens=3, seed=1, stop=["a", "b"],
                                                        kv_sent=False, transport="shm")}
    assert ins == {"text_input": "BYTES", "max_tokens": "INT32", "seed": "UINT64", "stop": "BYTES",
                   "kv_sent": "BOOL", "transport": "BYTES"}
    with pytest.raises(ValueError, match="unknown input"):
        build_inputs(None, no_such_input=1)


def test_error_kinds_roundtrip_and_never_stack():
    msg = errors.tag(errors.OVERLOADED, "pending KV full; retry after 0.5s")
    want = (errors.OVERLOADED, "decode at 1.2.3.4:9001: pending KV full; retry after 0.5s")
    assert errors.parse("decode at 1.2.3.4:9001: " + msg) == want
    assert errors.tag(errors.BAD_INPUT, msg) == "[hetserve:bad_input] pending KV full; retry after 0.5s"
    assert errors.parse("Stream removed") == (None, "Stream removed")
    with pytest.raises(ValueError):
        errors.tag("nope", "x")


def test_overload_is_the_kind_not_the_wording():
    assert retry.is_overload(errors.tag(errors.UNAVAILABLE, "no healthy decode server"))
    assert not retry.is_overload(errors.tag(errors.BAD_INPUT, "the word overloaded, queue full, retry after 1s"))
    assert not retry.is_overload("queue full")  # untagged vocabulary is no longer guessed at
    assert retry.is_overload("frontend busy; retry after 1.0s")  # untagged with a hint: the frontend's own


def test_openai_frontend_maps_kinds_to_statuses():
    pytest.importorskip("fastapi")
    from hetserve.openai_api.backend import classify

    e = classify(errors.tag(errors.OVERLOADED, "circuit breaker open; retry in 2.5s"))
    assert (e.status, e.retry_after) == (503, "3") and "[hetserve" not in str(e.body())
    assert classify(errors.tag(errors.BAD_INPUT, "internal token mismatch")).status == 400
    assert classify(errors.tag(errors.INTERNAL, "engine failed")).status == 500
    assert classify("unknown model 'llm'").status == 503


def test_generation_error_strips_the_tag_and_keeps_the_kind():
    from hetserve.client import GenerationError

    g = GenerationError("llm at x: " + errors.tag(errors.OVERLOADED, "busy; retry after 1.0s"), "")
    assert g.kind == errors.OVERLOADED and str(g) == "llm at x: busy; retry after 1.0s"


def test_a_relayed_peer_error_keeps_its_kind():
    from hetserve.reliability import BreakerOpen

    relayed = RuntimeError("decode refused KV: " + errors.tag(errors.OVERLOADED, "pending KV full"))
    assert errors.kind_of_exception(relayed) == errors.OVERLOADED
    assert errors.kind_of_exception(RuntimeError("boom")) == errors.INTERNAL
    assert errors.kind_of_exception(BreakerOpen("open")) == errors.OVERLOADED
    assert errors.kind_of_exception(errors.RequestError("x")) == errors.BAD_INPUT
