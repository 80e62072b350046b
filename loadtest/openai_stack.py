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
                 static_decode: bool = False) -> Iterator[Tuple[object, str]]:
    """(the LocalCluster, the frontend's base URL); prefill on base_port.., decode on base_port+1000..,
    the frontend on base_port+80."""
    from hetserve.cluster import LocalCluster
    from hetserve.engines.builder import build_engines
    from hetserve.openai_api.process import FrontendProcess, FrontendSpec

    build_engines(None, engine_dir)
    cluster = LocalCluster(engine_dir, base_port=base_port, n_decode=n_decode, env=env,
                           static_decode=static_decode)
    fe = None
    try:
        cluster.start(300)
        fe = FrontendProcess(FrontendSpec(cluster.prefill_grpc, base_port + 80, engine_dir))
        fe.start().wait_ready(180)
        yield cluster, fe.spec.url
    finally:
        if fe is not None:
            fe.stop()
        cluster.stop()
