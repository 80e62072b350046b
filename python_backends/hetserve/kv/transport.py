"""KV transports, sender side (runs on the prefill server, pushes straight to the decode server's kv_ingest).

  grpc : header + payload as Triton binary tensors over gRPC.
  shm  : same host; the payload is written into a POSIX shm region registered once with the decode server
         (Triton system shared memory); only (region, offset, size) travels in the request.
Both deliver the same (header, payload) to kv_ingest, which verifies the handshake and checksum.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from .wire import KVHeader

log = logging.getLogger("hetserve.kv.transport")

TRANSPORTS = ("grpc", "shm")
SHM_PREFIX = "hetserve_kv_"


def _admin_headers() -> Dict[str, str]:
    from ..server import admin_headers  # shm registration is a restricted Triton API (server.py)

    return admin_headers()


def create_private_region(size: int):
    """A new POSIX shm region under an unpredictable name, created exclusively (never an existing file that a
    local user planted), mode 0600 and owned by us: (name, key, handle)."""
    import tritonclient.utils.shared_memory as shm

    for _ in range(4):
        name = SHM_PREFIX + secrets.token_hex(12)
        key = "/" + name
        try:
            handle = shm.create_shared_memory_region(name, key, size, create_only=True)
        except Exception as e:  # name taken (astronomically unlikely): try another
            log.warning("shm region %s could not be created exclusively (%s); trying another name", name, e)
            continue
        st = os.stat("/dev/shm" + key)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            shm.destroy_shared_memory_region(handle)
            raise TransferError(f"shm region {key} is not private to us (uid {st.st_uid}, "
                                f"mode {oct(stat.S_IMODE(st.st_mode))}); refusing to use it")
        return name, key, handle
    raise TransferError("could not create a private shm region for KV transfers")


class TransferError(RuntimeError):
    pass


def _client(url: str):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url, verbose=False)


def _ingest_inputs(request_id: str, hdr: KVHeader, payload_len: int):
    import tritonclient.grpc as grpcclient

    rid = grpcclient.InferInput("request_id", [1], "BYTES")
    rid.set_data_from_numpy(np.array([request_id.encode()], dtype=np.object_))
    h = grpcclient.InferInput("kv_header", [1], "BYTES")
    h.set_data_from_numpy(np.array([hdr.to_json()], dtype=np.object_))
    p = grpcclient.InferInput("kv_payload", [payload_len], "UINT8")
    return rid, h, p


class RangeAllocator:
    """First-fit byte-range allocator over one region (thread-safe)."""

    ALIGN = 64

    def __init__(self, size: int):
        self.size = size
        self.free: List[Tuple[int, int]] = [(0, size)]
        self.lock = threading.Lock()

    def alloc(self, n: int) -> Optional[int]:
        n = (n + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        with self.lock:
            for i, (off, sz) in enumerate(self.free):
                if sz >= n:
                    if sz == n:
                        self.free.pop(i)
                    else:
                        self.free[i] = (off + n, sz - n)
                    return off
        return None

    def release(self, off: int, n: int) -> None:
        n = (n + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        with self.lock:
            self.free.append((off, n))
            self.free.sort()
            merged: List[Tuple[int, int]] = []
            for o, s in self.free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self.free = merged

    def free_bytes(self) -> int:
        with self.lock:
            return sum(s for _, s in self.free)


class KVSender:
    """Sends KV to a decode server's kv_ingest over the chosen transport."""

    def __init__(self, shm_bytes: int = int(os.environ.get("HETSERVE_SHM_BYTES", str(256 << 20)))):
        self.shm_bytes = shm_bytes
        self._clients: Dict[str, object] = {}
        self._shm: Dict[str, Tuple[str, object, RangeAllocator]] = {}  # url -> (region name, handle, alloc)
        self._lock = threading.Lock()
        self.stats = {"grpc": [0, 0, 0.0], "shm": [0, 0, 0.0]}  # transfers, bytes, seconds

    def client(self, url: str):
        with self._lock:
            c = self._clients.get(url)
            if c is None:
                c = self._clients[url] = _client(url)
            return c

    def _shm_region(self, url: str):
        import tritonclient.utils.shared_memory as shm

        with self._lock:
            r = self._shm.get(url)
            if r is not None:
                return r
            name, key, handle = create_private_region(self.shm_bytes)
            c = self._clients.get(url) or _client(url)
            self._clients[url] = c
            try:
                c.register_system_shared_memory(name, key, self.shm_bytes, headers=_admin_headers())
            except Exception:
                shm.destroy_shared_memory_region(handle)
                raise
            r = self._shm[url] = (name, handle, RangeAllocator(self.shm_bytes))
            return r

    def _forget_shm(self, url: str) -> None:
        """Drop a region the decode server no longer knows (it restarted): re-registered on next use."""
        import tritonclient.utils.shared_memory as shm

        with self._lock:
            r = self._shm.pop(url, None)
        if r is not None:
            try:
                shm.destroy_shared_memory_region(r[1])
            except Exception:
                pass

    def send(self, url: str, transport: str, request_id: str, hdr: KVHeader, payload: np.ndarray,
             timeout_s: float = 30.0) -> dict:
        try:
            return self._send(url, transport, request_id, hdr, payload, timeout_s)
        except TransferError as e:
            if transport != "shm" or "shared memory region" not in str(e).lower():
                raise
            log.warning("decode server %s lost our shm registration (restarted?); re-registering", url)
            self._forget_shm(url)
            return self._send(url, transport, request_id, hdr, payload, timeout_s)

    def _send(self, url: str, transport: str, request_id: str, hdr: KVHeader, payload: np.ndarray,
              timeout_s: float) -> dict:
        if transport not in TRANSPORTS:
            raise TransferError(f"unknown KV transport {transport!r}; use one of {TRANSPORTS}")
        t0 = time.perf_counter()
        used = transport
        c = self.client(url)
        rid, h, p = _ingest_inputs(request_id, hdr, payload.nbytes)
        off = None
        region = None
        try:
            if transport == "shm":
                import tritonclient.utils.shared_memory as shm

                region = self._shm_region(url)
                off = region[2].alloc(payload.nbytes)
                if off is None:  # region full: fall back to gRPC for this transfer
                    log.warning("shm region full (%d B free); sending %d B over grpc",
                                region[2].free_bytes(), payload.nbytes)
                    used = "grpc"
                else:
                    shm.set_shared_memory_region(region[1], [payload], offset=off)
                    p.set_shared_memory(region[0], payload.nbytes, offset=off)
            if used == "grpc":
                p.set_data_from_numpy(payload)
            c.infer("kv_ingest", [rid, h, p], client_timeout=timeout_s, parameters={"hetserve_transport": used})
        except Exception as e:
            raise TransferError(f"KV transfer over {used} to {url} failed: {e}") from e
        finally:
            if off is not None:
                region[2].release(off, payload.nbytes)
        dt = time.perf_counter() - t0
        st = self.stats[used]
        st[0] += 1
        st[1] += payload.nbytes
        st[2] += dt
        return {"transport": used, "bytes": int(payload.nbytes), "seconds": dt}

    def close(self):
        import tritonclient.utils.shared_memory as shm

        with self._lock:
            for url, (name, handle, _) in self._shm.items():
                try:
                    self._clients[url].unregister_system_shared_memory(name, headers=_admin_headers())
                except Exception:
                    pass
                try:
                    shm.destroy_shared_memory_region(handle)
                except Exception:
                    pass
            self._shm.clear()
            for c in self._clients.values():
                try:
                    c.close()
                except Exception:
                    pass
            self._clients.clear()
