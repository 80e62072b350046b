"""Storage tiers of the KV block pool (kv/blocks.py), top to bottom: device arena (numpy, or torch CUDA),
host arena (page-locked with CUDA), one memory-mapped file on local disk, Redis (one key per block, with a TTL).
A tier stores fixed-shape blocks [2, L, KVH, block, D] at integer slots and copies bytes verbatim (bit-exact)."""
from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import tempfile
import uuid
from typing import List, Optional, Sequence, Tuple

import numpy as np


class PoolFull(RuntimeError):
    """No tier can take the blocks (device pinned full and nowhere to demote to)."""


class KVLost(RuntimeError):
    """A block is gone from its tier (Redis TTL expiry / eviction, storage error)."""


class Tier:
    """Storage for fixed-shape blocks addressed by integer slots. `capacity` None = unbounded."""

    def __init__(self, name: str, capacity: Optional[int], block_shape: Tuple[int, ...], dtype):
        if capacity is not None and capacity < 0:
            raise ValueError(f"tier {name}: negative capacity")
        self.name, self.capacity = name, capacity
        self.block_shape, self.dtype = tuple(block_shape), np.dtype(dtype)
        self.used = 0

    @property
    def free(self) -> float:
        return math.inf if self.capacity is None else self.capacity - self.used

    def alloc(self, n: int) -> List[int]:
        raise NotImplementedError

    def release(self, slots: Sequence[int]) -> None:
        raise NotImplementedError

    def write(self, slots: Sequence[int], data: np.ndarray) -> None:
        """data: [len(slots), *block_shape]."""
        raise NotImplementedError

    def read(self, slots: Sequence[int]) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SlotTier(Tier):
    """A tier with a fixed number of slots and a free list."""

    def __init__(self, name, capacity, block_shape, dtype):
        super().__init__(name, int(capacity), block_shape, dtype)
        self.capacity: int = int(capacity)
        self._free = list(range(self.capacity - 1, -1, -1))

    def write_tokens(self, slots, offsets, k, v) -> None:
        raise NotImplementedError  # the arenas (numpy, torch) write token rows into their blocks

    def alloc(self, n):
        if n > self.free:  # not len(_free): engine-held blocks are counted as used without a slot
            raise PoolFull(f"{self.name} tier: {n} blocks wanted, {self.free} free")
        out = [self._free.pop() for _ in range(n)]
        self.used += n
        return out

    def release(self, slots):
        self._free.extend(slots)
        self.used -= len(slots)

    def unback(self, slots):
        """The blocks in `slots` stay counted as used but give their slots back (their KV is engine-held)."""
        self._free.extend(slots)

    def back(self, n) -> List[int]:
        """Slots for n blocks already counted as used (used - slots in use >= n always holds)."""
        return [self._free.pop() for _ in range(n)]

    def release_unbacked(self, n):
        self.used -= n


class ArenaTier(SlotTier):
    """Blocks in one preallocated numpy array [capacity, *block_shape] (process memory, a memmap, or a numpy
    view of pinned host memory). np.zeros pages are committed lazily, so a large budget costs nothing unused."""

    def __init__(self, name, capacity, block_shape, dtype, array: Optional[np.ndarray] = None):
        super().__init__(name, capacity, block_shape, dtype)
        self.a = np.zeros((self.capacity, *self.block_shape), self.dtype) if array is None else array

    def write(self, slots, data):
        self.a[np.asarray(slots, np.int64)] = data

    def read(self, slots):
        return np.array(self.a[np.asarray(slots, np.int64)])

    def write_tokens(self, slots, offsets, k: np.ndarray, v: np.ndarray) -> None:
        """One token per (slot, offset): k, v [n, L, KVH, D]."""
        s, o = np.asarray(slots, np.int64), np.asarray(offsets, np.int64)
        self.a[s, 0, :, :, o] = k
        self.a[s, 1, :, :, o] = v


class TorchArenaTier(SlotTier):
    """Blocks in one torch tensor (a CUDA device arena; any torch device works). Same API as ArenaTier."""

    def __init__(self, name, capacity, block_shape, dtype, device: str = "cuda"):
        import torch

        super().__init__(name, capacity, block_shape, dtype)
        self._torch = torch
        self.device = torch.device(device)
        tdt = torch.from_numpy(np.zeros(0, self.dtype)).dtype
        self.t = torch.zeros((self.capacity, *self.block_shape), dtype=tdt, device=self.device)

    def _idx(self, slots):
        return self._torch.as_tensor(np.asarray(slots, np.int64), device=self.device)

    def _dev(self, x: np.ndarray):
        return self._torch.from_numpy(np.ascontiguousarray(x, self.dtype)).to(self.device)

    def write(self, slots, data):
        self.t[self._idx(slots)] = self._dev(data)

    def read(self, slots):
        return self.t[self._idx(slots)].cpu().numpy()

    def write_tokens(self, slots, offsets, k, v):
        s, o = self._idx(slots), self._idx(offsets)
        self.t[s, 0, :, :, o] = self._dev(k)
        self.t[s, 1, :, :, o] = self._dev(v)


class DiskTier(ArenaTier):
    """Blocks in one memory-mapped file under `directory` (sparse until written); the file is removed on close."""

    def __init__(self, name, capacity, block_shape, dtype, directory: str):
        os.makedirs(directory, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix=f"hetserve-kv-{os.getpid()}-", suffix=".blocks", dir=directory)
        os.close(fd)
        shape = (int(capacity), *block_shape)
        super().__init__(name, capacity, block_shape, dtype,
                         array=np.memmap(self.path, dtype=np.dtype(dtype), mode="w+", shape=shape))

    def close(self):
        self.a = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class RedisTier(Tier):
    """One Redis string per block, key `<namespace>:<slot>`, written with a TTL (seconds). Unbounded when
    capacity is None. Connection failures surface as PoolFull on write and KVLost on read."""

    def __init__(self, name, capacity, block_shape, dtype, url: str, ttl_s: int = 3600,
                 namespace: Optional[str] = None):
        import redis

        super().__init__(name, capacity, block_shape, dtype)
        self._redis = redis
        self.url, self.ttl_s = url, int(ttl_s)
        self.ns = namespace or f"hetserve:kv:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.r = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise ConnectionError(f"KV redis tier: cannot reach {url}: {e}") from e
        self._next = itertools.count()
        self._live: set = set()

    def key(self, slot: int) -> str:
        return f"{self.ns}:{slot}"

    def alloc(self, n):
        if n > self.free:
            raise PoolFull(f"{self.name} tier: {n} blocks wanted, {self.free} free")
        out = [next(self._next) for _ in range(n)]
        self._live.update(out)
        self.used += n
        return out

    def release(self, slots):
        slots = [s for s in slots if s in self._live]
        self._live.difference_update(slots)
        self.used -= len(slots)
        if slots:
            try:
                self.r.delete(*[self.key(s) for s in slots])
            except self._redis.RedisError:
                pass  # the TTL reclaims them

    def write(self, slots, data):
        data = np.ascontiguousarray(data, self.dtype)
        try:
            with self.r.pipeline(transaction=False) as p:
                for s, blk in zip(slots, data):
                    p.set(self.key(s), blk.tobytes(), ex=self.ttl_s)
                p.execute()
        except self._redis.RedisError as e:
            raise PoolFull(f"{self.name} tier unavailable: {e}") from e

    def read(self, slots):
        try:
            with self.r.pipeline(transaction=False) as p:
                for s in slots:
                    p.get(self.key(s))
                vals = p.execute()
        except self._redis.RedisError as e:
            raise KVLost(f"{self.name} tier unavailable: {e}") from e
        out = np.empty((len(slots), *self.block_shape), self.dtype)
        for i, (s, b) in enumerate(zip(slots, vals)):
            if b is None or len(b) != self.nbytes:
                raise KVLost(f"{self.name} tier: block {self.key(s)} " + ("expired or evicted" if b is None
                                                                          else f"has {len(b)} bytes"))
            out[i] = np.frombuffer(b, self.dtype).reshape(self.block_shape)
        return out

    def close(self):
        self.release(list(self._live))
        try:
            self.r.close()
        except Exception as e:  # the connection is already gone
            logging.getLogger("hetserve.kv").debug("redis close: %s", e)


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception as e:  # no torch, or torch without a working CUDA: host tiers only
        logging.getLogger("hetserve.kv").debug("no CUDA for KV tiers: %s", e)
        return False


def tier_stack(num_layers: int, num_kv_heads: int, head_dim: int, *, device_bytes: int, block_tokens: int = 16,
               host_bytes: int = 0, disk_dir: Optional[str] = None, disk_bytes: int = 0,
               redis_url: Optional[str] = None, redis_bytes: Optional[int] = None, redis_ttl_s: int = 3600,
               device: str = "auto", dtype=np.float32) -> List[Tier]:
    """Tiers sized in bytes (rounded down to whole blocks); a tier with 0 bytes / no dir / no url is left out.
    device: 'auto' (CUDA arena when torch sees a GPU), 'cpu', or a torch device string such as 'cuda:0'."""
    shape = (2, num_layers, num_kv_heads, int(block_tokens), head_dim)
    bb = int(np.prod(shape)) * np.dtype(dtype).itemsize
    n_dev = int(device_bytes) // bb
    if n_dev < 1:
        raise ValueError(f"KV device budget {int(device_bytes)} B is smaller than one block ({bb} B = "
                         f"{block_tokens} tokens)")
    cuda = cuda_available() if device == "auto" else device.startswith("cuda")
    tiers: List[Tier] = []
    try:
        if not cuda:
            tiers.append(ArenaTier("device", n_dev, shape, dtype))
        else:
            tiers.append(TorchArenaTier("device", n_dev, shape, dtype, "cuda" if device == "auto" else device))
        if host_bytes and int(host_bytes) // bb:
            n = int(host_bytes) // bb
            arr = None
            if cuda:
                import torch

                tdt = torch.from_numpy(np.zeros(0, dtype)).dtype
                arr = torch.zeros((n, *shape), dtype=tdt, pin_memory=True).numpy()
            tiers.append(ArenaTier("host", n, shape, dtype, array=arr))
        if disk_dir and int(disk_bytes) // bb:
            tiers.append(DiskTier("disk", int(disk_bytes) // bb, shape, dtype, disk_dir))
        if redis_url:
            cap = None if redis_bytes is None else max(int(redis_bytes) // bb, 0)
            tiers.append(RedisTier("redis", cap, shape, dtype, redis_url, ttl_s=redis_ttl_s))
    except Exception:
        for t in tiers:
            t.close()
        raise
    return tiers
