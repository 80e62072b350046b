"""KV transports between real tritonservers (a prefill and a decode server of their own): the same greedy tokens
over grpc, shm and nixl (NIXL agents with UCX over loopback), the decode server's capability offer and the
orchestrator's negotiation, the KV really going over the transport asked for (prefill metrics, no fallback), and
the doctor's nixl link + kv lines. Ports: HETSERVE_TRANSPORT_TEST_PORT (default 32600) .. +12."""
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hetserve.client import generate

BASE = int(os.environ.get("HETSERVE_TRANSPORT_TEST_PORT", "32600"))
LIVE = ("grpc", "shm", "nixl")
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")
PROCS: list = []  # the running servers' TritonProcess objects (decode, prefill)



def _require_nixl():
    """nixl is part of the install (scripts/install.sh, extra `nixl`): missing is a broken install, not a skip."""
    import importlib.util

    assert importlib.util.find_spec("nixl") is not None, "nixl is not installed: pip install nixl (or .[nixl])"

@pytest.fixture(scope="module")
def servers(engine_dir, tmp_path_factory):
    _require_nixl()
    from hetserve.server import ServerSpec, TritonProcess, check_ports_free
    from hetserve.topology import split_cpus

    logs = tmp_path_factory.mktemp("transport-live")
    cpus = split_cpus()
    # HETSERVE_KV_ROUTING=0: every request's whole KV crosses on its transport (the tests below count it); with
    # KV-aware routing a prompt sent again would move only the blocks the decode server lacks
    common = {"HETSERVE_BREAKER_P99_MS": "60000", "HETSERVE_DECODE_ENGINES": "decode_fp32", "HETSERVE_THREADS": "1",
              "HETSERVE_KV_ROUTING": "0"}
    decode = ServerSpec("decode", BASE + 10, BASE + 11, BASE + 12, engine_dir, cpus=cpus["decode"], env=common,
                        log_file=str(logs / "decode.log"))
    prefill = ServerSpec("prefill", BASE, BASE + 1, BASE + 2, engine_dir, cpus=cpus["prefill"],
                         env={**common, "HETSERVE_DECODE_URL": decode.grpc_url, "HETSERVE_HEALTH_INTERVAL_S": "1",
                              "HETSERVE_HEALTH_TIMEOUT_S": "20"}, log_file=str(logs / "prefill.log"))
    check_ports_free([decode, prefill])
    procs = [TritonProcess(decode).start(check_ports=False), TritonProcess(prefill).start(check_ports=False)]
    try:
        for p in procs:
            p.wait_ready(300)
        PROCS[:] = procs  # the idle CPU test reads their pids
        yield prefill, decode
    finally:
        for p in reversed(procs):
            p.stop()


def _metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_decode_offers_nixl_and_the_pair_negotiates_all_three(servers):
    from hetserve.kv.transport.negotiate import fetch_offer, negotiate

    _, decode = servers
    offer = fetch_offer(decode.grpc_url, 10)
    assert set(LIVE) <= set(offer["transports"])
    assert "unverified" in offer["unavailable"].get("cuda_shm", "unverified")
    assert negotiate(decode.grpc_url, 10).transports == LIVE


def test_same_greedy_tokens_over_grpc_shm_and_nixl(servers):
    prefill, _ = servers
    for tr in LIVE:  # the first request per transport may race the pool's first negotiation: warm up
        generate(prefill.grpc_url, "Hi", transport=tr, max_tokens=2, timeout_s=120)
    before = {tr: _metric(prefill.metrics_port, "hetserve_kv_transfer_bytes_total", transport=tr) for tr in LIVE}
    falls = _metric(prefill.metrics_port, "hetserve_kv_transport_fallbacks_total")
    for p in PROMPTS:
        got = {tr: generate(prefill.grpc_url, p, transport=tr, kv_dtype="fp32", decode_precision="fp32",
                            max_tokens=24, ignore_eos=True, timeout_s=120) for tr in LIVE}
        assert got["shm"].token_ids == got["grpc"].token_ids == got["nixl"].token_ids, p
        assert len(got["nixl"].token_ids) == 24
    for tr in LIVE:  # each transport carried its own KV: no silent fallback
        sent = _metric(prefill.metrics_port, "hetserve_kv_transfer_bytes_total", transport=tr) - before[tr]
        assert sent >= len(PROMPTS) * 23_040 * 2 * 5, (tr, sent)  # fp32 KV of each prompt (> 5 tokens)
    assert _metric(prefill.metrics_port, "hetserve_kv_transport_fallbacks_total") == falls


def test_grpc_and_shm_kv_go_straight_to_decode_and_nixl_through_kv_ingest(servers, engine_dir):
    """HETSERVE_KV_DIRECT (default on): grpc and shm KV reach the decode model itself (op=ingest on the prefill
    server's shared stream to it): kv_ingest serves none of those transfers, and decode uses the KV (no
    recompute); nixl's pull still goes through kv_ingest. A KV the decode model refuses is typed (PeerRefused)
    and counted there under its transport."""
    from hetserve.kv.transport import KVSender, PeerRefused

    prefill, decode = servers

    def served(model):
        return _metric(decode.metrics_port, "nv_inference_request_success", model=model)

    def recomputed():
        return _metric(decode.metrics_port, "hetserve_kv_recompute_total")

    for tr in LIVE:  # negotiation and first-use set-up out of the way
        generate(prefill.grpc_url, "Hi", transport=tr, max_tokens=2, timeout_s=120)
    got = {}
    for tr in LIVE:
        ingest0, rec0 = served("kv_ingest"), recomputed()
        got[tr] = generate(prefill.grpc_url, PROMPTS[1], transport=tr, kv_dtype="fp32", decode_precision="fp32",
                           max_tokens=12, ignore_eos=True, timeout_s=120).token_ids
        assert recomputed() == rec0, tr  # the transferred KV was used
        assert served("kv_ingest") - ingest0 == (1 if tr == "nixl" else 0), tr
    assert got["grpc"] == got["shm"] == got["nixl"]

    key = dict(transport="shm", reason="hash_mismatch")
    before, ingest0 = _metric(decode.metrics_port, "hetserve_kv_transfer_failures_total", **key), served("kv_ingest")
    s = KVSender()
    try:
        with pytest.raises(PeerRefused, match="model hash mismatch"):
            s.send(decode.grpc_url, "shm", "bad-direct-1", *_probe_kv(engine_dir, compat="0" * 32))
        assert s.transport("shm")._regions[decode.grpc_url].alloc.free_bytes() == s.transport("shm").region_bytes
    finally:
        s.close()
    assert _metric(decode.metrics_port, "hetserve_kv_transfer_failures_total", **key) == before + 1
    assert served("kv_ingest") == ingest0


def test_cli_generate_transport_nixl(servers):
    prefill, _ = servers
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "python_backends")}
    outs = {}
    for tr in ("grpc", "nixl"):
        p = subprocess.run([sys.executable, "-m", "hetserve.cli", "generate", "--url", prefill.grpc_url,
                            "--transport", tr, "--max-tokens", "16", "What is the capital of France?"],
                           capture_output=True, text=True, timeout=180, env=env)
        assert p.returncode == 0, p.stderr
        outs[tr] = p.stdout
    assert outs["nixl"] == outs["grpc"] and "Paris" in outs["nixl"]


def test_doctor_nixl_link_and_kv_lines(servers):
    from hetserve import doctor

    prefill, decode = servers
    rep = doctor.Doctor(prefill.grpc_url, decode.grpc_url, sizes=[128, 2048], repeats=2, ping_n=3,
                        transports=list(LIVE), kv_dtypes=["fp32", "fp16", "int8"],
                        prompts=["What is the capital of France?"]).run()
    text = doctor.format_text(rep)
    print("\n" + text)
    c = {x.id: x for x in rep.checks}
    for cid in ("link/nixl", "latency/prefill->decode:nixl", "kv/nixl/fp32", "kv/nixl/fp16", "kv/nixl/int8",
                "link/grpc", "link/shm", "kv/pending"):
        assert c[cid].status == "PASS", (cid, c[cid].detail)
    assert c["link/nixl"].data["gbps"] > 0 and "fell back" not in c["link/nixl"].detail
    assert c["kv/nixl/fp32"].data["exact"] == 1  # bit-exact KV through NIXL
    assert re.search(r"^\s+nixl\s+2048\s", text, re.M), text


def test_idle_servers_do_not_spin_after_nixl_transfers(servers):
    """NIXL's own progress thread polls UCX with no pause: an idle prefill server sat at 97% of a core and a
    decode server at 45% once nixl had been used. The agents run without it (kv/transport/nixl_pull.py)."""
    import time

    from hetserve.server import group_cpu_seconds

    prefill, _ = servers
    generate(prefill.grpc_url, "Hi", transport="nixl", max_tokens=4, timeout_s=120)  # both agents started
    time.sleep(2)  # the stream's tail, metrics polls
    procs = PROCS
    before = [group_cpu_seconds(os.getpgid(p.proc.pid)) for p in procs]
    t0 = time.time()
    time.sleep(4)
    used = [group_cpu_seconds(os.getpgid(p.proc.pid)) - b for p, b in zip(procs, before)]
    share = [u / (time.time() - t0) for u in used]
    print(f"\nidle CPU after nixl transfers: decode {share[0]:.0%}, prefill {share[1]:.0%} of a core")
    assert max(share) < 0.25, share


def _probe_kv(engine_dir, compat=None, tokens=8):
    import numpy as np

    from hetserve.engines.manifest import read_manifest
    from hetserve.kv import wire

    man = read_manifest(engine_dir)
    c = man["config"]
    k = np.random.default_rng(1).standard_normal((c["num_layers"], c["num_kv_heads"], tokens, c["head_dim"]))
    return wire.encode(k.astype(np.float32), k.astype(np.float32), compat or man["compat_hash"], "fp16")


def test_shm_registration_lost_is_typed_and_recovered(servers, engine_dir):
    """The decode server forgets our shm region (as after a restart): the sender learns it from the server's
    registration status (PeerLostRegistration, no message matching), registers again and the send succeeds."""
    from hetserve.kv.transport import KVSender
    from hetserve.server import admin_headers

    _, decode = servers
    s = KVSender()
    try:
        hdr, payload = _probe_kv(engine_dir)
        assert s.send(decode.grpc_url, "shm", "hetserve-probe/shm-1", hdr, payload)["transport"] == "shm"
        region = s.transport("shm")._regions[decode.grpc_url].name
        s.client(decode.grpc_url).unregister_system_shared_memory(region, headers=admin_headers())
        info = s.send(decode.grpc_url, "shm", "hetserve-probe/shm-2", hdr, payload)
        assert info["transport"] == "shm" and s.transport("shm")._regions[decode.grpc_url].name != region
    finally:
        s.close()


def test_shm_lost_registration_under_concurrent_sends(servers, engine_dir):
    """The prefill server sends KV from several threads (HETSERVE_PREFILL_SEND_THREADS). The decode server
    forgets our region while 8 sends from 4 threads are under way: every send still lands (retried once on a new
    region), nothing writes into an unmapped region (that crashed the prefill stub before regions were counted
    per send), and the lost region is unmapped once its last send settled."""
    import concurrent.futures
    import threading

    from hetserve.kv.transport import KVSender
    from hetserve.server import admin_headers

    _, decode = servers
    s = KVSender()
    try:
        hdr, payload = _probe_kv(engine_dir, tokens=64)
        url = decode.grpc_url
        assert s.send(url, "shm", "hetserve-probe/shm-c0", hdr, payload)["transport"] == "shm"
        shm = s.transport("shm")
        old = shm._regions[url]
        go = threading.Barrier(4)

        def one(i):
            if i < 4:
                go.wait()
            return s.send(url, "shm", f"hetserve-probe/shm-c{i + 1}", hdr, payload)

        s.client(url).unregister_system_shared_memory(old.name, headers=admin_headers())
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            infos = list(ex.map(one, range(8)))
        assert all(i["transport"] == "shm" for i in infos)
        new = shm._regions[url]
        assert new is not old and not new.lost and new.users == 0
        assert old.retired and old.users == 0  # unmapped by its last user, not under a send
        assert new.alloc.free_bytes() == shm.region_bytes
    finally:
        s.close()


def test_nixl_refusal_is_typed_and_counted_on_decode(servers, engine_dir):
    from hetserve.kv.transport import KVSender, PeerRefused

    _, decode = servers
    key = dict(transport="nixl", reason="hash_mismatch")
    before = _metric(decode.metrics_port, "hetserve_kv_transfer_failures_total", **key)
    s = KVSender()
    try:
        with pytest.raises(PeerRefused, match="model hash mismatch"):
            s.send(decode.grpc_url, "nixl", "bad-nixl-1", *_probe_kv(engine_dir, compat="0" * 32))
        assert s.transport("nixl")._alloc.free_bytes() == s.transport("nixl").region_bytes  # range released
    finally:
        s.close()
    assert _metric(decode.metrics_port, "hetserve_kv_transfer_failures_total", **key) == before + 1


def test_shm_to_a_decode_server_with_another_dev_shm_is_negotiated_away(engine_dir, tmp_path, monkeypatch):
    """A decode server that cannot see our /dev/shm (its own tmpfs in a private mount namespace: what another host
    or a container with its own IPC namespace looks like). The pool's handshake leaves shm out for it, so a
    request asking for shm goes over grpc -- counted as a fallback (reason peer_unsupported), not failed and
    silently recomputed -- and gives the same tokens; nixl still works to it."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a private mount namespace (unshare -m)")
    from hetserve.server import ServerSpec, TritonProcess, check_ports_free, tritonserver_binary

    wrapper = tmp_path / "tritonserver-own-dev-shm"
    wrapper.write_text("#!/bin/sh\n# tritonserver with a /dev/shm of its own (private mount namespace)\n"
                       "exec unshare -m /bin/sh -c 'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec \"$@\"' "
                       f"sh {tritonserver_binary()} \"$@\"\n")
    wrapper.chmod(0o755)
    light = {"HETSERVE_BREAKER_P99_MS": "60000", "HETSERVE_DECODE_ENGINES": "decode_fp32", "HETSERVE_THREADS": "1"}
    decode = ServerSpec("decode", BASE + 30, BASE + 31, BASE + 32, engine_dir, env=light,
                        log_file=str(tmp_path / "decode.log"))
    prefill = ServerSpec("prefill", BASE + 40, BASE + 41, BASE + 42, engine_dir, log_file=str(tmp_path / "prefill.log"),
                         env={**light, "HETSERVE_DECODE_URL": decode.grpc_url, "HETSERVE_HEALTH_INTERVAL_S": "1",
                              "HETSERVE_HEALTH_TIMEOUT_S": "20", "HETSERVE_KV_TIMEOUT_MS": "100"})
    check_ports_free([decode, prefill])
    with monkeypatch.context() as m:
        m.setenv("HETSERVE_TRITONSERVER", str(wrapper))
        d = TritonProcess(decode).start(check_ports=False)
    procs = [d, TritonProcess(prefill).start(check_ports=False)]
    try:
        for p in procs:
            p.wait_ready(300)
        from hetserve.kv.transport.negotiate import negotiate

        n = negotiate(decode.grpc_url, 10)
        assert "shm" not in n.transports and "same host" in n.reasons["shm"] and "nixl" in n.transports
        ask = dict(kv_dtype="fp32", decode_precision="fp32", max_tokens=12, ignore_eos=True, timeout_s=120)
        generate(prefill.grpc_url, "Hi", transport="grpc", max_tokens=2, timeout_s=120)  # pool negotiated
        fell = dict(requested="shm", used="grpc", reason="peer_unsupported")
        f0 = _metric(prefill.metrics_port, "hetserve_kv_transport_fallbacks_total", **fell)
        r0 = _metric(decode.metrics_port, "hetserve_kv_recompute_total")
        ref = generate(prefill.grpc_url, PROMPTS[0], transport="grpc", **ask).token_ids
        assert generate(prefill.grpc_url, PROMPTS[0], transport="shm", **ask).token_ids == ref
        assert generate(prefill.grpc_url, PROMPTS[0], transport="nixl", **ask).token_ids == ref
        assert _metric(prefill.metrics_port, "hetserve_kv_transport_fallbacks_total", **fell) == f0 + 1
        assert _metric(prefill.metrics_port, "hetserve_kv_transfer_bytes_total", transport="shm") == 0
        assert _metric(prefill.metrics_port, "hetserve_kv_transfer_bytes_total", transport="nixl") > 0
        assert _metric(decode.metrics_port, "hetserve_kv_recompute_total") == r0  # the KV arrived every time
    finally:
        for p in reversed(procs):
            p.stop()
