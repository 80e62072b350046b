"""kv_ingest (decode server): verify the KV handshake + checksum, then hand the KV to `decode`'s pool.

Receives what a KVSender sent over gRPC or system shared memory (Triton resolves shm inputs before we run).
A mismatch (model hash, layout, dtype, shape, size, HMAC tag) is refused with INVALID_ARG and the reason.
`hetserve doctor` (doctor.py): op=ping answers at once; transfers whose request id starts with
doctor.PROBE_PREFIX (link probes) are verified the same way and then discarded, never reaching decode.
"""
from __future__ import annotations

import json
import logging

import numpy as np

import triton_python_backend_utils as pb_utils

from ..doctor import PROBE_PREFIX
from ..engines.manifest import read_manifest
from ..kv import wire
from ..kv.transport import TRANSPORTS
from .common import (RequestError, check_kv_tokens, engine_dir, ingest_token, inp, respond_each, scalar,
                     str_tensor)
from .metrics import REGISTRY, declare_transfer_failures, transfer_failure_reason

log = logging.getLogger("hetserve.kv_ingest")


def _transport_of(request) -> str:
    """The sender names its transport in a request parameter (KVSender); 'unknown' for other senders."""
    try:
        t = json.loads(request.parameters() or "{}").get("hetserve_transport", "unknown")
    except Exception:
        return "unknown"
    return t if t in TRANSPORTS else "unknown"


class TritonPythonModel:
    def initialize(self, args):
        man = read_manifest(engine_dir())
        if man is None:
            raise RuntimeError(f"{engine_dir()}: no manifest.json")
        self.compat = man["compat_hash"]
        c = man["config"]
        self.shape = (c["num_layers"], c["num_kv_heads"], c["head_dim"])
        self.max_position = c["max_position"]
        self.token = ingest_token()
        declare_transfer_failures(TRANSPORTS)

    def _one(self, r):
        op = scalar(r, "op", "ingest", str)
        if op == "ping":
            return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([0], np.int32))])
        if op != "ingest":
            raise RequestError(f"unknown op {op!r}; use 'ingest' or 'ping'")
        rid = scalar(r, "request_id", None, str)
        if not rid:
            raise RequestError("missing 'request_id'")
        raw = inp(r, "kv_header")
        payload = inp(r, "kv_payload")
        if raw is None or payload is None:
            raise RequestError("missing 'kv_header' or 'kv_payload'")
        hdr = wire.KVHeader.from_json(bytes(raw.reshape(-1)[0]))
        payload = np.ascontiguousarray(payload.reshape(-1), dtype=np.uint8)
        try:
            check_kv_tokens(hdr, self.max_position)
            wire.verify(hdr, payload, self.compat, self.shape)
        except (wire.KVWireError, RequestError) as e:
            if rid.startswith(PROBE_PREFIX):  # a deliberate doctor probe, not a transfer failure
                raise RequestError(f"KV refused for request {rid}: {e}") from None
            REGISTRY.inc("hetserve_kv_transfer_failures_total", transport=_transport_of(r),
                         reason=transfer_failure_reason(e))
            raise RequestError(f"KV refused for request {rid}: {e}") from None
        if rid.startswith(PROBE_PREFIX):  # link probe: verified, discarded
            return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([hdr.num_tokens], np.int32))])
        req = pb_utils.InferenceRequest(
            model_name="decode",
            inputs=[str_tensor("op", ["ingest"]), str_tensor("request_id", [rid]),
                    str_tensor("ingest_token", [self.token]),
                    pb_utils.Tensor("kv_header", raw), pb_utils.Tensor("kv_payload", payload)],
            requested_output_names=["token_ids"])
        for resp in req.exec(decoupled=True):
            if resp.has_error():
                raise RuntimeError(f"decode refused KV: {resp.error().message()}")
        return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([hdr.num_tokens], np.int32))])

    def execute(self, requests):
        return respond_each(requests, self._one, log)
