"""Paged KV block pool with a tier stack: device -> host -> local disk -> Redis.

A block holds K and V of `block_tokens` consecutive tokens for every layer, as one array [2, L, KVH, block, D]
(index 0 = K, 1 = V). Each sequence owns a block table (block ids in token order) and a token count. Blocks
carry a refcount (forked sequences share full blocks) and a pin count (a block of an *active* sequence is
pinned: it stays on the device tier and is never moved).

Tiers (kv/tiers.py), top to bottom, each with a capacity in blocks:
  device  process-memory numpy arena (a torch CUDA arena when CUDA is available)
  host    a second arena (page-locked when CUDA is available)
  disk    one memory-mapped file under a directory
  redis   one key per block on a real redis-server (namespaced, with a TTL)
When a tier is full, making room demotes its least recently used unpinned blocks one tier down (cascading);
`activate` promotes a sequence back to the device tier and pins it. Every move copies the bytes verbatim, so
round trips through any tier are bit-exact. All public methods are thread-safe.

Engine-held sequences (`attach` / `detach`): the decode batch (engines/decode_batch.py) keeps a running
sequence's KV where the engine reads and writes it in place, so the pool must not hold a second copy. An
attached sequence's blocks stay on the device tier's books (they count against its capacity, pinned) but give
their arena slots back (slot ENGINE); the pool only accounts for them. `detach` takes slots again and writes
the engine's KV into them (preemption), after which the sequence moves through the tiers like any other.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, cast

import numpy as np

from .. import config
from .tiers import KVLost, PoolFull, SlotTier, Tier, tier_stack

TIER_NAMES = ("device", "host", "disk", "redis")
log = logging.getLogger("hetserve.kv")
ENGINE = -1  # slot of a block whose KV lives in the engine's batch buffer (attached sequence)
LOST = -2  # slot of a block whose data is gone (a failed promotion could not put it back): reads raise KVLost


# ---- the pool -------------------------------------------------------------------------------------
@dataclass
class _Block:
    tier: int
    slot: int
    ref: int = 1
    pins: int = 0


@dataclass
class _Seq:
    blocks: List[int] = field(default_factory=list)
    n_tokens: int = 0
    active: bool = False
    attached: bool = False  # KV held by the engine batch (n_tokens is as of attach)
    touched: float = field(default_factory=time.monotonic)


class BlockPool:
    """Paged KV pool over a tier stack (tiers[0] is the device tier and must support write_tokens)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, tiers: List[Tier],
                 block_tokens: int = 16, dtype=np.float32):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if not tiers or not hasattr(tiers[0], "write_tokens"):
            raise ValueError("the first tier must be a device arena")
        self.L, self.H, self.D, self.bt = num_layers, num_kv_heads, head_dim, int(block_tokens)
        self.dtype = np.dtype(dtype)
        self.block_shape = (2, self.L, self.H, self.bt, self.D)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        for t in tiers:
            if t.block_shape != self.block_shape or t.dtype != self.dtype:
                raise ValueError(f"tier {t.name}: block shape/dtype differ from the pool's")
        self.tiers = tiers
        self.device = cast(SlotTier, tiers[0])  # checked above: a slot arena (ArenaTier or TorchArenaTier)
        self._blocks: Dict[int, _Block] = {}
        self._lru: List["collections.OrderedDict[int, None]"] = [collections.OrderedDict() for _ in tiers]
        self._seqs: Dict[Hashable, _Seq] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.counters = {"demoted_blocks": 0, "promoted_blocks": 0, "lost_blocks": 0}

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, device_bytes: int,
               block_tokens: int = 16, host_bytes: int = 0, disk_dir: Optional[str] = None, disk_bytes: int = 0,
               redis_url: Optional[str] = None, redis_bytes: Optional[int] = None, redis_ttl_s: int = 3600,
               device: str = "auto", dtype=np.float32) -> "BlockPool":
        """A pool over tiers.tier_stack(...) (sizes in bytes, rounded down to whole blocks)."""
        tiers = tier_stack(num_layers, num_kv_heads, head_dim, device_bytes=device_bytes, block_tokens=block_tokens,
                           host_bytes=host_bytes, disk_dir=disk_dir, disk_bytes=disk_bytes, redis_url=redis_url,
                           redis_bytes=redis_bytes, redis_ttl_s=redis_ttl_s, device=device, dtype=dtype)
        return cls(num_layers, num_kv_heads, head_dim, tiers, block_tokens, dtype)

    @classmethod
    def from_env(cls, cfg, env=None) -> "BlockPool":
        """Pool for a LlamaConfig from env vars (sizes in MiB, fractions allowed):
        HETSERVE_KV_BUDGET_MB (device tier, default 2048), HETSERVE_KV_BLOCK_TOKENS (16),
        HETSERVE_KV_HOST_MB (1024), HETSERVE_KV_DISK_DIR (unset: no disk tier), HETSERVE_KV_DISK_MB (4096),
        HETSERVE_REDIS_URL (unset: no redis tier), HETSERVE_KV_REDIS_MB (unbounded), HETSERVE_KV_REDIS_TTL_S
        (3600), HETSERVE_KV_DEVICE (auto|cpu|cuda[:n])."""
        def mb(name):
            v = config.get(name, env)
            return None if v is None else int(v * (1 << 20))

        return cls.create(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                          device_bytes=mb("HETSERVE_KV_BUDGET_MB"),
                          block_tokens=config.get("HETSERVE_KV_BLOCK_TOKENS", env),
                          host_bytes=mb("HETSERVE_KV_HOST_MB") or 0,
                          disk_dir=config.get("HETSERVE_KV_DISK_DIR", env) or None,
                          disk_bytes=mb("HETSERVE_KV_DISK_MB") or 0,
                          redis_url=config.get("HETSERVE_REDIS_URL", env) or None,
                          redis_bytes=mb("HETSERVE_KV_REDIS_MB"),
                          redis_ttl_s=config.get("HETSERVE_KV_REDIS_TTL_S", env),
                          device=config.get("HETSERVE_KV_DEVICE", env))

    def close(self) -> None:
        with self._lock:
            for t in self.tiers:
                t.close()
            self._seqs.clear()
            self._blocks.clear()

    # ---- queries --------------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.bt)

    def capacity(self, tier: str = "device") -> Optional[int]:
        return self.tiers[self._tier_index(tier)].capacity

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id) -> int:
        return self._seq(seq_id).n_tokens

    def placement(self, seq_id) -> Dict[str, int]:
        """Blocks of one sequence per tier name."""
        with self._lock:
            c = collections.Counter(self.tiers[self._blocks[b].tier].name for b in self._seq(seq_id).blocks)
            return dict(c)

    def stats(self) -> dict:
        """Occupancy for metrics: tier_blocks / tier_capacity per tier name, plus totals and move counters."""
        with self._lock:
            pinned = sum(1 for b in self._blocks.values() if b.pins)
            engine = sum(1 for b in self._blocks.values() if b.slot == ENGINE)
            return {"block_tokens": self.bt, "block_bytes": self.block_bytes, "engine_blocks": engine,
                    "tier_blocks": {t.name: t.used for t in self.tiers},
                    "tier_capacity": {t.name: t.capacity for t in self.tiers},
                    "used_blocks": len(self._blocks), "pinned_blocks": pinned,
                    "sequences": len(self._seqs), "active_sequences": sum(s.active for s in self._seqs.values()),
                    **self.counters}

    # ---- sequences ------------------------------------------------------------------------------
    def add(self, seq_id, k: np.ndarray, v: np.ndarray) -> None:
        """New (inactive) sequence holding KV k, v [L, KVH, T, D]; blocks go to the highest tiers with free
        slots (nothing is evicted for it). Raises PoolFull when all tiers together lack room."""
        if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != (self.L, self.H) or k.shape[3] != self.D:
            raise ValueError(f"KV shape {k.shape}/{v.shape} does not match pool layout [L={self.L}, "
                             f"KVH={self.H}, T, D={self.D}]")
        T = k.shape[2]
        nb = self.blocks_for(T)
        with self._lock:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} already in the KV pool")
            if sum(t.free for t in self.tiers) < nb:
                raise PoolFull(f"KV pool full: {nb} blocks needed, "
                               f"{sum(t.free for t in self.tiers)} free over all tiers")
            data = self._to_blocks(k, v, nb)
            placed: List[Tuple[int, List[int]]] = []
            i = 0
            try:
                for ti, t in enumerate(self.tiers):
                    take = int(min(nb - i, t.free))
                    if take <= 0:
                        continue
                    slots = t.alloc(take)
                    placed.append((ti, slots))
                    t.write(slots, data[i:i + take])
                    i += take
                    if i == nb:
                        break
            except Exception:
                for ti, slots in placed:
                    self.tiers[ti].release(slots)
                raise
            seq = self._seqs[seq_id] = _Seq(n_tokens=T)
            for ti, slots in placed:
                for s in slots:
                    seq.blocks.append(self._new_block(ti, s))

    def fork(self, src, dst, n_tokens: Optional[int] = None) -> None:
        """dst shares src's first n_tokens (default all): full blocks by refcount, a partial last block copied
        (so appends never write into a shared block)."""
        with self._lock:
            s = self._seq(src)
            if s.attached:
                raise ValueError(f"sequence {src!r} is attached: its KV lives in the engine batch")
            n = s.n_tokens if n_tokens is None else int(n_tokens)
            if not 0 <= n <= s.n_tokens:
                raise ValueError(f"fork of {n} tokens from a {s.n_tokens}-token sequence")
            if dst in self._seqs:
                raise ValueError(f"sequence {dst!r} already in the KV pool")
            full, part = divmod(n, self.bt)
            copied = None
            if part:
                b = self._blocks[s.blocks[full]]
                data = self._read_tier(b.tier, [b.slot])
                ti = next((i for i, t in enumerate(self.tiers) if t.free >= 1), None)
                if ti is None:
                    raise PoolFull("KV pool full: no slot for the forked partial block")
                slot = self.tiers[ti].alloc(1)
                try:
                    self.tiers[ti].write(slot, data)
                except Exception:
                    self.tiers[ti].release(slot)
                    raise
                copied = self._new_block(ti, slot[0])
            d = self._seqs[dst] = _Seq(n_tokens=n)
            for bid in s.blocks[:full]:
                self._blocks[bid].ref += 1
                d.blocks.append(bid)
            if copied is not None:
                d.blocks.append(copied)

    def free(self, seq_id) -> bool:
        """Drop a sequence: unpin, unref, and release every block whose refcount reaches zero."""
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                return False
            for bid in seq.blocks:
                b = self._blocks[bid]
                if seq.active:
                    b.pins -= 1
                b.ref -= 1
                if b.ref == 0:
                    self._drop_block(bid)
            return True

    def read(self, seq_id) -> Tuple[np.ndarray, np.ndarray]:
        """The sequence's KV as contiguous k, v [L, KVH, n_tokens, D], read from whichever tiers hold it."""
        with self._lock:
            seq = self._seq(seq_id)
            if seq.attached:
                raise ValueError(f"sequence {seq_id!r} is attached: its KV lives in the engine batch")
            data = np.empty((len(seq.blocks), *self.block_shape), self.dtype)
            by_tier: Dict[int, List[Tuple[int, int]]] = collections.defaultdict(list)
            for i, bid in enumerate(seq.blocks):
                b = self._blocks[bid]
                by_tier[b.tier].append((i, b.slot))
            for ti, items in by_tier.items():
                data[[i for i, _ in items]] = self._read_tier(ti, [s for _, s in items])
            self._touch(seq)
            n = seq.n_tokens
        kv = data.transpose(1, 2, 3, 0, 4, 5).reshape(2, self.L, self.H, -1, self.D)
        return np.ascontiguousarray(kv[0, :, :, :n]), np.ascontiguousarray(kv[1, :, :, :n])

    # ---- device residency -----------------------------------------------------------------------
    def can_activate(self, seq_id, n_tokens: Optional[int] = None) -> bool:
        """Whether activate(seq_id, n_tokens) would succeed now."""
        with self._lock:
            seq = self._seq(seq_id)
            return self._can_take(0, self._activation_need(seq, n_tokens), set(seq.blocks), self._vacating(seq))

    def can_allocate(self, n_blocks: int) -> bool:
        """Whether the device tier can take n_blocks new blocks now (demoting unpinned blocks if needed)."""
        with self._lock:
            return self._can_take(0, n_blocks, set())

    def activate(self, seq_id, n_tokens: Optional[int] = None) -> None:
        """Promote all of a sequence's blocks to the device tier, pin them, and make room for n_tokens
        (default: its current length). Unpinned LRU blocks are demoted as needed. Raises PoolFull."""
        with self._lock:
            seq = self._seq(seq_id)
            own = set(seq.blocks)
            need = self._activation_need(seq, n_tokens)
            if not self._can_take(0, need, own, self._vacating(seq)):
                raise PoolFull(f"KV device tier full: {need} blocks needed for {seq_id!r}, "
                               f"{self.tiers[0].free} free and too little to demote")
            up = [bid for bid in seq.blocks if self._blocks[bid].tier != 0]
            if up:
                self._promote(up, own)
            if not seq.active:
                for bid in seq.blocks:
                    self._blocks[bid].pins += 1
                seq.active = True
            if n_tokens is not None:
                self._grow(seq, n_tokens, own)
            self._touch(seq)

    def attach(self, seq_id) -> Tuple[np.ndarray, np.ndarray]:
        """Hand an active sequence's KV to the engine: returns it (k, v [L, KVH, T, D]) and frees the arena
        slots of its exclusively owned blocks, which stay counted (and pinned) on the device tier. Blocks
        `reserve` adds while attached get no slot either. Undo with `detach`."""
        with self._lock:
            seq = self._seq(seq_id)
            if not seq.active or seq.attached:
                raise ValueError(f"sequence {seq_id!r}: attach needs an active, detached sequence")
            k, v = self.read(seq_id)
            own = [self._blocks[bid] for bid in seq.blocks if self._blocks[bid].ref == 1]
            assert all(b.tier == 0 for b in own), "attach of a sequence not on the device tier"
            self.device.unback([b.slot for b in own])
            for b in own:
                b.slot = ENGINE
            seq.attached = True
            return k, v

    def detach(self, seq_id, k: np.ndarray, v: np.ndarray) -> None:
        """Take the KV back from the engine (k, v [L, KVH, T, D], T <= the reserved tokens): its engine-held
        blocks get device slots again and are written verbatim; the sequence stays active."""
        with self._lock:
            seq = self._seq(seq_id)
            if not seq.attached:
                raise ValueError(f"sequence {seq_id!r} is not attached")
            T = int(k.shape[2])
            if k.shape != v.shape or not seq.n_tokens <= T <= len(seq.blocks) * self.bt:
                raise ValueError(f"sequence {seq_id!r}: detach of {T} tokens into {len(seq.blocks)} blocks")
            idx = [i for i, bid in enumerate(seq.blocks) if self._blocks[bid].slot == ENGINE]
            slots = self.device.back(len(idx))
            self.tiers[0].write(slots, self._to_blocks(k, v, len(seq.blocks))[idx])
            for i, slot in zip(idx, slots):
                self._blocks[seq.blocks[i]].slot = slot
            seq.n_tokens, seq.attached = T, False
            self._touch(seq)

    def deactivate(self, seq_id) -> None:
        """Unpin (the sequence becomes an LRU candidate for demotion)."""
        with self._lock:
            seq = self._seq(seq_id)
            if seq.attached:
                raise ValueError(f"sequence {seq_id!r} is attached: detach its KV first")
            if seq.active:
                for bid in seq.blocks:
                    self._blocks[bid].pins -= 1
                seq.active = False
            self._touch(seq)

    def reserve(self, seq_id, n_tokens: int) -> bool:
        """Make an active sequence's block table hold n_tokens, allocating device blocks (demoting unpinned
        LRU blocks if needed). False when the device tier cannot make room (the caller preempts)."""
        with self._lock:
            seq = self._seq(seq_id)
            if not seq.active:
                raise ValueError(f"sequence {seq_id!r} is not active")
            extra = self.blocks_for(n_tokens) - len(seq.blocks)
            if extra <= 0:
                return True
            own = set(seq.blocks)
            if not self._can_take(0, extra, own):
                return False
            try:
                self._grow(seq, n_tokens, own)
            except PoolFull:  # a lower tier failed while taking demoted blocks (e.g. Redis down)
                return False
            return True

    def append(self, seq_ids: Sequence[Hashable], k: np.ndarray, v: np.ndarray) -> None:
        """Append one token to each active sequence: k, v [n, L, KVH, D] (row i -> seq_ids[i]). Capacity must
        be reserved first (raises PoolFull otherwise)."""
        with self._lock:
            slots, offs, seqs = [], [], []
            for sid in seq_ids:
                seq = self._seq(sid)
                if not seq.active or seq.attached:
                    raise ValueError(f"sequence {sid!r} is not active" if not seq.active else
                                     f"sequence {sid!r} is attached: the engine writes its KV")
                j, off = divmod(seq.n_tokens, self.bt)
                if j >= len(seq.blocks):
                    raise PoolFull(f"sequence {sid!r}: no block reserved for token {seq.n_tokens}")
                b = self._blocks[seq.blocks[j]]
                assert b.tier == 0 and b.ref == 1, "append into a moved or shared block"
                slots.append(b.slot)
                offs.append(off)
                seqs.append(seq)
            if seqs:
                self.device.write_tokens(slots, offs, k, v)
            for seq in seqs:
                seq.n_tokens += 1

    def demote(self, seq_id, to: Optional[str] = None) -> int:
        """Move a sequence's unpinned blocks down the stack: each group to the next lower tier that can take it
        (default), or all into tier `to`. Lower tiers make room by demoting their own LRU blocks. Returns the
        number of blocks moved (0: already at the bottom / all pinned); raises PoolFull when nothing below fits."""
        with self._lock:
            seq = self._seq(seq_id)
            own = set(seq.blocks)
            target = None if to is None else self._tier_index(to)
            groups: Dict[int, List[int]] = collections.defaultdict(list)
            for bid in seq.blocks:
                b = self._blocks[bid]
                if not b.pins and (b.tier + 1 < len(self.tiers) if target is None else b.tier < target):
                    groups[b.tier].append(bid)
            moved = 0
            for src in sorted(groups, reverse=True):  # deepest first so upper groups find room below
                rest = groups[src]
                for dst in (range(src + 1, len(self.tiers)) if target is None else [target]):
                    take = self._room(dst, len(rest), own)  # the next tier first, overflow further down
                    if take:
                        self._move(rest[:take], dst, own)
                        moved += take
                        rest = rest[take:]
                    if not rest:
                        break
                if rest:
                    raise PoolFull(f"KV tiers below {self.tiers[src].name} are full: cannot demote {seq_id!r}")
            self._touch(seq)
            return moved

    def promote(self, seq_id) -> None:
        """Bring a sequence's blocks back to the device tier without pinning them. Raises PoolFull."""
        with self._lock:
            seq = self._seq(seq_id)
            own = set(seq.blocks)
            up = [bid for bid in seq.blocks if self._blocks[bid].tier != 0]
            if up:
                if not self._can_take(0, len(up), own, self._vacating(seq)):
                    raise PoolFull(f"KV device tier full: cannot promote {seq_id!r}")
                self._promote(up, own)
            self._touch(seq)

    def demote_idle(self, idle_s: float) -> int:
        """Demote (one tier) every inactive sequence untouched for idle_s seconds; returns blocks moved."""
        now = time.monotonic()
        moved = 0
        with self._lock:
            for sid, seq in list(self._seqs.items()):
                if not seq.active and now - seq.touched >= idle_s:
                    try:
                        moved += self.demote(sid)
                    except (PoolFull, KVLost):
                        pass
                    seq.touched = now
        return moved

    # ---- internals ------------------------------------------------------------------------------
    def _seq(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} not in the KV pool") from None

    def _tier_index(self, name: str) -> int:
        for i, t in enumerate(self.tiers):
            if t.name == name:
                return i
        raise ValueError(f"no KV tier {name!r}; have {[t.name for t in self.tiers]}")

    def _new_block(self, tier: int, slot: int) -> int:
        bid = next(self._ids)
        self._blocks[bid] = _Block(tier, slot)
        self._lru[tier][bid] = None
        return bid

    def _drop_block(self, bid: int) -> None:
        b = self._blocks.pop(bid)
        self._lru[b.tier].pop(bid, None)
        if b.slot == ENGINE:
            cast(SlotTier, self.tiers[b.tier]).release_unbacked(1)
        elif b.slot != LOST:  # a lost block's slot was released when it was lost
            self.tiers[b.tier].release([b.slot])

    def _touch(self, seq: _Seq) -> None:
        seq.touched = time.monotonic()
        for bid in seq.blocks:
            self._lru[self._blocks[bid].tier].move_to_end(bid)

    def _activation_need(self, seq: _Seq, n_tokens: Optional[int]) -> int:
        off_device = sum(1 for bid in seq.blocks if self._blocks[bid].tier != 0)
        grow = 0 if n_tokens is None else max(0, self.blocks_for(n_tokens) - len(seq.blocks))
        return off_device + grow

    def _to_blocks(self, k: np.ndarray, v: np.ndarray, nb: int) -> np.ndarray:
        T = k.shape[2]
        buf = np.zeros((2, self.L, self.H, nb * self.bt, self.D), self.dtype)
        buf[0, :, :, :T] = k
        buf[1, :, :, :T] = v
        return buf.reshape(2, self.L, self.H, nb, self.bt, self.D).transpose(3, 0, 1, 2, 4, 5)

    def _read_tier(self, ti: int, slots: List[int]) -> np.ndarray:
        if LOST in slots:
            raise KVLost(f"{slots.count(LOST)} KV blocks were lost after a failed promotion")
        try:
            return self.tiers[ti].read(slots)
        except KVLost:
            self.counters["lost_blocks"] += len(slots)
            raise

    def _movable(self, ti: int, limit: int, exclude: set) -> List[int]:
        """Up to `limit` unpinned blocks of tier ti not in exclude, least recently used first."""
        out: List[int] = []
        if limit <= 0:
            return out
        for bid in self._lru[ti]:
            if not self._blocks[bid].pins and bid not in exclude:
                out.append(bid)
                if len(out) >= limit:
                    break
        return out

    def _room(self, ti: int, limit: int, exclude: set, vacating: Optional[Dict[int, int]] = None) -> int:
        """How many of `limit` blocks tier ti can accept: free slots (plus slots that `vacating` blocks will
        leave) and its unpinned LRU blocks that the tiers below can in turn accept."""
        if ti >= len(self.tiers) or limit <= 0:
            return 0
        free = self.tiers[ti].free + (vacating or {}).get(ti, 0)
        if free >= limit:
            return int(limit)
        free = int(free)
        movable = len(self._movable(ti, limit - free, exclude))
        return free + self._room(ti + 1, movable, exclude, vacating)

    def _can_take(self, ti: int, m: int, exclude: set, vacating: Optional[Dict[int, int]] = None) -> bool:
        return m <= 0 or self._room(ti, m, exclude, vacating) >= m

    def _vacating(self, seq: _Seq) -> Dict[int, int]:
        """Slots per tier that promoting seq's off-device blocks will free."""
        return dict(collections.Counter(self._blocks[b].tier for b in seq.blocks if self._blocks[b].tier != 0))

    def _make_room(self, ti: int, m: int, exclude: set) -> None:
        short = m - self.tiers[ti].free
        if short <= 0:
            return
        short = int(short)
        victims = self._movable(ti, short, exclude)
        if len(victims) < short or ti + 1 >= len(self.tiers):
            raise PoolFull(f"KV {self.tiers[ti].name} tier full")
        self._move(victims, ti + 1, exclude)

    def _gather(self, bids: List[int]) -> np.ndarray:
        data = np.empty((len(bids), *self.block_shape), self.dtype)
        by_src: Dict[int, List[int]] = collections.defaultdict(list)
        for i, bid in enumerate(bids):
            by_src[self._blocks[bid].tier].append(i)
        for src, idx in by_src.items():
            data[idx] = self._read_tier(src, [self._blocks[bids[i]].slot for i in idx])
        return data

    def _move(self, bids: List[int], dst: int, exclude: set) -> None:
        """Copy blocks (from tiers above dst) verbatim into tier dst, then release their old slots."""
        self._make_room(dst, len(bids), exclude)
        data = self._gather(bids)
        t = self.tiers[dst]
        slots = t.alloc(len(bids))
        try:
            t.write(slots, data)
        except Exception:
            t.release(slots)
            raise
        for bid, slot in zip(bids, slots):
            b = self._blocks[bid]
            self.counters["demoted_blocks"] += 1
            self.tiers[b.tier].release([b.slot])
            self._lru[b.tier].pop(bid, None)
            b.tier, b.slot = dst, slot
            self._lru[dst][bid] = None

    def _promote(self, bids: List[int], exclude: set) -> None:
        """Bring blocks up to the device tier. Their old slots are released first, so demotions made to free
        device slots can take them (a swap)."""
        data = self._gather(bids)
        for bid in bids:
            b = self._blocks[bid]
            self.tiers[b.tier].release([b.slot])
            self._lru[b.tier].pop(bid, None)
        try:
            self._make_room(0, len(bids), exclude)
            slots = self.tiers[0].alloc(len(bids))
            try:
                self.tiers[0].write(slots, data)
            except Exception:
                self.tiers[0].release(slots)
                raise
        except Exception:
            self._replace(bids, data)
            raise
        for bid, slot in zip(bids, slots):
            b = self._blocks[bid]
            b.tier, b.slot = 0, slot
            self._lru[0][bid] = None
        self.counters["promoted_blocks"] += len(bids)

    def _replace(self, bids: List[int], data: np.ndarray) -> None:
        """Put released blocks back into whichever tiers have free slots (after a failed promotion)."""
        i = 0
        for ti, t in enumerate(self.tiers):
            take = int(min(len(bids) - i, t.free))
            if take <= 0:
                continue
            slots = t.alloc(take)
            try:
                t.write(slots, data[i:i + take])
            except Exception as e:  # this tier cannot take them either: try the next one
                t.release(slots)
                log.warning("KV blocks not put back into the %s tier: %s", t.name, e)
                continue
            for bid, slot in zip(bids[i:i + take], slots):
                b = self._blocks[bid]
                b.tier, b.slot = ti, slot
                self._lru[ti][bid] = None
            i += take
            if i == len(bids):
                return
        for bid in bids[i:]:  # their old slots were released by _promote: never release them again
            b = self._blocks[bid]
            b.slot = LOST
            self._lru[b.tier].pop(bid, None)
        self.counters["lost_blocks"] += len(bids) - i
        raise KVLost(f"{len(bids) - i} KV blocks could not be put back after a failed promotion")

    def _grow(self, seq: _Seq, n_tokens: int, exclude: set) -> None:
        extra = self.blocks_for(n_tokens) - len(seq.blocks)
        if extra <= 0:
            return
        self._make_room(0, extra, exclude)
        slots = self.tiers[0].alloc(extra)
        if seq.attached:  # the engine holds the KV: count the blocks, keep no slot
            self.device.unback(slots)
        for s in slots:
            bid = self._new_block(0, ENGINE if seq.attached else s)
            self._blocks[bid].pins = 1 if seq.active else 0
            seq.blocks.append(bid)
