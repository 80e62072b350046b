"""kv_ingest (decode server): take KV over any registered transport, verify the handshake + HMAC tag, hand it to
`decode`'s pool. The prefill server's grpc and shm hand-offs skip it by default (HETSERVE_KV_DIRECT: op=ingest on
the decode model itself, kv/transport/control.py); pulling transports (nixl), cuda_shm and plain unary senders
come here.

The sender names its transport in the request parameter `hetserve_transport` (kv/transport/control.py). In-band
transports (grpc, shm, cuda_shm) deliver the payload as kv_payload (Triton resolves shm before we run); pulling
transports (nixl) send a kv_remote descriptor and the receiver READs the payload. Every path ends in the same
wire.verify. A mismatch (model hash, layout, dtype, shape, size, HMAC tag) or a bad descriptor is refused with
INVALID_ARG and the reason.
Ops: ingest (default); caps -> kv_caps JSON, this server's capability offer (kv/transport/negotiate.py);
ping answers at once (`hetserve doctor`). Transfers whose request id starts with diagnostics.PROBE_PREFIX (link
probes) are verified the same way and then discarded, never reaching decode.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Dict

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import config, errors
from ..diagnostics import PROBE_PREFIX
from ..engines.manifest import read_manifest
from ..kv import wire
from ..kv.transport import NAMES, PeerRefused, TransferError, TransportReceiver, TransportUnavailable, spec, to_prepare
from ..kv.transport.negotiate import local_offer
from ..stages.decode import TRANSFER_FAILURES_METRIC, refused_kv
from .common import (
    RequestError,
    check_kv_tokens,
    engine_dir,
    ingest_token,
    inp,
    kv_transport_of,
    raise_bls_failure,
    respond_each,
    scalar,
    str_tensor,
)
from .metrics import REGISTRY, declare_transfer_failures, transfer_failure_reason

log = logging.getLogger("hetserve.kv_ingest")


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
        self.pull_timeout_s = config.get("HETSERVE_KV_PULL_TIMEOUT_S")
        self._receivers: Dict[str, TransportReceiver] = {}
        self._receiver_errors: Dict[str, str] = {}  # transport -> why its receiver could not start
        self._receivers_lock = threading.Lock()  # the prepare thread and requests may start one at once
        declare_transfer_failures(NAMES)
        # Receivers named by HETSERVE_KV_PREPARE start now, in the background (NIXL's agent imports torch:
        # ~250 MB, ~2 s, more on a loaded box, which the first nixl request would otherwise wait for); the
        # others on first use, so a server that never sees a transport does not pay for it.
        prepare = to_prepare(config.get("HETSERVE_KV_PREPARE"), config.get("HETSERVE_KV_TRANSPORT"))
        if prepare:
            threading.Thread(target=self._prepare, args=(prepare,), daemon=True, name="kv-receiver-prepare").start()

    def _prepare(self, names):
        for name in names:
            try:
                self._receiver(name)
            except TransferError:
                pass  # _receiver logged why; requests over it are refused with that reason

    def finalize(self):
        for r in self._started().values():
            r.close()
        REGISTRY.close()  # last: metrics released while the stub still takes the deletes

    def _started(self) -> Dict[str, TransportReceiver]:
        # a copy: the prepare thread may add a receiver meanwhile (dict() copies in one step under the GIL; the
        # lock is held for a whole receiver start, seconds for NIXL, too long for op=caps to wait)
        return dict(self._receivers)

    def _receiver(self, name: str) -> TransportReceiver:
        r = self._receivers.get(name)
        if r is not None:
            return r
        with self._receivers_lock:
            r = self._receivers.get(name)
            if r is not None:
                return r
            if name in self._receiver_errors:
                raise TransportUnavailable(self._receiver_errors[name])
            s = spec(name)
            why = s.available()
            try:
                if why:
                    raise TransportUnavailable(why)
                r = self._receivers[name] = getattr(s.load(), s.receiver)()
            except TransferError as e:
                self._receiver_errors[name] = str(e)
                log.warning("KV transport %s cannot receive on this server: %s", name, e)
                raise
            return r

    def _offer(self) -> dict:
        offer = local_offer({name: r.offer() for name, r in self._started().items()})
        for name, why in dict(self._receiver_errors).items():  # a copy, as in _started()
            offer["transports"].pop(name, None)
            offer["unavailable"][name] = why
        return offer

    def _refuse(self, rid: str, transport: str, e: Exception):
        raise refused_kv(rid, e, lambda e: REGISTRY.inc(TRANSFER_FAILURES_METRIC, transport=transport,
                                                        reason=transfer_failure_reason(e))) from None

    def _check_pull_size(self, hdr) -> None:
        """A pulling receiver sizes its buffer from hdr.nbytes: it must be what our engine's shape gives for the
        header's dtype and token count. If not, verify() against an empty payload raises the header's first
        mismatch (hash, layout, dtype, shape) or, failing that, the size."""
        L, H, D = self.shape
        want = wire.payload_nbytes(hdr.dtype, L, H, hdr.num_tokens, D) if hdr.dtype in wire.DTYPES else -1
        if hdr.nbytes != want:
            wire.verify(hdr, np.empty(0, np.uint8), self.compat, self.shape)
            raise wire.KVWireError(f"KV header size {hdr.nbytes} B != expected {want} B")

    def _one(self, r):
        op = scalar(r, "op", "ingest", str)
        if op == "ping":
            return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([0], np.int32))])
        if op == "caps":
            return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([0], np.int32)),
                                               str_tensor("kv_caps", [json.dumps(self._offer())])])
        if op != "ingest":
            raise RequestError(f"unknown op {op!r}; use 'ingest', 'caps' or 'ping'")
        rid = scalar(r, "request_id", None, str)
        if not rid:
            raise RequestError("missing 'request_id'")
        transport = kv_transport_of(r)
        raw = inp(r, "kv_header")
        if raw is None:
            raise RequestError("missing 'kv_header'")
        payload = inp(r, "kv_payload")
        remote = inp(r, "kv_remote")
        try:
            hdr = wire.KVHeader.from_json(bytes(raw.reshape(-1)[0]))
            check_kv_tokens(hdr, self.max_position)  # before any buffer is sized from the header
            receiver = self._receiver(transport)
            if receiver.pulls:
                self._check_pull_size(hdr)
            payload = receiver.receive(
                hdr, payload, None if remote is None else bytes(remote.reshape(-1)[0]), self.pull_timeout_s)
            wire.verify(hdr, payload, self.compat, self.shape)
        except (wire.KVWireError, RequestError, PeerRefused) as e:
            self._refuse(rid, transport, e)
        except TransferError as e:  # the pull itself failed (timeout, peer gone): the sender sees why
            REGISTRY.inc(TRANSFER_FAILURES_METRIC, transport=transport, reason=transfer_failure_reason(e))
            raise RequestError(f"KV for request {rid} not received over {transport}: {e}") from None
        if rid.startswith(PROBE_PREFIX):  # link probe: verified, discarded
            return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([hdr.num_tokens], np.int32))])
        req = pb_utils.InferenceRequest(
            model_name="decode",
            inputs=[str_tensor("op", ["ingest"]), str_tensor("request_id", [rid]),
                    str_tensor("ingest_token", [self.token]),
                    pb_utils.Tensor("kv_header", raw), pb_utils.Tensor("kv_payload", payload)],
            requested_output_names=["token_ids", errors.ERROR_OUTPUT])
        for resp in req.exec(decoupled=True):  # decode's typed error (send_error) comes before its Triton error
            raise_bls_failure("decode", resp)
        return pb_utils.InferenceResponse([pb_utils.Tensor("kv_tokens", np.array([hdr.num_tokens], np.int32))])

    def execute(self, requests):
        return respond_each(requests, self._one, log, "kv_ingest")
