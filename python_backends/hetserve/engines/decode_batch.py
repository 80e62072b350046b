"""The running decode batch of one engine: the only copy of the running sequences' KV on the decode server.

Rows 0..n-1 of a preallocated buffer are the active sequences (right-padded to `cap` tokens); a retiring
row is refilled by the last row (one row copy), so the engine input is always a contiguous prefix. The
scheduler's block pool only *accounts* for these sequences (kv/blocks.py attach/detach); their KV is copied
out of here on preemption, and snapshots read it from `row_kv`.

  StandardBatch  standard graph (onnx_graph.py, also TensorRT): buffer [rows, L, KVH, cap, D] fed as
                 past KV with an additive mask; the step's new K/V come back and are written into the rows.
  NativeBatch    native engine (native.py): GqaBatch's layout, each row passed to the C step by pointer.
  GqaBatch       fused graph (onnx_fused.py): one buffer [L, rows, KVH, cap, D] per K and V; layer l's
                 [n, KVH, cap, D] slice is bound (IOBinding, by pointer) as both past_key_<l> and
                 present_key_<l>, so GroupQueryAttention appends the new token at each row's own offset in
                 place. Feeds (token ids, seqlens_k, total length, logits) are preallocated arrays bound once
                 per batch shape: a step writes n token ids and n lengths and runs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .cpu_clock import ENGINE_CPU
from .feeds import NEG_INF

CAP_CHUNK = 64  # standard graph: past length fed every step, so grow in small steps
GQA_CAP_CHUNK = 256  # GQA attends over each row's own length only; a bigger buffer costs untouched pages


class _Batch:
    row_axis = 0
    cap_chunk = CAP_CHUNK

    def __init__(self, engine, rows: int):
        c = engine.config
        self.engine = engine
        self.L, self.H, self.D = c.num_layers, c.num_kv_heads, c.head_dim
        self.n = 0
        self.rows, self.cap = 0, 0
        self._min_rows = max(1, int(rows))
        self.lens = np.zeros(0, np.int64)
        self._kb = self._vb = self._alloc(0, 0)

    # layout ------------------------------------------------------------------------------------
    def _alloc(self, rows: int, cap: int) -> np.ndarray:
        raise NotImplementedError

    def _row(self, buf: np.ndarray, row) -> np.ndarray:  # [L, KVH, cap, D] view of one row
        return buf[row] if self.row_axis == 0 else buf[:, row]

    def _rows(self, buf: np.ndarray, m: int) -> np.ndarray:
        return buf[:m] if self.row_axis == 0 else buf[:, :m]

    @property
    def k(self) -> np.ndarray:
        """[rows, L, KVH, cap, D] view (row b's first lens[b] tokens are its KV)."""
        return self._kb if self.row_axis == 0 else self._kb.transpose(1, 0, 2, 3, 4)

    @property
    def v(self) -> np.ndarray:
        return self._vb if self.row_axis == 0 else self._vb.transpose(1, 0, 2, 3, 4)

    # membership --------------------------------------------------------------------------------
    def ensure(self, rows: int, length: int) -> None:
        cap = self.cap
        if length > cap:
            cap = -(-length // self.cap_chunk) * self.cap_chunk
        r = max(self.rows, self._min_rows)
        while r < rows:
            r *= 2
        if cap != self.cap or r != self.rows:
            kb, vb = self._alloc(r, cap), self._alloc(r, cap)
            m, c = self.n, min(cap, self.cap)
            if m:
                self._rows(kb, m)[..., :c, :] = self._rows(self._kb, m)[..., :c, :]
                self._rows(vb, m)[..., :c, :] = self._rows(self._vb, m)[..., :c, :]
            lens = np.zeros(r, np.int64)
            lens[:m] = self.lens[:m]
            self._kb, self._vb, self.lens, self.rows, self.cap = kb, vb, lens, r, cap
            self._changed()

    def add(self, k: np.ndarray, v: np.ndarray) -> int:
        """Append a sequence with KV k, v [L, KVH, P, D]; returns its row."""
        P = k.shape[2]
        self.ensure(self.n + 1, P + 1)
        row = self.n
        self._row(self._kb, row)[:, :, :P] = k
        self._row(self._vb, row)[:, :, :P] = v
        self.lens[row] = P
        self.n += 1
        self._changed()
        return row

    def remove(self, row: int) -> Optional[int]:
        """Free `row`; returns the old index of the row moved into it (or None)."""
        last = self.n - 1
        moved = None
        if row != last:
            ln = int(self.lens[last])
            self._row(self._kb, row)[:, :, :ln] = self._row(self._kb, last)[:, :, :ln]
            self._row(self._vb, row)[:, :, :ln] = self._row(self._vb, last)[:, :, :ln]
            self.lens[row] = ln
            moved = last
        self.n -= 1
        if self.n == 0:  # give the pages back while idle
            self._kb = self._vb = self._alloc(0, 0)
            self.rows = self.cap = 0
            self.lens = np.zeros(0, np.int64)
        self._changed()
        return moved

    def row_kv(self, row: int, start: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """Copies of row's KV [L, KVH, lens[row] - start, D] from token `start` (preemption, snapshots, the
        decode prefix cache)."""
        ln = int(self.lens[row])
        return (np.ascontiguousarray(self._row(self._kb, row)[:, :, start:ln]),
                np.ascontiguousarray(self._row(self._vb, row)[:, :, start:ln]))

    def _changed(self) -> None:
        pass

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One decode step of rows 0..n-1 (tokens[b] is row b's last token): writes each row's new K/V at
        lens[b], advances lens, returns logits [n, V] (valid until the next step)."""
        raise NotImplementedError


class StandardBatch(_Batch):
    row_axis = 0

    def _alloc(self, rows, cap):
        return np.zeros((rows, self.L, self.H, cap, self.D), np.float32)

    def step(self, tokens):
        n = self.n
        self.ensure(n, int(self.lens[:n].max()) + 1)
        cap, lens = self.cap, self.lens[:n]
        mask = np.zeros((n, 1, 1, cap + 1), np.float32)
        mask[:, 0, 0, :cap] = np.where(np.arange(cap)[None, :] < lens[:, None], 0.0, NEG_INF)
        logits, nk, nv = self.engine.forward(np.asarray(tokens, np.int64).reshape(n, 1), lens[:, None].copy(),
                                             mask, self._kb[:n], self._vb[:n], np.zeros(n, np.int64))
        rows = np.arange(n)
        self._kb[rows, :, :, lens] = nk[:, :, :, 0]
        self._vb[rows, :, :, lens] = nv[:, :, :, 0]
        self.lens[:n] += 1
        return logits


class GqaBatch(_Batch):
    row_axis = 1
    cap_chunk = GQA_CAP_CHUNK

    def __init__(self, engine, rows):
        from .onnx_fused import past_names, present_names

        super().__init__(engine, rows)
        self._sess = engine._sess
        self._io = self._sess.io_binding()
        self._pk, self._pv = past_names(self.L)
        self._ok, self._ov = present_names(self.L)
        self._bound = None
        self._feeds_rows = 0

    def _alloc(self, rows, cap):
        return np.zeros((self.L, rows, self.H, cap, self.D), np.float32)

    def _feeds(self, rows):
        if rows > self._feeds_rows:
            self._ids = np.zeros((rows, 1), np.int64)
            self._seqlens = np.zeros(rows, np.int32)
            self._total = np.zeros((), np.int32)
            self._last = np.zeros(rows, np.int64)
            self._logits = np.zeros((rows, self.engine.config.vocab_size), np.float32)
            self._feeds_rows = rows
            self._bound = None

    def _bind(self):
        """Bind every input/output by pointer for the current (n, cap, buffers); reused until they change."""
        n, cap = self.n, self.cap
        io, f32 = self._io, np.float32
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        io.bind_input("input_ids", "cpu", 0, np.int64, [n, 1], self._ids.ctypes.data)
        io.bind_input("seqlens_k", "cpu", 0, np.int32, [n], self._seqlens.ctypes.data)
        io.bind_input("total_sequence_length", "cpu", 0, np.int32, [], self._total.ctypes.data)
        io.bind_input("last_index", "cpu", 0, np.int64, [n], self._last.ctypes.data)
        io.bind_output("logits", "cpu", 0, f32, [n, self._logits.shape[1]], self._logits.ctypes.data)
        shape = [n, self.H, cap, self.D]
        for li in range(self.L):  # same pointer in and out: the kernel appends in place
            kp, vp = self._kb[li].ctypes.data, self._vb[li].ctypes.data
            io.bind_input(self._pk[li], "cpu", 0, f32, shape, kp)
            io.bind_output(self._ok[li], "cpu", 0, f32, shape, kp)
            io.bind_input(self._pv[li], "cpu", 0, f32, shape, vp)
            io.bind_output(self._ov[li], "cpu", 0, f32, shape, vp)
        self._bound = (n, cap, self._kb.ctypes.data, self._vb.ctypes.data, self._ids.ctypes.data)

    def step(self, tokens):
        n = self.n
        need = int(self.lens[:n].max()) + 1
        self.ensure(n, need)
        self._feeds(self.rows)
        if self._bound != (n, self.cap, self._kb.ctypes.data, self._vb.ctypes.data, self._ids.ctypes.data):
            self._bind()
        self._ids[:n, 0] = tokens
        self._seqlens[:n] = self.lens[:n]  # past length + 1 - 1
        self._total[()] = need
        with ENGINE_CPU.timed():
            self._sess.run_with_iobinding(self._io)
        self.lens[:n] += 1
        return self._logits[:n]


class NativeBatch(_Batch):
    """Native engine (engines/native.py): GqaBatch's layout ([L, rows, KVH, cap, D] per K and V) in fp16, the KV
    cache type of llama.cpp and of the fp16 wire: at batch 16 the fp32 cache was as many bytes per step as the
    weights. KV enters (add) and leaves (row_kv: preemption, snapshots) as fp32; fp16 values survive that round
    trip exactly, so a swapped-out sequence resumes bit-exact. Each step passes every row's base pointer: the
    engine writes the new token's K/V at lens[b] in place and attends over each row's own length. Pointer and
    feed arrays are rebuilt only when the buffer changes."""
    row_axis = 1
    cap_chunk = GQA_CAP_CHUNK
    dtype = np.float16

    def __init__(self, engine, rows):
        super().__init__(engine, rows)
        self._model = engine.native
        self._bound = None

    def _alloc(self, rows, cap):
        return np.zeros((self.L, rows, self.H, cap, self.D), self.dtype)

    def row_kv(self, row, start=0):
        k, v = super().row_kv(row, start)
        return k.astype(np.float32), v.astype(np.float32)

    def _bind(self):
        rows, cap = self.rows, self.cap
        per_row = self.H * cap * self.D  # elements between rows inside a layer
        step = np.uint64(per_row * self._kb.itemsize)
        self._kp = self._kb.ctypes.data + np.arange(rows, dtype=np.uint64) * step
        self._vp = self._vb.ctypes.data + np.arange(rows, dtype=np.uint64) * step
        self._lstride = np.full(rows, rows * per_row, np.int64)
        self._caps = np.full(rows, cap, np.int32)
        self._kvlen = self._kb.size - np.arange(rows, dtype=np.int64) * per_row  # elements from each row's pointer
        self._rowi = np.arange(rows, dtype=np.int32)
        self._ids = np.zeros(rows, np.int64)
        self._pos = np.zeros(rows, np.int32)
        self._logits = np.zeros((rows, self.engine.config.vocab_size), np.float32)
        self._bound = (rows, cap, self._kb.ctypes.data, self._vb.ctypes.data)

    def step(self, tokens):
        n = self.n
        self.ensure(n, int(self.lens[:n].max()) + 1)
        if self._bound != (self.rows, self.cap, self._kb.ctypes.data, self._vb.ctypes.data):
            self._bind()
        self._ids[:n] = tokens
        self._pos[:n] = self.lens[:n]
        out = self._model.run(self._ids[:n], self._pos[:n], self._rowi[:n], self._kp[:n], self._vp[:n],
                              self._lstride[:n], self._caps[:n], self._kvlen[:n], self._rowi[:n], self._logits,
                              kv16=True)
        self.lens[:n] += 1
        return out
