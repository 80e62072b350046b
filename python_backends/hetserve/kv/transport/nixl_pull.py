"""`nixl`: NIXL (PyPI `nixl`, UCX backend). The decode side pulls, as NIXL's disaggregation examples do.

Prefill: one NIXL agent per process and one staging buffer registered with it once (DRAM here; VRAM on a GPU
box). A send copies the payload into a free range of the buffer and makes the usual kv_ingest call, with no
kv_payload and a `kv_remote` descriptor instead: {agent, meta (the agent's metadata, base64), addr, len}.
Decode (kv_ingest): its own agent loads the sender's metadata (cached per agent name, at most MAX_PEERS), registers
a receive buffer, posts a NIXL READ of (addr, len) from the sender's agent and polls it to DONE within the
deadline. The reply to the kv_ingest call tells the sender the range can be reused; no NIXL notification is
needed. NIXL itself refuses a READ outside memory the sender registered (NIXL_ERR_NOT_FOUND).

Metadata travels in-band (452 bytes for UCX here) rather than through NIXL's listener thread or etcd, so a decode
server that restarts needs nothing re-sent out of band. UCX picks its transports (UCX_TLS: rc/dc on RDMA NICs,
tcp/sm/self on this CPU box). Capabilities: any host the agents can reach; RDMA when the link has it.

Progress: NIXL's own progress thread polls the UCX worker with no pause (nixl 1.5.1 sets pthrDelay=0), so an
idle agent keeps a core busy: measured here, an idle prefill server at 97% CPU and each idle decode server at
45%, which made every other request on a 2-core box slower. The agents run without it. The decode side
progresses its READ itself (check_xfer_state in its poll loop); the prefill side must progress too (a READ
of its memory never completes otherwise, even on one host), so the sender pumps its worker from its own thread
only while a transfer is in flight (spinning briefly, backing off to 1 ms), and sleeps when there is none.
loadtest/nixl_progress_ab.py (two processes, 48 MiB READ, the initiator polling): as fast as NIXL's thread
(9-10 vs 10-11 ms on one host, 41-49 vs 32-51 ms with UCX_TLS=tcp) for 0.02-0.14 s of target CPU instead of
2.2 s; with NIXL's thread on both ends, as before, the READ took 50-98 ms on this 2-core box.
"""
from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Dict, Optional

import numpy as np

from ... import config
from .base import (
    PeerRefused,
    RecvState,
    TransferError,
    TransferTimeout,
    TransportReceiver,
    TransportSender,
    TransportUnavailable,
)
from .control import ClientCache, ingest_inputs, post
from .shm import RangeAllocator

log = logging.getLogger("hetserve.kv.transport.nixl")

MAX_PEERS = 64  # sender agents a receiver keeps loaded (one per prefill process); least recently used go first
BACKEND = "UCX"


def _make_agent(role: str):
    """A NIXL agent with the UCX backend; TransportUnavailable (with NIXL's own error) when it cannot start."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except Exception as e:
        raise TransportUnavailable(f"nixl is not importable here ({type(e).__name__}: {e}); pip install nixl") \
            from None
    name = f"hetserve-{role}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        # STRICT: the agent is used from several threads (batcher, doctor ops, the sender's progress pump)
        # no NIXL progress thread: it spins (see the module docstring); callers progress while they transfer
        cfg = nixl_agent_config(enable_prog_thread=False, backends=[BACKEND],
                                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        agent = nixl_agent(name, cfg)
    except Exception as e:
        raise TransportUnavailable(f"NIXL agent could not start: {type(e).__name__}: {e}") from None
    if BACKEND not in agent.backends:
        raise TransportUnavailable(f"NIXL agent has no {BACKEND} backend (plugins: {agent.get_plugin_list()})")
    return agent


class NixlSender(TransportSender):
    name = "nixl"
    concurrent_sends = True  # one staging buffer under a range allocator; no per-peer state to drop

    def __init__(self, clients: ClientCache, region_bytes: Optional[int] = None):
        self.clients = clients
        self.region_bytes = int(region_bytes or config.get("HETSERVE_NIXL_BYTES"))
        self._lock = threading.Lock()
        self._agent = None
        self._buf: Optional[np.ndarray] = None
        self._reg = None
        self._alloc: Optional[RangeAllocator] = None
        self._meta_b64 = ""
        self._inflight = 0  # transfers between start() and settle: the pump runs while there are any
        self._pump_cv = threading.Condition()
        self._closed = False
        self._pump: Optional[threading.Thread] = None

    def _ready(self):
        with self._lock:
            if self._agent is None:
                agent = _make_agent("prefill")
                buf = np.zeros(self.region_bytes, np.uint8)  # pages are touched on first write only
                self._reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
                self._meta_b64 = base64.b64encode(agent.get_agent_metadata()).decode()
                self._agent, self._buf, self._alloc = agent, buf, RangeAllocator(self.region_bytes)
                self._pump = threading.Thread(target=self._progress_loop, args=(agent,), daemon=True,
                                              name="nixl-progress")
                self._pump.start()
                log.info("NIXL sender agent %s: %d MiB registered staging buffer", agent.name,
                         self.region_bytes >> 20)
            return self._agent

    def prepare(self) -> None:
        self._ready()

    def _progress_loop(self, agent) -> None:
        """Progress the UCX worker while any transfer is in flight (the decode side is READing our memory)."""
        pause = 0.0
        while True:
            with self._pump_cv:
                while self._inflight == 0 and not self._closed:
                    pause = 0.0
                    self._pump_cv.wait()
                if self._closed:
                    return
            try:
                agent.get_new_notifs()  # progresses the backend's worker (we send no notifications)
            except Exception as e:  # the agent is being torn down
                log.debug("NIXL progress: %s", e)
            if pause:
                time.sleep(pause)
            pause = min(1e-3, pause * 2 or 2e-5)  # spin briefly, then back off to 1 ms

    def _begin(self) -> None:
        with self._pump_cv:
            self._inflight += 1
            self._pump_cv.notify()

    def _end(self) -> None:
        with self._pump_cv:
            self._inflight -= 1

    @contextlib.contextmanager
    def in_flight(self):
        """Progress our worker for the duration: for a READ of the staging buffer posted outside start()."""
        self._ready()
        self._begin()
        try:
            yield
        finally:
            self._end()

    def _settled(self, off: int, n: int) -> None:
        assert self._alloc is not None
        self._alloc.release(off, n)
        self._end()

    def start(self, url, request_id, hdr, payload, timeout_s):
        agent = self._ready()
        assert self._alloc is not None and self._buf is not None  # set by _ready()
        n = payload.nbytes
        off = self._alloc.reserve(n, "nixl staging buffer", "HETSERVE_NIXL_BYTES")
        try:
            self._buf[off:off + n] = payload.reshape(-1).view(np.uint8)
            remote = json.dumps({"agent": agent.name, "meta": self._meta_b64,
                                 "addr": int(self._buf.ctypes.data + off), "len": int(n)}).encode()
            ins, _ = ingest_inputs(request_id, hdr, None, remote)
        except Exception:
            self._alloc.release(off, n)
            raise
        self._begin()
        try:
            return post(self.clients, url, self.name, request_id, ins, n,
                        on_settle=lambda ok: self._settled(off, n))
        except Exception:
            self._settled(off, n)
            raise

    def close(self):
        with self._pump_cv:
            self._closed = True
            self._pump_cv.notify_all()
        if self._pump is not None:
            self._pump.join(timeout=2.0)
        with self._lock:
            agent, reg = self._agent, self._reg
            self._agent = self._reg = None
        if agent is not None and reg is not None:
            try:
                agent.deregister_memory(reg)
            except Exception as e:  # the agent is going away with the process anyway
                log.debug("NIXL deregister: %s", e)


def parse_remote(remote: Optional[bytes], expect_len: int) -> dict:
    """Validate a kv_remote descriptor against the header's payload size (it sizes our receive buffer)."""
    if not remote:
        raise PeerRefused("transport 'nixl' needs a 'kv_remote' descriptor (agent, meta, addr, len)")
    try:
        d = json.loads(bytes(remote))
        out: Dict[str, Any] = {"agent": str(d["agent"]), "meta": base64.b64decode(d["meta"], validate=True),
               "addr": int(d["addr"]), "len": int(d["len"])}
    except (ValueError, KeyError, TypeError) as e:
        raise PeerRefused(f"malformed kv_remote descriptor: {type(e).__name__}: {e}") from None
    if out["len"] != expect_len:
        raise PeerRefused(f"kv_remote describes {out['len']} B but the KV header needs {expect_len} B")
    if out["addr"] <= 0 or not out["agent"] or len(out["meta"]) > (1 << 20):
        raise PeerRefused("kv_remote descriptor out of range (addr, agent name or metadata size)")
    return out


class NixlReceiver(TransportReceiver):
    name = "nixl"
    pulls = True

    def __init__(self):
        self.agent = _make_agent("decode")
        self._peers: "collections.OrderedDict[str, str]" = collections.OrderedDict()  # agent -> metadata digest
        self._lock = threading.Lock()
        self.last_state = RecvState.DONE
        self._stranded: list = []  # (buffer, registration) of READs that timed out and could not be released

    def offer(self) -> dict:
        return {"agent": self.agent.name, "backend": BACKEND}

    def _peer(self, name: str, meta: bytes) -> str:
        digest = hashlib.sha256(meta).hexdigest()
        if self._peers.get(name) == digest:
            self._peers.move_to_end(name)
            return name
        try:
            loaded = self.agent.add_remote_agent(meta)
        except Exception as e:
            raise PeerRefused(f"NIXL could not load the sender agent's metadata: {type(e).__name__}: {e}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self.agent.remove_remote_agent(loaded)
            raise PeerRefused(f"kv_remote names agent {name!r} but its metadata is agent {loaded!r}")
        self._peers[name] = digest
        self._peers.move_to_end(name)
        while len(self._peers) > MAX_PEERS:
            old, _ = self._peers.popitem(last=False)
            try:
                self.agent.remove_remote_agent(old)
            except Exception as e:
                log.debug("NIXL remove_remote_agent(%s): %s", old, e)
        return name

    def receive(self, hdr, payload, remote, timeout_s):
        d = parse_remote(remote, int(hdr.nbytes))
        with self._lock:  # one pull at a time per kv_ingest instance (its requests run one by one anyway)
            peer = self._peer(d["agent"], d["meta"])
            return self._pull(peer, d["addr"], d["len"], timeout_s)

    def _pull(self, peer: str, addr: int, n: int, timeout_s: float) -> np.ndarray:
        buf = np.empty(n, np.uint8)
        agent = self.agent
        reg = agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
        handle = None
        try:
            try:
                handle = agent.initialize_xfer("READ", agent.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM"),
                                               agent.get_xfer_descs([(addr, n, 0)], "DRAM"), peer, b"")
                state = agent.transfer(handle)
            except Exception as e:  # e.g. NIXL_ERR_NOT_FOUND: not memory the sender registered
                self.last_state = RecvState.FAILED
                raise PeerRefused(f"NIXL READ from {peer} refused: {type(e).__name__}: {e}") from None
            self.last_state = RecvState.TRANSFERRING
            deadline = time.monotonic() + timeout_s
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    self.last_state = RecvState.FAILED
                    raise TransferTimeout(f"NIXL READ of {n} B from {peer} not done in {timeout_s:.1f}s")
                if pause:
                    time.sleep(pause)
                pause = min(1e-3, pause * 2 or 2e-5)  # spin briefly, then back off to 1 ms
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                self.last_state = RecvState.FAILED
                raise TransferError(f"NIXL READ of {n} B from {peer} failed (state {state})")
            self.last_state = RecvState.DONE
            return buf
        finally:
            released = True
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception as e:  # still in flight after a timeout: the READ may still write into buf
                    released = False
                    log.warning("NIXL READ from %s still in flight, its %d B buffer is kept: %s", peer, n, e)
            if released:
                agent.deregister_memory(reg)
            elif len(self._stranded) < MAX_PEERS:  # keep buf alive while NIXL may write into it (bounded)
                self._stranded.append((buf, reg))

    def close(self):
        with self._lock:
            for name in list(self._peers):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:
                    log.debug("NIXL remove_remote_agent(%s): %s", name, e)
            self._peers.clear()


def available() -> str:
    """Installed? (not imported: nixl imports torch, ~250 MB per process; an agent that then cannot start says
    why as TransportUnavailable on first use)"""
    import importlib.util

    return "" if importlib.util.find_spec("nixl") is not None else "nixl is not installed (pip install nixl)"
