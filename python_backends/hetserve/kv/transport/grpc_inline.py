"""`grpc`: the payload travels inline, as the kv_payload tensor of the kv_ingest call (Triton binary tensor data).
Works between any two hosts that can reach each other; the baseline every decode server accepts."""
from __future__ import annotations

from .base import InBandReceiver, TransportSender
from .control import ClientCache, ingest_inputs, post


class GrpcSender(TransportSender):
    name = "grpc"
    concurrent_sends = True  # stateless: the payload travels in the call

    def __init__(self, clients: ClientCache):
        self.clients = clients

    def start(self, url, request_id, hdr, payload, timeout_s):
        ins, p = ingest_inputs(request_id, hdr, payload.nbytes)
        p.set_data_from_numpy(payload)
        return post(self.clients, url, self.name, request_id, ins, payload.nbytes)

    def close(self):
        pass  # the ClientCache belongs to KVSender


class GrpcReceiver(InBandReceiver):
    name = "grpc"


def available() -> str:
    """'' when the transport can run in this process, else why not."""
    return ""
