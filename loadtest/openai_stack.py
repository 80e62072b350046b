"""The real serving stack behind the OpenAI-endpoint benches (structured_tpot.py, multiturn.py): the engines built
if needed, prefill + decode tritonservers (cluster.LocalCluster, pinned as `hetserve up` pins them) and the OpenAI
frontend on loopback, stopped on the way out whatever happens; and the percentile both report."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends"))
DEFAULT_ENGINE_DIR = str(ROOT / ".hetserve" / "engines")


def pct(xs: List[float], q: float) -> float:
    """The q-th percentile, nearest rank (nan for no samples)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


@contextlib.contextmanager
def openai_stack(engine_dir: str, base_port: int, env: Optional[dict] = None, n_decode: int = 1,
                 static_decode: bool = False, n_prefill: int = 1) -> Iterator[Tuple[object, str]]:
    """(the LocalCluster, the frontend's base URL); prefill on base_port (+10 per replica).., decode on
    base_port+1000.., the frontend on base_port+80; with several prefill servers the frontend talks to an nginx
    in front of them (least_conn, as `hetserve up` runs it) on base_port+90/91."""
    from hetserve.cluster import LocalCluster
    from hetserve.engines.builder import build_engines
    from hetserve.openai_api.process import FrontendProcess, FrontendSpec

    build_engines(None, engine_dir)
    cluster = LocalCluster(engine_dir, base_port=base_port, n_decode=n_decode, env=env,
                           static_decode=static_decode, n_prefill=n_prefill)
    fe = None
    try:
        cluster.start(300)
        grpc_url = cluster.prefill_grpc
        if n_prefill > 1:
            lb = cluster.start_lb(base_port + 90, base_port + 91)
            grpc_url = f"127.0.0.1:{lb.grpc_port}"
        fe = FrontendProcess(FrontendSpec(grpc_url, base_port + 80, engine_dir))
        fe.start().wait_ready(180)
        yield cluster, fe.spec.url
    finally:
        if fe is not None:
            fe.stop()
        cluster.stop()
