"""The README's "Supported models" table, written from the lists the loaders enforce (never by hand).

`python3 -m hetserve.model.support` prints it; tests/test_model_zoo.py fails when README.md's copy differs.
"""
from __future__ import annotations

from typing import List

from ..tokenizer import gguf_pre_names
from .checkpoint import GGUF_ARCHES, GGUF_HANDLED, GGUF_HARMLESS
from .config import ARCHITECTURES, HANDLED, HARMLESS, ROPE_KEYS

BEGIN, END = "<!-- supported-models:begin -->", "<!-- supported-models:end -->"
# GGUF tensor types the model zoo builds and checks token-exact in CI (tests/test_model_zoo.py); others the `gguf`
# package dequantizes load too, unchecked
GGUF_TYPES_TESTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _codes(names) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names))


def table() -> str:
    rows: List[tuple] = [
        ("HF `model_type`", _codes(ARCHITECTURES)),
        ("GGUF `general.architecture`", _codes(GGUF_ARCHES)),
        ("RoPE types (`rope_scaling` / `rope_parameters`)", _codes(ROPE_KEYS)
         + "; GGUF `rope.scaling.type` linear / yarn and the `rope_freqs` tensor (Llama 3)"),
        ("config.json keys that change the math, all implemented", _codes(HANDLED)),
        ("config.json keys known not to change the math", f"{len(HARMLESS)} (model/config.py HARMLESS)"),
        ("GGUF `{arch}.*` keys implemented", _codes(GGUF_HANDLED) + "; harmless: " + _codes(GGUF_HARMLESS)),
        ("HF weights", "safetensors F32 / F16 / BF16, one file or sharded (`model.safetensors.index.json`), "
                       "memory-mapped, converted tensor by tensor"),
        ("GGUF tensor types checked in CI", ", ".join(GGUF_TYPES_TESTED) + "; one file or split "
                                                                           "(`-0000i-of-0000N.gguf`)"),
        ("GGUF tokenizers", "`gpt2` (byte-level BPE) with `tokenizer.ggml.pre` " + _codes(gguf_pre_names())
         + " (and none = llama.cpp's default); `llama` (SentencePiece BPE, byte fallback)"),
    ]
    out = [BEGIN, "| what | supported |", "|---|---|"]
    out += [f"| {a} | {b} |" for a, b in rows]
    out.append(END)
    return "\n".join(out)


if __name__ == "__main__":
    print(table())
