"""`cuda_shm`: Triton CUDA shared memory (CUDA IPC handles) between a prefill and a decode server on the SAME GPU.

UNVERIFIED: written against tritonclient.utils.cuda_shared_memory and Triton's register_cuda_shared_memory API,
never run (this project's machines have no GPU). available() says so until a CUDA device is present, and the
capability negotiation only offers it when both ends report the same GPU.

Prefill: per decode URL, a bounded pool of device regions (HETSERVE_CUDA_SHM_SLOTS x HETSERVE_CUDA_SHM_BYTES on
HETSERVE_CUDA_SHM_DEVICE), each registered once with the decode server by its IPC handle. tritonclient writes a
region from offset 0 only, so one transfer holds one slot; none free -> CapacityExhausted (a counted fallback).
Decode: Triton maps the handle and delivers kv_payload (copied to CPU by the Python backend by default).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Dict, List

from ... import config
from .base import CapacityExhausted, InBandReceiver, TransferError, TransportSender, TransportUnavailable
from .control import ClientCache, ingest_inputs, post

log = logging.getLogger("hetserve.kv.transport.cuda_shm")


def _cudashm():
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except Exception as e:
        raise TransportUnavailable(f"tritonclient CUDA shared memory is not importable: {e}") from None
    return cudashm


class _Slot:
    def __init__(self, name: str, handle):
        self.name, self.handle, self.busy = name, handle, False


class CudaShmSender(TransportSender):
    name = "cuda_shm"

    def __init__(self, clients: ClientCache):
        self.clients = clients
        self.slot_bytes = config.get("HETSERVE_CUDA_SHM_BYTES")
        self.slots_per_peer = config.get("HETSERVE_CUDA_SHM_SLOTS")
        self.device = config.get("HETSERVE_CUDA_SHM_DEVICE")
        self._pools: Dict[str, List[_Slot]] = {}
        self._lock = threading.Lock()

    def _take(self, url: str, n: int) -> _Slot:
        from ...admin_key import admin_headers

        if n > self.slot_bytes:
            raise CapacityExhausted(f"KV payload {n} B > CUDA shm slot {self.slot_bytes} B "
                                    f"(HETSERVE_CUDA_SHM_BYTES)")
        cudashm = _cudashm()
        with self._lock:
            pool = self._pools.setdefault(url, [])
            for s in pool:
                if not s.busy:
                    s.busy = True
                    return s
            if len(pool) >= self.slots_per_peer:
                raise CapacityExhausted(f"all {len(pool)} CUDA shm slots for {url} are in flight")
            name = "hetserve_kv_cuda_" + secrets.token_hex(8)
            handle = cudashm.create_shared_memory_region(name, self.slot_bytes, self.device)
            try:
                self.clients.get(url).register_cuda_shared_memory(
                    name, cudashm.get_raw_handle(handle), self.device, self.slot_bytes, headers=admin_headers())
            except Exception as e:
                cudashm.destroy_shared_memory_region(handle)
                raise TransferError(f"could not register a CUDA shm region with {url}: {e}") from e
            s = _Slot(name, handle)
            s.busy = True
            pool.append(s)
            return s

    def _free(self, slot: _Slot) -> None:
        with self._lock:
            slot.busy = False

    def start(self, url, request_id, hdr, payload, timeout_s):
        slot = self._take(url, payload.nbytes)
        try:
            _cudashm().set_shared_memory_region(slot.handle, [payload])
            ins, p = ingest_inputs(request_id, hdr, payload.nbytes)
            p.set_shared_memory(slot.name, payload.nbytes)
        except Exception:
            self._free(slot)
            raise
        return post(self.clients, url, self.name, request_id, ins, payload.nbytes,
                    on_settle=lambda ok: self._free(slot))

    def forget(self, url: str) -> None:
        with self._lock:
            pool = self._pools.pop(url, [])
        for s in pool:
            try:
                _cudashm().destroy_shared_memory_region(s.handle)
            except Exception as e:
                log.debug("destroying CUDA shm region %s: %s", s.name, e)

    def close(self) -> None:
        from ...admin_key import admin_headers

        with self._lock:
            pools, self._pools = dict(self._pools), {}
        for url, pool in pools.items():
            for s in pool:
                try:
                    self.clients.get(url).unregister_cuda_shared_memory(s.name, headers=admin_headers())
                except Exception as e:
                    log.debug("unregistering %s from %s: %s", s.name, url, e)
                try:
                    _cudashm().destroy_shared_memory_region(s.handle)
                except Exception as e:
                    log.debug("destroying CUDA shm region %s: %s", s.name, e)


class CudaShmReceiver(InBandReceiver):
    name = "cuda_shm"


def gpu_uuids() -> List[str]:
    """UUIDs of the CUDA devices this process sees ([] without a GPU or without torch)."""
    if not os.path.isdir("/proc/driver/nvidia/gpus"):  # no NVIDIA driver: do not import torch to learn that
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch / no driver: no GPU for us
        return []


def available() -> str:
    if not gpu_uuids():
        return "no CUDA device visible (cuda_shm is written but unverified on this project's machines)"
    try:
        _cudashm()
    except TransportUnavailable as e:
        return str(e)
    return ""
