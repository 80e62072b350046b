"""The llama.cpp side of bench_vs_llamacpp.py: the equal-precision GGUF and llama.cpp's own batching engine.

- make_q8_0(): a Q8_0 GGUF made from the shipped GGUF by llama.cpp's own quantizer (llama_model_quantize,
  ftype 7 = LLAMA_FTYPE_MOSTLY_Q8_0, allow_requantize: the shipped file is already quantized), cached next to
  the benchmark output. Q8_0 (8-bit weights, block 32) is the precision of hetserve's INT8 decode engine.
- LlamaBatched: llama.cpp's multi-sequence batching through the llama-cpp-python C API (what
  `llama-server -np N` does, minus HTTP):
  * run(): closed loop, N prompts prefilled in one llama_decode, then one llama_decode per step;
  * run_open(): open loop, continuous batching like llama-server: requests arrive on a schedule, each
    iteration is one llama_decode holding the running sequences' next tokens plus the prompts of newly
    admitted ones (at most n_seq_max sequences; later arrivals wait, and that wait counts in their TTFT).
- BatchedProc: LlamaBatched in its own process (like a server), so the client threads of the benchmark do
  not steal cycles from llama.cpp's spinning worker threads.
Not a CI test (llama-cpp-python is built from source: `pip install llama-cpp-python`).
"""
from __future__ import annotations

import collections
import ctypes
import time
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from hetserve.engines.llamacpp_compat import model_params

Q8_0_FTYPE = 7  # LLAMA_FTYPE_MOSTLY_Q8_0


def make_q8_0(src: str, out_dir: str) -> str:
    """Q8_0 GGUF from `src` with llama.cpp's quantizer; reused while newer than its source."""
    import llama_cpp as L

    dst = Path(out_dir) / (Path(src).stem + ".Q8_0.gguf")
    if dst.exists() and dst.stat().st_mtime >= Path(src).stat().st_mtime and dst.stat().st_size > 0:
        return str(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    p = L.llama_model_quantize_default_params()
    p.ftype = Q8_0_FTYPE
    p.allow_requantize = True
    p.nthread = 2
    rc = L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p))
    if rc != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> Q8_0) failed with {rc}")
    tmp.replace(dst)
    return str(dst)


def _result(**kw) -> dict:
    return dict(kw)


class LlamaBatched:
    """llama.cpp's own multi-sequence batching, in process; greedy."""

    def __init__(self, gguf: str, threads: int, max_seqs: int, n_ctx_per_seq: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), model_params())  # no AMX repack: llamacpp_compat
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx = max_seqs * n_ctx_per_seq
        cp.n_batch, cp.n_ubatch = min(cp.n_ctx, 2048), min(cp.n_ctx, 512)  # llama-server's defaults
        cp.n_seq_max = max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.max_seqs = max_seqs
        self.n_batch = cp.n_batch
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_batch, 0, max_seqs)
        self.mem = L.llama_get_memory(self.ctx)

    def _decode(self, items):
        """items: (token, pos, seq, want_logits) -> greedy next token of each row with logits, in order."""
        b, out = self.batch, []
        for i, (t, p, s, lo) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, int(lo)
            b.seq_id[i][0] = s
            if lo:
                out.append(i)
        b.n_tokens = len(items)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), (self.vocab,))))
                for i in out]

    def run(self, prompts: List[List[int]], max_tokens: int) -> List[dict]:
        """Closed loop: all prompts start together and run to max_tokens."""
        self.L.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} prompt tokens > n_batch {self.n_batch}")
        toks = [[t] for t in self._decode(items)]
        ttft = time.perf_counter() - t0
        pos = [len(p) for p in prompts]
        for _ in range(max_tokens - 1):
            nxt = self._decode([(toks[s][-1], pos[s], s, True) for s in range(len(prompts))])
            for s, t in enumerate(nxt):
                toks[s].append(t)
                pos[s] += 1
        total = time.perf_counter() - t0
        return [_result(ttft_s=ttft, total_s=total, tokens=max_tokens,
                        tpot_s=(total - ttft) / max(1, max_tokens - 1)) for _ in prompts]

    def run_open(self, schedule: Sequence[Tuple[float, List[int]]], max_tokens: int) -> List[dict]:
        """Open loop: schedule = (arrival offset s, prompt ids), sorted. Continuous batching; returns one
        result per request, in schedule order: ttft_s / tpot_s measured from its arrival."""
        self.L.llama_memory_clear(self.mem, True)
        free = collections.deque(range(self.max_seqs))
        waiting: "collections.deque[int]" = collections.deque()
        running = {}  # seq id -> [request index, last token, next pos, tokens so far, t_first]
        out: List[dict] = [None] * len(schedule)
        nxt_arrival = 0
        t0 = time.perf_counter()
        while nxt_arrival < len(schedule) or waiting or running:
            now = time.perf_counter() - t0
            while nxt_arrival < len(schedule) and schedule[nxt_arrival][0] <= now:
                waiting.append(nxt_arrival)
                nxt_arrival += 1
            if not waiting and not running:
                time.sleep(max(0.0, schedule[nxt_arrival][0] - now))
                continue
            items, owners = [], []  # owners: (seq, admitted now) per row with logits, in order
            for s, st in running.items():
                items.append((st[1], st[2], s, True))
                owners.append((s, False))
            while waiting and free and len(items) + len(schedule[waiting[0]][1]) <= self.n_batch:
                i = waiting.popleft()
                s = free.popleft()
                ids = schedule[i][1]
                items += [(t, j, s, j == len(ids) - 1) for j, t in enumerate(ids)]
                owners.append((s, True))
                running[s] = [i, None, len(ids), 0, None]
            toks = self._decode(items)
            t = time.perf_counter() - t0
            for (s, _), tok in zip(owners, toks):
                st = running[s]
                if st[3] == 0:
                    st[4] = t
                else:
                    st[2] += 1
                st[1] = tok
                st[3] += 1
                if st[3] >= max_tokens:
                    i = st[0]
                    arr = schedule[i][0]
                    out[i] = _result(ttft_s=st[4] - arr, total_s=t - arr, tokens=st[3], arrival_s=arr,
                                     tpot_s=(t - st[4]) / (st[3] - 1) if st[3] > 1 else None)
                    self.L.llama_memory_seq_rm(self.mem, s, -1, -1)
                    del running[s]
                    free.append(s)
        return out


def _worker(conn, *args):
    try:
        lb = LlamaBatched(*args)
        conn.send(("ready", None))
    except Exception as e:  # report, don't hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, margs = msg
        try:
            conn.send(("ok", getattr(lb, method)(*margs)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class BatchedProc:
    """LlamaBatched(gguf, threads, max_seqs, n_ctx_per_seq) in its own process."""

    def __init__(self, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, *args), daemon=True)
        self.proc.start()
        self._call(None, wait_only=True)

    def _call(self, msg, wait_only=False):
        if not wait_only:
            self.conn.send(msg)
        if not self.conn.poll(900):
            raise TimeoutError("llama.cpp batched worker did not answer in 900 s")
        status, val = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"llama.cpp batched worker: {val}")
        return val

    def run(self, prompts: List[List[int]], max_tokens: int) -> List[dict]:
        return self._call(("run", (prompts, max_tokens)))

    def run_open(self, schedule, max_tokens: int) -> List[dict]:
        return self._call(("run_open", (list(schedule), max_tokens)))

    def close(self):
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
