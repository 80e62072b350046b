"""Any local Llama-family HF safetensors checkpoint builds and matches transformers (tiny random model)."""
import shutil

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, engine_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(d), safe_serialization=True)
    shutil.copy(f"{engine_dir}/tokenizer.json", d / "tokenizer.json")
    return d, model


def test_safetensors_checkpoint_matches_transformers(tiny_hf_dir, tmp_path):
    import torch

    from hetserve.engines.builder import build_engines
    from hetserve.engines.runtime import Engine

    d, model = tiny_hf_dir
    man = build_engines(str(d), str(tmp_path / "eng"), tensorrt=False, log=lambda s: None)
    assert man["config"]["num_kv_heads"] == 2 and not man["config"]["tie_word_embeddings"]
    e = Engine(str(tmp_path / "eng"), "prefill_fp32", threads=1)
    ids = [5, 17, 923, 4000, 12, 7, 88]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].numpy()
    lo, k, v = e.prefill(ids)
    np.testing.assert_allclose(lo, ref, rtol=1e-3, atol=1e-4)
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    out = [int(lo.argmax())]
    for _ in range(7):
        lo, k2, v2 = e.prefill([out[-1]], k, v)
        k, v = np.concatenate([k, k2], 2), np.concatenate([v, v2], 2)
        out.append(int(lo.argmax()))
    assert out == gen


def test_bad_checkpoint_path_clear_error(tmp_path):
    from hetserve.model.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="not a .gguf file"):
        load_checkpoint(str(tmp_path / "nope.bin"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="unsupported model_type"):
        load_checkpoint(str(tmp_path))
