"""prefill: run the prompt through the prefill engine, sample the first token, push KV to the decode server.

Inputs: input_ids, request_id, decode_url?, transport? (grpc|shm), kv_dtype? (fp32|fp16|int8), skip_transfer?,
prefix_cache? (default true), sampling params.
Outputs: first_token, prompt_len, kv_bytes, prefill_ms, transfer_ms, transfer_ok, transport_used, prefix_hit_tokens
(prompt tokens whose KV came from the prefix cache, kv/prefix.py; HETSERVE_PREFIX_CACHE_MB sizes it, 0 disables).
A failed transfer is reported (transfer_ok=false), not raised: the decode server then recomputes the prompt.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

import triton_python_backend_utils as pb_utils

from ..engines.runtime import Engine
from ..kv import wire
from ..kv.prefix import PrefixCache
from ..kv.transport import TRANSPORTS, KVSender
from ..sampling import sample
from .common import (RequestError, check_prompt, engine_dir, inp, json_bytes, respond_each, sampling_params,
                     scalar, str_tensor)
from .metrics import REGISTRY, BusyMeter, Poller, declare_transfer_failures, gauges, transfer_failure_reason

log = logging.getLogger("hetserve.prefill")


class TritonPythonModel:
    def initialize(self, args):
        self.engine = Engine(engine_dir(), os.environ.get("HETSERVE_PREFILL_ENGINE", "prefill_fp32"))
        self.engine.warmup()
        self.sender = KVSender()
        self.default_url = os.environ.get("HETSERVE_DECODE_URL", "127.0.0.1:9001").split(",")[0]
        self.default_transport = os.environ.get("HETSERVE_KV_TRANSPORT", "grpc")
        self.default_kv_dtype = os.environ.get("HETSERVE_KV_DTYPE", "fp32")
        self.cfg = self.engine.config
        self.prefix = PrefixCache.from_env(seed=self.engine.compat_hash)  # HETSERVE_PREFIX_CACHE_MB
        self.busy = BusyMeter()
        for t in TRANSPORTS:
            REGISTRY.declare("hetserve_kv_transfer_bytes_total", transport=t)
        declare_transfer_failures(TRANSPORTS)
        for n in ("hetserve_kv_prefix_hits_total", "hetserve_kv_prefix_lookups_total"):
            REGISTRY.declare(n)
        self.poller = Poller(self._sample_metrics, "prefill")

    def _sample_metrics(self) -> dict:
        out = {"busy_seconds": self.busy.total(), "counters": {}}
        prefix = getattr(self, "prefix", None)  # prefix cache, when enabled
        if prefix is not None:
            st = prefix.stats()
            out["counters"] = gauges([
                ("hetserve_kv_prefix_hits_total", {}, st.get("hits", 0)),
                ("hetserve_kv_prefix_lookups_total", {}, st.get("lookups", 0)),
                ("hetserve_kv_prefix_hit_tokens_total", {}, st.get("hit_tokens", 0))])
        return out

    def _record_transfer(self, transport: str, info: dict, exc=None):
        if exc is not None:
            REGISTRY.inc("hetserve_kv_transfer_failures_total", transport=transport,
                         reason=transfer_failure_reason(exc))
            return
        REGISTRY.inc("hetserve_kv_transfer_bytes_total", info["bytes"], transport=transport)
        REGISTRY.observe("hetserve_kv_transfer_seconds", info["seconds"], transport=transport)
        if info["seconds"] > 0:
            REGISTRY.set("hetserve_kv_transfer_bandwidth_bytes_per_second", info["bytes"] / info["seconds"],
                         transport=transport)

    def finalize(self):
        self.poller.close()
        self.sender.close()

    def _prefill(self, ids, use_prefix: bool):
        """Prefill with prefix reuse: the engine runs only on the tokens after the longest cached whole-block
        prefix, with that prefix's KV as past; the returned KV covers the whole prompt. -> logits, k, v, hit."""
        if not use_prefix:
            return (*self.engine.prefill(ids), 0)
        hit, pk, pv = self.prefix.lookup(ids)
        logits, k, v = self.engine.prefill(ids[hit:], pk, pv)
        if hit:
            k, v = np.concatenate([pk, k], axis=2), np.concatenate([pv, v], axis=2)
        self.prefix.insert(ids, k, v)
        return logits, k, v, hit

    def _doctor(self, op, r):
        """`hetserve doctor` ops (doctor.py): info | ping | ping_decode | probe_link | kv_check -> doctor_json."""
        from .. import doctor

        ids_a = inp(r, "input_ids")
        ids = [] if ids_a is None else [int(x) for x in ids_a.reshape(-1)]
        try:
            out = doctor.prefill_op(self, op, doctor.parse_args_json(scalar(r, "doctor_args", "", str)),
                                    scalar(r, "decode_url", None, str) or self.default_url,
                                    scalar(r, "transport", None, str) or self.default_transport,
                                    scalar(r, "kv_dtype", None, str) or self.default_kv_dtype, ids)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return pb_utils.InferenceResponse([str_tensor("doctor_json", [json_bytes(out)])])

    def _one(self, r):
        op = scalar(r, "op", "prefill", str)
        if op != "prefill":
            return self._doctor(op, r)
        ids_a = inp(r, "input_ids")
        if ids_a is None or ids_a.size == 0:
            raise RequestError("empty prompt: 'input_ids' has no tokens")
        params = sampling_params(r)
        ids = check_prompt([int(x) for x in ids_a.reshape(-1)], self.cfg, params.max_tokens)
        rid = scalar(r, "request_id", None, str) or f"req-{time.time_ns()}"
        transport = scalar(r, "transport", None, str) or self.default_transport
        if transport not in TRANSPORTS:
            raise RequestError(f"unknown transport {transport!r}; use one of {list(TRANSPORTS)}")
        kv_dtype = scalar(r, "kv_dtype", None, str) or self.default_kv_dtype
        if kv_dtype not in wire.DTYPES:
            raise RequestError(f"unknown kv_dtype {kv_dtype!r}; use one of {sorted(wire.DTYPES)}")
        url = scalar(r, "decode_url", None, str) or self.default_url
        skip = bool(scalar(r, "skip_transfer", False))
        use_prefix = bool(scalar(r, "prefix_cache", True))

        t0 = time.perf_counter()
        with self.busy.timed():
            logits, k, v, hit = self._prefill(ids, use_prefix)
        first = sample(logits, params, 0)
        t1 = time.perf_counter()
        info = {"transport": "none", "bytes": 0, "seconds": 0.0}
        ok = True
        if not skip:
            hdr, payload = wire.encode(k, v, self.engine.compat_hash, kv_dtype)
            try:
                info = self.sender.send(url, transport, rid, hdr, payload)
                self._record_transfer(transport, info)
            except Exception as e:
                log.warning("request %s: %s", rid, e)
                self._record_transfer(transport, None, e)
                ok = False
                info = {"transport": transport, "bytes": 0, "seconds": time.perf_counter() - t1}
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("first_token", np.array([first], np.int32)),
            pb_utils.Tensor("prompt_len", np.array([len(ids)], np.int32)),
            pb_utils.Tensor("kv_bytes", np.array([info["bytes"]], np.int64)),
            pb_utils.Tensor("prefill_ms", np.array([(t1 - t0) * 1e3], np.float32)),
            pb_utils.Tensor("transfer_ms", np.array([info["seconds"] * 1e3], np.float32)),
            pb_utils.Tensor("transfer_ok", np.array([ok], bool)),
            pb_utils.Tensor("prefix_hit_tokens", np.array([hit], np.int32)),
            str_tensor("transport_used", [info["transport"]]),
        ])

    def execute(self, requests):
        return respond_each(requests, self._one, log)
