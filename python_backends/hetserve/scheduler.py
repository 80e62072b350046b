"""Iteration-level (continuous) batching for the decode server.

Sequences join and leave at every step; each step makes one engine call per precision group for the whole
batch. KV of the running batch lives in one batch-major buffer [rows, L, KVH, cap, D] whose first n rows are
the active sequences, so the engine input is a contiguous view with no per-step copy; a retiring sequence's
row is refilled by the last row (one row copy).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

import numpy as np

from .engines.runtime import NEG_INF
from .sampling import SamplingParams, is_stop_token, sample

log = logging.getLogger("hetserve.scheduler")

CAP_CHUNK = 64


class Overloaded(RuntimeError):
    """Admission control refused the request (queue full / KV budget exhausted)."""


@dataclass
class Sequence:
    request_id: str
    prompt_len: int
    tokens: List[int]  # generated so far (first token from prefill included)
    params: SamplingParams
    precision: str
    on_tokens: Callable[[List[int], Optional[str]], None]  # (new tokens, finish_reason or None)
    is_cancelled: Callable[[], bool] = lambda: False
    k: Optional[np.ndarray] = None  # [L,KVH,P,D] until admitted
    v: Optional[np.ndarray] = None
    arrived: float = field(default_factory=time.monotonic)
    finished: Optional[str] = None

    @property
    def kv_len(self) -> int:  # tokens whose KV is cached: prompt + generated except the last one
        return self.prompt_len + len(self.tokens) - 1

    def reserve_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens


class BatchKV:
    def __init__(self, L: int, H: int, D: int):
        self.L, self.H, self.D = L, H, D
        self.rows, self.cap = 0, 0
        self.k = np.zeros((0, L, H, 0, D), np.float32)
        self.v = np.zeros_like(self.k)
        self.lens = np.zeros(0, np.int64)
        self.n = 0

    def _realloc(self, rows: int, cap: int):
        k = np.zeros((rows, self.L, self.H, cap, self.D), np.float32)
        v = np.zeros_like(k)
        m = self.n
        if m:
            c = min(cap, self.cap)
            k[:m, :, :, :c] = self.k[:m, :, :, :c]
            v[:m, :, :, :c] = self.v[:m, :, :, :c]
        lens = np.zeros(rows, np.int64)
        lens[:m] = self.lens[:m]
        self.k, self.v, self.lens, self.rows, self.cap = k, v, lens, rows, cap

    def ensure(self, rows: int, length: int):
        cap = self.cap
        if length > cap:
            cap = ((length + CAP_CHUNK - 1) // CAP_CHUNK) * CAP_CHUNK
        r = self.rows
        while r < rows:
            r = max(1, 2 * r)
        if cap != self.cap or r != self.rows:
            self._realloc(r, cap)

    def add(self, k: np.ndarray, v: np.ndarray) -> int:
        P = k.shape[2]
        self.ensure(self.n + 1, P + 1)
        row = self.n
        self.k[row, :, :, :P] = k
        self.v[row, :, :, :P] = v
        self.k[row, :, :, P:] = 0
        self.v[row, :, :, P:] = 0
        self.lens[row] = P
        self.n += 1
        return row

    def remove(self, row: int) -> Optional[int]:
        """Free `row`; returns the old index of the row moved into it (or None)."""
        last = self.n - 1
        moved = None
        if row != last:
            ln = int(self.lens[last])
            self.k[row, :, :, :ln] = self.k[last, :, :, :ln]
            self.v[row, :, :, :ln] = self.v[last, :, :, :ln]
            self.lens[row] = ln
            moved = last
        self.n -= 1
        if self.n == 0:
            self._realloc(0, 0)
        return moved


class DecodeScheduler:
    def __init__(self, engines: Dict[str, "object"], eos_ids=(), max_batch: int = 16,
                 kv_budget_bytes: int = 2 << 30, max_queue: int = 64, idle_wait_s: float = 0.05):
        self.engines = engines
        e0 = next(iter(engines.values()))
        c = e0.config
        self.cfg = c
        self.eos_ids = set(eos_ids or c.eos_token_ids)
        self.max_batch = max_batch
        self.kv_budget = kv_budget_bytes
        self.max_queue = max_queue
        self.kv_token_bytes = c.kv_bytes_per_token(4)
        self.batches = {p: BatchKV(c.num_layers, c.num_kv_heads, c.head_dim) for p in engines}
        self.running: Dict[str, List[Sequence]] = {p: [] for p in engines}
        self.waiting: Deque[Sequence] = collections.deque()
        self.cv = threading.Condition()
        self.stats = {"steps": 0, "tokens": 0, "batch_size": 0, "queue_depth": 0, "admitted": 0,
                      "finished": 0, "cancelled": 0, "step_seconds": 0.0}
        self._stop = False
        self._idle_wait = idle_wait_s
        self._thread = threading.Thread(target=self._loop, name="decode-batcher", daemon=True)
        self._thread.start()

    # ---- admission ------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if seq.precision not in self.engines:
            raise ValueError(f"decode precision {seq.precision!r} not loaded; have {sorted(self.engines)}")
        need = seq.reserve_tokens() * self.kv_token_bytes
        with self.cv:
            if len(self.waiting) >= self.max_queue:
                raise Overloaded(f"decode queue full ({self.max_queue} waiting); retry later")
            if need > self.kv_budget:
                raise Overloaded(f"request needs {need >> 20} MiB of KV, budget is {self.kv_budget >> 20} MiB")
            self.waiting.append(seq)
            self.cv.notify()

    def n_running(self) -> int:
        return sum(len(r) for r in self.running.values())

    def _admit(self):
        reserved = sum(s.reserve_tokens() for rs in self.running.values() for s in rs) * self.kv_token_bytes
        while self.waiting and self.n_running() < self.max_batch:
            s = self.waiting[0]
            need = s.reserve_tokens() * self.kv_token_bytes
            if reserved + need > self.kv_budget and self.n_running() > 0:
                break  # wait for memory to free up
            self.waiting.popleft()
            if s.is_cancelled():
                self.stats["cancelled"] += 1
                self._finish(s, "cancelled")
                continue
            self.batches[s.precision].add(s.k, s.v)
            s.k = s.v = None
            self.running[s.precision].append(s)
            reserved += need
            self.stats["admitted"] += 1

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self):
        while not self._stop:
            with self.cv:
                self._admit()
                if self.n_running() == 0:
                    self.cv.wait(self._idle_wait)
                    continue
                self.stats["queue_depth"] = len(self.waiting)
            try:
                self.step()
            except Exception as e:  # engine failure: fail the running sequences, keep serving
                log.exception("decode step failed")
                for p, seqs in self.running.items():
                    for s in list(seqs):
                        self._retire(p, s, f"error: {e}")

    def step(self):
        t0 = time.monotonic()
        total = 0
        for prec, seqs in self.running.items():
            if not seqs:
                continue
            for s in [s for s in seqs if s.is_cancelled()]:
                self.stats["cancelled"] += 1
                self._retire(prec, s, "cancelled")
            if not seqs:
                continue
            bk = self.batches[prec]
            n = bk.n
            bk.ensure(n, int(bk.lens[:n].max()) + 1)
            cap = bk.cap
            lens = bk.lens[:n]
            mask = np.zeros((n, 1, 1, cap + 1), np.float32)
            col = np.arange(cap)
            mask[:, 0, 0, :cap] = np.where(col[None, :] < lens[:, None], 0.0, NEG_INF)
            ids = np.array([[s.tokens[-1]] for s in seqs], np.int64)
            logits, nk, nv = self.engines[prec].forward(ids, lens[:, None].copy(), mask, bk.k[:n], bk.v[:n],
                                                       np.zeros(n, np.int64))
            for b in range(n):
                pos = int(lens[b])
                bk.k[b, :, :, pos] = nk[b, :, :, 0]
                bk.v[b, :, :, pos] = nv[b, :, :, 0]
            bk.lens[:n] += 1
            done = []
            for b, s in enumerate(seqs):
                tok = sample(logits[b], s.params, len(s.tokens))
                s.tokens.append(tok)
                reason = None
                if is_stop_token(tok, s.params, self.eos_ids):
                    reason = "stop"
                elif len(s.tokens) >= s.params.max_tokens:
                    reason = "length"
                elif s.kv_len + 1 >= self.cfg.max_position:
                    reason = "length"
                try:
                    s.on_tokens([tok], reason)
                except Exception:  # client went away
                    reason = reason or "cancelled"
                if reason:
                    done.append((s, reason))
            for s, reason in done:
                self._retire(prec, s, reason, emit=False)
            total += n
        dt = time.monotonic() - t0
        self.stats["steps"] += 1
        self.stats["tokens"] += total
        self.stats["batch_size"] = total
        self.stats["step_seconds"] += dt

    def _retire(self, prec: str, s: Sequence, reason: str, emit: bool = True):
        seqs = self.running[prec]
        row = seqs.index(s)
        moved = self.batches[prec].remove(row)
        if moved is not None:
            seqs[row] = seqs[moved]
        seqs.pop()
        self._finish(s, reason, emit)

    def _finish(self, s: Sequence, reason: str, emit: bool = True):
        s.finished = reason
        self.stats["finished"] += 1
        if emit:
            try:
                s.on_tokens([], reason)
            except Exception:
                pass

    def close(self):
        self._stop = True
        with self.cv:
            self.cv.notify_all()
        self._thread.join(timeout=5)
