"""Custom Triton metrics on the real servers, and a real Prometheus (Debian package) scraping both of them.

The metrics are read from Triton's own /metrics endpoint (the prefill server at base+2, decode at base+1002);
the Prometheus test loads deploy/prometheus/alerts.yml unchanged and waits for a real alert to fire.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import scrape, stop_process, total, wait_for
from hetserve.client import generate
from hetserve.kv import wire
from hetserve.kv.transport import KVSender, TransferError

ROOT = Path(__file__).resolve().parents[1]
PREFILL_METRICS = ("hetserve_ttft_seconds", "hetserve_tpot_seconds", "hetserve_kv_transfer_bytes_total",
                   "hetserve_kv_transfer_seconds", "hetserve_kv_transfer_bandwidth_bytes_per_second",
                   "hetserve_kv_transfer_failures_total", "hetserve_kv_transport_fallbacks_total",
                   "hetserve_kv_prefix_hits_total",
                   "hetserve_kv_prefix_lookups_total", "hetserve_utilization_ratio", "hetserve_breaker_state",
                   "hetserve_decode_servers", "hetserve_engine_cpu_seconds_total")
DECODE_METRICS = ("hetserve_kv_recompute_total", "hetserve_batch_size", "hetserve_queue_depth",
                  "hetserve_kv_transfer_failures_total", "hetserve_utilization_ratio", "hetserve_kv_tier_blocks",
                  "hetserve_snapshot_age_seconds", "hetserve_kv_preemptions_total", "hetserve_engine_cpu_seconds_total")
TRITON_METRICS = ("nv_inference_request_success", "nv_inference_request_duration_us", "nv_cpu_utilization")

def names(samples: dict) -> set:
    base = set()
    for n, _ in samples:
        base.add(re.sub(r"_(bucket|sum|count)$", "", n) if n.endswith(("_bucket", "_sum", "_count")) else n)
        base.add(n)
    return base


def ports(topo):
    return topo.base_port + 2, topo.base_port + 1002


def test_custom_metrics_count_real_traffic(topology, prompt_ids, engine_dir):
    pm, dm = ports(topology)
    before_p, before_d = scrape(pm), scrape(dm)
    prompt = next(iter(prompt_ids.values()))
    n_tok = 8
    # a fresh prompt per transport: no decode server holds any of its blocks, so the KV-aware router sends all
    # of its KV (a prompt seen before would only send what the decode server lacks)
    rng = np.random.default_rng()
    fresh = {t: [1] + rng.integers(100, 40000, 40).tolist() for t in ("grpc", "shm", "nixl")}
    for transport in ("grpc", "shm", "nixl"):
        g = generate(topology.prefill_grpc, None, input_ids=fresh[transport], max_tokens=n_tok, ignore_eos=True,
                     transport=transport, kv_dtype="fp16", timeout_s=60)
        assert len(g.token_ids) == n_tok
    generate(topology.prefill_grpc, None, model="aggregated", input_ids=prompt, max_tokens=n_tok, ignore_eos=True,
             timeout_s=60)

    def grown():
        p, d = scrape(pm), scrape(dm)
        ok = (total(p, "hetserve_ttft_seconds_count", model="llm") - total(before_p, "hetserve_ttft_seconds_count",
                                                                              model="llm") >= 3
              and total(p, "hetserve_ttft_seconds_count", model="aggregated")
              > total(before_p, "hetserve_ttft_seconds_count", model="aggregated")
              # engine CPU (engines/cpu_clock.py) of every model that ran an engine, sampled every second
              and all(total(s, "hetserve_engine_cpu_seconds_total", model=m)
                      > total(b, "hetserve_engine_cpu_seconds_total", model=m)
                      for s, b, m in ((p, before_p, "prefill"), (p, before_p, "aggregated"), (d, before_d, "decode"))))
        return (p, d) if ok else None

    p, d = wait_for(grown, 15, "TTFT histogram to count the requests")
    for n in PREFILL_METRICS + TRITON_METRICS:
        assert n in names(p), f"prefill server does not export {n}"
    for n in DECODE_METRICS + TRITON_METRICS:
        assert n in names(d), f"decode server does not export {n}"
    assert all(("server", "prefill") in lab for (n, lab) in p if n.startswith("hetserve_"))
    assert all(("server", "decode") in lab for (n, lab) in d if n.startswith("hetserve_"))

    # KV bytes are exact: fp16 KV of the prompt, once per transport.
    kv_fp16 = len(fresh["grpc"]) * topology_config(engine_dir).kv_bytes_per_token(2)
    for t in ("grpc", "shm", "nixl"):
        delta = total(p, "hetserve_kv_transfer_bytes_total", transport=t) - \
            total(before_p, "hetserve_kv_transfer_bytes_total", transport=t)
        assert delta == kv_fp16, f"{t}: {delta} bytes counted, expected {kv_fp16}"
        assert total(p, "hetserve_kv_transfer_seconds_count", transport=t) > \
            total(before_p, "hetserve_kv_transfer_seconds_count", transport=t)
        assert total(p, "hetserve_kv_transfer_bandwidth_bytes_per_second", transport=t) > 0
    # TTFT/TPOT sums are plausible wall times (positive, below the per-request time budget).
    dt = total(p, "hetserve_ttft_seconds_sum", model="llm") - total(before_p, "hetserve_ttft_seconds_sum", model="llm")
    assert 0 < dt < 60
    assert total(p, "hetserve_tpot_seconds_count", model="llm") > total(before_p, "hetserve_tpot_seconds_count",
                                                                         model="llm")
    # Triton's own request counters agree that the decode model served the streams.
    assert total(d, "nv_inference_request_success", model="decode") >= \
        total(before_d, "nv_inference_request_success", model="decode") + 2
    # Utilization is a ratio and becomes > 0 after work.
    for s in (p, d):
        vals = [v for (n, lab), v in s.items() if n == "hetserve_utilization_ratio"]
        assert vals and all(0.0 <= v <= 1.0 for v in vals)


def topology_config(engine_dir):
    from hetserve.engines.manifest import read_manifest
    from hetserve.model.checkpoint import LlamaConfig

    return LlamaConfig.from_dict(read_manifest(engine_dir)["config"])


def _refused_kv(topology, engine_dir):
    """Send KV with a wrong model hash straight to the decode server: refused and counted there."""
    c = topology_config(engine_dir)
    k = np.random.default_rng(0).standard_normal((c.num_layers, c.num_kv_heads, 4, c.head_dim)).astype(np.float32)
    hdr, payload = wire.encode(k, k, "0" * 16, "fp32")
    s = KVSender()
    try:
        with pytest.raises(TransferError, match="hash"):
            s.send(topology.decode_grpc, "grpc", f"bad-{time.time_ns()}", hdr, payload)
    finally:
        s.close()


def test_refused_kv_is_counted_with_reason(topology, engine_dir):
    _, dm = ports(topology)
    key = dict(transport="grpc", reason="hash_mismatch")
    before = total(scrape(dm), "hetserve_kv_transfer_failures_total", **key)
    _refused_kv(topology, engine_dir)
    assert total(scrape(dm), "hetserve_kv_transfer_failures_total", **key) == before + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prom_get(base: str, path: str, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian package) not installed")
def test_real_prometheus_scrapes_both_servers_and_fires_alert(topology, engine_dir, tmp_path):
    import yaml

    pm, dm = ports(topology)
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus-local.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in cfg["scrape_configs"]:
        job["scrape_interval"] = "1s"
        job["scrape_timeout"] = "1s"
        port = pm if job["job_name"] == "hetserve-prefill" else dm
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    web = _free_port()
    base = f"http://127.0.0.1:{web}"
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def targets_up():
            try:
                d = _prom_get(base, "/api/v1/targets")
            except Exception:
                return None
            act = d["activeTargets"]
            return act if len(act) == 2 and all(t["health"] == "up" for t in act) else None

        act = wait_for(targets_up, 60, "both Triton metrics endpoints to be up in Prometheus")
        assert {t["labels"]["job"] for t in act} == {"hetserve-prefill", "hetserve-decode"}
        rules = _prom_get(base, "/api/v1/rules")
        loaded = {r["name"]: r for g in rules["groups"] for r in g["rules"]}
        assert {"HetserveHighUtilization", "HetserveTTFTP99High", "HetserveKVTransferFailures",
                "HetserveSnapshotStale", "HetserveBreakerOpen"} <= set(loaded)
        assert all(r["health"] in ("ok", "unknown") for r in loaded.values()), loaded

        generate(topology.prefill_grpc, "Name a colour.", max_tokens=4, timeout_s=60)

        def ttft_series():
            res = _prom_get(base, "/api/v1/query", query='sum(hetserve_ttft_seconds_count{job="hetserve-prefill"})')
            return res["result"] and float(res["result"][0]["value"][1]) >= 1
        wait_for(ttft_series, 30, "hetserve_ttft_seconds_count in Prometheus")
        q = _prom_get(base, "/api/v1/query", query='count by (job) ({__name__=~"hetserve_.+"})')
        jobs = {r["metric"]["job"] for r in q["result"]}
        assert jobs == {"hetserve-prefill", "hetserve-decode"}

        # A refused KV transfer must fire HetserveKVTransferFailures (no `for:`), evaluated on real scrapes.
        def zero_scraped():
            res = _prom_get(base, "/api/v1/query", query='hetserve_kv_transfer_failures_total{job="hetserve-decode",'
                                                         'transport="grpc",reason="hash_mismatch"}')
            return bool(res["result"])
        wait_for(zero_scraped, 30, "the failure counter to be scraped before the failure")
        time.sleep(2)
        _refused_kv(topology, engine_dir)

        def firing():
            alerts = _prom_get(base, "/api/v1/alerts")["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "HetserveKVTransferFailures"
                    and a["state"] == "firing" and a["labels"].get("reason") == "hash_mismatch"]
        got = wait_for(firing, 45, "HetserveKVTransferFailures to fire")
        assert got[0]["labels"]["transport"] == "grpc"
    finally:
        stop_process(proc)
        log.close()


def test_metrics_survive_16_concurrent_streams(topology):
    """Regression: metric updates from many request threads at once crashed the prefill server (SIGSEGV in
    libtriton_python.so); updates are serialized now. 3 rounds x 16 concurrent streams, metrics on."""
    import concurrent.futures

    pm, _ = ports(topology)
    before = total(scrape(pm), "hetserve_ttft_seconds_count", model="llm")

    def one(i):
        g = generate(topology.prefill_grpc, f"Count to {i}.", max_tokens=16, ignore_eos=True, timeout_s=120,
                     decode_precision="int8", transport="shm", kv_dtype="fp16")
        return len(g.token_ids)

    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            assert list(ex.map(one, range(16))) == [16] * 16
        assert topology.servers["prefill"].alive() and topology.servers["decode"].alive()
    assert total(scrape(pm), "hetserve_ttft_seconds_count", model="llm") == before + 48
