"""Iteration-level (continuous) batching for the decode server.

Sequences join and leave at every step; each step makes one engine call per precision group for the whole
batch. The running sequences' KV lives in one place: the engine's decode batch (engines/decode_batch.py, one
preallocated buffer per precision whose first n rows are the active sequences; the fused GQA engine appends
each step's K/V there in place). A retiring sequence's row is refilled by the last row (one row copy).

The KV memory budget is a paged block pool (kv/blocks.py): waiting sequences' KV lives in pool blocks anywhere
in the tier stack; a running sequence is *attached* (its blocks stay counted and pinned on the device tier,
but hold no data: the batch row is the KV). It is copied back into blocks only when it is preempted; snapshots
read the batch rows. A sequence is admitted when the device tier can hold its KV plus one block of headroom.
When a running sequence needs a new block and the
device tier is full, the lowest-priority, newest running sequence is preempted: its blocks are swapped down a
tier and it resumes (bit-exact, so greedy output is unchanged) when blocks free up. Without a lower tier to
swap to, or if a tier lost the blocks, the KV is recomputed from `prompt_ids` on resume.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from . import faults
from .errors import EngineFailed, HetserveError, Overloaded, RequestError
from .kv.blocks import BlockPool, KVLost, PoolFull
from .sampling import MatcherFactory, SamplingParams, TokenSampler, is_stop_token

log = logging.getLogger("hetserve.scheduler")
__all__ = ["DecodeScheduler", "Overloaded", "Sequence"]  # Overloaded: hetserve.errors, re-exported


@dataclass
class Sequence:
    request_id: str
    prompt_len: int
    tokens: List[int]  # generated so far (first token from prefill included)
    params: SamplingParams
    precision: str
    # (new tokens, finish_reason or None[, TokenLogprobs]): the logprobs come only when params ask for them
    on_tokens: Callable[..., None]
    is_cancelled: Callable[[], bool] = lambda: False
    # the sequence failed (engine step, KV lost, budget): called once instead of a final on_tokens; unset, the
    # failure ends the stream with finish_reason "error"
    on_error: Optional[Callable[[HetserveError], None]] = None
    k: Optional[np.ndarray] = None  # [L,KVH,P,D] until admitted
    v: Optional[np.ndarray] = None
    arrived: float = field(default_factory=time.monotonic)
    finished: Optional[str] = None
    error: Optional[HetserveError] = None  # why it failed (finished == "error")
    priority: int = 0  # preemption takes the lowest priority first, then the newest arrival
    prompt_ids: Optional[List[int]] = None  # lets the scheduler recompute KV that could not be kept
    kv_id: int = -1  # key of this sequence in the KV block pool (set by submit)
    preempted: int = 0  # times preempted
    # a choice of an n > 1 request: (key, shares) of the KV all n fork, copy on write (KV blocks added once)
    kv_group: Optional[Tuple[str, int]] = None
    sampler: Optional[TokenSampler] = None  # built by submit: penalties, grammar, logprobs

    @property
    def kv_len(self) -> int:  # tokens whose KV is cached: prompt + generated except the last one
        return self.prompt_len + len(self.tokens) - 1

    def reserve_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens


class DecodeScheduler:
    def __init__(self, engines: Dict[str, "object"], eos_ids=(), max_batch: int = 16,
                 kv_budget_bytes: int = 2 << 30, max_queue: int = 64, idle_wait_s: float = 0.05,
                 pool: Optional[BlockPool] = None, block_tokens: int = 16, idle_demote_s: float = 0.0,
                 matcher_factory: Optional[MatcherFactory] = None):
        """pool: the KV block pool (the scheduler owns and closes it); default: a device tier of
        kv_budget_bytes plus a host tier of the same size. idle_demote_s > 0 demotes waiting sequences'
        KV one tier after that many idle seconds. matcher_factory: grammar matchers for structured output
        (hetserve.structured); without it a guided request is refused."""
        self.engines = engines
        e0 = next(iter(engines.values()))
        c = e0.config
        self.cfg = c
        self.eos_ids = set(eos_ids or c.eos_token_ids)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.kv_pool = pool if pool is not None else BlockPool.create(
            c.num_layers, c.num_kv_heads, c.head_dim, device_bytes=kv_budget_bytes, host_bytes=kv_budget_bytes,
            block_tokens=block_tokens)
        self.kv_budget = self.kv_pool.capacity("device") * self.kv_pool.block_bytes
        self._kv_ids = itertools.count()
        self.matcher_factory = matcher_factory
        self._shared: Dict[str, list] = {}  # kv_group key -> [base kv_id, forks still to come, created]
        self._shared_lock = threading.Lock()
        self._idle_demote_s = idle_demote_s
        self._last_idle_check = self._last_sweep = time.monotonic()
        self.batches = {p: e.new_batch(max_batch) for p, e in engines.items()}  # the running KV
        self.running: Dict[str, List[Sequence]] = {p: [] for p in engines}
        self.waiting: Deque[Sequence] = collections.deque()
        self.cv = threading.Condition()
        self.stats = {"steps": 0, "tokens": 0, "batch_size": 0, "queue_depth": 0, "admitted": 0,
                      "finished": 0, "cancelled": 0, "step_seconds": 0.0, "engine_seconds": 0.0, "preempted": 0,
                      "resumed": 0, "kv_recomputed": 0, "kv_dropped": 0}
        self._stop = False
        self._idle_wait = idle_wait_s
        self.snapshotter = None  # kv.snapshot.Snapshotter: after_step(sched) / on_finish(request_id)
        # kv.prefix.PrefixCache: a sequence that ends (stop/length) leaves the KV of its prompt + answer there
        # for the conversation's next turn (stages/router.py steers it back here)
        self.prefix_cache = None
        self._thread = threading.Thread(target=self._loop, name="decode-batcher", daemon=True)
        self._thread.start()

    # ---- admission ------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if seq.precision not in self.engines:
            raise ValueError(f"decode precision {seq.precision!r} not loaded; have {sorted(self.engines)}")
        if seq.k is None or seq.v is None:
            raise ValueError("sequence has no KV (k, v)")
        pool = self.kv_pool
        need, cap = pool.blocks_for(seq.reserve_tokens()), pool.capacity("device")
        if need > cap:
            raise Overloaded(f"request needs {need} KV blocks ({need * pool.block_bytes / 2**20:.1f} MiB) on the "
                             f"device tier, budget is {cap} blocks ({self.kv_budget / 2**20:.1f} MiB)")
        with self.cv:
            if len(self.waiting) >= self.max_queue:
                raise Overloaded(f"decode queue full ({self.max_queue} waiting)", where="decode queue")
        if seq.sampler is None:
            seq.sampler = self.new_sampler(seq.params, seq.prompt_ids or (), seq.tokens)
        seq.kv_id = next(self._kv_ids)
        try:
            if seq.kv_group is not None:
                self._add_forked(seq)
            else:
                pool.add(seq.kv_id, seq.k, seq.v)
        except PoolFull as e:
            raise Overloaded(str(e), where="decode KV pool") from e
        seq.k = seq.v = None
        with self.cv:
            self.waiting.append(seq)
            self.cv.notify()

    def new_sampler(self, params: SamplingParams, prompt, tokens) -> TokenSampler:
        """The sequence's sampler, caught up with the tokens it has (a grammar matcher advanced through them)."""
        matcher = None
        if params.guide_type:
            if self.matcher_factory is None:
                raise RequestError("structured output (guided decoding) is not available on this decode server")
            matcher = self.matcher_factory(params, tokens)
        return TokenSampler(params, prompt, tokens, matcher)

    def _add_forked(self, seq: Sequence) -> None:
        """A choice of n: the first to arrive adds the shared KV to the pool once, each forks it (full blocks
        shared by refcount, copied on write); the base goes when the last fork is made, or after
        FORK_TTL_S when choices never came (cancelled before their decode request)."""
        assert seq.kv_group is not None
        key, shares = seq.kv_group
        pool = self.kv_pool
        with self._shared_lock:
            now = time.monotonic()
            for old in [x for x, e in self._shared.items() if now - e[2] > self.FORK_TTL_S]:
                pool.free(self._shared.pop(old)[0])
            ent = self._shared.get(key)
            if ent is None:
                base = next(self._kv_ids)
                pool.add(base, seq.k, seq.v)
                ent = self._shared[key] = [base, shares, now]
            pool.fork(ent[0], seq.kv_id)
            ent[1] -= 1
            if ent[1] <= 0:
                pool.free(self._shared.pop(key)[0])

    FORK_TTL_S = 120.0

    def n_running(self) -> int:
        return sum(len(r) for r in self.running.values())

    def _admit(self):
        pool = self.kv_pool
        while self.waiting and self.n_running() < self.max_batch:
            s = self.waiting[0]
            if s.is_cancelled():
                self.waiting.popleft()
                self.stats["cancelled"] += 1
                self._finish(s, "cancelled")
                continue
            want = min(s.kv_len + pool.bt, s.reserve_tokens())  # its KV plus one block of headroom
            fits = (pool.can_activate(s.kv_id, want) if s.kv_id in pool
                    else pool.can_allocate(pool.blocks_for(want)))
            if not fits and self.n_running() > 0:
                self._sweep_cancelled()
                break  # wait for running sequences to free blocks
            self.waiting.popleft()
            try:
                k, v = self._activate(s)
            except Exception as e:  # KV pool exhausted on every tier, lost KV without prompt ids, an engine bug
                log.warning("cannot resume %s: %s", s.request_id, e, exc_info=not isinstance(e, (PoolFull, KVLost)))
                err = (Overloaded(f"cannot resume: {e}", where="decode admission") if isinstance(e, PoolFull)
                       else EngineFailed(f"cannot resume: {type(e).__name__}: {e}", where="decode admission"))
                self._fail(s, err)
                continue
            self.batches[s.precision].add(k, v)
            self.running[s.precision].append(s)
            self.stats["resumed" if s.preempted else "admitted"] += 1

    def _sweep_cancelled(self):
        """Free the KV of cancelled sequences stuck behind the queue head (at most every 0.5 s)."""
        now = time.monotonic()
        if now - self._last_sweep < 0.5:
            return
        self._last_sweep = now
        for s in [s for s in self.waiting if s.is_cancelled()]:
            self.waiting.remove(s)
            self.stats["cancelled"] += 1
            self._finish(s, "cancelled")

    def _activate(self, s: Sequence):
        """Pin s's KV on the device tier (room for the next token) and return it; recompute it when gone."""
        pool = self.kv_pool
        if s.kv_id in pool:
            try:
                pool.activate(s.kv_id, s.kv_len + 1)
                return pool.attach(s.kv_id)
            except KVLost as e:
                log.warning("KV of %s lost (%s); recomputing", s.request_id, e)
                pool.free(s.kv_id)
        if s.prompt_ids is None:
            raise KVLost("the sequence's KV is gone and it has no prompt ids to recompute it from")
        _, k, v = self.engines[s.precision].prefill(list(s.prompt_ids) + s.tokens[:-1])
        self.stats["kv_recomputed"] += 1
        s.kv_id = next(self._kv_ids)
        pool.add(s.kv_id, k, v)
        pool.activate(s.kv_id, s.kv_len + 1)
        return pool.attach(s.kv_id)

    def _reserve_blocks(self):
        """Give every running sequence a block slot for the token this step writes. When the device tier is
        full (and waiting sequences' blocks there cannot be demoted), drop recomputable waiting KV from the
        device tier, then preempt the lowest-priority, newest running sequences until it fits."""
        pool = self.kv_pool
        key = lambda s: (s.priority, -s.arrived)  # noqa: E731 - min() = the preemption victim
        for s in sorted((s for rs in self.running.values() for s in rs), key=key, reverse=True):
            while s in self.running[s.precision] and not pool.reserve(s.kv_id, s.kv_len + 1):
                if not self._drop_waiting_kv():
                    self._preempt(min((x for rs in self.running.values() for x in rs), key=key))

    def _drop_waiting_kv(self) -> bool:
        """Free the device-resident KV of the newest waiting sequence that can recompute it (no lower tier had
        room for it); False if there is none."""
        pool = self.kv_pool
        with self.cv:
            for w in reversed(self.waiting):
                if w.prompt_ids is not None and w.kv_id in pool and pool.placement(w.kv_id).get("device"):
                    pool.free(w.kv_id)
                    self.stats["kv_dropped"] += 1
                    return True
        return False

    def _preempt(self, s: Sequence):
        """Copy s's KV out of the batch into its blocks, take it out of the batch and swap the blocks down a
        tier (or drop them to recompute on resume)."""
        pool = self.kv_pool
        k, v = self.batches[s.precision].row_kv(self.running[s.precision].index(s))
        pool.detach(s.kv_id, k, v)
        self._remove_row(s.precision, s)
        pool.deactivate(s.kv_id)
        try:
            where = f"{pool.demote(s.kv_id)} blocks swapped down"
            if pool.placement(s.kv_id).get("device"):
                raise PoolFull("no tier below the device tier")
        except (PoolFull, KVLost) as e:
            if s.prompt_ids is None:
                self._fail(s, Overloaded(f"KV budget exhausted and nowhere to swap to ({e})",
                                         where="decode preemption"))
                return
            pool.free(s.kv_id)
            where = "KV dropped, will recompute"
        s.preempted += 1
        self.stats["preempted"] += 1
        log.warning("KV device tier full: preempted %s at %d tokens (%s)", s.request_id, s.kv_len, where)
        with self.cv:
            self.waiting.appendleft(s)

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self):
        while not self._stop:
            if self._idle_demote_s > 0 and time.monotonic() - self._last_idle_check > 1.0:
                self._last_idle_check = time.monotonic()
                self.kv_pool.demote_idle(self._idle_demote_s)
            with self.cv:
                self._admit()
                if self.n_running() == 0:
                    self.cv.wait(self._idle_wait)
                    continue
                self.stats["queue_depth"] = len(self.waiting)
            try:
                self.step()
                if self.snapshotter is not None:
                    self.snapshotter.after_step(self)
            except Exception as e:  # engine failure: fail the running sequences (typed), keep serving
                ids = [s.request_id for seqs in self.running.values() for s in seqs]
                log.error("decode step failed for requests %s: %s", ", ".join(ids), e, exc_info=e)
                err = EngineFailed(f"decode step failed: {type(e).__name__}: {e}", where="decode step")
                for p, seqs in self.running.items():
                    for s in list(seqs):
                        self._remove_row(p, s)
                        self._fail(s, err)

    def step(self):
        t0 = time.monotonic()
        total = 0
        self._reserve_blocks()
        for prec, seqs in self.running.items():
            if not seqs:
                continue
            n = len(seqs)
            # the engine writes each row's new K/V into the batch (in place for GQA); blocks were reserved above
            te = time.monotonic()
            faults.check("decode_step")
            logits = self.batches[prec].step(np.fromiter((s.tokens[-1] for s in seqs), np.int64, n))
            self.stats["engine_seconds"] += time.monotonic() - te
            done = []
            failed: list = []
            for b, s in enumerate(seqs):
                # asked right before sending, not before the step: Triton 2.51 can crash on a response sent after
                # its stream was cancelled (docs/reliability.md), so the window is this line, not a whole step
                if s.is_cancelled():
                    self.stats["cancelled"] += 1
                    done.append((s, "cancelled", True))
                    continue
                assert s.sampler is not None  # submit built it
                try:
                    tok, lp = s.sampler.next(logits[b], len(s.tokens))
                except Exception as exc:  # this sequence's sampler or grammar: it fails alone, the batch goes on
                    log.error("sampling failed for request %s: %s", s.request_id, exc, exc_info=exc)
                    failed.append((s, exc))
                    continue
                s.tokens.append(tok)
                reason = None
                if is_stop_token(tok, s.params, self.eos_ids):
                    reason = "stop"
                elif len(s.tokens) >= s.params.max_tokens:
                    reason = "length"
                elif s.kv_len + 1 >= self.cfg.max_position:
                    reason = "length"
                if reason and self.prefix_cache is not None and s.prompt_ids is not None:
                    self._keep_prefix(prec, b, s)  # before the final answer: the next turn may follow at once
                try:
                    if lp is None:
                        s.on_tokens([tok], reason)
                    else:
                        s.on_tokens([tok], reason, lp)
                except Exception:  # client went away
                    reason = reason or "cancelled"
                if reason:
                    done.append((s, reason, False))
            for s, reason, emit in done:
                self._retire(prec, s, reason, emit=emit)
            for s, why in failed:
                self._remove_row(prec, s)
                self._fail(s, why if isinstance(why, HetserveError) else
                           EngineFailed(f"sampling failed: {type(why).__name__}: {why}", where="decode sampling"))
            total += n
        dt = time.monotonic() - t0
        self.stats["steps"] += 1
        self.stats["tokens"] += total
        self.stats["batch_size"] = total
        self.stats["step_seconds"] += dt

    def _remove_row(self, prec: str, s: Sequence):
        seqs = self.running[prec]
        row = seqs.index(s)
        moved = self.batches[prec].remove(row)
        if moved is not None:
            seqs[row] = seqs[moved]
        seqs.pop()

    def _retire(self, prec: str, s: Sequence, reason: str, emit: bool = True):
        self._remove_row(prec, s)
        self._finish(s, reason, emit)

    def _keep_prefix(self, prec: str, row: int, s: Sequence) -> None:
        """Copy the blocks of s's KV (prompt + tokens[:-1], what its batch row holds) that the prefix cache lacks.
        A failure here costs the cache entry, never the answer."""
        batch = self.batches[prec]
        try:
            self.prefix_cache.insert_from(list(s.prompt_ids) + s.tokens[:-1],
                                          lambda start: batch.row_kv(row, start))
        except Exception as e:
            log.warning("KV of %s not kept for reuse: %s: %s", s.request_id, type(e).__name__, e)

    def _fail(self, s: Sequence, err: HetserveError):
        """End s with a typed failure: on_error when it has one, else a final "error" finish reason."""
        s.error = err
        if s.on_error is None:
            self._finish(s, "error")
            return
        self._finish(s, "error", emit=False)
        try:
            s.on_error(err)
        except Exception as e:  # the answer channel is gone: nothing left to tell
            log.info("failure of %s not delivered (%s): %s", s.request_id, e, err)

    def _finish(self, s: Sequence, reason: str, emit: bool = True):
        self.kv_pool.free(s.kv_id)  # every block of a finished / cancelled / failed sequence
        s.finished = reason
        self.stats["finished"] += 1
        if self.snapshotter is not None:
            self.snapshotter.on_finish(s.request_id)
        if emit:
            try:
                s.on_tokens([], reason)
            except Exception as e:  # the client is gone: nothing left to tell it
                log.debug("final response of %s not delivered: %s", s.request_id, e)

    def close(self):
        self._stop = True
        with self.cv:
            self.cv.notify_all()
        self._thread.join(timeout=5)
        self.kv_pool.close()
