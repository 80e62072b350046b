"""`hetserve doctor` against the real prefill + decode servers (session topology), plus its local helpers."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from hetserve import diagnostics, doctor

FAST = dict(sizes=[128, 512], repeats=2, ping_n=5, prompts=["What is the capital of France?",
                                                            "List three prime numbers."])


def _by_id(rep):
    return {c.id: c for c in rep.checks}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hetserve.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- local (no servers) --------------------------------------------------------------------------------
def test_precision_support_local():
    sup = diagnostics.precision_support()
    assert set(sup) == set(diagnostics.PRECISIONS)
    assert sup["fp32"]["supported"] and sup["int8"]["supported"]
    for p, v in sup.items():
        assert v["via"] if v["supported"] else v["reason"], p  # every "no" says why
    if not diagnostics.runtime_info()["cuda_devices"]:
        assert not sup["fp8"]["supported"] and "sm >= 89" in sup["fp8"]["reason"]


def test_verify_kv_and_digest_local(engine_dir, prompt_ids):
    from hetserve.engines.runtime import Engine
    from hetserve.kv import wire

    e = Engine(engine_dir, "prefill_fp32")
    ids = prompt_ids["What is the capital of France?"]
    _, k, v = e.prefill(ids[:-1])
    hdr, payload = wire.encode(k, v, e.compat_hash, "fp32")
    k2, v2 = wire.decode(hdr, payload)
    assert diagnostics.kv_digest(k, v) == diagnostics.kv_digest(k2, v2)
    k2[0, 0, 0, 0] = np.nextafter(k2[0, 0, 0, 0], np.float32(np.inf))  # one ulp anywhere changes the digest
    assert diagnostics.kv_digest(k, v) != diagnostics.kv_digest(k2, v2)
    r = diagnostics.verify_kv(e, ids, k, v)
    assert r["max_abs_diff"] <= doctor.THRESHOLDS["fp32"] and r["argmax_received"] == r["argmax_full"]
    with pytest.raises(ValueError, match="expected"):
        diagnostics.verify_kv(e, ids + [5], k, v)


def test_versions_mismatch_between_servers_fails(engine_dir):
    """admin info answers from two servers whose engines were built from different checkpoints -> FAIL."""
    from hetserve.engines.manifest import read_manifest

    man = read_manifest(engine_dir)
    other = dict(man, compat_hash="e" * 32, manifest_version=man["manifest_version"] + 1)
    d = doctor.Doctor("127.0.0.1:1", "127.0.0.1:2")
    d.report.sections["servers"] = {"prefill": {"triton": "2.51.0"}, "decode": {"triton": "2.51.0"}}
    assert not d.check_versions({"prefill": diagnostics.server_info("prefill", man, {"prefill_fp32": "fp32"}),
                                 "decode": diagnostics.server_info("decode", other, {"decode_fp32": "fp32"})})
    c = _by_id(d.report)
    assert c["versions/compat_hash"].status == "FAIL" and "e" * 32 in c["versions/compat_hash"].detail
    assert c["versions/manifest"].status == "FAIL" and "manifest_version" in c["versions/manifest"].detail
    assert c["versions/triton"].status == "PASS"
    assert "-> FAIL" in doctor.format_text(d.report)


# ---- live ----------------------------------------------------------------------------------------------
def test_doctor_passes_on_healthy_topology(topology):
    t0 = time.perf_counter()
    rep = doctor.Doctor(topology.prefill_grpc, topology.decode_grpc, **FAST).run()
    text = doctor.format_text(rep)
    print("\n" + text)
    assert rep.ok, text
    assert {"servers", "precision", "versions", "latency", "link", "kv"} <= set(rep.sections)
    c = _by_id(rep)
    for cid in ("servers/prefill", "servers/decode", "precision/prefill", "precision/decode", "versions/compat_hash",
                "versions/manifest", "latency/client->prefill", "latency/client->decode",
                "latency/prefill->decode", "latency/prefill->decode:grpc", "latency/prefill->decode:shm",
                "latency/prefill->decode:nixl", "link/grpc", "link/shm", "link/nixl", "link/refuse_wrong_hash",
                "link/refuse_corrupted", "kv/pending"):
        assert c[cid].status == "PASS", (cid, c[cid].detail)
    for role in ("prefill", "decode"):
        info = rep.sections["precision"][role]
        assert set(info["precision"]) == set(diagnostics.PRECISIONS) and info["compat_hash"]
    assert rep.sections["precision"]["decode"]["pending"] == 0
    for tr in ("grpc", "shm", "nixl"):
        assert c[f"link/{tr}"].data["gbps"] > 0
        rows = [r for r in rep.sections["link"]["rows"] if r["transport"] == tr]
        assert [r["tokens"] for r in rows] == [128, 512] and all(r["mbps"] > 0 for r in rows)
        assert rows[-1]["bytes"] == 2 * 30 * 3 * 512 * 64 * 2  # KV of 512 tokens, fp16
        for dt in ("fp32", "fp16", "int8"):
            k = c[f"kv/{tr}/{dt}"]
            assert k.status == "PASS", k.detail
            assert k.data["exact"] == k.data["n"] == 2
        kv_rows = [r for r in rep.sections["kv"]["rows"] if r["transport"] == tr and r["kv_dtype"] == "fp32"]
        assert all(r["bit_exact_source"] for r in kv_rows)  # fp32: decode holds exactly the prefill KV
    assert "-> PASS" in text and "GB/s" in text
    print(f"doctor wall time {time.perf_counter() - t0:.1f}s")


def test_doctor_cli_json(topology):
    p = _cli("--prefill-url", topology.prefill_grpc, "--decode-url", topology.decode_grpc, "--json", "--sizes", "64",
             "--repeats", "1", "--ping", "3", "--kv-dtypes", "fp32", "--transports", "grpc", "--prompt", "Hi there")
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(p.stdout)
    assert d["ok"] is True and d["summary"]["FAIL"] == 0
    ids = {c["id"]: c["status"] for c in d["checks"]}
    assert ids["kv/grpc/fp32"] == "PASS" and ids["link/grpc"] == "PASS"
    assert d["sections"]["link"]["rows"][0]["gbps"] > 0


def test_doctor_dead_decode_url_fails_fast(topology):
    port = _free_port()  # nothing listens there
    t0 = time.perf_counter()
    p = _cli("--prefill-url", topology.prefill_grpc, "--decode-url", f"127.0.0.1:{port}", "--timeout", "5",
             timeout=60)
    dt = time.perf_counter() - t0
    assert p.returncode == 1, p.stdout + p.stderr
    assert "[FAIL] servers/decode" in p.stdout and "unreachable" in p.stdout
    assert "-> FAIL" in p.stdout and "[PASS] servers/prefill" in p.stdout
    assert dt < 30, f"took {dt:.1f}s"


def test_doctor_reports_compat_hash_mismatch(topology):
    """Probes claiming another model's compat hash (a bad header): decode refuses, doctor FAILs saying why."""
    rep = doctor.Doctor(topology.prefill_grpc, topology.decode_grpc, sizes=[16], repeats=1, ping_n=2,
                        transports=["grpc"], kv_dtypes=["fp32"], prompts=["Hi there"],
                        probe_compat_hash="f" * 32).run()
    assert not rep.ok
    c = _by_id(rep)
    for cid in ("link/grpc", "kv/grpc/fp32"):
        assert c[cid].status == "FAIL" and "KV model hash mismatch" in c[cid].detail, c[cid].detail
        assert "f" * 32 in c[cid].detail
    assert c["versions/compat_hash"].status == "PASS"  # the servers themselves agree
    assert c["kv/pending"].status == "PASS"


def test_doctor_ops_bad_input(topology):
    """The admin ops answer bad input with clear 4xx errors (DoctorError with the server's message); the servers
    stay up."""
    d = doctor.Doctor(topology.prefill_grpc, topology.decode_grpc)
    try:
        with pytest.raises(doctor.DoctorError, match="unknown admin op 'nope'"):
            d._prefill("nope")
        with pytest.raises(doctor.DoctorError, match="probe sizes"):
            d._prefill("probe_link", {"tokens": [0]})
        with pytest.raises(doctor.DoctorError, match="unknown transport"):
            d._prefill("probe_link", {"tokens": [4], "transports": ["carrier-pigeon"]})
        with pytest.raises(doctor.DoctorError, match="'input_ids' must be a list"):
            d._prefill("kv_check", {"input_ids": "1 2 3"})
        with pytest.raises(doctor.DoctorError, match="no KV arrived"):
            d._decode("verify", {"timeout_s": 0.05}, request_id="hetserve-doctor/none", input_ids=[1, 2, 3])
        with pytest.raises(doctor.DoctorError, match="needs 'request_id'"):
            d._decode("verify")
        assert d._prefill("ping") == {"pong": True}
        assert d._decode("info")["role"] == "decode"
    finally:
        d.close()
