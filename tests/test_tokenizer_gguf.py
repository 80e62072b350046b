"""GGUF tokenizers (SentencePiece `llama`, byte-level `gpt2` per `tokenizer.ggml.pre`) against llama.cpp itself.

Tiny GGUF files are written here with the `gguf` writer; llama.cpp (llama_cpp, vocab_only) is the oracle: the ids
must be identical, and decoding must give back the text.
"""
from __future__ import annotations

import ctypes
import random

import pytest

from hetserve.tokenizer import Tokenizer, TokenizerError

CORPUS = """The quick brown fox jumps over the lazy dog. I don't think we'll ever know; I'LL try again.
Café, naïve, résumé and déjà vu are French loan words. Numbers: 12345, 2024, 3.14159 and 42.
    Indented code: def main(): return x + y  # comment
Hello world! Hello there, how are you doing today? We're fine, they've gone, she'd said it's done.
"""

TEXTS = [
    "Hello world", " Hello world", "Hello  world", "  leading and trailing  ", "trailing ", "   ", " ", "", "x",
    "a\nb\n\nc\n", "\n\nnewlines first", "tabs\tand\r\nCRLF", "    def f(x):\n        return 1\n",
    "12345 and 3.14159", "1234567890 123", "don't I'LL we're they've", "DON'T we'Re it's", "Hello, World!!! ...  ",
    "Café naïve résumé déjà vu", "Ünïcödé ñ ß", "中文字符 and 日本語", "emoji 😀🎉 ok", "$+<=>^~| (a) [b] {c}",
    "The quick brown fox jumps over the lazy dog.", "zzq zzq", "x12345",
]
FUZZ_PIECES = list("abcdefghijklmnopqrstuvwxyzTHEIL'  .,!?0123456789\n\t\ré中😀$+<=>^~|") + ["  ", "'s", "'LL", "12345"]


def _write(path, tokens, types, model, scores=None, merges=None, pre=None, add_space_prefix=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads the hparams even with vocab_only; no tensors are needed
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _spec(path) -> dict:
    """The tokenizer spec exactly as model/checkpoint.py reads it from a GGUF."""
    import gguf

    from hetserve.model.checkpoint import gguf_tokenizer_spec

    return gguf_tokenizer_spec(gguf.GGUFReader(str(path)))


def _spm_vocab():
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, BPE pieces trained here (score = -rank,
    as SentencePiece gives them), runs of U+2581 as Llama has, and a user-defined token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE())
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    t.train_from_iterator(CORPUS.splitlines() * 3, trainers.BpeTrainer(vocab_size=420, show_progress=False))
    pieces = [p for p, _ in sorted(t.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for score, piece in [(-0.5, "\u2581\u2581"), (-0.25, "\u2581\u2581\u2581\u2581")] + [(-float(i), p)
                                                                                       for i, p in enumerate(pieces)]:
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(score)
    tokens.append("<tool>")
    types.append(4)
    scores.append(0.0)
    return tokens, scores, types


def _texts(specials, n, seed):
    rnd = random.Random(seed)
    pieces = FUZZ_PIECES + list(specials)
    words = CORPUS.split(" ")
    fuzz = ["".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 24))) if i % 2 else
            " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 8))) for i in range(n)]
    return TEXTS + [s.join(("a", "b ", "\n")) for s in specials] + [f"{s} x{s}" for s in specials] + fuzz


def _llama(path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _llama_detokenize(llm, ids, unparse_special: bool) -> str:
    """llama.cpp's own detokenizer (strips the space SentencePiece's prefix added, like ours)."""
    import llama_cpp

    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = ctypes.create_string_buffer(8192)
    n = llama_cpp.llama_detokenize(llama_cpp.llama_model_get_vocab(llm.model), arr, len(ids), buf, 8192, False,
                                   unparse_special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8")


def _llama_pieces(llm, ids) -> str:
    """llama.cpp's pieces, special tokens left out (Llama.detokenize drops a leading space after BOS, and
    llama_detokenize cleans spaces before punctuation for some pre types; neither is the text that was encoded)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out = b""
    for i in ids:
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, 256, 0, False)
        out += buf.raw[:n]
    return out.decode("utf-8")


@pytest.fixture(scope="module")
def spm_vocab():
    return _spm_vocab()


@pytest.mark.parametrize("add_space_prefix", [None, True, False])
def test_sentencepiece_matches_llama_cpp(tmp_path, spm_vocab, add_space_prefix):
    tokens, scores, types = spm_vocab
    path = tmp_path / "spm.gguf"
    _write(path, tokens, types, "llama", scores=scores, add_space_prefix=add_space_prefix)
    llm, tok = _llama(path), Tokenizer(_spec(path))
    special_ids = {tokens.index(s) for s in ("<unk>", "<s>", "</s>")}
    for text in _texts(["<s>", "</s>", "<unk>", "<tool>"], 400, seed=0):
        ids = tok.encode(text)
        assert ids == llm.tokenize(text.encode(), add_bos=True, special=True), text  # BOS as llama.cpp defaults it
        assert tok.decode(ids, skip_special_tokens=False) == _llama_detokenize(llm, ids, True), text
        if not any(s in text for s in ("<s>", "</s>", "<unk>", "<tool>")):
            # (llama.cpp puts the prefix space after user-defined tokens too, so those cannot round-trip)
            assert tok.decode(ids) == text
        if ids and ids[0] not in special_ids:
            # (after a leading skipped special token we strip the prefix space, llama.cpp keeps it)
            assert tok.decode(ids) == _llama_detokenize(llm, ids, False), text
    # byte fallback really was exercised, and the space runs merged
    assert tok.encode("中")[-3:] == [tokens.index(f"<0x{b:02X}>") for b in "中".encode()]
    assert tokens.index("\u2581\u2581\u2581\u2581") in tok.encode("a     b")


@pytest.fixture(scope="module")
def default_spec():
    """The default model's byte-level vocabulary as model/checkpoint.py reads it; only `pre` changes below. Its
    digits never merge, so multi-digit tokens are added (llama3 groups up to 3 digits, qwen2 splits each), and a
    token no merge reaches (llama.cpp's llama3 takes a pre-token that is in the vocab whole: ignore_merges)."""
    from hetserve.model.checkpoint import load_checkpoint

    spec = load_checkpoint(None).tokenizer_spec
    extra = ["12", "123", "34", "345", "45", "zzq"]
    return {**spec, "tokens": spec["tokens"] + extra, "token_type": spec["token_type"] + [1] * len(extra),
            "merges": spec["merges"] + ["1 2", "12 3", "3 4", "34 5", "4 5"]}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "default", None])
def test_byte_level_pre_matches_llama_cpp(tmp_path, default_spec, pre):
    spec = {**default_spec, "pre": pre}
    path = tmp_path / "bpe.gguf"
    _write(path, spec["tokens"], spec["token_type"], "gpt2", merges=spec["merges"], pre=pre)
    llm, tok = _llama(path), Tokenizer(spec)  # (re-reading 49k tokens with GGUFReader would take 2 s)
    for text in _texts(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], 300, seed=1):
        ids = tok.encode(text)
        assert ids == llm.tokenize(text.encode(), add_bos=False, special=True), (pre, text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == _llama_pieces(llm, ids), (pre, text)


@pytest.mark.parametrize("pre", ["falcon", "made-up-pre"])
def test_unknown_pre_is_refused_by_name(pre):
    spec = {"kind": "gguf", "model": "gpt2", "pre": pre, "tokens": ["a", "b", "ab"], "merges": ["a b"],
            "token_type": [1, 1, 1]}
    with pytest.raises(TokenizerError, match=pre):
        Tokenizer(spec)


def test_sentencepiece_placeholder_scores_refused():
    # equal scores (a GGUF converted without SentencePiece's): llama.cpp merges leftmost-first, a merge table cannot
    spec = {"kind": "gguf", "model": "llama", "tokens": ["<unk>", "a", "b", "c", "ab", "bc"], "merges": [],
            "scores": [0.0, -1.0, -2.0, -3.0, -1000.0, -1000.0], "token_type": [2, 1, 1, 1, 1, 1]}
    with pytest.raises(TokenizerError, match="equal scores"):
        Tokenizer(spec)
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer({**spec, "scores": []})


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_incremental_detokenizer_equals_full_decode_and_is_linear(tmp_path, spm_vocab, default_spec, kind):
    """IncrementalDetokenizer (the streamers' detokenizer) and the stateless text_delta give, chunk by chunk,
    exactly the text of decoding the whole sequence (byte fallback and multi-byte characters held back until
    complete, SentencePiece's prefix space); the streamers' one decodes O(1) ids per call (linear in all)."""
    from hetserve.tokenizer import IncrementalDetokenizer, stable_text, text_delta

    if kind == "sentencepiece":
        tokens, scores, types = spm_vocab
        path = tmp_path / "spm.gguf"
        _write(path, tokens, types, "llama", scores=scores)
        tok = Tokenizer(_spec(path))
    else:
        tok = Tokenizer({**default_spec, "pre": "smollm"})
    rnd = random.Random(3)
    decoded = [0]
    real_decode = tok.decode

    def counting_decode(ids, *a, **kw):
        decoded[0] += len(ids)
        return real_decode(ids, *a, **kw)

    for text in _texts([], 150, seed=2):
        ids = tok.encode(text)
        if kind == "sentencepiece" and ids and ids[0] == 1:
            ids = ids[1:]  # generated text has no BOS
        d, pos, out, stateless = IncrementalDetokenizer(tok), 0, "", ""
        tok.decode = counting_decode
        decoded[0] = 0
        while pos < len(ids):
            n = rnd.randint(1, 3)
            out += d.add(ids[pos:pos + n])
            pos += n
            assert "\ufffd" not in out
        tok.decode = real_decode
        assert decoded[0] <= 6 * len(ids) + 16, (decoded[0], len(ids))  # a full decode per step: ~len^2 / 2
        for i in range(len(ids)):
            stateless += text_delta(tok, ids[:i + 1], 1)
        assert out == d.text == stable_text(tok, ids), (kind, text)
        assert stateless == stable_text(tok, ids), (kind, text)
