"""The OpenAI frontend serves the checkpoint under its own name (issue 27), driven by the official `openai` client.

The name comes from the engine dir's manifest, as the build recorded the checkpoint: a GGUF's file name without
.gguf (not `general.name`, often an internal run name shared by every quantization), an HF checkpoint's directory
name; `--served-model-name` (`hetserve up` /
`hetserve serve --role openai`) replaces it and HETSERVE_OPENAI_MODEL wins over both. /v1/models lists that one
name; a request naming another model is a 404 with an OpenAI error body (code model_not_found).

Real frontend processes (`hetserve serve --role openai`, as `hetserve up` starts them) in front of the session's
real prefill + decode servers. The HF case gives its frontend an engine dir holding what a build of a tiny HF
checkpoint records (manifest config + source, from the real loader) and the default model's tokenizer: the frontend
reads nothing else, and its requests run on the session's servers.
"""
import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_openai import _frontend  # the one way tests start a frontend process

openai = pytest.importorskip("openai")  # installed by scripts/install.sh (.[test]); a skip is a CI failure

OLD_DEFAULT = "smollm2-135m-instruct"  # the name every checkpoint was served under before


def _gguf_general_name(path: str):
    import gguf

    f = gguf.GGUFReader(path).fields.get("general.name")
    return None if f is None else bytes(f.parts[f.data[0]]).decode()


def _client(fe):
    return openai.OpenAI(base_url=fe.spec.url, api_key="unused", max_retries=0, timeout=120)


def _assert_404(client, served: str, other: str):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model=other, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ei.value.status_code == 404
    assert ei.value.body == {"message": f"The model '{other}' does not exist (served: '{served}')",
                             "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=other, prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(other)


def test_default_gguf_is_served_under_its_file_name(topology, engine_dir):
    from hetserve.engines.manifest import read_manifest

    src = read_manifest(engine_dir)["source"]
    name = Path(src).stem
    assert name == "SmolLM2-135M-Instruct.Q4_1" and name != OLD_DEFAULT, src
    fe = _frontend(topology, engine_dir, topology.base_port + 85)
    try:
        client = _client(fe)
        assert [m.id for m in client.models.list().data] == [name]
        assert client.models.retrieve(name).id == name
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0)
        assert r.model == name and r.usage.completion_tokens >= 1
        chunks = list(client.completions.create(model=name, prompt="The capital of France is", max_tokens=3,
                                                temperature=0, stream=True))
        assert chunks and all(c.model == name for c in chunks)
        _assert_404(client, name, OLD_DEFAULT)
        # a raw request (no client-side shaping): the OpenAI error body as it goes over the wire
        req = urllib.request.Request(f"{fe.spec.url}/chat/completions", method="POST",
                                     data=json.dumps({"model": "gpt-4o", "messages": [
                                         {"role": "user", "content": "hi"}]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=30)
        assert ei.value.code == 404
        assert json.loads(ei.value.read())["error"]["code"] == "model_not_found"
    finally:
        fe.stop()


def test_served_model_name_flag_and_env_precedence(topology, engine_dir):
    from hetserve.engines.manifest import read_manifest

    gguf_name = Path(read_manifest(engine_dir)["source"]).stem
    fe = _frontend(topology, engine_dir, topology.base_port + 86, model_name="acme/tiny-chat")  # as `hetserve up`
    try:
        client = _client(fe)
        assert [m.id for m in client.models.list().data] == ["acme/tiny-chat"]
        assert client.models.retrieve("acme/tiny-chat").id == "acme/tiny-chat"  # a '/' in the name: one path
        r = client.completions.create(model="acme/tiny-chat", prompt="Hello", max_tokens=2, temperature=0)
        assert r.model == "acme/tiny-chat"
        _assert_404(client, "acme/tiny-chat", gguf_name)  # the checkpoint's own name is not served any more
    finally:
        fe.stop()
    fe = _frontend(topology, engine_dir, topology.base_port + 87, model_name="from-flag",
                   env={"HETSERVE_OPENAI_MODEL": "from-env"})
    try:
        client = _client(fe)
        assert [m.id for m in client.models.list().data] == ["from-env"]
        _assert_404(client, "from-env", "from-flag")
        assert "HETSERVE_OPENAI_MODEL='from-env' wins over --served-model-name 'from-flag'" in fe.log_tail()
    finally:
        fe.stop()


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """A tiny HF checkpoint in a directory named like a hub model, and two GGUFs of it: one with a general.name
    that is not its file name, one without general.name."""
    import gguf

    import zoo

    d = tmp_path_factory.mktemp("names")
    tok = zoo.tokenizer_json()
    hf = d / "TinyZoo-1M-Instruct"
    model = zoo.make_hf(hf, "plain", tok_json=tok)
    orig = gguf.GGUFWriter.add_name
    try:
        gguf.GGUFWriter.add_name = lambda self, name: orig(self, "Tiny Zoo GGUF")
        zoo.write_gguf(d / "tiny-named.Q8_0.gguf", hf, model)
        gguf.GGUFWriter.add_name = lambda self, name: None
        zoo.write_gguf(d / "tiny-nameless.F32.gguf", hf, model)
    finally:
        gguf.GGUFWriter.add_name = orig
    return {"hf": hf, "named": d / "tiny-named.Q8_0.gguf", "nameless": d / "tiny-nameless.F32.gguf"}


def _recorded(path) -> dict:
    """The manifest fields the build writes about its checkpoint (engines/builder.py: source, config)."""
    from hetserve.model.checkpoint import load_checkpoint

    ck = load_checkpoint(str(path))
    return {"source": ck.source, "config": ck.config.to_dict()}


def test_checkpoint_names_as_the_build_records_them(tiny_checkpoints):
    from hetserve.openai_api.app import served_model_name

    assert _gguf_general_name(str(tiny_checkpoints["named"])) == "Tiny Zoo GGUF"
    assert _gguf_general_name(str(tiny_checkpoints["nameless"])) is None
    assert served_model_name(_recorded(tiny_checkpoints["named"])) == Path(tiny_checkpoints["named"]).stem
    assert served_model_name(_recorded(tiny_checkpoints["nameless"])) == "tiny-nameless.F32"
    assert served_model_name(_recorded(tiny_checkpoints["hf"])) == "TinyZoo-1M-Instruct"
    assert served_model_name(_recorded(str(tiny_checkpoints["hf"]) + "/")) == "TinyZoo-1M-Instruct"
    assert served_model_name({"source": "/models/Foo-7B.Q4_K_M.gguf", "config": {"name": "x"}}) == "Foo-7B.Q4_K_M"
    assert served_model_name({"source": "/m/Big-70B.Q8_0-00001-of-00003.gguf", "config": {}}) == "Big-70B.Q8_0"
    assert served_model_name({"source": "/ckpts/Bar-1B-hf/", "config": {"name": ""}}) == "Bar-1B-hf"
    assert served_model_name({"source": "", "config": {"name": "Baz"}}) == "Baz"


def test_hf_checkpoint_served_under_its_directory_name(topology, engine_dir, tiny_checkpoints, tmp_path):
    from hetserve.engines.manifest import read_manifest, write_manifest

    ed = tmp_path / "engines-hf"
    ed.mkdir()
    shutil.copy(Path(engine_dir) / "tokenizer.json", ed / "tokenizer.json")
    man = dict(read_manifest(engine_dir), **_recorded(tiny_checkpoints["hf"]))
    write_manifest(ed, man)
    fe = _frontend(topology, ed, topology.base_port + 88)
    try:
        client = _client(fe)
        assert [m.id for m in client.models.list().data] == ["TinyZoo-1M-Instruct"]
        r = client.chat.completions.create(model="TinyZoo-1M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, temperature=0)
        assert r.model == "TinyZoo-1M-Instruct"
        _assert_404(client, "TinyZoo-1M-Instruct", OLD_DEFAULT)
    finally:
        fe.stop()


def test_cli_flag_reaches_the_frontend(monkeypatch):
    """`hetserve up --served-model-name X` and `hetserve serve --role openai --served-model-name X` parse, and up
    hands X to the frontend process's command line."""
    from hetserve import cli
    from hetserve.openai_api.process import FrontendProcess, FrontendSpec

    got = {}
    monkeypatch.setattr(cli, "cmd_up", lambda a: got.setdefault("up", a.served_model_name) and 0)
    monkeypatch.setattr(cli, "cmd_serve", lambda a: got.setdefault("serve", a.served_model_name) and 0)
    cli.main(["up", "--served-model-name", "x/y"])
    cli.main(["serve", "--role", "openai", "--served-model-name", "z"])
    assert got == {"up": "x/y", "serve": "z"}
    cmd = FrontendProcess(FrontendSpec("127.0.0.1:1", 1, "/e", model_name="x/y")).command()
    assert cmd[:3] == [sys.executable, "-m", "hetserve"] and cmd[-2:] == ["--served-model-name", "x/y"]
    assert "--served-model-name" not in FrontendProcess(FrontendSpec("127.0.0.1:1", 1, "/e")).command()
