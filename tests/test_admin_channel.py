"""The admin side channel (admin_channel.py) on its own: a real HTTP server on loopback, the real client; the
handlers are plain functions (the live doctor tests exercise the prefill/decode ones)."""
from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from hetserve import admin_channel as ac
from hetserve.admin_channel import AdminClient, AdminError, AdminServer, BadAdminRequest

KEY = "k-" + "x" * 30


def _boom(args):
    raise RuntimeError("engine fell over")


def _picky(args):
    if "n" not in args:
        raise BadAdminRequest("needs 'n'")
    return {"twice": 2 * int(args["n"])}


@pytest.fixture
def server():
    s = AdminServer("127.0.0.1:0", KEY, {"echo": lambda a: {"got": a}, "picky": _picky, "boom": _boom},
                    name="unit").start()
    yield s
    s.close()


def _raw(server, method, path, body=b"", headers=None):
    c = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        c.request(method, path, body, headers or {})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def test_ops_answer_holders_of_the_key(server):
    cl = AdminClient(server.addr, KEY)
    assert cl.call("echo", {"a": [1, 2]}) == {"got": {"a": [1, 2]}}
    assert cl.call("picky", {"n": 4}) == {"twice": 8}
    with pytest.raises(AdminError, match="needs 'n'") as e:
        cl.call("picky")
    assert e.value.status == 400
    with pytest.raises(AdminError, match="RuntimeError: engine fell over") as e:
        cl.call("boom")
    assert e.value.status == 500
    with pytest.raises(AdminError, match="unknown admin op 'nope'; this server has boom, echo, picky") as e:
        cl.call("nope")
    assert e.value.status == 404
    assert cl.call("echo") == {"got": {}}  # still serving after the failures


def test_no_key_or_a_wrong_key_is_refused(server):
    with pytest.raises(AdminError, match="need the deployment admin key") as e:
        AdminClient(server.addr, "wrong").call("echo")
    assert e.value.status == 401
    for headers in ({}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer "}):
        status, body = _raw(server, "POST", "/v1/admin/echo", b"{}", headers)
        assert status == 401 and "admin key" in body["error"]


def test_bad_bodies_get_4xx_with_a_message(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert _raw(server, "POST", "/v1/admin/echo", b"{oops", auth)[0] == 400
    status, body = _raw(server, "POST", "/v1/admin/echo", b"[1, 2]", auth)
    assert status == 400 and "JSON object" in body["error"]
    status, body = _raw(server, "GET", "/v1/admin/echo")
    assert status == 405 and "POST" in body["error"]
    status, body = _raw(server, "POST", "/elsewhere", b"{}", auth)
    assert status == 404
    # an oversized body is refused from its Content-Length, before it is read
    c = socket.create_connection((server.host, server.port), timeout=10)
    try:
        c.sendall(f"POST /v1/admin/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Length: {ac.MAX_BODY + 1}\r\n\r\n".encode())
        head = b""
        while chunk := c.recv(4096):  # the server answers and closes (the body was never read)
            head += chunk
        head = head.decode()
    finally:
        c.close()
    assert " 413 " in head.split("\r\n")[0] and "exceeds" in head
    assert AdminClient(server.addr, KEY).call("echo", {"ok": 1}) == {"got": {"ok": 1}}
    # a negative length is refused at once (read() would wait for EOF on the one serving thread)
    status, body = _raw(server, "POST", "/v1/admin/echo", None, {**auth, "Content-Length": "-5"})
    assert status == 400 and "Content-Length" in body["error"]


def test_one_serving_thread_and_the_port_is_freed_on_close():
    s = AdminServer("127.0.0.1:0", KEY, {"echo": lambda a: a}).start()
    port = s.port
    names = [t.name for t in threading.enumerate() if t.name.endswith("-admin")]
    assert names.count("admin-admin") == 1
    s.close()
    with pytest.raises(AdminError, match="unreachable"):
        AdminClient(f"127.0.0.1:{port}", KEY, timeout_s=2).call("echo")
    again = AdminServer(f"127.0.0.1:{port}", KEY, {"echo": lambda a: a}).start()  # the port is free again
    again.close()


def test_addresses_and_the_key_is_required():
    assert ac.parse_addr("127.0.0.1:8003") == ("127.0.0.1", 8003) and ac.parse_addr("[::1]:9") == ("::1", 9)
    for bad in ("nohost", "h:port", "h:70000"):
        with pytest.raises(ValueError, match="expected host:port"):
            ac.parse_addr(bad)
    assert ac.default_addr("127.0.0.1:8001") == "127.0.0.1:8003" and ac.default_addr("[::1]:9001") == "[::1]:9003"
    with pytest.raises(ValueError, match="admin key"):
        AdminServer("127.0.0.1:0", "", {})
