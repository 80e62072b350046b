"""The admin side channel: operator ops (`hetserve doctor`'s info, link probes, KV correctness) served by the model
process that owns the state they need, on a port of its own -- not through the data-plane models' tensors.

Why a side channel and not a Triton model: the ops need the live engine, KV sender and pending-KV store of the
`prefill` / `decode` model process; a separate Triton model runs in another process and would reach them only
by multiplexing ops into the data-plane schema again (what this replaces). Dynamo's per-worker system port is
the same shape.

Safe by default: the channel binds loopback unless the address says otherwise (HETSERVE_PREFILL_ADMIN /
HETSERVE_DECODE_ADMIN, set by the launcher), is never behind the client-facing nginx, and every request carries
the deployment admin key (`Authorization: Bearer <key>`, compared in constant time). Bounded: one serving
thread (operator ops run one at a time, each with its own timeout), request bodies of at most MAX_BODY bytes,
a socket timeout on every connection.

Protocol: POST /v1/admin/<op> with a JSON object of arguments -> 200 {"result": ...}; 400 (bad arguments),
401 (no or wrong key), 404 (unknown op), 413 (body too large), 500 (the op failed) -> {"error": "..."}.
No Triton import here: the models register plain callables (args dict -> JSON-able dict).
"""
from __future__ import annotations

import hmac
import http.client
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable, Dict, Optional, Tuple

log = logging.getLogger("hetserve.admin")
MAX_BODY = 1 << 20  # doctor arguments are a few hundred bytes; the KV itself travels on the data plane
SOCKET_TIMEOUT_S = 30.0
PATH_PREFIX = "/v1/admin/"
Handler = Callable[[dict], dict]


class AdminError(RuntimeError):
    """An admin op refused or failed; `status` is the HTTP status (0: the channel could not be reached)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class BadAdminRequest(ValueError):
    """Raised by a handler for arguments it cannot take (answered 400 with the message)."""


def parse_addr(addr: str) -> Tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError with the reason otherwise."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"admin address {addr!r}: expected host:port")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def format_addr(host: str, port: int) -> str:
    """(host, port) -> 'host:port', IPv6 hosts in brackets (what parse_addr reads back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _HTTPServer6(HTTPServer):
    address_family = socket.AF_INET6


class AdminServer:
    """Serves `handlers` on `addr` for holders of `key`. start() binds (raises OSError when the port is taken),
    close() stops the thread and frees the port. One instance per model process that has admin ops."""

    def __init__(self, addr: str, key: str, handlers: Dict[str, Handler], name: str = "admin"):
        if not key:
            raise ValueError("the admin channel needs the deployment admin key (HETSERVE_ADMIN_KEY)")
        self.host, self.port = parse_addr(addr)
        self.key = key.encode()
        self.handlers = dict(handlers)
        self.name = name
        self._httpd: Optional[HTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "AdminServer":
        server = self

        class _Handler(BaseHTTPRequestHandler):
            timeout = SOCKET_TIMEOUT_S
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # the default writes every request to stderr
                log.debug("%s admin: " + fmt, server.name, *args)

            def _answer(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(405, {"error": f"use POST {PATH_PREFIX}<op> with a JSON object of arguments"})

            def do_POST(self):
                status, body = server._serve(self.path, self.headers.get("Authorization", ""),
                                             self.headers.get("Content-Length"), self.rfile)
                # one request per connection: a refused request's body may still be unread on the socket
                self.close_connection = True
                self._answer(status, body)

        cls = _HTTPServer6 if ":" in self.host else HTTPServer
        self._httpd = cls((self.host, self.port), _Handler)
        self.port = self._httpd.server_address[1]  # port 0 = any free port (tests)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"{self.name}-admin", daemon=True)
        self._thread.start()
        log.info("%s admin channel on %s:%d (ops: %s)", self.name, self.host, self.port, ", ".join(self.handlers))
        return self

    @property
    def addr(self) -> str:
        return format_addr(self.host, self.port)

    def _serve(self, path: str, auth: str, length: Optional[str], rfile) -> Tuple[int, dict]:
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key):
            return 401, {"error": "admin ops need the deployment admin key (Authorization: Bearer <key>)"}
        if not path.startswith(PATH_PREFIX):
            return 404, {"error": f"unknown path {path!r}; use {PATH_PREFIX}<op>"}
        op = path[len(PATH_PREFIX):]
        fn = self.handlers.get(op)
        if fn is None:
            return 404, {"error": f"unknown admin op {op!r}; this server has {', '.join(sorted(self.handlers))}"}
        try:
            n = int(length or 0)
        except ValueError:
            n = -1
        if n < 0:  # a negative length would make read() wait for EOF, holding the one serving thread
            return 400, {"error": "bad Content-Length"}
        if n > MAX_BODY:
            return 413, {"error": f"admin request body of {n} bytes exceeds {MAX_BODY}"}
        try:
            args = json.loads(rfile.read(n) or b"{}")
        except ValueError as e:
            return 400, {"error": f"arguments are not valid JSON: {e}"}
        if not isinstance(args, dict):
            return 400, {"error": "arguments must be a JSON object"}
        try:
            return 200, {"result": fn(args)}
        except (BadAdminRequest, ValueError, TypeError, KeyError) as e:
            return 400, {"error": str(e) or type(e).__name__}
        except Exception as e:
            log.exception("%s admin op %s failed", self.name, op)
            return 500, {"error": f"{type(e).__name__}: {e}"[:500]}

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class AdminClient:
    """Calls one server's admin channel. call(op, args) -> the op's result; AdminError on any refusal."""

    def __init__(self, addr: str, key: str, timeout_s: float = 30.0):
        self.host, self.port = parse_addr(addr)
        self.addr, self.key, self.timeout_s = addr, key, float(timeout_s)

    def call(self, op: str, args: Optional[dict] = None, timeout_s: Optional[float] = None) -> dict:
        body = json.dumps(args or {}).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s or self.timeout_s)
        try:
            conn.request("POST", PATH_PREFIX + op, body, {"Authorization": f"Bearer {self.key}",
                                                         "Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise AdminError(f"admin channel {self.addr} unreachable ({type(e).__name__}: {e}); is the server "
                             "up, and is this its admin address (--prefill-admin / --decode-admin)?") from None
        finally:
            conn.close()
        try:
            out = json.loads(raw)
        except ValueError:
            raise AdminError(f"admin channel {self.addr}: not a JSON answer (HTTP {resp.status})", resp.status) \
                from None
        if resp.status != 200:
            raise AdminError(f"admin op {op} on {self.addr}: {out.get('error', raw[:200])}", resp.status)
        return out["result"]


def default_addr(grpc_url: str) -> str:
    """The admin address of a server started by hetserve's launchers: its gRPC host, gRPC port + 2 (the
    ports of one server are http b, grpc b+1, metrics b+2, admin b+3)."""
    host, port = parse_addr(grpc_url)
    return format_addr(host, port + 2)
