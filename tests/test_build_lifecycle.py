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
