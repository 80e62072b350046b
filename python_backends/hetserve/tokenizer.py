"""Tokenizer + chat template built from the checkpoint itself (GGUF metadata or HF tokenizer.json).

Uses the `tokenizers` library (byte-level BPE); nothing is downloaded.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

_SPECIAL_TYPES = (3, 4)  # gguf token_type CONTROL, USER_DEFINED


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, spec: dict, chat_template: Optional[str] = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.spec_kind = spec["kind"]
        if spec["kind"] == "hf":
            self._tok = HFTokenizer.from_file(spec["path"])
        elif spec["kind"] == "gguf":
            self._tok = self._from_gguf(spec)
        else:
            raise TokenizerError(f"unknown tokenizer kind {spec['kind']!r}")
        self.bos_token_id = spec.get("bos_token_id")
        self.eos_token_id = spec.get("eos_token_id")
        self.add_bos = bool(spec.get("add_bos"))
        self.chat_template = chat_template
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _from_gguf(spec: dict):
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if spec.get("model") != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {spec.get('model')!r} not supported (byte-level BPE only)")
        tokens: List[str] = spec["tokens"]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in spec["merges"]]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = spec.get("pre")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact", "default", None):
            # llama.cpp's smollm/starcoder pre-tokenisers split digits individually before GPT-2's regex.
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        types = spec.get("token_type") or []
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, ty in enumerate(types) if ty in _SPECIAL_TYPES]
        if special:
            tok.add_special_tokens(special)
        return tok

    def encode(self, text: str, add_special: bool = False) -> List[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (add_special or self.add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            # no template: plain concatenation of contents
            return "\n".join(m["content"] for m in messages)
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)


def stable_text(tok: Tokenizer, ids: Sequence[int]) -> str:
    """Decoded text without a trailing incomplete UTF-8 character (held back until completed)."""
    t = tok.decode(ids)
    return t[:-1] if t.endswith("\ufffd") else t


def text_delta(tok: Tokenizer, all_ids: Sequence[int], n_new: int) -> str:
    """Stateless incremental detokenisation: text added by the last `n_new` of `all_ids`."""
    prev = stable_text(tok, all_ids[:len(all_ids) - n_new])
    cur = stable_text(tok, all_ids)
    return cur[len(prev):] if cur.startswith(prev) else cur
