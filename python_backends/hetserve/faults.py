"""Fault injection for tests of the failure paths on real servers (HETSERVE_INJECT_FAULT, off by default).

`HETSERVE_INJECT_FAULT=decode_step:3` makes the 3rd and every later call of `check("decode_step")` in this
process raise InjectedFault, a RuntimeError standing for an engine bug (not a HetserveError: it must travel the
path a real bug takes: logged as ours, typed internal by the adapters). Points: decode_step (DecodeScheduler.step,
right before the engine call).
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

from . import config


class InjectedFault(RuntimeError):
    """Raised at an injection point (HETSERVE_INJECT_FAULT)."""


_lock = threading.Lock()
_counts: Dict[str, int] = {}
_spec: Optional[Tuple[str, int]] = None
_read = False


def _parse() -> Optional[Tuple[str, int]]:
    raw = config.get("HETSERVE_INJECT_FAULT")
    if not raw:
        return None
    point, _, n = raw.partition(":")
    try:
        return point, max(1, int(n or 1))
    except ValueError:
        raise ValueError(f"HETSERVE_INJECT_FAULT={raw!r}: expected POINT:N") from None


def check(point: str) -> None:
    """Raise InjectedFault at the configured point from its Nth call on; nothing (one dict lookup) when off."""
    global _spec, _read
    if not _read:
        _spec, _read = _parse(), True
    if _spec is None or _spec[0] != point:
        return
    with _lock:
        _counts[point] = n = _counts.get(point, 0) + 1
    if n >= _spec[1]:
        raise InjectedFault(f"injected fault at {point} (call {n}; HETSERVE_INJECT_FAULT)")
