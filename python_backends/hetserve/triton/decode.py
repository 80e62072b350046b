"""decode (decode server, decoupled): continuous-batching generation from ingested KV.

op=ingest   : (from kv_ingest) store a verified KV transfer under request_id.
op=generate : join the running batch; stream token ids. If the KV has not arrived within the receive
              timeout (HETSERVE_KV_TIMEOUT_MS, default 100), recompute it from prompt + tokens so far.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Dict, Tuple

import numpy as np

import triton_python_backend_utils as pb_utils

from ..engines.runtime import Engine
from ..kv import wire
from ..scheduler import DecodeScheduler, Sequence
from ..sampling import is_stop_token
from .common import RequestError, check_prompt, classify, engine_dir, error, inp, int_list, sampling_params, scalar, str_tensor
from .metrics import REGISTRY, Poller, gauges

log = logging.getLogger("hetserve.decode")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PENDING_TTL_S = 120.0


class PendingKV:
    """KV that arrived before its generate request (the normal order), keyed by request id."""

    def __init__(self):
        self._d: Dict[str, Tuple[np.ndarray, np.ndarray, float]] = {}
        self._cv = threading.Condition()

    def put(self, rid, k, v):
        with self._cv:
            now = time.monotonic()
            for old in [x for x, (_, _, t) in self._d.items() if now - t > PENDING_TTL_S]:
                del self._d[old]
            self._d[rid] = (k, v, now)
            self._cv.notify_all()

    def take(self, rid, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while rid not in self._d:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            k, v, _ = self._d.pop(rid)
            return k, v

    def __len__(self):
        return len(self._d)


class TritonPythonModel:
    def initialize(self, args):
        names = os.environ.get("HETSERVE_DECODE_ENGINES", "decode_fp32,decode_int8").split(",")
        self.engines = {}
        for n in names:
            e = Engine(engine_dir(), n.strip())
            e.warmup()
            self.engines[e.precision] = e
        e0 = next(iter(self.engines.values()))
        self.cfg = e0.config
        self.compat = e0.compat_hash
        self.default_precision = os.environ.get("HETSERVE_DECODE_PRECISION", e0.precision)
        self.kv_timeout_s = float(os.environ.get("HETSERVE_KV_TIMEOUT_MS", "100")) / 1e3
        self.sched = DecodeScheduler(
            self.engines, eos_ids=self.cfg.eos_token_ids,
            max_batch=int(os.environ.get("HETSERVE_MAX_BATCH", "16")),
            kv_budget_bytes=int(float(os.environ.get("HETSERVE_KV_BUDGET_MB", "2048")) * (1 << 20)),
            max_queue=int(os.environ.get("HETSERVE_MAX_QUEUE", "64")))
        self.pending = PendingKV()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="decode-admit")
        self.counters = {"recompute": 0, "ingested": 0}
        for reason in ("timeout", "mismatch", "resume"):
            REGISTRY.declare("hetserve_kv_recompute_total", reason=reason)
        self.poller = Poller(self._sample_metrics, "decode")

    def _sample_metrics(self) -> dict:
        sched = self.sched
        st = sched.stats
        g = [("hetserve_batch_size", {}, st["batch_size"] if sched.n_running() else 0),
             ("hetserve_queue_depth", {}, len(sched.waiting))]
        pool = getattr(sched, "kv_pool", None)  # paged KV pool, when present
        if pool is not None:
            for tier, n in pool.stats().get("tier_blocks", {}).items():
                g.append(("hetserve_kv_tier_blocks", {"tier": tier}, n))
        return {"gauges": gauges(g), "busy_seconds": st["step_seconds"]}

    def finalize(self):
        self.poller.close()
        self.sched.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- ops ------------------------------------------------------------------------------------
    def _ingest(self, r):
        rid = scalar(r, "request_id", None, str)
        hdr = wire.KVHeader.from_json(bytes(inp(r, "kv_header").reshape(-1)[0]))
        payload = np.ascontiguousarray(inp(r, "kv_payload").reshape(-1), dtype=np.uint8)
        k, v = wire.decode(hdr, payload)
        self.pending.put(rid, k, v)
        self.counters["ingested"] += 1

    def _generate(self, r, sender):
        rid = scalar(r, "request_id", None, str)
        if not rid:
            raise RequestError("missing 'request_id'")
        prompt = int_list(r, "input_ids")
        out_ids = int_list(r, "output_ids")
        if not prompt or not out_ids:
            raise RequestError("'input_ids' (prompt) and 'output_ids' (tokens so far, >= 1) are required")
        params = sampling_params(r)
        check_prompt(prompt + out_ids, self.cfg, params.max_tokens - len(out_ids))
        params.stop_token_ids = [t for t in params.stop_token_ids if t >= 0]
        prec = scalar(r, "precision", None, str) or self.default_precision
        if prec not in self.engines:
            raise RequestError(f"decode precision {prec!r} not loaded; have {sorted(self.engines)}")
        if len(out_ids) >= params.max_tokens or is_stop_token(out_ids[-1], params, self.cfg.eos_token_ids):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", np.zeros(0, np.int32)),
                                                    str_tensor("finish_reason", ["length"])]), flags=FINAL)
            self.pending.take(rid, 0)
            return
        self.pool.submit(self._admit, rid, prompt, out_ids, params, prec, sender)

    def _admit(self, rid, prompt, out_ids, params, prec, sender):
        try:
            got = self.pending.take(rid, self.kv_timeout_s) if len(out_ids) == 1 else None
            ctx = prompt + out_ids[:-1]
            if got is None or got[0].shape[2] != len(ctx):
                # KV missing (timeout, failed transfer, or resume after migration): recompute it here.
                self.counters["recompute"] += 1
                reason = "resume" if len(out_ids) > 1 else ("timeout" if got is None else "mismatch")
                REGISTRY.inc("hetserve_kv_recompute_total", reason=reason)
                _, k, v = self.engines[prec].prefill(ctx)
            else:
                k, v = got

            def on_tokens(toks, reason, sender=sender):
                tensors = [pb_utils.Tensor("token_ids", np.asarray(toks, np.int32))]
                if reason:
                    tensors.append(str_tensor("finish_reason", [reason]))
                sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if reason else 0)

            cancelled = getattr(sender, "is_cancelled", lambda: False)
            self.sched.submit(Sequence(rid, len(prompt), list(out_ids), params, prec, on_tokens, cancelled,
                                       k=k, v=v))
        except Exception as e:
            if classify(e) == pb_utils.TritonError.INTERNAL:
                log.exception("decode admission failed")
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error(str(e), classify(e))),
                        flags=FINAL)

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            try:
                op = scalar(r, "op", "generate", str)
                if op == "ingest":
                    self._ingest(r)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", np.zeros(0, np.int32))]),
                                flags=FINAL)
                elif op == "generate":
                    self._generate(r, sender)
                else:
                    raise RequestError(f"unknown op {op!r}; use 'generate' or 'ingest'")
            except Exception as e:
                if classify(e) == pb_utils.TritonError.INTERNAL:
                    log.exception("decode request failed")
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error(str(e), classify(e))),
                            flags=FINAL)
        return None
