"""`shm`: same host. The payload is written into a POSIX shm region this process created (private, 0600) and
registered once per decode server (Triton system shared memory); only (region, offset, size) travels in the
kv_ingest call and Triton resolves it into the kv_payload tensor before kv_ingest runs."""
from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
from typing import Dict, List, Optional, Tuple

from ... import config
from .base import CapacityExhausted, InBandReceiver, PeerLostRegistration, TransferError, TransportSender
from .control import ClientCache, ingest_inputs, post

log = logging.getLogger("hetserve.kv.transport.shm")

SHM_PREFIX = "hetserve_kv_"  # server.SHM_PATTERNS sweeps stale regions by this prefix


def _admin_headers() -> Dict[str, str]:
    from ...admin_key import admin_headers  # shm registration is a restricted Triton API (server.py)

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


class RangeAllocator:
    """First-fit byte-range allocator over one staging region (thread-safe). Shared by shm, nixl, cuda_shm."""

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

    def reserve(self, n: int, what: str, sized_by: str) -> int:
        """alloc(n), or CapacityExhausted naming the region (`what`) and the setting that sizes it."""
        off = self.alloc(n)
        if off is None:
            raise CapacityExhausted(f"{what} full ({self.free_bytes()} B free of {self.size}, need {n}; "
                                    f"{sized_by} sizes it)")
        return off

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


class _Region:
    """Our region registered with one decode server. users: sends between start() and settle; a region the peer
    lost (lost) is retired by forget() and unmapped by whoever leaves it last, never under a concurrent send."""

    def __init__(self, name: str, handle, size: int):
        self.name, self.handle, self.alloc = name, handle, RangeAllocator(size)
        self.users = 0
        self.lost = False
        self.retired = False


class ShmSender(TransportSender):
    name = "shm"
    concurrent_sends = True  # regions counted per send: one the peer lost is unmapped after its last send

    def __init__(self, clients: ClientCache, region_bytes: Optional[int] = None):
        self.clients = clients
        self.region_bytes = int(region_bytes or config.get("HETSERVE_SHM_BYTES"))
        self._regions: Dict[str, _Region] = {}  # decode url -> our region registered there
        self._lock = threading.Lock()

    def _acquire(self, url: str) -> _Region:
        """The region registered with `url` (registered now if none), counted as used until _release."""
        import tritonclient.utils.shared_memory as shm

        with self._lock:
            r = self._regions.get(url)
            if r is None:
                name, key, handle = create_private_region(self.region_bytes)
                try:
                    self.clients.get(url).register_system_shared_memory(name, key, self.region_bytes,
                                                                        headers=_admin_headers())
                except Exception as e:
                    shm.destroy_shared_memory_region(handle)
                    raise TransferError(f"could not register a shm region with {url}: {e}") from e
                r = self._regions[url] = _Region(name, handle, self.region_bytes)
            r.users += 1
            return r

    def _release(self, r: _Region) -> None:
        with self._lock:
            r.users -= 1
            last = r.retired and r.users == 0
        if last:
            _destroy(r)

    def _still_registered(self, url: str, region: _Region) -> bool:
        """Asked of the peer after a failed call (no error-message matching): does it still know our region?"""
        try:
            st = self.clients.get(url).get_system_shared_memory_status(region.name, headers=_admin_headers(),
                                                                        as_json=True)
        except Exception:  # unknown region -> NOT_FOUND / INVALID_ARG from Triton; unreachable peer alike
            return False
        return bool(st.get("regions"))

    def start(self, url, request_id, hdr, payload, timeout_s):
        import tritonclient.utils.shared_memory as shm

        region = self._acquire(url)
        n = payload.nbytes
        try:
            off = region.alloc.reserve(n, "shm region", "HETSERVE_SHM_BYTES")
        except Exception:
            self._release(region)
            raise
        try:
            shm.set_shared_memory_region(region.handle, [payload], offset=off)
            ins, p = ingest_inputs(request_id, hdr, n)
            p.set_shared_memory(region.name, n, offset=off)
        except Exception:
            region.alloc.release(off, n)
            self._release(region)
            raise

        def classify(err: TransferError) -> TransferError:
            # Triton answers an unknown region like a bad input: ask it whether it still has ours
            if not self._still_registered(url, region):
                region.lost = True
                return PeerLostRegistration(f"{url} no longer has our shm region {region.name} registered "
                                            f"(restarted?): {err}")
            return err

        def settle(ok: bool) -> None:
            region.alloc.release(off, n)
            self._release(region)

        try:
            return post(self.clients, url, self.name, request_id, ins, n, on_settle=settle,
                        classify=classify)
        except Exception:
            settle(False)
            raise

    def forget(self, url: str) -> None:
        """Drop our region at `url` if the peer lost it (a send that found so calls this; with several sends in
        flight, a region registered again meanwhile is kept). It is unmapped once no send uses it."""
        with self._lock:
            r = self._regions.get(url)
            if r is None or not r.lost:
                return
            del self._regions[url]
            r.retired = True
            last = r.users == 0
        if last:
            _destroy(r)

    def close(self) -> None:
        import tritonclient.utils.shared_memory as shm

        with self._lock:
            regions, self._regions = dict(self._regions), {}
        for url, r in regions.items():
            try:
                self.clients.get(url).unregister_system_shared_memory(r.name, headers=_admin_headers())
            except Exception as e:  # peer gone: its registration went with it
                log.debug("unregistering %s from %s: %s", r.name, url, e)
            try:
                shm.destroy_shared_memory_region(r.handle)
            except Exception as e:
                log.debug("destroying shm region %s: %s", r.name, e)


def _destroy(r: _Region) -> None:
    import tritonclient.utils.shared_memory as shm

    try:
        shm.destroy_shared_memory_region(r.handle)
    except Exception as e:  # already gone: nothing to free
        log.debug("destroying shm region %s: %s", r.name, e)


class ShmReceiver(InBandReceiver):
    name = "shm"


def available() -> str:
    return "" if os.path.isdir("/dev/shm") else "no /dev/shm on this host"
