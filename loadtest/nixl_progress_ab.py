#!/usr/bin/env python3
"""NIXL progress A/B: a READ between two processes with NIXL's own progress thread, with none, and with the target
pumping its worker from a thread of its own (what kv/transport/nixl_pull.py does while a transfer is in flight).
Not a CI test; the numbers behind nixl_pull.py's docstring.

    python loadtest/nixl_progress_ab.py                    # UCX picks its transports (sm/cma on one host)
    UCX_TLS=tcp python loadtest/nixl_progress_ab.py        # as across hosts without RDMA

Per mode: the READ time of --mib MiB, 3 times (the first includes connection set-up), and the CPU seconds the
target process used meanwhile. "none" shows that a READ of memory whose owner never progresses does not finish
(each READ gives up after --timeout-s).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

import numpy as np


def _agent(name: str, progress_thread: bool):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    cfg = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    return nixl_agent(name, cfg)


def _target(conn, mode: str, nbytes: int, pump_pause_s: float) -> None:
    agent = _agent(f"target-{mode}", mode == "nixl-thread")
    buf = np.arange(nbytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    stop = threading.Event()
    if mode == "pump":
        def pump():
            while not stop.is_set():
                agent.get_new_notifs()  # progresses the UCX worker
                time.sleep(pump_pause_s)
        threading.Thread(target=pump, daemon=True).start()
    cpu0 = time.process_time()
    conn.recv()
    stop.set()
    conn.send(time.process_time() - cpu0)


def _reads(meta: bytes, addr: int, nbytes: int, timeout_s: float, name: str) -> list:
    agent = _agent(name, False)  # it progresses its own READ by polling check_xfer_state
    peer = agent.add_remote_agent(meta)
    out = []
    for _ in range(3):
        buf = np.empty(nbytes, np.uint8)
        reg = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(buf.ctypes.data, nbytes, 0)], "DRAM"),
                                  agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM"), peer, b"")
        state = agent.transfer(h)
        while state == "PROC" and time.perf_counter() - t0 < timeout_s:
            state = agent.check_xfer_state(h)
        ms = (time.perf_counter() - t0) * 1e3
        ok = state == "DONE" and int(buf[12345]) == 12345 % 256
        out.append(f"{ms:.0f} ms" if ok else f"not done ({state}) after {ms:.0f} ms")
        if state == "DONE":
            agent.release_xfer_handle(h)
            agent.deregister_memory(reg)
        # an unfinished READ keeps its handle and buffer: releasing them while in flight is not allowed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=48)
    ap.add_argument("--modes", default="nixl-thread,none,pump")
    ap.add_argument("--pump-pause-s", type=float, default=1e-3, help="the pump's sleep between progress calls")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for mode in a.modes.split(","):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_target, args=(child, mode, a.mib << 20, a.pump_pause_s))
        proc.start()
        meta, addr = parent.recv()
        reads = _reads(meta, addr, a.mib << 20, a.timeout_s, f"initiator-{mode}")
        parent.send("done")
        cpu = parent.recv()
        proc.join()
        print(f"{mode:12s} READ {a.mib} MiB: {', '.join(reads)}; target CPU {cpu:.2f} s during the reads")


if __name__ == "__main__":
    main()
