"""Structured output (guided decoding, issue 28): the grammar engine layer.

The engine is llguidance (MIT; chosen by measurement against xgrammar, loadtest/README.md "Structured output:
grammar engine choice (issue 28)"). A request names one constraint, a GuideSpec:

  type          guide                                  what the output is
  json          "" (empty)                             any JSON object (OpenAI response_format json_object)
  json_schema   the JSON Schema, as JSON text          an instance of the schema (llguidance's JSON Schema
                                                       subset; keywords it cannot enforce, e.g. uniqueItems /
                                                       not, are refused, never silently ignored)
  regex         a regular expression (Rust regex       text the whole regex matches
                syntax: no look-around, no backrefs)
  ebnf_grammar  a grammar in llguidance's Lark dialect  text the grammar derives; Lark (`start: ...`, regex
                                                       terminals /.../, %json etc.) or llama.cpp GBNF
                                                       (`root ::= ...`), which is converted to Lark
  choice        a JSON list of strings                 exactly one of the strings

JSON is laid out as Python's json.dumps lays it out by default (", " and ": ", no other whitespace): the layout
models are trained on, and a small model cannot pad a free-whitespace grammar with newlines forever.

One GrammarCompiler per process (built from our Tokenizer, the model's vocab size -- ids past the tokenizer's
are never allowed -- and the EOS ids), with an LRU cache of compiled grammars; one Matcher per sequence. EOS is
allowed only where the grammar may end; once the grammar cannot continue, EOS is the only id allowed
(is_terminated() is then true: the sampler may stop the sequence there). The prefill server samples the first
token with a fresh Matcher and the decode server rebuilds its own with Matcher.resume(compiler, spec, tokens)
from the tokens generated so far (also after a migration): replaying tokens costs about a microsecond each.

No Triton import here; only hetserve.errors and hetserve.tokenizer from hetserve.
"""
from __future__ import annotations

import functools
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import numpy as np

from .errors import InternalError, RequestError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "choice")
MAX_GUIDE_BYTES = 64 * 1024
MAX_CHOICES = 1024
DEFAULT_CACHE_ENTRIES = 128
# json.dumps' default layout, nothing else (see the module doc)
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'

# byte of a token bitmask -> what its 8 ids add to their logits: 0 allowed, -inf not (bit i = id 8k + i)
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
_ADD = {np.dtype(np.float32): np.where(_BITS, np.float32(0), np.float32(-np.inf)),
        np.dtype(np.float64): np.where(_BITS, 0.0, -np.inf)}


class GrammarViolation(InternalError):
    """A token the grammar does not allow reached accept() (the sampler masks them out, so this is ours: a
    sampler that skipped the mask, or tokens replayed into a matcher of another spec)."""


def _llg():
    import llguidance
    import llguidance.numpy  # noqa: F401  (the bitmask helpers)

    return llguidance


@dataclass(frozen=True)
class GuideSpec:
    """One structured-output constraint: `type` in GUIDE_TYPES, `guide` its text (see the module doc)."""
    type: str
    guide: str

    @classmethod
    def parse(cls, type: str, guide: Optional[str] = "") -> "GuideSpec":
        """Validated spec; RequestError with a clear message for an unknown type, an oversized or malformed
        guide, or a grammar llguidance refuses (checked without a tokenizer: ~1 ms, the last 256 remembered)."""
        if not isinstance(type, str) or not isinstance(guide or "", str):
            raise RequestError(f"guide type and guide must be strings, got {type!r}, {guide.__class__.__name__}")
        return _parse(type, guide or "")

    @classmethod
    def _parse(cls, type: str, guide: str) -> "GuideSpec":
        if type not in GUIDE_TYPES:
            raise RequestError(f"unknown guide type {type!r} (one of {', '.join(GUIDE_TYPES)})")
        if len(guide) > MAX_GUIDE_BYTES or len(guide.encode("utf-8", "surrogatepass")) > MAX_GUIDE_BYTES:
            raise RequestError(f"{type} guide is longer than {MAX_GUIDE_BYTES} bytes")
        if type == "json":
            if guide.strip():
                raise RequestError("guide type json takes no guide (any JSON object); use json_schema for a schema")
            guide = ""
        elif type == "json_schema":
            schema = _loads(guide, "json_schema guide")
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"json_schema guide must be a JSON object, got {schema.__class__.__name__}")
        elif type == "choice":
            lst = _loads(guide, "choice guide")
            if not (isinstance(lst, list) and lst and all(isinstance(c, str) for c in lst)):
                raise RequestError("choice guide must be a non-empty JSON list of strings")
            if len(lst) > MAX_CHOICES:
                raise RequestError(f"choice guide has {len(lst)} strings; at most {MAX_CHOICES}")
        elif not guide:
            raise RequestError(f"{type} guide is empty")
        spec = cls(type, guide)
        if type != "json":
            err = _validate(spec.grammar())
            if err:
                raise RequestError(f"invalid {type}: {err}")
        return spec

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this spec; RequestError when it cannot be built."""
        llg = _llg()
        try:
            if self.type in ("json", "json_schema"):
                return llg.LLMatcher.grammar_from_json_schema(self.guide or ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
            if self.type == "regex":
                return llg.LLMatcher.grammar_from_regex(self.guide)
            if self.type == "ebnf_grammar":
                return llg.grammar_from("grammar", self.guide)
            # choice: our own Lark (llguidance's escapes non-ASCII as \\u, which Lark literals do not read)
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.guide))
            return llg.LLMatcher.grammar_from_lark(f"start: {alts}")
        except (ValueError, TypeError) as e:
            raise RequestError(f"invalid {self.type}: {e}") from None

    def short(self) -> str:
        g = self.guide if len(self.guide) <= 80 else self.guide[:77] + "..."
        return f"{self.type}({g!r})"


@functools.lru_cache(maxsize=256)
def _parse(type: str, guide: str) -> GuideSpec:
    return GuideSpec._parse(type, guide)


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise RequestError(f"{what} is not valid JSON: {e}") from None


def _validate(grammar: str) -> str:
    """llguidance's error for a grammar ("" when valid), without a tokenizer."""
    is_error, msgs = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    return msgs[0] if is_error and msgs else ""


class CompiledGrammar:
    """A spec compiled for one tokenizer: a matcher at the start state (its first mask computed, so the lexer
    states of the start are built once), copied for each sequence."""

    def __init__(self, spec: GuideSpec, template):
        self.spec, self._template = spec, template

    def new_matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles GuideSpecs for one tokenizer, vocab size and set of EOS ids; thread-safe; keeps the last
    `cache_entries` compiled grammars (LRU). Build it once per process (for_tokenizer: ~0.2 s)."""

    def __init__(self, ll_tokenizer, vocab_size: int, eos_ids: Sequence[int],
                 cache_entries: int = DEFAULT_CACHE_ENTRIES, threads: Optional[int] = None):
        llg = _llg()
        self.tokenizer = ll_tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.words = (self.vocab_size + 31) // 32  # int32 words of one token bitmask
        self.cache_entries = max(1, int(cache_entries))
        self._cache: "OrderedDict[GuideSpec, CompiledGrammar]" = OrderedDict()
        self._lock = threading.Lock()
        # batch masks: one thread per core this process may use (the decode server is pinned to one)
        self.threads = threads or max(1, min(8, len(os.sched_getaffinity(0))))
        self.executor = llg.LLExecutor(num_threads=self.threads)
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, tok: "Tokenizer", vocab_size: Optional[int] = None, eos_ids: Iterable[int] = (),
                      **kw) -> "GrammarCompiler":
        """From our Tokenizer (its HF `tokenizers` object: llguidance reads the token bytes from it). vocab_size:
        the model's (logits' length), at least the tokenizer's; eos_ids: every id that ends a sequence."""
        eos = [int(e) for e in eos_ids] or ([int(tok.eos_token_id)] if tok.eos_token_id is not None else [])
        if not eos:
            raise ValueError("structured output needs the model's EOS id(s)")
        n = int(vocab_size or tok.vocab_size)
        if n < tok.vocab_size:
            raise ValueError(f"model vocab_size {n} is smaller than the tokenizer's {tok.vocab_size}")
        ll = _llg().LLTokenizer(tok._tok.to_str(), n_vocab=n, eos_token=eos)
        return cls(ll, n, eos, **kw)

    def compile(self, spec: GuideSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); RequestError when llguidance refuses it (its message)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return hit
            self.misses += 1
        llg = _llg()
        template = llg.LLMatcher(self.tokenizer, spec.grammar(), log_level=0)  # drops the GIL while compiling
        if not template.is_error():
            template.compute_bitmask()
        if template.is_error():
            raise RequestError(f"invalid {spec.type}: {template.get_error()}")
        compiled = CompiledGrammar(spec, template)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)  # a racing compile of the same spec: keep one
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    def matcher(self, spec: GuideSpec, tokens: Sequence[int] = ()) -> "Matcher":
        return Matcher.resume(self, spec, tokens)


class Matcher:
    """One sequence's grammar state: mask_logits before each sample, accept after it."""

    def __init__(self, compiler: GrammarCompiler, spec: GuideSpec):
        self.compiler, self.spec = compiler, spec
        self._m = compiler.compile(spec).new_matcher()
        self._bits = np.empty(compiler.words, np.int32)
        self.tokens_accepted = 0

    @classmethod
    def resume(cls, compiler: GrammarCompiler, spec: GuideSpec, tokens: Sequence[int] = ()) -> "Matcher":
        """A matcher that has accepted `tokens` (the output so far, e.g. the prefill server's first token):
        masks from here on are those of the matcher that generated them. GrammarViolation if they do not
        follow the grammar."""
        m = cls(compiler, spec)
        if len(tokens):
            ids = [int(t) for t in tokens]
            if not m._m.consume_tokens(ids):
                raise GrammarViolation(f"resuming {spec.short()}: the {len(ids)} tokens so far do not follow the "
                                       f"grammar: {m._m.get_error()}", where="structured output")
            m.tokens_accepted = len(ids)
        return m

    def fill_bitmask(self, out: np.ndarray) -> None:
        """The allowed ids as a bitmask into `out` (int32, [ceil(V/32)], C-contiguous; bit i of word w = id
        32w+i)."""
        if out.dtype != np.int32 or out.shape != (self.compiler.words,) or not out.flags.c_contiguous:
            raise ValueError(f"bitmask must be C-contiguous int32 [{self.compiler.words}]")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check()

    def mask_logits(self, logits: np.ndarray) -> None:
        """Disallowed ids of `logits` ([V] float32/float64) set to -inf, in place."""
        self.fill_bitmask(self._bits)
        apply_bitmask(logits[None, :], self._bits[None, :])

    def accept(self, token_id: int) -> None:
        """Advance by the sampled token; GrammarViolation if the grammar does not allow it."""
        if not self._m.consume_token(int(token_id)):
            raise GrammarViolation(f"token {int(token_id)} is not allowed by {self.spec.short()} after "
                                   f"{self.tokens_accepted} tokens: {self._m.get_error()}",
                                   where="structured output")
        self.tokens_accepted += 1

    def is_terminated(self) -> bool:
        """The grammar cannot continue (only EOS is allowed), or EOS was accepted."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    def can_end(self) -> bool:
        """EOS is allowed now (the output so far is complete)."""
        return bool(self._m.is_accepting())

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarViolation(f"grammar matcher for {self.spec.short()} failed: {self._m.get_error()}",
                                   where="structured output")


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: Optional[Sequence[int]] = None) -> None:
    """-inf into `logits` ([B, V] float32/float64, in place) where `bitmask` ([B, W] int32) has a 0 bit;
    ids past 32*W are disallowed. rows: the rows of `logits` that the rows of `bitmask` are for, in order
    (default: all, B = len(bitmask)). Branch-free: each mask byte indexes a table
    of 8 addends (0 or -inf), ~16 us per row of 49152 ids."""
    add = _ADD.get(logits.dtype)
    if add is None:
        raise TypeError(f"logits must be float32 or float64, got {logits.dtype}")
    V = logits.shape[1]
    n = min(V, 32 * bitmask.shape[1])
    sel = slice(None) if rows is None else np.asarray(rows, np.intp)
    addend = np.take(add, bitmask.view(np.uint8), axis=0).reshape(-1, 32 * bitmask.shape[1])[:, :n]
    if rows is None:
        logits[:, :n] += addend
        if V > n:
            logits[:, n:] = -np.inf
    else:
        logits[sel, :n] += addend
        if V > n:
            logits[sel, n:] = -np.inf


def mask_batch(matchers: Sequence[Optional[Matcher]], logits: np.ndarray) -> None:
    """Each constrained row of `logits` ([B, V], B = len(matchers)) masked by its matcher (None: left alone):
    the masks computed by llguidance's parallel executor (the GIL released), then applied in one numpy pass."""
    if logits.ndim != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"logits {logits.shape} for {len(matchers)} matchers")
    idx = [i for i, m in enumerate(matchers) if m is not None]
    if not idx:
        return
    first = matchers[idx[0]]
    assert first is not None
    comp = first.compiler
    bitmask = np.empty((len(idx), comp.words), np.int32)
    pairs = []
    for k, i in enumerate(idx):
        m = matchers[i]
        assert m is not None
        pairs.append((m._m, k))
    _llg().numpy.fill_next_token_bitmask_par(comp.executor, pairs, bitmask)
    for i in idx:
        m = matchers[i]
        assert m is not None
        m._check()
    apply_bitmask(logits, bitmask, None if len(idx) == len(matchers) else idx)


def matcher_factory(compiler: GrammarCompiler):
    """hetserve.sampling's MatcherFactory: (params with guide_type / guide, tokens so far) -> Matcher."""

    def make(params, tokens: Sequence[int] = ()) -> Matcher:
        return Matcher.resume(compiler, GuideSpec.parse(params.guide_type, params.guide), tokens)

    return make


__all__ = ["GUIDE_TYPES", "MAX_GUIDE_BYTES", "JSON_OPTIONS", "GuideSpec", "GrammarCompiler", "CompiledGrammar",
           "Matcher", "GrammarViolation", "apply_bitmask", "mask_batch", "matcher_factory"]
