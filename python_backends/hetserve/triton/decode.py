"""decode (decode server, decoupled): continuous-batching generation from ingested KV.

op=ingest   : (from kv_ingest) store a verified KV transfer under request_id.
op=generate : join the running batch; stream token ids. If the KV has not arrived within the receive
              timeout (HETSERVE_KV_TIMEOUT_MS, default 100), recompute it from prompt + tokens so far.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, Tuple

import numpy as np

import triton_python_backend_utils as pb_utils

from ..engines.runtime import Engine
from ..kv import wire
from ..kv.blocks import BlockPool
from ..kv.snapshot import Snapshotter
from ..scheduler import DecodeScheduler, Overloaded, Sequence
from ..sampling import is_stop_token
from ..bounded import BoundedExecutor
from .common import (RequestError, check_kv_tokens, check_prompt, classify, engine_dir, error, ingest_token_ok, inp,
                     int_list, require_admin, sampling_params, scalar, str_tensor)
from .metrics import REGISTRY, Poller, gauges

log = logging.getLogger("hetserve.decode")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PENDING_TTL_S = 120.0


class PendingKV:
    """KV that arrived before its generate request (the normal order), keyed by request id. Bounded in entries
    and bytes (HETSERVE_PENDING_KV_MAX / HETSERVE_PENDING_KV_MB): past either, expired entries go first, then
    the transfer is refused (Overloaded) and the generate recomputes; entries expire after PENDING_TTL_S."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 1 << 30):
        self._d: Dict[str, Tuple[np.ndarray, np.ndarray, float]] = {}
        self._cv = threading.Condition()
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.nbytes = 0

    @classmethod
    def from_env(cls) -> "PendingKV":
        return cls(int(os.environ.get("HETSERVE_PENDING_KV_MAX") or 256),
                   int(float(os.environ.get("HETSERVE_PENDING_KV_MB") or 1024) * (1 << 20)))

    def _drop(self, rid):
        k, v, _ = self._d.pop(rid)
        self.nbytes -= k.nbytes + v.nbytes
        return k, v

    def put(self, rid, k, v):
        size = k.nbytes + v.nbytes
        with self._cv:
            now = time.monotonic()
            for old in [x for x, (_, _, t) in self._d.items() if now - t > PENDING_TTL_S]:
                self._drop(old)
            if rid in self._d:
                self._drop(rid)
            if len(self._d) >= self.max_entries or self.nbytes + size > self.max_bytes:
                raise Overloaded(f"pending KV full ({len(self._d)} transfers, {self.nbytes / 2**20:.0f} MiB of "
                                 f"{self.max_bytes / 2**20:.0f} MiB) waiting for their generate requests; "
                                 f"retry after 1.0s")
            self._d[rid] = (k, v, now)
            self.nbytes += size
            self._cv.notify_all()

    def take(self, rid, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while rid not in self._d:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return self._drop(rid)

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
            pool=BlockPool.from_env(self.cfg),  # HETSERVE_KV_* and HETSERVE_REDIS_URL (README)
            idle_demote_s=float(os.environ.get("HETSERVE_KV_IDLE_DEMOTE_S", "0")),
            max_queue=int(os.environ.get("HETSERVE_MAX_QUEUE", "64")))
        self.snapshots = Snapshotter.from_env(self.compat)
        self.sched.snapshotter = self.snapshots
        self.pending = PendingKV.from_env()
        # admission work (waiting for KV, recompute) off the request thread; bounded like the scheduler queue
        self.pool = BoundedExecutor(8, int(os.environ.get("HETSERVE_MAX_QUEUE", "64")), "decode-admit")
        self.counters = {"recompute": 0, "ingested": 0}
        for reason in ("timeout", "mismatch", "resume"):
            REGISTRY.declare("hetserve_kv_recompute_total", reason=reason)
        for name in ("hetserve_kv_preemptions_total", "hetserve_snapshot_restores_total"):
            REGISTRY.declare(name)
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
        if self.snapshots is not None:
            g.append(("hetserve_snapshot_age_seconds", {}, self.snapshots.oldest_age_s()))
        counters = gauges([("hetserve_kv_preemptions_total", {}, st.get("preempted", 0))])
        return {"gauges": gauges(g), "counters": counters, "busy_seconds": st["step_seconds"]}

    def finalize(self):
        self.poller.close()
        self.sched.close()
        if self.snapshots is not None:
            self.snapshots.close()
        self.pool.shutdown()

    # ---- ops ------------------------------------------------------------------------------------
    def _ingest(self, r):
        """KV from kv_ingest (verified there; it proves it with the internal token) or from anyone else, which
        is verified here: compat hash, layout, shape, context bound, size, checksum."""
        rid = scalar(r, "request_id", None, str)
        raw, payload = inp(r, "kv_header"), inp(r, "kv_payload")
        if not rid or raw is None or payload is None:
            raise RequestError("op=ingest needs 'request_id', 'kv_header' and 'kv_payload'")
        hdr = wire.KVHeader.from_json(bytes(raw.reshape(-1)[0]))
        payload = np.ascontiguousarray(payload.reshape(-1), dtype=np.uint8)
        if not ingest_token_ok(scalar(r, "ingest_token", "", str)):
            check_kv_tokens(hdr, self.cfg.max_position)
            try:
                wire.verify(hdr, payload, self.compat, (self.cfg.num_layers, self.cfg.num_kv_heads,
                                                        self.cfg.head_dim))
            except wire.KVWireError as e:
                raise RequestError(f"KV refused for request {rid}: {e}") from None
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

    def _context_kv(self, rid, prompt, out_ids, prec):
        """KV of prompt + out_ids[:-1]: the transferred KV, else a snapshot + the tail, else a full recompute."""
        got = self.pending.take(rid, self.kv_timeout_s) if len(out_ids) == 1 else None
        ctx = prompt + out_ids[:-1]
        if got is not None and got[0].shape[2] == len(ctx):
            return got
        eng = self.engines[prec]
        if len(out_ids) > 1 and self.snapshots is not None:  # resume after migration
            snap = self.snapshots.restore(rid, ctx, (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim))
            if snap is not None:
                n, k, v = snap
                REGISTRY.inc("hetserve_snapshot_restores_total")
                if n == len(ctx):
                    return k, v
                _, tk, tv = eng.prefill(ctx[n:], past_k=k, past_v=v)
                return np.concatenate([k, tk], axis=2), np.concatenate([v, tv], axis=2)
        # KV missing (timeout, failed transfer, or resume without snapshot): recompute it here.
        self.counters["recompute"] += 1
        reason = "resume" if len(out_ids) > 1 else ("timeout" if got is None else "mismatch")
        REGISTRY.inc("hetserve_kv_recompute_total", reason=reason)
        _, k, v = eng.prefill(ctx)
        return k, v

    def _admit(self, rid, prompt, out_ids, params, prec, sender):
        try:
            k, v = self._context_kv(rid, prompt, out_ids, prec)
            if self.snapshots is not None:
                self.snapshots.track(rid, prompt)

            def on_tokens(toks, reason, sender=sender):
                tensors = [pb_utils.Tensor("token_ids", np.asarray(toks, np.int32))]
                if reason:
                    tensors.append(str_tensor("finish_reason", [reason]))
                sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL if reason else 0)

            cancelled = getattr(sender, "is_cancelled", lambda: False)
            self.sched.submit(Sequence(rid, len(prompt), list(out_ids), params, prec, on_tokens, cancelled,
                                       k=k, v=v, prompt_ids=list(prompt)))
        except Exception as e:
            if classify(e) == pb_utils.TritonError.INTERNAL:
                log.exception("decode admission failed")
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error(str(e), classify(e))),
                        flags=FINAL)

    def _stats(self) -> dict:
        sched = self.sched
        with sched.cv:
            out = {"running": sched.n_running(), "waiting": len(sched.waiting), "pending_kv": len(self.pending),
                   "scheduler": dict(sched.stats), "counters": dict(self.counters)}
        pool = getattr(sched, "kv_pool", None)
        if pool is not None:
            out["kv_pool"] = pool.stats()
        if self.snapshots is not None:
            out["snapshots"] = {**self.snapshots.stats, "files": self.snapshots.store.count(),
                                "tracked": len(self.snapshots.prompts)}
        return out

    def _canary(self, sender):
        eng = self.engines[self.default_precision]
        bos = self.cfg.bos_token_id
        logits, _, _ = eng.prefill([int(bos) if bos is not None else 1])
        tok = int(np.argmax(logits))
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", np.array([tok], np.int32))]),
                    flags=FINAL)

    def _doctor(self, op, r, sender):
        """`hetserve doctor` ops, one final response with doctor_json. info: what this server runs (engines,
        precisions, versions, pending KV count). verify: take the KV sent under request_id out of pending and
        compare its next-token logits with a full recompute of input_ids (doctor.verify_kv), off this thread."""
        from .. import doctor

        args = doctor.parse_args_json(scalar(r, "doctor_args", "", str))
        if op == "info":
            man = next(iter(self.engines.values())).manifest
            out = doctor.server_info("decode", man, {e.name: e.precision for e in self.engines.values()},
                                     pending=len(self.pending), counters=dict(self.counters),
                                     default_precision=self.default_precision, kv_timeout_ms=self.kv_timeout_s * 1e3)
            return self._send_json(sender, out)
        rid = scalar(r, "request_id", None, str)
        prompt = int_list(r, "input_ids")
        if not rid or len(prompt) < 2:
            raise RequestError("op=verify needs 'request_id' and 'input_ids' (the prompt, >= 2 tokens)")
        check_prompt(prompt, self.cfg)
        prec = scalar(r, "precision", None, str) or ("fp32" if "fp32" in self.engines else self.default_precision)
        if prec not in self.engines:
            raise RequestError(f"decode precision {prec!r} not loaded; have {sorted(self.engines)}")
        timeout_s = min(max(float(args.get("timeout_s", 5.0)), 0.0), 60.0)
        self.pool.submit(self._verify, rid, prompt, prec, timeout_s, sender)

    def _verify(self, rid, prompt, prec, timeout_s, sender):
        from .. import doctor

        try:
            got = self.pending.take(rid, timeout_s)
            if got is None:
                raise RequestError(f"no KV arrived for request {rid!r} within {timeout_s:g}s")
            self._send_json(sender, doctor.verify_kv(self.engines[prec], prompt, *got))
        except Exception as e:
            if classify(e) == pb_utils.TritonError.INTERNAL:
                log.exception("decode op=verify failed")
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error(str(e), classify(e))),
                        flags=FINAL)

    @staticmethod
    def _send_json(sender, obj):
        from .common import json_bytes

        sender.send(pb_utils.InferenceResponse([str_tensor("doctor_json", [json_bytes(obj)])]), flags=FINAL)

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            try:
                op = scalar(r, "op", "generate", str)
                if op == "canary":  # health check: one real engine step, answered at once
                    self._canary(sender)
                elif op == "ingest":
                    self._ingest(r)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", np.zeros(0, np.int32))]),
                                flags=FINAL)
                elif op == "generate":
                    try:
                        self._generate(r, sender)
                    except Exception:  # refused: drop any KV already pushed for it (else it waits for its TTL)
                        self.pending.take(scalar(r, "request_id", "", str) or "", 0)
                        raise
                elif op in ("info", "verify"):  # `hetserve doctor` (doctor.py), admin key required
                    require_admin(r, op)
                    self._doctor(op, r, sender)
                elif op == "release":  # the orchestrator will not decode this request: drop its pushed KV
                    rid = scalar(r, "request_id", None, str)
                    if not rid:
                        raise RequestError("op=release needs 'request_id'")
                    self.pending.take(rid, 0)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", np.zeros(0, np.int32))]),
                                flags=FINAL)
                elif op == "stats":  # leak checks, soak tests, operators
                    self._send_json(sender, self._stats())
                else:
                    raise RequestError(f"unknown op {op!r}; use generate, ingest, release, canary, stats, info or verify")
            except Exception as e:
                if classify(e) == pb_utils.TritonError.INTERNAL:
                    log.exception("decode request failed")
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error(str(e), classify(e))),
                            flags=FINAL)
        return None
