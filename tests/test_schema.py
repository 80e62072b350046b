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


@pytest.mark.parametrize("model", [m for m in _models() if m != "ensemble"])
def test_config_input_blocks_are_generated_from_the_schema(model):
    """One place defines each input: `python -m hetserve.schema model_repository` writes these blocks."""
    text = (REPO / model / "config.pbtxt").read_text()
    assert schema.config_input_block(model) in text, f"{model}: run python -m hetserve.schema model_repository"


def test_schema_reads_and_writes_each_input_with_its_dtype():
    for spec in schema.INPUTS.values():
        value = {"STRING": "x", "BOOL": True}.get(spec.dtype, 1)
        arr = schema.array(spec.name, value)
        assert arr.dtype == np.dtype(spec.np_dtype) and arr.shape == (1,)
        # an array made by array() goes through it unchanged (sampling_arrays -> client.build_inputs does this)
        again = schema.array(spec.name, arr)
        assert again.dtype == arr.dtype and again.tolist() == arr.tolist(), spec.name


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


def test_errors_travel_as_data_and_keep_kind_where_and_retry():
    """to_wire / from_wire: the kind, message, where, migrate flag and retry hint survive a hop as data; a
    payload that does not parse is itself an internal error, never bad input."""
    e = errors.Overloaded("pending KV full", where="decode pending KV", retry_after_s=0.5)
    got = errors.from_wire(e.to_wire())
    assert type(got) is errors.Overloaded and (got.message, got.where, got.retry_after_s) == \
        ("pending KV full", "decode pending KV", 0.5)
    assert got.human() == "pending KV full; retry after 0.5s" and got.retryable and got.migrate
    eng = errors.from_wire(errors.EngineFailed("decode step failed", where="decode step").to_wire())
    assert eng.kind == errors.INTERNAL and eng.migrate
    assert eng.human() == "internal error in decode step: decode step failed"  # says whose fault it is
    assert errors.from_wire(b"{not json").kind == errors.INTERNAL
    assert errors.from_wire(b'{"kind": "nope", "message": "x"}').kind == errors.INTERNAL
    for kind, (triton, http, grpc) in errors.STATUS.items():
        err = errors.from_dict({"kind": kind, "message": "m"})
        assert (err.kind, err.triton_code, err.http_status, err.grpc_status) == (kind, triton, http, grpc)


def test_overload_hint_is_read_back_from_text_only_for_plain_clients():
    assert retry.is_overload(errors.Overloaded("queue full").human())
    assert retry.after_s(errors.Unavailable("no healthy decode server", retry_after_s=2.5).human()) == 2.5
    assert not retry.is_overload(errors.RequestError("the word overloaded, queue full").human())
    assert retry.header_value(0.4) == "1" and retry.header_value(2.5) == "3"


def test_openai_frontend_maps_kinds_to_statuses():
    pytest.importorskip("fastapi")
    from hetserve.openai_api.backend import api_error, classify

    e = api_error(errors.Overloaded("circuit breaker open", retry_after_s=2.5))
    assert (e.status, e.retry_after, e.code) == (503, "3", "overloaded")
    assert api_error(errors.RequestError("bad stop string")).status == 400
    e = api_error(errors.EngineFailed("decode step failed"))
    assert (e.status, e.type, e.code) == (500, "server_error", "internal_error")
    assert classify("unknown model 'llm'").status == 503
    assert classify("Socket closed", call_failed=True).status == 502
    assert classify("anything Triton says").status == 500  # the frontend built the inputs: never the client's


def test_generation_error_keeps_the_typed_fields():
    from hetserve.client import GenerationError

    g = GenerationError.of(errors.from_wire(errors.Overloaded("busy", where="llm").to_wire()))
    assert (g.kind, g.retry_after_s, g.where, g.status, str(g)) == (
        errors.OVERLOADED, 1.0, "llm", "StatusCode.UNAVAILABLE", "busy")


def test_only_hetserve_errors_are_the_clients_fault():
    """A ValueError from an engine or a library is ours (internal), not bad input; typed ones keep their kind."""
    from hetserve.reliability import BreakerOpen, NoDecodeServer

    assert errors.kind_of_exception(ValueError("shapes do not match")) == errors.INTERNAL
    assert errors.kind_of_exception(RuntimeError("boom")) == errors.INTERNAL
    assert errors.kind_of_exception(BreakerOpen("open")) == errors.OVERLOADED
    assert errors.kind_of_exception(NoDecodeServer("none")) == errors.UNAVAILABLE
    assert errors.kind_of_exception(errors.RequestError("x")) == errors.BAD_INPUT
    assert errors.parse_failure(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")).kind == errors.BAD_INPUT
    assert errors.parse_failure(KeyError("k")).kind == errors.INTERNAL
