"""KV-aware routing: which decode server a request goes to, and whether its prompt is prefilled there.

Each decode server keeps the KV of the sequences that ended on it in a prefix cache (kv/prefix.py, blocks keyed
by the hash chain of their tokens, seeded with the build's compat hash) and publishes the block hashes it holds
(decode op=prefix). The router keeps, per server, the hashes it last read (refresh() every
HETSERVE_ROUTER_REFRESH_S) plus the ones it has sent there since (routed(): a finished sequence's prompt + answer,
which the server caches when the stream ends), so a conversation's next turn finds its history at once. A turn
whose history this router did not route (several prefill replicas each run a router; a load balancer spreads the
turns) finds no holder in a view up to a refresh old: on such a miss (no server known to hold enough for a local
prefill) the orchestrator asks the decode servers how much of this prompt they hold (decode op=prefix with the
prompt, answered from the server's own cache, bounded by HETSERVE_ROUTER_LOOKUP_MS) and learn() records it.

Choice: cost(server) = uncached prompt tokens + HETSERVE_ROUTER_LOAD_TOKENS x its streams in flight; the lowest
cost wins (ties: the pool's round robin). Then conditional disaggregation: the prompt is prefilled on that server
(its cache + the suffix it lacks, no KV moves) when
  - it lacks at most HETSERVE_LOCAL_PREFILL_MAX_TOKENS of the prompt and holds at least
    HETSERVE_LOCAL_PREFILL_MIN_HIT_TOKENS and HETSERVE_LOCAL_PREFILL_MIN_HIT_SHARE of it (a conversation's
    history worth reusing, a suffix worth no hop; a new prompt that shares only a system prompt is not that), and
  - the stall this prefill puts on the streams it is decoding, uncached tokens x streams in flight there, is at
    most HETSERVE_LOCAL_PREFILL_STALL_TOKENS or at most the prompt tokens already queued at the prefill servers
    (what this request would wait behind there): a busy decode server keeps its TPOT unless the prefill side is
    the bottleneck. Both sides in token-times of prefill work, the unit the planner models too.
Otherwise the prefill server prefills it and sends only the KV of the tokens after the held whole blocks (wire header
`start`); the decode server joins its cached blocks with it, recomputing any it lost meanwhile. A stale view
costs time, never correctness: the decode server looks the prefix up in its own cache (tokens compared, not
only hashes) and computes whatever is missing.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from ..kv.prefix import block_hashes

log = logging.getLogger("hetserve.router")

# {where}: prompts prefilled on the prefill server ("prefill") or on the chosen decode server ("decode")
PREFILL_PLACEMENT_METRIC = "hetserve_prefill_placement_total"
# {}: prompt tokens the router expected the chosen decode server to hold
ROUTER_HIT_TOKENS_METRIC = "hetserve_router_hit_tokens_total"
# {result=found|none}: misses on which the decode servers were asked (found: one held more than the view said)
ROUTER_LOOKUP_METRIC = "hetserve_router_lookups_total"


@dataclass
class RouterConfig:
    load_tokens: int = 256                # one more stream in flight weighs as much as this many uncached tokens
    local_prefill_max_tokens: int = 512   # prefill on the decode server when at most this much is uncached ...
    local_prefill_min_hit_tokens: int = 64  # ... and it holds at least this much of the prompt (0: always)
    local_prefill_min_hit_share: float = 0.5  # ... and at least this share of it
    local_prefill_stall_tokens: int = 256  # ... and uncached x its streams <= max(this, tokens queued at prefill)
    max_blocks_per_server: int = 65536    # bound of each server's index (16 bytes a block)
    recent_s: float = 30.0                # routed blocks kept over a refresh that does not list them yet

    @classmethod
    def from_env(cls) -> "RouterConfig":
        from .. import config

        return cls(load_tokens=int(config.get("HETSERVE_ROUTER_LOAD_TOKENS")),
                   local_prefill_max_tokens=int(config.get("HETSERVE_LOCAL_PREFILL_MAX_TOKENS")),
                   local_prefill_min_hit_tokens=int(config.get("HETSERVE_LOCAL_PREFILL_MIN_HIT_TOKENS")),
                   local_prefill_min_hit_share=float(config.get("HETSERVE_LOCAL_PREFILL_MIN_HIT_SHARE")),
                   local_prefill_stall_tokens=int(config.get("HETSERVE_LOCAL_PREFILL_STALL_TOKENS")))


def local_prefill_eligible(c, uncached, hit, prompt_len):
    """The size half of the local-prefill rule: a short uncached suffix of a prompt mostly held. `c` has the
    RouterConfig fields (the planner's model.Routing too); scalars or numpy arrays (elementwise)."""
    return ((uncached <= c.local_prefill_max_tokens) & (hit >= c.local_prefill_min_hit_tokens)
            & (hit >= c.local_prefill_min_hit_share * prompt_len))


def local_prefill_stall_ok(c, uncached, streams, prefill_queued_tokens):
    """The load half: the stall on the server's streams within the bound or the prefill side's backlog."""
    return uncached * streams <= max(c.local_prefill_stall_tokens, prefill_queued_tokens)


@dataclass
class Route:
    """The router's verdict for one request on the server picked with its cost()."""
    hit_tokens: int      # prompt tokens the server is expected to hold
    local: bool          # prefill on the decode server
    whole_blocks: int = 0  # hit_tokens rounded down to whole cache blocks: the KV a handoff may leave out


class PrefixRouter:
    def __init__(self, block_tokens: int, seed: str, config: Optional[RouterConfig] = None,
                 clock: Callable[[], float] = time.monotonic):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block, self.seed = block_tokens, seed.encode()
        self.config = config or RouterConfig()
        self.clock = clock
        # url -> block hash -> when the router sent it there (0.0: read from the server's own list)
        self._index: Dict[str, "collections.OrderedDict[bytes, float]"] = {}
        self._lock = threading.Lock()

    def hashes(self, ids: Sequence[int]) -> List[bytes]:
        return block_hashes(ids, self.block, self.seed)

    def hit_tokens(self, url: str, hashes: Sequence[bytes]) -> int:
        """Leading prompt tokens whose blocks `url` is believed to hold."""
        with self._lock:
            held = self._index.get(url)
            if not held:
                return 0
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
        return n * self.block

    def cost(self, hashes: Sequence[bytes], prompt_len: int) -> "Costing":
        """The pool's cost of sending this prompt to a member (DecodePool.pick(cost=...)); it remembers what it
        saw of each member for route()."""
        return Costing(self, hashes, prompt_len)

    def route(self, url: str, costing: "Costing", prefill_queued_tokens: int = 0) -> Route:
        """The verdict for `url` (picked with `costing`); prefill_queued_tokens: prompt tokens waiting or running
        at the prefill servers now (the orchestrator's count)."""
        held, streams = costing.seen.get(url) or (self.hit_tokens(url, costing.hashes), 0)
        hit = min(held, max(costing.prompt_len - 1, 0))
        uncached = costing.prompt_len - hit
        c = self.config
        local = bool(local_prefill_eligible(c, uncached, hit, costing.prompt_len)
                     & local_prefill_stall_ok(c, uncached, streams, prefill_queued_tokens))
        return Route(hit, local, hit // self.block * self.block)

    def routed(self, url: str, ids: Sequence[int]) -> None:
        """The KV of `ids` now lives on `url` (a sequence ended there: the server caches prompt + answer)."""
        hs = self.hashes(ids)
        self.learn(url, hs, len(hs))

    def should_look_up(self, costing: "Costing") -> bool:
        """A miss worth asking the decode servers about: the prompt is long enough for a held prefix to matter,
        and no server is known to hold enough of it for a local prefill."""
        c, n = self.config, costing.prompt_len
        if n <= max(c.local_prefill_min_hit_tokens, self.block) or c.local_prefill_max_tokens <= 0:
            return False
        with self._lock:
            urls = list(self._index)
        best = max((self.hit_tokens(u, costing.hashes) for u in urls), default=0)
        best = min(best, n - 1)
        return not local_prefill_eligible(c, n - best, best, n)

    def learn(self, url: str, hashes: Sequence[bytes], blocks: int) -> None:
        """`url` says it holds the first `blocks` of this chain (and not the next one): recorded like a routed
        sequence (kept over a refresh for recent_s), the block after them dropped from the view."""
        now = self.clock()
        with self._lock:
            held = self._index.setdefault(url, collections.OrderedDict())
            for h in hashes[:blocks]:
                held[h] = now
                held.move_to_end(h)
            if blocks < len(hashes):
                held.pop(hashes[blocks], None)
            self._trim(held)

    def refresh(self, url: str, published: Iterable[bytes]) -> None:
        """Replace what `url` is believed to hold by what it published (most recent first), keeping blocks routed
        there within recent_s (their sequences may not have ended yet)."""
        cutoff = self.clock() - self.config.recent_s
        fresh: "collections.OrderedDict[bytes, float]" = collections.OrderedDict()
        for h in reversed(list(published)[:self.config.max_blocks_per_server]):
            fresh[h] = 0.0
        with self._lock:
            for h, t in (self._index.get(url) or {}).items():
                if t > cutoff:
                    fresh[h] = t
                    fresh.move_to_end(h)
            self._trim(fresh)
            self._index[url] = fresh

    def forget(self, url: str) -> None:
        """`url` is gone (or restarted): it holds nothing the router may count on."""
        with self._lock:
            self._index.pop(url, None)

    def servers(self) -> Dict[str, int]:
        with self._lock:
            return {u: len(h) for u, h in self._index.items()}

    def _trim(self, held: "collections.OrderedDict[bytes, float]") -> None:
        while len(held) > self.config.max_blocks_per_server:
            held.popitem(last=False)


class Costing:
    """cost(url, inflight) for DecodePool.pick; remembers (held tokens, streams in flight) of each member it
    priced, so route() judges the chosen one as it was when chosen (and looks its hits up once)."""

    def __init__(self, router: PrefixRouter, hashes: Sequence[bytes], prompt_len: int):
        self.router, self.hashes, self.prompt_len = router, hashes, prompt_len
        self.seen: Dict[str, "tuple[int, int]"] = {}

    def __call__(self, url: str, inflight: int) -> float:
        held = self.router.hit_tokens(url, self.hashes)
        self.seen[url] = (held, inflight)
        return (self.prompt_len - held) + self.router.config.load_tokens * inflight


class Refresher:
    """Reads every healthy decode server's published block list (decode op=prefix) into the router, every
    interval_s on one daemon thread. members() -> {url: healthy}; fetch(url) -> the op's JSON answer."""

    def __init__(self, router: PrefixRouter, members: Callable[[], Dict[str, bool]],
                 fetch: Callable[[str], dict], interval_s: float, start: bool = True):
        self.router, self.members, self.fetch, self.interval_s = router, members, fetch, interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if start:
            self._thread = threading.Thread(target=self._run, name="kv-router-refresh", daemon=True)
            self._thread.start()

    def refresh_once(self) -> None:
        for url, healthy in self.members().items():
            if not healthy:
                self.router.forget(url)
                continue
            try:
                got = self.fetch(url)
                if got.get("block_tokens") != self.router.block:  # another block size: its hashes never match
                    self.router.forget(url)
                    continue
                self.router.refresh(url, [bytes.fromhex(h) for h in got.get("blocks", [])])
            except Exception as e:  # the health check owns marking it down; until then, keep the last view
                log.debug("prefix blocks of %s not read: %s: %s", url, type(e).__name__, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh_once()

    def close(self) -> None:
        self._stop.set()
