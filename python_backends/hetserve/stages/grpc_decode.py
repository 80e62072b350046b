"""DecodeClient over Triton gRPC: the orchestrator's link to a decode server's `decode` model (tritonclient,
no Triton Python-backend import)."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterator

from .. import errors
from .types import DecodeFailed, DecodeRequest, TokenChunk

log = logging.getLogger("hetserve.orchestrator")
RELEASE_TIMEOUT_S = 10.0
# responses buffered per stream: decode sends one per step and the orchestrator drains them as they come;
# past this the decode side is far ahead of a stuck consumer, which the step timeout then reports
MAX_BUFFERED = 4096


def stream_error(err) -> Exception:
    """A stream error that came without the decode model's typed error before it (send_error sends that first,
    and responses() raises it): the call itself failed (server gone, stream broken, deadline) or Triton refused
    it (model not loaded): the server cannot serve it, so migrate."""
    status = str(getattr(err, "status", lambda: "")() or "")
    msg = str(getattr(err, "message", lambda: str(err))() or err)
    return DecodeFailed(f"{status + ': ' if status else ''}{msg}")


class GrpcDecodeStream:
    """One gRPC stream to the decode server's `decode` model for one request."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.q: "queue.Queue" = queue.Queue(MAX_BUFFERED)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error):
        try:
            self.q.put_nowait((result, error))
        except queue.Full:  # the consumer is gone or stuck: drop, it fails on its step timeout
            log.warning("decode stream buffer full (%d responses); dropping one", MAX_BUFFERED)

    def start(self, req: DecodeRequest) -> None:
        from .. import schema
        from ..client import build_inputs

        ins = build_inputs(None, op="generate", request_id=req.request_id, input_ids=req.prompt,
                           output_ids=req.output_ids, precision=req.precision,
                           kv_sent=None if req.kv_sent else False, **dict(schema.sampling_arrays(req.params)))
        self.client.async_stream_infer("decode", ins, request_id=req.request_id, enable_empty_final_response=True)

    def responses(self, timeout_s: float) -> Iterator[TokenChunk]:
        """The decode responses as chunks; responses already waiting are merged into one chunk (a consumer that
        fell behind catches up with one client response, not one per token)."""
        while True:
            try:
                item = self.q.get(timeout=timeout_s)
            except queue.Empty:
                raise DecodeFailed(f"decode server sent nothing for {timeout_s:.1f}s") from None
            ids: list = []
            while True:
                try:
                    chunk = self._chunk(*item)
                except Exception:
                    if ids:  # tokens that arrived before the error still count (a migration resumes after them)
                        yield TokenChunk(ids)
                    raise
                ids += chunk.token_ids
                if chunk.finish_reason is not None:
                    yield TokenChunk(ids, chunk.finish_reason)
                    return
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
            yield TokenChunk(ids)

    @staticmethod
    def _chunk(result, err) -> TokenChunk:
        if err is not None:
            raise stream_error(err)
        data = result.as_numpy(errors.ERROR_OUTPUT)
        if data is not None and data.size:  # the decode model's typed error (its Triton error follows)
            raise errors.from_wire(bytes(data.reshape(-1)[0]))
        resp = result.get_response()
        final = resp.parameters.get("triton_final_response")
        final = bool(final and final.bool_param)
        toks = result.as_numpy("token_ids")
        fr = result.as_numpy("finish_reason")
        reason = fr.reshape(-1)[0].decode() if fr is not None and fr.size else None
        return TokenChunk([] if toks is None else [int(x) for x in toks.reshape(-1)],
                          reason or ("stop" if final else None))

    def close(self, cancel: bool = False) -> None:
        try:
            self.client.stop_stream(cancel_requests=cancel)
        except TypeError:
            self.client.stop_stream()
        except Exception:
            pass
        try:
            self.client.close()
        except Exception:
            pass


class GrpcDecodeClient:
    # releases run on their own short-lived threads; past this many at once a release is skipped (the
    # decode server's pending-KV TTL frees the KV anyway)
    MAX_RELEASES = 64

    def __init__(self):
        self._releases = threading.BoundedSemaphore(self.MAX_RELEASES)

    def open(self, url: str) -> GrpcDecodeStream:
        return GrpcDecodeStream(url)

    def release(self, url: str, request_id: str) -> None:
        from ..client import build_inputs, stream_once

        if not self._releases.acquire(blocking=False):
            log.info("release of %s on %s skipped (%d in flight); its pending TTL frees it", request_id, url,
                     self.MAX_RELEASES)
            return

        def go():
            try:
                stream_once(url, "decode", build_inputs(None, op="release", request_id=request_id),
                            RELEASE_TIMEOUT_S, request_id)
            except Exception as e:
                log.info("release of %s on %s failed (%s); its pending TTL frees it", request_id, url, e)
            finally:
                self._releases.release()
        threading.Thread(target=go, daemon=True, name="decode-release").start()
