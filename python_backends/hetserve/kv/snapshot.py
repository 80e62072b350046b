"""KV snapshots of in-flight sequences, for resuming a request on another decode server after a failure.

Every `interval_s` (HETSERVE_SNAPSHOT_INTERVAL_S, default 60 s, must be <= 300) the decode loop copies the KV of
each running sequence and a writer thread stores it, wire-encoded (same header, model hash and HMAC tag as a
transfer), with the token ids it covers, in the snapshot directory (HETSERVE_SNAPSHOT_DIR: a volume every decode
server mounts; local disk here). Writes are atomic (tmp + rename). A finished sequence's snapshot is deleted at
once; orphans (their server died and the request was never resumed) are removed after the retention
(HETSERVE_SNAPSHOT_RETENTION_S, default 7 days) by a cleanup pass at start-up and every hour.

On resume, decode loads the snapshot of the request id, checks that its tokens are a prefix of prompt + tokens
so far, and recomputes only the tail; without a usable snapshot it recomputes everything.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import config
from . import wire

log = logging.getLogger("hetserve.kv.snapshot")

MAGIC = b"HSNP1\n"
SUFFIX = ".kvsnap"
MAX_INTERVAL_S = 300.0
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _ids_digest(ids: List[int]) -> str:
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:32]


class SnapshotStore:
    def __init__(self, root: str, compat_hash: str, kv_dtype: str = "fp32",
                 retention_s: float = 7 * 86400.0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.compat = compat_hash
        self.kv_dtype = kv_dtype
        self.retention_s = retention_s

    def path(self, rid: str) -> Path:
        safe = _SAFE.sub("_", rid)[:120] or "empty"
        return self.root / f"{safe}-{hashlib.sha1(rid.encode()).hexdigest()[:8]}{SUFFIX}"

    def save(self, rid: str, ids: List[int], k: np.ndarray, v: np.ndarray) -> int:
        """Store the KV ([L,KVH,T,D]) of token ids `ids` (T of them) for request `rid`; returns bytes written."""
        if k.shape[2] != len(ids):
            raise ValueError(f"snapshot of {len(ids)} tokens with KV of {k.shape[2]}")
        hdr, payload = wire.encode(k, v, self.compat, self.kv_dtype)
        meta = json.dumps({"request_id": rid, "ids": [int(x) for x in ids], "ids_sha": _ids_digest(ids),
                           "created": time.time(), "kv_header": hdr.to_json().decode()}).encode()
        p = self.path(rid)
        tmp = p.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(meta)) + meta)
            f.write(memoryview(payload))
        os.replace(tmp, p)
        return len(meta) + payload.nbytes

    def load(self, rid: str, shape: Tuple[int, int, int]) -> Optional[Tuple[List[int], np.ndarray, np.ndarray]]:
        """(ids, k, v) of a verified snapshot, or None when absent/unusable (the caller recomputes)."""
        p = self.path(rid)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if not raw.startswith(MAGIC):
                raise ValueError("bad magic")
            n = struct.unpack_from("<Q", raw, len(MAGIC))[0]
            off = len(MAGIC) + 8
            meta = json.loads(raw[off:off + n])
            if meta["request_id"] != rid or _ids_digest(meta["ids"]) != meta["ids_sha"]:
                raise ValueError("request id or token digest mismatch")
            hdr = wire.KVHeader.from_json(meta["kv_header"].encode())
            payload = np.frombuffer(raw, np.uint8, offset=off + n)
            wire.verify(hdr, payload, self.compat, shape)
            k, v = wire.decode(hdr, payload)
            return list(meta["ids"]), k, v
        except Exception as e:
            log.warning("snapshot %s unusable (%s); recomputing instead", p.name, e)
            return None

    def delete(self, rid: str) -> None:
        try:
            self.path(rid).unlink()
        except FileNotFoundError:
            pass

    def cleanup(self, now: Optional[float] = None) -> int:
        """Remove snapshots (and stale temp files) older than the retention; returns how many."""
        now = time.time() if now is None else now
        n = 0
        for p in self.root.iterdir():
            if not (p.name.endswith(SUFFIX) or ".tmp" in p.suffix):
                continue
            try:
                if now - p.stat().st_mtime > self.retention_s:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n

    def count(self) -> int:
        return sum(1 for p in self.root.iterdir() if p.name.endswith(SUFFIX))


class Snapshotter:
    """Periodic snapshots of the decode scheduler's running sequences (hooked into its loop)."""

    def __init__(self, store: SnapshotStore, interval_s: float = 60.0, cleanup_every_s: float = 3600.0):
        if not 0 < interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"snapshot interval must be in (0, {MAX_INTERVAL_S:.0f}] s, got {interval_s}")
        self.store = store
        self.interval_s = interval_s
        self.cleanup_every_s = cleanup_every_s
        self.prompts: Dict[str, List[int]] = {}
        self.last: Dict[str, float] = {}  # rid -> monotonic time of its last snapshot (or admission)
        self.stats = {"saved": 0, "bytes": 0, "restored": 0, "deleted": 0, "cleaned": 0, "errors": 0}
        self._lock = threading.Lock()
        self._pending: Dict[str, Tuple[List[int], np.ndarray, np.ndarray]] = {}
        self._cv = threading.Condition(self._lock)
        self._stop = False
        self._next_round = time.monotonic() + interval_s
        self._next_cleanup = 0.0
        self._writer = threading.Thread(target=self._write_loop, name="kv-snapshot", daemon=True)
        self._writer.start()

    @classmethod
    def from_env(cls, compat_hash: str) -> Optional["Snapshotter"]:
        root = config.get("HETSERVE_SNAPSHOT_DIR")
        if not root or not config.get("HETSERVE_SNAPSHOTS"):
            return None
        store = SnapshotStore(root, compat_hash, config.get("HETSERVE_SNAPSHOT_KV_DTYPE"),
                              config.get("HETSERVE_SNAPSHOT_RETENTION_S"))
        return cls(store, config.get("HETSERVE_SNAPSHOT_INTERVAL_S"))

    # ---- called by the decode model -------------------------------------------------------------
    def track(self, rid: str, prompt: List[int]) -> None:
        with self._lock:
            self.prompts[rid] = list(prompt)
            self.last[rid] = time.monotonic()

    def restore(self, rid: str, ctx: List[int], shape) -> Optional[Tuple[int, np.ndarray, np.ndarray]]:
        """(tokens covered, k, v) when a snapshot of `rid` covers a prefix of `ctx`."""
        got = self.store.load(rid, shape)
        if got is None:
            return None
        ids, k, v = got
        if len(ids) > len(ctx) or list(ctx[:len(ids)]) != ids:
            log.warning("snapshot of %s does not match the resumed context; recomputing", rid)
            return None
        self.stats["restored"] += 1
        return len(ids), k, v

    # ---- called from the scheduler loop (between steps) ------------------------------------------
    def after_step(self, sched) -> None:
        now = time.monotonic()
        if now >= self._next_cleanup:
            self._next_cleanup = now + self.cleanup_every_s
            threading.Thread(target=self._cleanup, daemon=True).start()
        if now < self._next_round:
            return
        self._next_round = now + self.interval_s
        batch = {}
        for prec, seqs in sched.running.items():
            bk = sched.batches[prec]
            for row, s in enumerate(seqs):
                prompt = self.prompts.get(s.request_id)
                if prompt is None:
                    continue
                n = int(bk.lens[row])
                ids = (prompt + s.tokens)[:n]
                batch[s.request_id] = (ids, bk.k[row, :, :, :n].copy(), bk.v[row, :, :, :n].copy())
        if batch:
            with self._cv:
                self._pending.update(batch)
                self._cv.notify()

    def on_finish(self, rid: str) -> None:
        with self._lock:
            self.prompts.pop(rid, None)
            self.last.pop(rid, None)
            self._pending.pop(rid, None)
        self.store.delete(rid)
        self.stats["deleted"] += 1

    def oldest_age_s(self) -> float:
        """Age of the oldest snapshot among in-flight sequences (time since admission if none yet)."""
        now = time.monotonic()
        with self._lock:
            return max((now - t for t in self.last.values()), default=0.0)

    # ---- writer ----------------------------------------------------------------------------------
    def _write_loop(self):
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                work, self._pending = self._pending, {}
            for rid, (ids, k, v) in work.items():
                with self._lock:
                    live = rid in self.prompts
                if not live:
                    continue
                try:
                    nbytes = self.store.save(rid, ids, k, v)
                    with self._lock:
                        if rid in self.prompts:
                            self.last[rid] = time.monotonic()
                        else:  # finished while we were writing
                            self.store.delete(rid)
                    self.stats["saved"] += 1
                    self.stats["bytes"] += nbytes
                except Exception:
                    self.stats["errors"] += 1
                    log.exception("snapshot of %s failed", rid)

    def _cleanup(self):
        try:
            self.stats["cleaned"] += self.store.cleanup()
        except Exception:
            log.exception("snapshot cleanup failed")

    def close(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()
