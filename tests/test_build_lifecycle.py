"""`hetserve build` as a person runs it: a short console log, and a failed build leaves nothing behind."""
import pytest

import zoo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lifecycle")
    zoo.make_hf(d / "hf", "plain", tok_json=zoo.tokenizer_json())
    return d


def test_build_console_is_short_and_library_logs_go_to_a_file(tiny, capfd):
    from hetserve.engines.builder import build_engines

    lines = []
    build_engines(str(tiny / "hf"), str(tiny / "eng"), tensorrt=False, log=lines.append)
    out, err = capfd.readouterr()
    console = lines + out.splitlines() + err.splitlines()
    # ONNX Runtime's quantizer alone logged ~5,500 INFO lines here before the build wrote its own graphs
    assert len(console) <= 50, "\n".join(console[:80])
    assert not [line for line in console if "[INFO]" in line], "\n".join(console[:20])
    assert "[6/6] tokenizer, manifest, quality gate" in (tiny / "eng" / "build.log").read_text()


def test_failed_build_keeps_the_previous_engines_and_leaves_no_partial_files(tiny, monkeypatch):
    from hetserve.engines import builder

    eng = tiny / "eng"
    builder.build_engines(str(tiny / "hf"), str(eng), tensorrt=False, log=lambda s: None)
    before = {f.name: f.stat().st_mtime_ns for f in eng.iterdir()}

    def boom(*a, **k):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(builder, "_build_native", boom)  # late in the build: the ONNX graphs are written by then
    with pytest.raises(RuntimeError, match="simulated"):
        builder.build_engines(str(tiny / "hf"), str(eng), tensorrt=False, force=True, log=lambda s: None)
    assert {f.name: f.stat().st_mtime_ns for f in eng.iterdir()} == before
    assert not [p.name for p in tiny.iterdir() if ".building-" in p.name]


def _shape_only(**kw):
    """A Checkpoint with a config and no weights: what the build plan reads."""
    from hetserve.model.checkpoint import Checkpoint, LlamaConfig

    base = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position=8192, tie_word_embeddings=True,
                bos_token_id=1, eos_token_ids=(2,))
    return Checkpoint(LlamaConfig(**{**base, **kw}), {}, "shape-only", "0", {}, None)


def test_build_plan_by_size_and_refusal_before_writing():
    """Llama-3.2-1B shapes: 16-bit exact prefill weights, no A/B baselines (recorded with their fallbacks), and a
    machine without the memory is refused with both figures; the default-size model builds everything."""
    from hetserve.engines.build_plan import BuildRefused, check_memory, plan_build

    big = plan_build(_shape_only())
    assert big.params == 1_235_814_400  # Llama-3.2-1B as published
    assert big.prefill_exact16 and not big.baselines
    assert {n: u["fallback"] for n, u in big.unbuilt.items()} == {"decode_fp32": "decode_fp32_standard",
                                                                   "decode_int8_standard": "decode_int8",
                                                                   "decode_int8_qdq": None, "decode_fp8_qdq": None}
    assert not big.qdq and "--qdq yes" in big.unbuilt["decode_fp8_qdq"]["reason"]
    # the QDQ graphs are TensorRT's input: built whenever it builds, or when asked; never refused silently
    assert plan_build(_shape_only(), tensorrt=True).qdq and plan_build(_shape_only(), qdq="yes").qdq
    assert "decode_fp8_qdq" not in plan_build(_shape_only(), qdq="yes").unbuilt
    with pytest.raises(ValueError, match="TensorRT"):
        plan_build(_shape_only(), qdq="no", tensorrt=True)
    from hetserve.engines.manifest import unresolved_engines  # a server configured for one refuses, saying why

    [msg] = unresolved_engines({"engines": {"decode_int8": {}}, "unbuilt": big.unbuilt}, ["decode_fp8_qdq"])
    assert "was not built (QDQ graph not built: it is TensorRT's input" in msg
    assert 5 << 30 < big.estimate_bytes() < 8 << 30  # measured peak 6.6 GiB (loadtest/README.md)
    assert big.serving["HETSERVE_DECODE_ENGINES"] == "decode_int8_native"
    with pytest.raises(BuildRefused, match=r"needs about \d+\.\d GiB of memory and 2\.0 GiB is available"):
        check_memory(big, available=2 << 30)
    check_memory(big, available=64 << 30)
    small = plan_build(_shape_only(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                   num_heads=9, num_kv_heads=3))
    assert small.baselines and small.qdq and not small.prefill_exact16 and not small.unbuilt and not small.serving
    assert plan_build(_shape_only(), prefill_weights="fp32").prefill_exact16 is False


def test_serving_engines_default_to_the_builds_choice_and_the_operator_wins(tmp_path, monkeypatch):
    """A large build names the engines its servers run (manifest `serving`); a HETSERVE_* setting overrides it."""
    from hetserve.engines.manifest import configured_engines, write_manifest

    write_manifest(tmp_path, {"engines": {}, "serving": {"HETSERVE_DECODE_ENGINES": "decode_int8_native"}})
    monkeypatch.delenv("HETSERVE_DECODE_ENGINES", raising=False)
    monkeypatch.delenv("HETSERVE_PREFILL_ENGINE", raising=False)
    assert configured_engines(tmp_path, "HETSERVE_DECODE_ENGINES") == ["decode_int8_native"]
    assert configured_engines(tmp_path, "HETSERVE_PREFILL_ENGINE") == ["prefill_fp32"]  # the setting's default
    monkeypatch.setenv("HETSERVE_DECODE_ENGINES", "decode_fp32, decode_int8")
    assert configured_engines(tmp_path, "HETSERVE_DECODE_ENGINES") == ["decode_fp32", "decode_int8"]
