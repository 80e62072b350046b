"""decode (decode server, decoupled): the Triton binding of stages/decode.py (op dispatch, the KV rendezvous,
admission into continuous batching). This file builds the stage from the environment and converts tensors <->
its dataclasses; the ops are described there.
"""
from __future__ import annotations

import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config
from ..bounded import BoundedExecutor
from ..engines.manifest import configured_engines
from ..engines.runtime import load_engine
from ..kv.blocks import BlockPool
from ..kv.snapshot import Snapshotter
from ..scheduler import DecodeScheduler

# PendingKV re-exported for existing callers (tests/test_hardening.py)
from ..stages.decode import RECOMPUTE_REASONS, DecodeConfig, DecodeStage, PendingKV
from .common import engine_dir, ingest_token_ok, json_bytes, send_error, start_admin_channel, str_tensor, tensors_of
from .metrics import REGISTRY, Poller, gauges

log = logging.getLogger("hetserve.decode")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class SenderReply:
    """stages.types.Reply over a Triton response sender."""

    def __init__(self, sender):
        self.sender = sender

    def tokens(self, token_ids, finish_reason=None, final=False):
        tensors = [pb_utils.Tensor("token_ids", np.asarray(token_ids, np.int32))]
        if finish_reason:
            tensors.append(str_tensor("finish_reason", [finish_reason]))
        self.sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if final else 0)

    def json(self, obj):
        self.sender.send(pb_utils.InferenceResponse([str_tensor("op_json", [json_bytes(obj)])]), flags=FINAL)

    def error(self, exc):
        send_error(self.sender, exc)  # as data, then the final Triton error (stages/grpc_decode reads the data)

    def cancelled(self):
        return bool(getattr(self.sender, "is_cancelled", lambda: False)())


class TritonPythonModel:
    def initialize(self, args):
        names = configured_engines(engine_dir(), "HETSERVE_DECODE_ENGINES")
        engines = {}
        for n in names:
            e = load_engine(engine_dir(), n.strip())
            e.warmup()
            engines[e.precision] = e
        e0 = next(iter(engines.values()))
        cfg = e0.config
        max_queue = int(config.get("HETSERVE_MAX_QUEUE"))
        self.sched = DecodeScheduler(
            engines, eos_ids=cfg.eos_token_ids, max_batch=int(config.get("HETSERVE_MAX_BATCH")),
            pool=BlockPool.from_env(cfg),  # HETSERVE_KV_* and HETSERVE_REDIS_URL (README)
            idle_demote_s=float(config.get("HETSERVE_KV_IDLE_DEMOTE_S")), max_queue=max_queue)
        self.snapshots = Snapshotter.from_env(e0.compat_hash)
        self.sched.snapshotter = self.snapshots
        # admission work (waiting for KV, recompute) off the request thread; bounded like the scheduler queue
        self.admit = BoundedExecutor(8, max_queue, "decode-admit")
        self.stage = DecodeStage(
            engines, cfg, e0.compat_hash, self.sched, self.admit, PendingKV.from_env(),
            DecodeConfig(kv_timeout_s=float(config.get("HETSERVE_KV_TIMEOUT_MS")) / 1e3,
                         default_precision=config.get("HETSERVE_DECODE_PRECISION") or e0.precision),
            snapshots=self.snapshots, metrics=REGISTRY, ingest_token_ok=ingest_token_ok)
        for reason in RECOMPUTE_REASONS:
            REGISTRY.declare("hetserve_kv_recompute_total", reason=reason)
        for name in ("hetserve_kv_preemptions_total", "hetserve_snapshot_restores_total"):
            REGISTRY.declare(name)
        self.poller = Poller(self._sample_metrics, "decode")
        self.admin = start_admin_channel(config.get("HETSERVE_DECODE_ADMIN"), "decode", self.stage.admin_ops())

    def _sample_metrics(self) -> dict:
        sched = self.sched
        st = sched.stats
        g: list = [("hetserve_batch_size", {}, st["batch_size"] if sched.n_running() else 0),
             ("hetserve_queue_depth", {}, len(sched.waiting))]
        pool = getattr(sched, "kv_pool", None)  # paged KV pool, when present
        if pool is not None:
            for tier, n in pool.stats().get("tier_blocks", {}).items():
                g.append(("hetserve_kv_tier_blocks", {"tier": tier}, n))
        if self.snapshots is not None:
            g.append(("hetserve_snapshot_age_seconds", {}, self.snapshots.oldest_age_s()))
        counters = gauges([("hetserve_kv_preemptions_total", {}, st.get("preempted", 0))])
        return {"gauges": gauges(g), "counters": counters, "busy_seconds": st["step_seconds"]}

    def finalize(self):
        if self.admin is not None:
            self.admin.close()
        self.poller.close()
        self.sched.close()
        if self.snapshots is not None:
            self.snapshots.close()
        self.admit.shutdown()

    def execute(self, requests):
        for r in requests:
            self.stage.handle_tensors(tensors_of(r, "decode"), SenderReply(r.get_response_sender()))
        return None
