"""Prefix cache: reuse the KV of a repeated prompt prefix (system prompt, chat template, a conversation's history).
The prefill server keeps one for the prompts it prefills; each decode server keeps one for the sequences it
finished (prompt + answer), which the orchestrator's router (stages/router.py) steers the next turn to.

Prompts are cut into fixed-size token blocks (HETSERVE_PREFIX_BLOCK_TOKENS, default 8). Block i is keyed by a hash chain
h_i = blake2b(h_{i-1} || tokens of block i), so a key names the whole prefix up to and including that block
and only whole-block prefixes can match. Each entry holds the KV of its own block only ([L,KVH,BLOCK,D] fp32,
exactly what the prefill engine produced) plus its tokens, which are compared on lookup (a hash collision can
never return foreign KV).

Entries live in one LRU with a byte budget. A lookup or insert touches the chain from its last block back to
its first, so a parent block is always at least as recent as any of its children: eviction removes leaves
first and never orphans a still-cached suffix.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import config

BLOCK_TOKENS = config.VARS["HETSERVE_PREFIX_BLOCK_TOKENS"].default  # 8: see there


def block_hashes(ids: Sequence[int], block: int = BLOCK_TOKENS, seed: bytes = b"") -> List[bytes]:
    """Chained hashes of the whole blocks of `ids` (a trailing partial block gets none)."""
    out: List[bytes] = []
    h = hashlib.blake2b(seed, digest_size=16).digest()
    for i in range(len(ids) // block):
        toks = np.asarray(ids[i * block:(i + 1) * block], dtype=np.int64).tobytes()
        h = hashlib.blake2b(h + toks, digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class _Block:
    tokens: Tuple[int, ...]
    k: np.ndarray  # [L, KVH, BLOCK, D]
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PrefixCache:
    """LRU of per-block prefill KV under a byte budget (0 disables the cache; lookups then always miss)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS, seed: str = ""):
        if block < 1:
            raise ValueError("block size must be >= 1 token")
        self.budget = max(0, int(budget_bytes))
        self.block = block
        self.seed = seed.encode()
        self._lru: "collections.OrderedDict[bytes, _Block]" = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = {"lookups": 0, "hits": 0, "hit_tokens": 0, "inserted_blocks": 0, "evicted_blocks": 0}

    @classmethod
    def from_env(cls, seed: str = "", default_mb: float = 256.0) -> "PrefixCache":
        """Budget from HETSERVE_PREFIX_CACHE_MB (default 256; 0 disables)."""
        mb = config.get("HETSERVE_PREFIX_CACHE_MB") if config.is_set("HETSERVE_PREFIX_CACHE_MB") else default_mb
        return cls(int(mb * (1 << 20)), block=int(config.get("HETSERVE_PREFIX_BLOCK_TOKENS")), seed=seed)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> Dict[str, int]:
        """Counters for metrics: lookups, hits (lookups that reused >= 1 block), hit_tokens, blocks, bytes, ..."""
        with self._lock:
            return dict(self._stats, blocks=len(self._lru), bytes=self._bytes, budget_bytes=self.budget)

    def _touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # parents end up most recent
            self._lru.move_to_end(key)

    def lookup(self, ids: Sequence[int], count: bool = True) -> Tuple[int, Optional[np.ndarray], Optional[np.ndarray]]:
        """Longest cached whole-block prefix of `ids`, leaving at least one token to compute (the last token's
        logits are needed). Returns (n_tokens, k, v) with k/v [L,KVH,n,D] (copies), or (0, None, None)."""
        if not self.enabled:
            with self._lock:
                self._stats["lookups"] += count
            return 0, None, None
        n_max = (len(ids) - 1) // self.block
        keys = block_hashes(ids[:n_max * self.block], self.block, self.seed)
        with self._lock:
            self._stats["lookups"] += count
            found: List[_Block] = []
            for i, key in enumerate(keys):
                b = self._lru.get(key)
                if b is None or b.tokens != tuple(ids[i * self.block:(i + 1) * self.block]):
                    break
                found.append(b)
            if not found:
                return 0, None, None
            self._touch(keys[:len(found)])
            n = len(found) * self.block
            if count:
                self._stats["hits"] += 1
                self._stats["hit_tokens"] += n
            k = np.concatenate([b.k for b in found], axis=2)
            v = np.concatenate([b.v for b in found], axis=2)
        return n, k, v

    def _leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain) are cached from the first on; the caller holds the lock."""
        for i, key in enumerate(keys):
            if key not in self._lru:
                return i
        return len(keys)

    def cached_blocks(self, ids: Sequence[int]) -> int:
        """How many leading whole blocks of `ids` are cached (no LRU touch, not counted as a lookup)."""
        if not self.enabled:
            return 0
        keys = block_hashes(ids, self.block, self.seed)
        with self._lock:
            return self._leading(keys)

    def insert_from(self, ids: Sequence[int], read: Callable[[int], Tuple[np.ndarray, np.ndarray]]) -> int:
        """Store the whole blocks of `ids`, reading KV only for the blocks not cached yet: read(start) returns
        the KV of tokens start.. (at least to the last whole block). A finished sequence's KV is read this way
        from the decode batch, so a conversation's next turn copies only its new blocks."""
        if not self.enabled or len(ids) < self.block:
            return 0
        keys = block_hashes(ids, self.block, self.seed)
        with self._lock:
            have = self._leading(keys)
            if have == len(keys):  # all cached already: only refresh their recency
                self._touch(keys)
                return 0
        k, v = read(have * self.block)
        return self._insert(ids, keys, k, v, have * self.block)

    def held(self, limit: int) -> List[bytes]:
        """The keys of up to `limit` cached blocks, most recently used first (what a decode server publishes to
        the router)."""
        with self._lock:
            out: List[bytes] = []
            for key in reversed(self._lru):
                if len(out) >= limit:
                    break
                out.append(key)
            return out

    def insert(self, ids: Sequence[int], k: np.ndarray, v: np.ndarray, start: int = 0) -> int:
        """Store the whole blocks of `ids` whose KV is given: k/v [L,KVH,T,D] hold tokens start.. (start is a
        multiple of the block; the blocks before it must be cached already, else nothing is added: a block
        whose parent is gone could never be found). Returns blocks added."""
        if not self.enabled:
            return 0
        return self._insert(ids, block_hashes(ids, self.block, self.seed), k, v, start)

    def _insert(self, ids: Sequence[int], keys: List[bytes], k: np.ndarray, v: np.ndarray, start: int) -> int:
        """insert() with the chain's keys already computed (insert_from hashes once)."""
        if start % self.block:
            raise ValueError(f"start {start} is not a multiple of the block ({self.block} tokens)")
        if k.shape != v.shape or k.ndim != 4 or start + k.shape[2] < len(ids) // self.block * self.block:
            raise ValueError(f"KV shape {k.shape}/{v.shape} from token {start} does not cover {len(ids)} tokens")
        per_block = 2 * k[:, :, :self.block].size * np.dtype(np.float32).itemsize
        if per_block > self.budget:
            return 0
        first = start // self.block
        added = 0
        with self._lock:
            if not all(key in self._lru for key in keys[:first]):
                return 0
            for i, key in enumerate(keys[first:], first):
                if key in self._lru:
                    continue
                s = slice(i * self.block - start, (i + 1) * self.block - start)
                b = _Block(tuple(int(t) for t in ids[i * self.block:(i + 1) * self.block]),
                           np.array(k[:, :, s], np.float32),
                           np.array(v[:, :, s], np.float32))
                self._lru[key] = b
                self._bytes += b.nbytes
                added += 1
            self._touch(keys)
            self._stats["inserted_blocks"] += added
            while self._bytes > self.budget and self._lru:
                _, old = self._lru.popitem(last=False)
                self._bytes -= old.nbytes
                self._stats["evicted_blocks"] += 1
        return added

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._bytes = 0
