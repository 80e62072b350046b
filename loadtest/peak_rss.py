"""Peak memory of a command and every process it starts, sampled (not estimated).

  python3 loadtest/peak_rss.py [--interval 0.2] [--json out.json] -- <command ...>

Every `interval` seconds the process tree of the command (the command and all its descendants, e.g. each
tritonserver and Python backend stub of `hetserve up`) is read from /proc: RSS summed (what `ps` shows; pages
shared between processes, such as one weights file mapped by two servers, count once per process) and PSS summed
(shared pages split between the processes that map them: what the tree costs the machine). The command's
stderr/stdout lines are echoed with the tree's RSS at that moment and the highest since the line before, so a
build's steps show where memory goes.
Prints the peaks at the end (and writes them to --json).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List

PAGE = os.sysconf("SC_PAGE_SIZE")
GiB = 1 << 30


def tree(root: int) -> List[int]:
    """root and its descendants (from /proc/<pid>/stat parent links)."""
    parent: Dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(c for c, pp in parent.items() if pp == p)
    return out


def usage(pids: List[int]) -> Dict[str, int]:
    rss = pss = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * PAGE
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                        break
        except OSError:  # exited between listing and reading
            pass
    return {"rss": rss, "pss": pss, "processes": len(pids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--json")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("no command")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    peak = {"rss": 0, "pss": 0, "processes": 0}
    now = dict(peak)
    since = {"rss": 0}  # the highest RSS since the previous output line (where a step's peak was)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            u = usage(tree(proc.pid))
            now.update(u)
            since["rss"] = max(since["rss"], u["rss"])
            for k in peak:
                peak[k] = max(peak[k], u[k])
            time.sleep(a.interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(f"[{time.time() - t0:6.1f}s rss {now['rss'] / GiB:5.2f} GiB, max before "
                             f"{since['rss'] / GiB:5.2f}] {line}")
            since["rss"] = now["rss"]
            sys.stdout.flush()
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    done.set()
    th.join()
    res = {"command": cmd, "rc": rc, "seconds": round(time.time() - t0, 1),
           "peak_rss_gib": round(peak["rss"] / GiB, 2), "peak_pss_gib": round(peak["pss"] / GiB, 2),
           "max_processes": peak["processes"]}
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
