"""Tokenizer + chat template built from the checkpoint itself (GGUF metadata or HF tokenizer.json).

Uses the `tokenizers` library; nothing is downloaded. GGUF vocabularies are rebuilt to tokenize as llama.cpp
does: byte-level BPE (`gpt2`, per `tokenizer.ggml.pre`) and SentencePiece BPE (`llama`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

_SPECIAL_TYPES = (2, 3)  # gguf token_type UNKNOWN, CONTROL
_USER_DEFINED = 4

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), applied in turn, by
# tokenizer.ggml.pre value. llama.cpp spells the case-insensitive contractions as [sS] etc.: the same matches.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# pre -> (regexes, ignore_merges: llama.cpp emits a whole pre-token found in the vocab as is, for llama3 only).
# A missing pre is llama.cpp's "default" (it warns that quality degrades).
_PRE_SPLITS: Dict[Optional[str], Tuple[Tuple[str, ...], bool]] = {
    "llama-bpe": ((_LLAMA3,), True), "llama3": ((_LLAMA3,), True), "llama-v3": ((_LLAMA3,), True),
    "qwen2": ((_QWEN2,), False), "deepseek-r1-qwen": ((_QWEN2,), False),
    "default": (_DEFAULT, False), None: (_DEFAULT, False),
}
# llama.cpp splits "\p{N}" then GPT-2's regex for these: Digits + ByteLevel's own regex do exactly that
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")


def gguf_pre_names() -> List[str]:
    """The tokenizer.ggml.pre values implemented (a missing one is llama.cpp's default); others are refused."""
    return sorted({p for p in _PRE_SPLITS if p} | set(_DIGIT_SPLIT_PRES))


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
        from tokenizers import AddedToken

        model = spec.get("model")
        if model == "gpt2":
            tok = _byte_level_bpe(spec)
        elif model == "llama":
            tok = _sentencepiece_bpe(spec)
        else:
            raise TokenizerError(f"GGUF tokenizer model {model!r} not supported (gpt2 byte-level BPE and llama "
                                 "SentencePiece BPE only)")
        tokens: List[str] = spec["tokens"]
        types = spec.get("token_type") or []
        # llama.cpp matches unknown/control/user-defined tokens whole in the text; user-defined ones (e.g. <think>)
        # are ordinary text when decoding, the others are skipped like llama.cpp's token_to_piece(special=False).
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, ty in enumerate(types) if ty in _SPECIAL_TYPES]
        if special:
            tok.add_special_tokens(special)
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, ty in enumerate(types) if ty == _USER_DEFINED]
        if user:
            tok.add_tokens(user)
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

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = True,
                            tools: Optional[List[dict]] = None, **extra) -> str:
        """The checkpoint's chat template rendered as transformers renders it: `messages` (dicts; assistant ones may
        carry `tool_calls` with `arguments` as a dict, role `tool` ones `tool_call_id`), `tools` (OpenAI tool
        definitions, {"type": "function", "function": {...}}; None when there are none, as transformers passes
        it) and any further template variables in `extra`. Build tool-use messages with
        hetserve.openai_api.tools.render_messages, which knows which templates take them."""
        if not self.chat_template:
            # no template: plain concatenation of contents
            return "\n".join(m.get("content") or "" for m in messages)
        template, bos, eos = self._compiled_template()
        return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token=eos, **extra)

    def _compiled_template(self):
        """The chat template compiled once (jinja compiles it to Python: ~1 ms, more than the render) with the
        BOS/EOS strings it is given. The environment is transformers' (chat_template_utils): undefined names are
        falsy (templates test `message.tool_calls` on messages without one), `tojson` keeps non-ASCII and does
        not HTML-escape, and `raise_exception` / `strftime_now` exist."""
        cached = getattr(self, "_template", None)
        if cached is None or cached[0] != self.chat_template:
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
            eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
            cached = self._template = (self.chat_template, env.from_string(self.chat_template or ""), bos, eos)
        return cached[1:]


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    """A template's own refusal (e.g. Llama 3.1: one tool call per message), as TokenizerError (a ValueError)."""
    raise TokenizerError(f"chat template: {message}")


def _strftime_now(fmt):
    import datetime

    return datetime.datetime.now().strftime(fmt)


def stable_text(tok: Tokenizer, ids: Sequence[int]) -> str:
    """Decoded text without a trailing incomplete UTF-8 character (held back until completed; byte fallback
    decodes each byte of one to its own U+FFFD)."""
    return tok.decode(ids).rstrip("\ufffd")


def _clean_prefix(tok: Tokenizer, ids: Sequence[int]) -> str:
    """The text of the longest prefix of `ids` that ends on a whole character. Byte fallback turns a whole run of
    byte tokens into U+FFFD while its last character is incomplete, so the text of a prefix is not monotonic in
    its length: step back (a character is at most 4 byte tokens) to where it is."""
    for cut in range(len(ids), max(-1, len(ids) - 5), -1):
        t = tok.decode(ids[:cut])
        if not t.endswith("\ufffd"):
            return t
    return tok.decode(ids).rstrip("\ufffd")


def text_delta(tok: Tokenizer, all_ids: Sequence[int], n_new: int) -> str:
    """Stateless incremental detokenisation (the ensemble's postprocess, which keeps no per-request state): the
    text the last `n_new` of `all_ids` completed. It decodes the whole sequence per call; the streamers keep
    state and use IncrementalDetokenizer, which is linear."""
    prev = _clean_prefix(tok, all_ids[:len(all_ids) - n_new])
    cur = _clean_prefix(tok, all_ids)
    return cur[len(prev):] if cur.startswith(prev) else cur


class IncrementalDetokenizer:
    """The text of a growing sequence of ids, linear in its length: each add() decodes a short window (the
    prefix-offset method of TGI / vLLM): `prefix` = ids of the last emitted piece, kept as context (so a
    decoder's merges across the boundary, e.g. SentencePiece's leading space, come out the same), `read` = where
    the ids not yet turned into text start. A trailing incomplete character is held back until a later id
    completes it. Ids in `skip` (EOS) are not text."""

    def __init__(self, tok: Tokenizer, skip: Iterable[int] = ()):
        self.tok, self.skip = tok, frozenset(skip)
        self.ids: List[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; returns the text they completed (possibly "")."""
        self.ids.extend(int(t) for t in new_ids if int(t) not in self.skip)
        if len(self.ids) == self._read:
            return ""
        prefix = self.tok.decode(self.ids[self._prefix:self._read])
        full = self.tok.decode(self.ids[self._prefix:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        delta = full[len(prefix):]
        # the old read offset ended on a whole character (its text was complete), so windows always start on one
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def _byte_level_bpe(spec: dict):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    pre = spec.get("pre")
    if pre not in _DIGIT_SPLIT_PRES and pre not in _PRE_SPLITS:
        raise TokenizerError(f"GGUF tokenizer.ggml.pre {pre!r} is not implemented (known: {gguf_pre_names()}); "
                             "refusing rather than splitting text differently from how the model was trained")
    splits, ignore_merges = _PRE_SPLITS.get(pre, ((), False))
    vocab = {t: i for i, t in enumerate(spec["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in spec["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=ignore_merges))
    if splits:
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(spec: dict):
    """llama.cpp's SPM tokenizer (Llama 2, Mistral): BPE over the whole text with spaces as U+2581, merging the
    adjacent pair whose joined piece scores highest, bytes for what no piece covers."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    tokens: List[str] = spec["tokens"]
    types = spec.get("token_type") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    # llama.cpp's SPM tokenizer goes by the scores and ignores any tokenizer.ggml.merges
    merges = _merges_from_scores(tokens, spec.get("scores") or [], types)
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == 2), None)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = spec.get("add_space_prefix")
    prefix = True if prefix is None else bool(prefix)  # GGUF tokenizer.ggml.add_space_prefix, llama.cpp default
    # A normalizer, not Metaspace: llama.cpp prepends a space to every text fragment (the start and after each
    # special token) even when it already starts with one; Metaspace would not add a second.
    steps = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> List[Tuple[str, str]]:
    """Every split of a piece into two pieces is a merge, ranked by the joined piece's score (llama.cpp merges the
    adjacent pair whose joined piece scores highest), best first."""
    if len(scores) != len(tokens):
        raise TokenizerError("GGUF SentencePiece vocabulary without tokenizer.ggml.scores for every token")
    vocab = set(tokens)
    ranked = [(-scores[i], i, k) for i, t in enumerate(tokens) for k in range(1, len(t))
              if t[:k] in vocab and t[k:] in vocab]
    # On a tie llama.cpp merges the leftmost pair, which no merge table can say; SentencePiece gives every piece
    # its own score, so ties mean placeholder scores (e.g. converted from tokenizer.json): refuse those.
    normal = {i: scores[i] for _, i, _ in ranked if i >= len(types) or types[i] == 1}
    if len(set(normal.values())) < len(normal):
        raise TokenizerError("GGUF SentencePiece vocabulary has pieces with equal scores; llama.cpp would merge "
                             "them leftmost-first, which hetserve cannot reproduce: refusing")
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def prompt_limits() -> Tuple[int, int]:
    """(max tokens, max characters) of a prompt, read when asked (not at import); characters are checked before
    tokenizing, so a huge body cannot make the tokenizer do unbounded work."""
    from . import config

    tokens = config.get("HETSERVE_MAX_PROMPT_TOKENS")
    return tokens, config.get("HETSERVE_MAX_PROMPT_CHARS") or 16 * tokens


def encode_prompt(tok: Tokenizer, text: Optional[str], apply_chat_template: bool = True) -> List[int]:
    """A client's prompt text -> token ids (as one user message through the chat template unless told not to),
    within the prompt limits; RequestError naming what is wrong. Every process that needs the ids runs this
    itself (llm, preprocess, aggregated): no hop to another model to tokenize."""
    from .errors import RequestError

    max_tokens, max_chars = prompt_limits()
    if text is None:
        raise RequestError("missing input 'text_input'")
    if len(text) > max_chars:
        raise RequestError(f"prompt too long: {len(text)} characters > limit {max_chars}")
    if not text.strip():
        raise RequestError("empty prompt: 'text_input' must contain text")
    if apply_chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text)
    if len(ids) > max_tokens:
        raise RequestError(f"prompt too long: {len(ids)} tokens > limit {max_tokens}")
    return ids
