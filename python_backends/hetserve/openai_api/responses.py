"""OpenAI response shapes for what `llm` streams back: the choices of one request and their logprobs.

Logprobs are the model's own log-softmax (hetserve.sampling), rendered the two ways OpenAI does: chat
(`logprobs.content[]` of {token, logprob, bytes, top_logprobs[]}) and legacy completions (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob} maps, `text_offset`). A token's text is its own decoded
piece (special tokens included); `bytes` are that text's UTF-8 (a piece that is part of a multi-byte character
decodes to U+FFFD, as in other servers that decode per token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..sampling import TokenLogprobs


class TokenTexts:
    """id -> its decoded piece, cached (the same ids come back in every top-N list)."""

    def __init__(self, tok, limit: int = 1 << 16):
        self.tok, self.limit = tok, limit
        self._cache: Dict[int, str] = {}

    def __call__(self, i: int) -> str:
        s = self._cache.get(i)
        if s is None:
            s = self.tok.decode([i], skip_special_tokens=False)
            if len(self._cache) < self.limit:
                self._cache[i] = s
        return s


def chat_logprobs(texts: TokenTexts, ids: List[int], lps: Optional[TokenLogprobs], top: int) -> Optional[dict]:
    if lps is None:
        return None
    content = []
    for j, t in enumerate(ids[:len(lps)]):
        s = texts(t)
        alts = [{"token": texts(a), "logprob": v, "bytes": list(texts(a).encode())}
                for a, v in zip(lps.top_ids[j][:top], lps.top_values[j][:top])]
        content.append({"token": s, "logprob": lps.logprob[j], "bytes": list(s.encode()), "top_logprobs": alts})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, ids: List[int], lps: Optional[TokenLogprobs], top: int,
                        offset: int) -> Optional[dict]:
    """Legacy completions logprobs; `offset` is the text offset of the first token."""
    if lps is None:
        return None
    tokens, offsets, tops = [], [], []
    for j, t in enumerate(ids[:len(lps)]):
        s = texts(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        tops.append({texts(a): v for a, v in zip(lps.top_ids[j][:top], lps.top_values[j][:top])} if top else None)
    return {"tokens": tokens, "token_logprobs": list(lps.logprob[:len(tokens)]),
            "top_logprobs": tops if top else None, "text_offset": offsets}


def echo_logprobs(texts: TokenTexts, prompt: List[int], plp: Optional[TokenLogprobs], top: int,
                  gen: dict) -> dict:
    """Completions echo + logprobs: the prompt tokens lead (the first has no logprob: None, as OpenAI), their
    text offsets from 0, then the answer's (whose offsets already start after the echoed prompt)."""
    tokens: List[str] = []
    offsets: List[int] = []
    lps: List[Optional[float]] = []
    tops: List[Optional[Dict[str, float]]] = []
    off = 0
    for j, t in enumerate(prompt):
        s = texts(t)
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        k = j - 1  # plp covers prompt tokens 1..
        if plp is None or not 0 <= k < len(plp):
            lps.append(None)
            tops.append(None)
            continue
        lps.append(plp.logprob[k])
        tops.append({texts(a): v for a, v in zip(plp.top_ids[k][:top], plp.top_values[k][:top])})
    return {"tokens": tokens + gen["tokens"], "token_logprobs": lps + gen["token_logprobs"],
            "top_logprobs": (tops + gen["top_logprobs"]) if top else None,
            "text_offset": offsets + gen["text_offset"]}


@dataclass
class Choice:
    """One choice being collected (non-streaming)."""
    index: int
    text: List[str] = field(default_factory=list)
    ids: List[int] = field(default_factory=list)
    logprobs: Optional[TokenLogprobs] = None
    finish_reason: Optional[str] = None

    def add(self, text: str, ids: List[int], lps: Optional[TokenLogprobs], reason: Optional[str]) -> None:
        self.text.append(text)
        self.ids += ids
        if lps is not None:
            if self.logprobs is None:
                self.logprobs = TokenLogprobs()
            self.logprobs.extend(lps)
        self.finish_reason = reason or self.finish_reason

    @property
    def cum_logprob(self) -> float:
        return float(sum(self.logprobs.logprob)) if self.logprobs is not None else 0.0


def best(choices: List[Choice], n: int) -> List[Choice]:
    """best_of: the n choices with the highest cumulative logprob, renumbered 0..n-1 (OpenAI's semantics)."""
    keep = sorted(choices, key=lambda c: -c.cum_logprob)[:n]
    for i, c in enumerate(keep):
        c.index = i
    return keep
