"""Batched, chunked prefill: which prompts run together in the next prefill forward, and how much of each.

Pure logic on dataclasses (no Triton, no engine): the prefill server (triton/prefill.py) keeps the waiting
prompts as PrefillJobs, asks plan_batch() for the next forward, runs it with Engine.forward and feeds each
row's new K/V back with PrefillJob.extend(). A job is done when all its prompt tokens have KV; only then is its
first token sampled and its KV sent to decode (once).

Why a planner at all: the engine takes a rectangle [rows, width] of new tokens (right-padded) plus a
right-padded past KV [rows, L, KVH, P, D]. Compute is rows x width (padding included), so the planner:
- bounds each forward by a token budget (rows x width <= token_budget), so the latency of one iteration, and
  therefore how long a newly arrived prompt waits for the next one, is bounded;
- cuts long prompts into chunks (at most chunk_tokens per forward, its KV accumulated across forwards), so one
  long prompt cannot hold the short ones: it takes one row of one forward at a time;
- picks the width that finishes the most prompts, then gives the most useful (non-padding) tokens, so short
  prompts are not padded to the width of a long chunk; the long prompt then advances by that width (never
  starved: rows are taken in arrival order, so the oldest job is always in the batch);
- bounds the padded past (rows x longest past <= past_budget tokens), since that buffer is copied per forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np

from .. import config


@dataclass(frozen=True)
class BatchConfig:
    token_budget: int = 256  # new tokens per forward (rows x width; a ragged engine: their sum)
    chunk_tokens: int = 128  # most new tokens of one prompt per forward
    max_rows: int = 16  # prompts per forward
    past_budget: int = 8192  # padded past tokens per forward (rows x longest past); one row always allowed
    max_queue: int = 256  # prompts waiting or in progress; more are refused (UNAVAILABLE)

    ENV = {"token_budget": "HETSERVE_PREFILL_TOKEN_BUDGET", "chunk_tokens": "HETSERVE_PREFILL_CHUNK_TOKENS",
           "max_rows": "HETSERVE_PREFILL_MAX_BATCH", "past_budget": "HETSERVE_PREFILL_PAST_BUDGET",
           "max_queue": "HETSERVE_PREFILL_MAX_QUEUE"}

    def __post_init__(self):
        for name in self.ENV:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"prefill batching: {name} ({self.ENV[name]}) must be an integer >= 1, got {v!r}")
        if self.chunk_tokens > self.token_budget:
            raise ValueError(f"prefill batching: chunk_tokens {self.chunk_tokens} > token_budget "
                             f"{self.token_budget} ({self.ENV['chunk_tokens']} <= {self.ENV['token_budget']})")

    @classmethod
    def from_env(cls, env=None) -> "BatchConfig":
        kw = {name: config.get(var, env) for name, var in cls.ENV.items() if config.is_set(var, env)}
        if "token_budget" in kw and "chunk_tokens" not in kw:  # a smaller budget implies smaller chunks
            kw["chunk_tokens"] = min(cls.chunk_tokens, kw["token_budget"])
        return cls(**kw)


@dataclass
class PrefillJob:
    """One prompt being prefilled. KV of ids[:done] is held in k/v ([L, KVH, len(ids), D], filled in place)."""
    ids: List[int]
    seq: int  # arrival order (smaller = older)
    done: int = 0  # tokens whose KV exists (prefix-cache hit, then computed chunks)
    hit: int = 0  # of which came from the prefix cache
    k: Optional[np.ndarray] = None
    v: Optional[np.ndarray] = None
    logits: Optional[np.ndarray] = None  # last token's logits, set by the final chunk
    forwards: int = 0  # forwards this job took part in
    compute_s: float = 0.0  # wall time of those forwards
    use_prefix: bool = True  # start from the prefix cache and add this prompt's KV to it
    handle: Any = None  # the caller's request state (opaque here)

    @property
    def remaining(self) -> int:
        return len(self.ids) - self.done

    @property
    def finished(self) -> bool:
        return self.remaining == 0 and self.logits is not None

    def start(self, kv_shape, past_k: Optional[np.ndarray] = None, past_v: Optional[np.ndarray] = None):
        """Allocate the KV buffer; kv_shape = (L, KVH, D). An optional cached prefix [L, KVH, n, D] becomes
        ids[:n] (at least one token must stay to compute: its logits give the first output token)."""
        L, H, D = kv_shape
        self.k = np.zeros((L, H, len(self.ids), D), np.float32)
        self.v = np.zeros_like(self.k)
        if past_k is not None:
            n = past_k.shape[2]
            if not 0 <= n < len(self.ids) or past_v is None or past_v.shape != past_k.shape:
                raise ValueError(f"cached prefix of {n} tokens does not fit a {len(self.ids)}-token prompt")
            self.k[:, :, :n], self.v[:, :, :n] = past_k, past_v
            self.done = self.hit = n

    def advance(self, n: int, logits: Optional[np.ndarray]) -> None:
        """A ragged engine wrote the next n tokens' K/V into k/v itself (Engine.prefill_into); logits as extend."""
        if n < 1 or n > self.remaining:
            raise ValueError(f"chunk of {n} tokens, {self.remaining} remaining")
        self.done += n
        if self.remaining == 0:
            self.logits = logits

    def extend(self, k_new: np.ndarray, v_new: np.ndarray, logits: Optional[np.ndarray]) -> None:
        """Append one chunk's K/V ([L, KVH, n, D]); logits are kept when this chunk ends the prompt."""
        n = k_new.shape[2]
        if n < 1 or n > self.remaining:
            raise ValueError(f"chunk of {n} tokens, {self.remaining} remaining")
        self.k[:, :, self.done:self.done + n] = k_new
        self.v[:, :, self.done:self.done + n] = v_new
        self.done += n
        if self.remaining == 0:
            self.logits = logits


@dataclass(frozen=True)
class Row:
    job: PrefillJob
    start: int  # first prompt position of this chunk (= past length)
    length: int  # new tokens in this chunk

    @property
    def tokens(self) -> List[int]:
        return self.job.ids[self.start:self.start + self.length]

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.job.ids)


@dataclass(frozen=True)
class BatchPlan:
    rows: List[Row]
    width: int  # T: longest chunk (the rest right-padded)
    past: int  # P: longest past (the rest right-padded)

    @property
    def useful_tokens(self) -> int:
        return sum(r.length for r in self.rows)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.width


def _rows_at(jobs: Sequence[PrefillJob], width: int, cfg: BatchConfig, ragged: bool = False) -> List[Row]:
    """Jobs in arrival order, each with a chunk of min(remaining, width), while the budgets hold. A job that
    would break a budget is skipped (a later, smaller one may fit); the oldest job always gets a row.
    ragged: the engine computes only real tokens (no padding, no padded past), so the token budget counts
    chunk lengths and the past budget does not apply."""
    rows: List[Row] = []
    past = used = 0
    for j in jobs:
        n = min(j.remaining, width)
        if len(rows) >= cfg.max_rows:
            break
        if ragged:
            if rows and used + n > cfg.token_budget:
                continue
        else:
            if (len(rows) + 1) * width > cfg.token_budget:
                break
            p = max(past, j.done)
            if rows and (len(rows) + 1) * p > cfg.past_budget:
                continue
            past = p
        rows.append(Row(j, j.done, n))
        used += n
    return rows


def plan_batch(jobs: Sequence[PrefillJob], cfg: BatchConfig, ragged: bool = False) -> Optional[BatchPlan]:
    """The next forward for the unfinished `jobs` (any order; arrival order is by seq), or None if none.

    Tries every width a job would ask for (its remaining tokens, capped at chunk_tokens) and keeps the one
    that finishes the most prompts (each finished prompt is a first token sent: TTFT), then the one with the
    most useful tokens, then the narrower one (less padding, less compute). Without the first rule, prompts
    of 36..39 tokens would be cut at 36 to fit one more row, and most would need a second forward.
    ragged: see _rows_at (Engine.ragged engines)."""
    todo = sorted((j for j in jobs if j.remaining > 0), key=lambda j: j.seq)
    if not todo:
        return None
    best: Optional[List[Row]] = None
    best_key = None
    for w in sorted({min(j.remaining, cfg.chunk_tokens) for j in todo}):
        rows = _rows_at(todo, w, cfg, ragged)
        key = (sum(r.last for r in rows), sum(r.length for r in rows), -len(rows) * max(r.length for r in rows))
        if best_key is None or key > best_key:
            best, best_key = rows, key
    width = max(r.length for r in best)
    return BatchPlan(best, width, max(r.start for r in best))


@dataclass
class BatchInputs:
    """Engine.forward feeds for a plan (right-padded rows; padded positions are masked out)."""
    input_ids: np.ndarray  # [B, T]
    position_ids: np.ndarray  # [B, T]
    past_key: np.ndarray  # [B, L, KVH, P, D]
    past_value: np.ndarray
    last_index: np.ndarray  # [B]
    past_lens: List[int] = field(default_factory=list)
    new_lens: List[int] = field(default_factory=list)


def batch_inputs(plan: BatchPlan, max_position: int, pad_id: int = 0) -> BatchInputs:
    """Pack a plan into engine inputs; the attention mask is runtime.causal_mask(past_lens, new_lens, P, T)."""
    B, T, P = len(plan.rows), plan.width, plan.past
    L, H, _, D = plan.rows[0].job.k.shape
    ids = np.full((B, T), pad_id, np.int64)
    pos = np.zeros((B, T), np.int64)
    pk = np.zeros((B, L, H, P, D), np.float32)
    pv = np.zeros_like(pk)
    for b, r in enumerate(plan.rows):
        ids[b, :r.length] = r.tokens
        # padded query positions only need a valid RoPE index (their outputs are discarded)
        pos[b] = np.minimum(np.arange(r.start, r.start + T), max_position - 1)
        if r.start:
            pk[b, :, :, :r.start] = r.job.k[:, :, :r.start]
            pv[b, :, :, :r.start] = r.job.v[:, :, :r.start]
    return BatchInputs(ids, pos, pk, pv, np.array([r.length - 1 for r in plan.rows], np.int64),
                       [r.start for r in plan.rows], [r.length for r in plan.rows])


class PrefillBatcher:
    """Runs batched prefill on one background thread: submit() PrefillJobs, each finished one is handed to
    on_done(job) (job.logits + job.k/v cover the whole prompt), a failed forward to on_error(job, exc) for every
    job in it. Bounded: at most cfg.max_queue jobs waiting or in progress (submit raises Overloaded beyond).

    engine: anything with .config (num_layers, num_kv_heads, head_dim, max_position) and
    .forward(input_ids, position_ids, attention_mask, past_key, past_value, last_index) -> (logits, k, v), i.e.
    engines.runtime.Engine; or, when its .ragged is true, .prefill_into(rows) (no padding, K/V in place).
    prefix: an optional kv.prefix.PrefixCache; each job starts from its longest cached prefix (lookup at
    admission) and its KV is inserted when it finishes.
    """

    def __init__(self, engine, cfg: BatchConfig, on_done, on_error, prefix=None, on_forward=None,
                 start: bool = True):
        import threading

        self.engine, self.cfg, self.prefix = engine, cfg, prefix
        self.on_done, self.on_error, self.on_forward = on_done, on_error, on_forward
        c = engine.config
        self.kv_shape = (c.num_layers, c.num_kv_heads, c.head_dim)
        self._new: List[PrefillJob] = []  # submitted, not yet admitted (prefix lookup happens on the thread)
        self._active: List[PrefillJob] = []
        self._count = 0
        self._seq = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="prefill-batcher", daemon=True)
        if start:  # start=False: the caller drives step() itself (unit tests)
            self._thread.start()

    def submit(self, ids: Sequence[int], handle=None, use_prefix: bool = True) -> PrefillJob:
        from ..scheduler import Overloaded

        with self._cv:
            if self._closed:
                raise RuntimeError("prefill batcher is shut down")
            if self._count >= self.cfg.max_queue:
                raise Overloaded(f"prefill overloaded: {self._count} prompts queued "
                                 f"(HETSERVE_PREFILL_MAX_QUEUE={self.cfg.max_queue})")
            self._seq += 1
            job = PrefillJob(list(ids), self._seq, use_prefix=use_prefix, handle=handle)
            self._new.append(job)
            self._count += 1
            self._cv.notify()
        return job

    def depth(self) -> int:
        with self._cv:
            return self._count

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self._drain()

    def _drain(self) -> None:
        """After close: every job not yet answered gets an error (no request is left hanging)."""
        with self._cv:
            pending = self._new + self._active
            self._new, self._active = [], []
            self._count = 0
        for j in pending:
            self._report(j, RuntimeError("prefill server shutting down"))

    def _admit(self, job: PrefillJob) -> None:
        pk = pv = None
        if job.use_prefix and self.prefix is not None:
            _, pk, pv = self.prefix.lookup(job.ids)
        job.start(self.kv_shape, pk, pv)

    def _release(self, jobs) -> None:
        with self._cv:
            for j in jobs:
                self._active.remove(j)
                self._count -= 1

    def step(self) -> int:
        """Admit new jobs, run one forward, hand out finished jobs. Returns rows run (0: nothing to do)."""
        import time

        from ..engines.runtime import causal_mask

        with self._cv:
            new, self._new = self._new, []
        for j in new:
            try:
                self._admit(j)
            except Exception as e:
                self._fail([j], e)
                continue
            with self._cv:
                self._active.append(j)
        with self._cv:
            active = list(self._active)
        ragged = bool(getattr(self.engine, "ragged", False))
        plan = plan_batch(active, self.cfg, ragged)
        if plan is None:
            return 0
        jobs = [r.job for r in plan.rows]
        try:
            t0 = time.perf_counter()
            if ragged:  # each row's K/V written straight into its job's buffer
                logits = self.engine.prefill_into([(r.tokens, r.start, r.job.k, r.job.v) for r in plan.rows])
                dt = time.perf_counter() - t0
                for b, r in enumerate(plan.rows):
                    r.job.advance(r.length, logits[b] if r.last else None)
            else:
                x = batch_inputs(plan, self.engine.config.max_position)
                mask = causal_mask(x.past_lens, x.new_lens, plan.past, plan.width)
                logits, k, v = self.engine.forward(x.input_ids, x.position_ids, mask, x.past_key, x.past_value,
                                                   x.last_index)
                dt = time.perf_counter() - t0
                for b, r in enumerate(plan.rows):
                    r.job.extend(k[b, :, :, :r.length], v[b, :, :, :r.length], logits[b] if r.last else None)
            for r in plan.rows:
                r.job.forwards += 1
                r.job.compute_s += dt
        except Exception as e:
            self._fail(jobs, e)
            return len(jobs)
        if self.on_forward is not None:
            self.on_forward(plan, dt)
        done = [j for j in jobs if j.finished]
        if done:
            self._release(done)
        for j in done:
            if self.prefix is not None and j.use_prefix:
                self.prefix.insert(j.ids, j.k, j.v)
            try:
                self.on_done(j)
            except Exception as e:  # the callback owns its errors; never kill the loop
                self._report(j, e)
        return len(jobs)

    def _fail(self, jobs, exc) -> None:
        with self._cv:
            for j in jobs:
                if j in self._active:
                    self._active.remove(j)
                self._count -= 1
        for j in jobs:
            self._report(j, exc)

    def _report(self, job, exc) -> None:
        try:
            self.on_error(job, exc)
        except Exception:
            import logging

            logging.getLogger("hetserve.prefill").exception("prefill error callback failed")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._new and not self._active:
                    self._cv.wait()
                if self._closed:
                    break
            try:
                self.step()
            except Exception:  # step() answers its own jobs' errors; this is a bug, keep serving
                import logging

                logging.getLogger("hetserve.prefill").exception("prefill batcher step failed")
        self._drain()
