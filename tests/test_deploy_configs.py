"""Static checks of the deployment configs (CPU only, no servers, no network).

* docker-compose.yml: services, images, GPUs, ports, healthchecks, env, mounts;
  ``docker compose config -q`` / ``docker-compose config -q`` when a Compose
  CLI is installed (it needs no Docker engine).
* deploy/nginx/nginx.conf: upstreams and streaming settings; ``nginx -t`` on a
  copy with the compose host names pointed at 127.0.0.1 when nginx is installed.
* deploy/prometheus: scrape targets, ``promtool check config|rules`` and the
  ``promtool test rules`` unit tests (alerts_test.yml) when promtool is installed.
* deploy/grafana: provisioning files and the dashboard JSON; every panel queries
  a known hetserve/Triton metric, and (with promtool) every query parses.
* loadtest/: the locustfile imports (in a subprocess: Locust monkey-patches the
  interpreter with gevent) and its scenarios are bounded; plot.py renders a PNG
  from synthetic CSVs; run.sh prints a headless, time-bounded locust command.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
NGINX = ROOT / "deploy" / "nginx" / "nginx.conf"
PROM_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "hetserve.json"
LOADTEST = ROOT / "loadtest"

# 25.07: first NGC release with the fixes of NVIDIA's August 2025 Triton bulletin (python backend shm chain
# CVE-2025-23319/23320/23334, HTTP CVE-2025-23310/23311/23317); see docker-compose.yml
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.07-py3"
# what compose may publish on the host: the client entry points (lb) and loopback-only dashboards
PUBLISHED = {"8000:8000", "8001:8001", "8080:8080", "127.0.0.1:9090:9090", "127.0.0.1:3000:3000"}
SECRETS = {"HETSERVE_ADMIN_KEY": "test-admin-key", "HETSERVE_REDIS_PASSWORD": "test-redis-pw",
           "GRAFANA_ADMIN_PASSWORD": "test-grafana-pw"}

HETSERVE_METRICS = {
    "hetserve_ttft_seconds",
    "hetserve_tpot_seconds",
    "hetserve_kv_transfer_bytes_total",
    "hetserve_kv_transfer_seconds",
    "hetserve_kv_transfer_failures_total",
    "hetserve_kv_recompute_total",
    "hetserve_kv_tier_blocks",
    "hetserve_kv_prefix_hits_total",
    "hetserve_kv_prefix_lookups_total",
    "hetserve_batch_size",
    "hetserve_queue_depth",
    "hetserve_breaker_state",
    "hetserve_snapshot_age_seconds",
    "hetserve_utilization_ratio",
}
TRITON_METRICS = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_queue_duration_us",
    "nv_cpu_utilization",
    "nv_gpu_utilization",
    "nv_cpu_memory_used_bytes",
}
KNOWN_METRICS = HETSERVE_METRICS | TRITON_METRICS | {"up"}
HISTOGRAMS = {"hetserve_ttft_seconds", "hetserve_tpot_seconds", "hetserve_kv_transfer_seconds"}

_METRIC_RE = re.compile(r"\b((?:hetserve|nv)_[a-zA-Z0-9_]+|up)\b(?!\s*\()")


def metrics_in(expr: str) -> set[str]:
    """Metric names an expression selects (histogram suffixes folded)."""
    # Drop label matchers and quoted strings so label names/values do not count.
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)
    stripped = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", stripped)
    names = set()
    for name in _METRIC_RE.findall(stripped):
        for suffix in ("_bucket", "_count", "_sum"):
            base = name[: -len(suffix)]
            if name.endswith(suffix) and base in HISTOGRAMS:
                name = base
        names.add(name)
    return names


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("cwd", ROOT)
    kwargs.setdefault("timeout", 120)
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def _clean_env() -> dict[str, str]:
    """Environment without HETSERVE_* overrides, so defaults are what is checked."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_")}


# --------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose() -> dict:
    with COMPOSE.open() as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict) and "services" in data
    return data


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _command(service: dict) -> str:
    cmd = service.get("command") or ""
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def _default(value: str) -> str:
    """'${VAR:-default}' -> 'default' (compose interpolation of an unset VAR); required '${VAR:?msg}' -> '<VAR>'."""
    value = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?\?[^}]*\}", r"<\1>", value)
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def _ports(service: dict) -> set[str]:
    out = set()
    for p in service.get("ports") or []:
        out.add(str(p) if not isinstance(p, dict) else f"{p['published']}:{p['target']}")
    return out


def _gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    ids = []
    for dev in devices:
        assert "gpu" in dev.get("capabilities", []), dev
        assert dev.get("driver") == "nvidia", dev
        ids.extend(str(i) for i in dev["device_ids"])
    return ids


def test_compose_services(compose):
    services = compose["services"]
    assert {"prefill", "decode", "build", "lb", "redis", "prometheus", "grafana", "openai"} <= set(services)
    for name in ("prefill", "decode", "build", "openai"):
        assert _default(services[name]["image"]) == TRITON_IMAGE, name
    assert services["lb"]["image"] == "nginx:1.27"
    assert services["redis"]["image"].startswith("redis:7")
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    # Prometheus 2.x keeps the rule/config format promtool 2.42 validates.
    assert re.match(r"prom/prometheus(:v2\.|$)", services["prometheus"]["image"])
    assert services["grafana"]["image"].startswith("grafana/grafana")


def test_compose_gpus(compose):
    services = compose["services"]
    assert _gpu_ids(services["prefill"]) == ["0"]
    assert _gpu_ids(services["decode"]) == ["1"]


@pytest.mark.parametrize(
    "role,http,grpc,metrics",
    [("prefill", 8000, 8001, 8002), ("decode", 9000, 9001, 9002)],
)
def test_compose_triton_servers(compose, role, http, grpc, metrics):
    svc = compose["services"][role]
    cmd = " ".join(_command(svc).replace("\\\n", " ").split())
    assert "pip install" in cmd and "-e /workspace" in cmd
    assert f"hetserve serve --role {role}" in cmd
    assert "--host 0.0.0.0" in cmd  # loopback is the default; containers are reached over the compose network
    assert "--model-repository /models" in cmd
    for flag, port in (("--http-port", http), ("--grpc-port", grpc), ("--metrics-port", metrics)):
        assert f"{flag} {port}" in cmd, (flag, cmd)
    volumes = [str(v) for v in svc["volumes"]]
    assert any(v.split(":")[:2] == ["./", "/workspace"] or v.startswith("./:/workspace") for v in volumes)
    assert any(v.startswith("engines:/engines") for v in volumes)
    assert any(v.split(":")[1] == "/models" for v in volumes)
    hc = svc["healthcheck"]
    assert hc["interval"] == "5s"
    assert f"localhost:{http}/v2/health/ready" in " ".join(hc["test"])
    env = {k: _default(v) for k, v in _env(svc).items()}
    assert env["HETSERVE_DECODE_URL"] == "decode:9001"
    assert env["HETSERVE_KV_TRANSPORT"] == "grpc"
    assert env["HETSERVE_REDIS_URL"] == "redis://:<HETSERVE_REDIS_PASSWORD>@redis:6379/0"
    assert env["HETSERVE_ADMIN_KEY"] == "<HETSERVE_ADMIN_KEY>"  # required from the environment, no default
    assert env["HETSERVE_ROLE"] == role
    assert all(k.startswith(("HETSERVE_", "PIP_", "PYTHON")) for k in env), env
    # Metrics reach Prometheus on the compose network only; nothing of a Triton server is published.
    assert str(metrics) in [str(p) for p in svc["expose"]]
    assert not _ports(svc)
    assert svc["depends_on"]["build"]["condition"] == "service_completed_successfully"


def test_compose_ports_and_dependencies(compose):
    services = compose["services"]
    # Clients enter through the balancer only (Triton HTTP/gRPC + the OpenAI API); no decode, metrics, Redis
    # or admin port is published; the dashboards only on the host's loopback.
    assert _ports(services["lb"]) == {"8000:8000", "8001:8001", "8080:8080"}
    for name in ("prefill", "decode", "openai", "redis", "build"):
        assert not _ports(services[name]), name
    published = set().union(*(_ports(s) for s in services.values()))
    assert published <= PUBLISHED, published - PUBLISHED
    assert _ports(services["prometheus"]) == {"127.0.0.1:9090:9090"}
    assert _ports(services["grafana"]) == {"127.0.0.1:3000:3000"}
    assert services["prefill"]["depends_on"]["decode"]["condition"] == "service_healthy"
    assert services["lb"]["depends_on"]["prefill"]["condition"] == "service_healthy"
    assert services["lb"]["depends_on"]["openai"]["condition"] == "service_healthy"


def test_compose_openai_frontend(compose):
    svc = compose["services"]["openai"]
    cmd = " ".join(_command(svc).replace("\\\n", " ").split())
    assert 'pip install --no-cache-dir -e "/workspace[openai]"' in cmd
    assert "hetserve serve --role openai --triton-url prefill:8001" in cmd and "--http-port 8080" in cmd
    assert "--host 0.0.0.0" in cmd and "--engine-dir /engines" in cmd
    assert "localhost:8080/health" in " ".join(svc["healthcheck"]["test"])
    assert svc["depends_on"]["prefill"]["condition"] == "service_healthy"


def test_compose_secrets_from_env_no_weak_defaults(compose):
    services = compose["services"]
    g = _env(services["grafana"])
    assert g["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?"), g
    assert g["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in g
    r = services["redis"]
    assert _env(r)["REDIS_PASSWORD"].startswith("${HETSERVE_REDIS_PASSWORD:?")
    assert "--requirepass" in _command(r) and "$$REDIS_PASSWORD" in _command(r)
    assert "$$REDIS_PASSWORD" in " ".join(r["healthcheck"]["test"])
    assert not any("lifecycle" in a for a in services["prometheus"]["command"])
    assert "admin:admin" not in COMPOSE.read_text() and ":-admin}" not in COMPOSE.read_text().replace(
        "GRAFANA_ADMIN_USER:-admin}", "")


def test_compose_build_service(compose):
    build = compose["services"]["build"]
    cmd = _command(build)
    assert "pip install" in cmd and "hetserve build --checkpoint" in cmd and "--out /engines" in cmd
    assert any(str(v).startswith("engines:/engines") for v in build["volumes"])
    assert build.get("restart") == "no"
    assert "engines" in compose["volumes"]


def test_compose_healthchecks(compose):
    services = compose["services"]
    for name in ("prefill", "decode", "lb", "redis", "prometheus", "grafana"):
        hc = services[name].get("healthcheck")
        assert hc and hc["interval"] == "5s", name
    assert "/v2/health/ready" in " ".join(services["lb"]["healthcheck"]["test"])
    assert "redis-cli" in " ".join(services["redis"]["healthcheck"]["test"])


def test_compose_lb_prometheus_grafana_mounts(compose):
    services = compose["services"]
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in services["lb"]["volumes"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert any("--config.file=/etc/prometheus/prometheus.yml" in a for a in services["prometheus"]["command"])
    gvols = services["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in gvols
    dash_mount = next(v for v in gvols if v.startswith("./deploy/grafana/dashboards:"))
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dash_mount.split(":")[1]


def test_compose_bind_mount_sources_exist(compose):
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes") or []:
            src = _default(str(vol)).split(":")[0]
            if src.startswith(("./", "../")) and "checkpoints" not in src:
                assert (ROOT / src).exists(), f"{name}: missing bind-mount source {src}"


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        try:
            if _run([docker, "compose", "version"], timeout=30).returncode == 0:
                return [docker, "compose"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_cli_config():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    proc = _run(cli + ["-f", str(COMPOSE), "config", "-q"], env={**_clean_env(), **SECRETS})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # without the secrets compose refuses to start anything
    env = {k: v for k, v in _clean_env().items() if k not in SECRETS}
    proc = _run(cli + ["-f", str(COMPOSE), "config", "-q"], env=env)
    assert proc.returncode != 0 and "set " in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ----------------------------------------------------------------------- nginx
def test_nginx_conf_structure():
    conf = NGINX.read_text()
    assert conf.count("{") == conf.count("}")
    assert re.search(r"upstream\s+triton_http\s*\{[^}]*server\s+prefill:8000", conf)
    assert re.search(r"upstream\s+triton_grpc\s*\{[^}]*server\s+prefill:8001", conf)
    assert re.search(r"listen\s+8000\s*;", conf)
    assert re.search(r"listen\s+8001\s+http2\s*;", conf)
    assert "grpc_pass grpc://triton_grpc;" in conf
    assert "proxy_pass http://triton_http;" in conf
    assert "location ~ ^/v2/health/(ready|live)$" in conf
    assert "proxy_buffering off;" in conf  # SSE token streaming
    assert re.search(r"grpc_read_timeout\s+\d+s;", conf)
    assert re.search(r"upstream\s+openai_http\s*\{[^}]*server\s+openai:8080", conf)
    assert re.search(r"listen\s+8080\s*;", conf)


def test_nginx_allow_list_only():
    """Only the client models' generate/infer + health (HTTP), inference + health methods (gRPC) and the OpenAI
    routes are proxied; every server's catch-all refuses (the live check is tests/test_openai.py)."""
    conf = NGINX.read_text()
    body = re.sub(r"#[^\n]*", "", conf)
    proxied = re.findall(r"location\s+([^{]*)\{[^}]*(?:proxy_pass|grpc_pass)", body)
    for loc in proxied:
        loc = loc.strip()
        assert loc.startswith(("~ ^/v2/models/(llm|ensemble|aggregated)", "~ ^/v2/health/", "= /v1/models",
                               "~ ^/v1/(chat/completions|completions|models/",
                               "~ ^/inference\\.GRPCInferenceService/(ModelInfer|ModelStreamInfer|ServerLive|")), loc
    assert not any("repository" in loc or "sharedmemory" in loc.lower() or "Trace" in loc or "Log" in loc
                   for loc in proxied), proxied
    catch_alls = re.findall(r"location\s+/\s*\{([^}]*)\}", body)
    assert len(catch_alls) == 3, catch_alls
    assert all("proxy_pass" not in c and "grpc_pass" not in c for c in catch_alls)
    assert sum("return 403" in c for c in catch_alls) == 2
    assert any("grpc-status 7" in c for c in catch_alls)  # PERMISSION_DENIED


def test_nginx_conf_syntax(tmp_path):
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if nginx is None:
        pytest.skip("nginx is not installed")
    # nginx -t resolves upstream host names; compose's "prefill" only exists in
    # the compose network, so test a copy that points at loopback.
    conf = NGINX.read_text().replace("prefill:", "127.0.0.1:").replace("openai:", "127.0.0.1:")
    (tmp_path / "logs").mkdir()
    path = tmp_path / "nginx.conf"
    path.write_text(conf)
    proc = _run([nginx, "-t", "-p", str(tmp_path), "-c", str(path), "-g", f"pid {tmp_path}/nginx.pid;"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ prometheus
def _load(path: Path) -> dict:
    with path.open() as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize(
    "name,prefill,decode",
    [("prometheus.yml", "prefill:8002", "decode:9002"), ("prometheus-local.yml", "127.0.0.1:8002", "127.0.0.1:9002")],
)
def test_prometheus_config(name, prefill, decode):
    cfg = _load(PROM_DIR / name)
    assert cfg["global"]["scrape_interval"] == "5s"
    assert cfg["rule_files"] == ["alerts.yml"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    targets = {
        job: [t for sc in j.get("static_configs", []) for t in sc["targets"]] for job, j in jobs.items()
    }
    assert targets["hetserve-prefill"] == [prefill]
    assert targets["hetserve-decode"] == [decode]
    for job in ("hetserve-prefill", "hetserve-decode"):
        assert jobs[job].get("scrape_interval", cfg["global"]["scrape_interval"]) == "5s"


REQUIRED_ALERTS = {
    "HetserveHighUtilization": {"hetserve_utilization_ratio", "nv_gpu_utilization"},
    "HetserveTTFTP99High": {"hetserve_ttft_seconds"},
    "HetserveKVTransferFailures": {"hetserve_kv_transfer_failures_total"},
    "HetserveSnapshotStale": {"hetserve_snapshot_age_seconds"},
    "HetserveBreakerOpen": {"hetserve_breaker_state"},
    "HetserveServerDown": {"up"},
}


@pytest.fixture(scope="module")
def alert_rules() -> dict[str, dict]:
    rules = {}
    for group in _load(PROM_DIR / "alerts.yml")["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["alert"] not in rules, f"duplicate alert {rule['alert']}"
                rules[rule["alert"]] = rule
    return rules


def test_alert_rules_content(alert_rules):
    assert set(REQUIRED_ALERTS) <= set(alert_rules)
    for name, metrics in REQUIRED_ALERTS.items():
        rule = alert_rules[name]
        found = metrics_in(rule["expr"])
        assert metrics <= found, (name, found)
        assert found <= KNOWN_METRICS, (name, found - KNOWN_METRICS)
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
    compact = {name: " ".join(rule["expr"].split()) for name, rule in alert_rules.items()}
    assert alert_rules["HetserveHighUtilization"]["for"] == "1m"
    assert compact["HetserveHighUtilization"].count("> 0.9") == 2
    assert "histogram_quantile(0.99" in compact["HetserveTTFTP99High"]
    assert "hetserve_ttft_seconds_bucket" in compact["HetserveTTFTP99High"]
    assert compact["HetserveTTFTP99High"].endswith("> 0.2")
    assert "increase(hetserve_kv_transfer_failures_total[5m])" in compact["HetserveKVTransferFailures"]
    assert compact["HetserveKVTransferFailures"].endswith("> 0")
    assert compact["HetserveSnapshotStale"].endswith("> 300")
    assert compact["HetserveBreakerOpen"].endswith(">= 2")
    assert compact["HetserveServerDown"].endswith("== 0")


def test_alert_unit_tests_cover_every_alert(alert_rules):
    tests = _load(PROM_DIR / "alerts_test.yml")
    assert tests["rule_files"] == ["alerts.yml"]
    fired, silent = set(), set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(alert_rules) <= fired, set(alert_rules) - fired
    assert set(alert_rules) <= silent, set(alert_rules) - silent


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    return promtool


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-local.yml"])
def test_promtool_check_config(name):
    proc = _run([_promtool(), "check", "config", f"deploy/prometheus/{name}"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_check_rules():
    proc = _run([_promtool(), "check", "rules", "deploy/prometheus/alerts.yml"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_test_rules():
    proc = _run([_promtool(), "test", "rules", "deploy/prometheus/alerts_test.yml"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


# --------------------------------------------------------------------- grafana
def test_grafana_provisioning():
    ds = _load(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert source["uid"] == "prometheus"
    providers = _load(GRAFANA_DIR / "provisioning" / "dashboards" / "dashboards.yml")
    assert providers["apiVersion"] == 1
    assert providers["providers"][0]["type"] == "file"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def test_dashboard_structure(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _panels(dashboard):
        gp = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(gp) and gp["x"] + gp["w"] <= 24, panel["title"]


def test_dashboard_panels_query_known_metrics(dashboard):
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 13
    for panel in panels:
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        exprs = [t.get("expr", "") for t in panel.get("targets", [])]
        assert exprs and all(exprs), f"panel {panel['title']!r} has no query"
        found = set().union(*(metrics_in(e) for e in exprs))
        assert found & KNOWN_METRICS, (panel["title"], exprs)
        assert found <= KNOWN_METRICS, (panel["title"], found - KNOWN_METRICS)


def test_dashboard_covers_required_views(dashboard):
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    by_title = {p["title"].lower(): p for p in panels}
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])

    def panel(*words):
        matches = [p for t, p in by_title.items() if all(w in t for w in words)]
        assert matches, f"no panel titled with {words}"
        return " ".join(t["expr"] for t in matches[0]["targets"])

    for metric in ("hetserve_ttft_seconds", "hetserve_tpot_seconds"):
        expr = panel(metric.split("_")[1])
        assert "histogram_quantile(0.5" in expr and "histogram_quantile(0.99" in expr
    assert "tokens" in " ".join(by_title)
    assert "by (transport)" in panel("kv transfer", "throughput")
    fail = panel("failures", "recomputes")
    assert "hetserve_kv_transfer_failures_total" in fail and "hetserve_kv_recompute_total" in fail
    assert "by (tier)" in panel("tier")
    hit = panel("hit rate")
    assert "hetserve_kv_prefix_hits_total" in hit and "hetserve_kv_prefix_lookups_total" in hit
    assert "hetserve_batch_size" in panel("batch size")
    assert "hetserve_queue_depth" in panel("queue depth")
    assert "hetserve_breaker_state" in panel("breaker")
    assert "hetserve_snapshot_age_seconds" in panel("snapshot")
    assert "nv_gpu_utilization" in panel("gpu")
    assert "nv_cpu_utilization" in panel("cpu utilization")
    assert HETSERVE_METRICS <= metrics_in(exprs)


def test_dashboard_queries_parse(dashboard, tmp_path):
    """Every panel query is valid PromQL (Grafana macros substituted)."""
    promtool = _promtool()
    rules = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$job", "hetserve-.*")
            assert "$" not in expr, expr
            rules.append({"record": f"dashboard:panel{panel['id']}:{target['refId'].lower()}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = _run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -------------------------------------------------------------------- loadtest
_PROBE = textwrap.dedent(
    """
    import importlib.util, json, random, sys
    spec = importlib.util.spec_from_file_location("hetserve_locustfile", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    from locust import LoadTestShape, User
    rng = random.Random(0)
    prompts = [mod.next_prompt(rng) for _ in range(200)]
    out = {
        "scenario": mod.SCENARIO_NAME,
        "duration": mod.DURATION_S,
        "users": sorted(n for n, v in vars(mod).items()
                        if isinstance(v, type) and issubclass(v, User) and not getattr(v, "abstract", False)
                        and v.__module__ == mod.__name__),
        "shapes": sorted(n for n, v in vars(mod).items()
                         if isinstance(v, type) and issubclass(v, LoadTestShape) and v is not LoadTestShape),
        "prompt_chars": [len(p.text) for p in prompts],
        "max_tokens": sorted({p.max_tokens for p in prompts}),
        "kinds": sorted({p.kind for p in prompts}),
        "latency_fields": mod.LATENCY_FIELDS,
        "remote_refused": False,
        "loopback_ok": mod._is_loopback("127.0.0.1") and mod._is_loopback("localhost") and mod._is_loopback("::1"),
    }
    try:
        mod._check_target("10.1.2.3")
    except RuntimeError:
        out["remote_refused"] = True
    if out["shapes"]:
        shape = mod.BurstShape()
        ticks = {}
        for t in range(0, int(mod.DURATION_S) + 5):
            shape.get_run_time = lambda t=t: float(t)
            ticks[t] = shape.tick()
        out["ticks"] = ticks
    print("PROBE" + json.dumps(out))
    """
)


def _need_locust():
    # never import locust here: its gevent monkey-patching deadlocks inside a threaded pytest process
    import importlib.util

    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")


def _probe(scenario: str) -> dict:
    _need_locust()
    env = _clean_env()
    env["HETSERVE_SCENARIO"] = scenario
    proc = _run([sys.executable, "-c", _PROBE, str(LOADTEST / "locustfile.py")], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))
    return json.loads(line[len("PROBE"):])


@pytest.mark.parametrize("scenario", ["steady", "burst", "long_prompts", "mixed"])
def test_locustfile_scenarios(scenario):
    info = _probe(scenario)
    assert info["scenario"] == scenario
    assert info["users"] == ["OpenAIChatStreamUser", "TritonGrpcStreamUser", "TritonHttpStreamUser"]
    assert 0 < info["duration"] <= 600
    assert info["remote_refused"] and info["loopback_ok"]
    assert {"ttft_s", "tpot_s", "e2e_s", "n_tokens", "ok"} <= set(info["latency_fields"])
    chars = info["prompt_chars"]
    if scenario == "burst":
        assert info["shapes"] == ["BurstShape"]
        ticks = {int(k): v for k, v in info["ticks"].items()}
        counts = [v[0] for t, v in sorted(ticks.items()) if v is not None]
        assert max(counts) > min(counts) > 0  # spikes over a baseline
        assert ticks[info["duration"]] is None  # stops on its own
    else:
        assert info["shapes"] == []  # -u/-r/-t stay in charge
    if scenario in ("steady", "burst"):
        assert max(chars) < 500
    if scenario == "long_prompts":
        assert min(chars) > 5000
    if scenario == "mixed":
        assert min(chars) < 500 < 5000 < max(chars)
        assert len(info["max_tokens"]) > 1
        assert any(k.endswith("+prefix") for k in info["kinds"])


def test_locust_lists_users():
    _need_locust()
    env = _clean_env()
    env["HETSERVE_SCENARIO"] = "steady"
    proc = _run([sys.executable, "-m", "locust", "-f", str(LOADTEST / "locustfile.py"), "--list"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TritonGrpcStreamUser" in proc.stdout and "TritonHttpStreamUser" in proc.stdout
    assert "OpenAIChatStreamUser" in proc.stdout


def test_run_sh_dry_run():
    env = _clean_env()
    env["HETSERVE_LOADTEST_OUT"] = "/tmp/hetserve-loadtest-dry-run"
    for scenario in ("steady", "burst", "long_prompts", "mixed"):
        proc = _run(["bash", str(LOADTEST / "run.sh"), scenario, "--dry-run"], env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert "--headless" in out and "--csv /tmp/hetserve-loadtest-dry-run/locust" in out
        assert f"HETSERVE_SCENARIO={scenario}" in out
        assert "HETSERVE_LATENCY_CSV=/tmp/hetserve-loadtest-dry-run/latency.csv" in out
        if scenario == "burst":
            assert " -t " not in out  # BurstShape bounds the run
        else:
            assert re.search(r" -u \d+ -r \d+ -t \d+s ", out)
    assert not Path("/tmp/hetserve-loadtest-dry-run").exists()


def test_plot_renders_png(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(LOADTEST))
    try:
        import importlib

        plot = importlib.import_module("plot")
    finally:
        sys.path.pop(0)
    fields = ["start_time", "user", "protocol", "scenario", "prompt_kind", "prompt_chars",
              "max_tokens", "n_tokens", "n_responses", "ttft_s", "tpot_s", "e2e_s", "ok", "error"]
    latency = tmp_path / "latency.csv"
    with latency.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for i in range(120):
            ok = i % 40 != 7
            w.writerow({
                "start_time": 1_700_000_000 + i * 0.25, "user": "U", "protocol": "grpc" if i % 2 else "http",
                "scenario": "mixed", "prompt_kind": "short" if i % 3 else "long", "prompt_chars": 40 + i,
                "max_tokens": 32, "n_tokens": 32 if ok else 0, "n_responses": 33,
                "ttft_s": f"{0.03 + (i % 7) * 0.01:.4f}" if ok else "",
                "tpot_s": f"{0.005 + (i % 5) * 0.001:.4f}" if ok else "",
                "e2e_s": f"{0.2 + (i % 9) * 0.02:.4f}", "ok": int(ok), "error": "" if ok else "boom",
            })
    prefix = tmp_path / "locust"
    stats_cols = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time",
                  "Average Response Time", "Min Response Time", "Max Response Time", "Average Content Size",
                  "Requests/s", "Failures/s", "50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%",
                  "99.9%", "99.99%", "100%"]
    with open(f"{prefix}_stats.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(stats_cols)
        w.writerow(["grpc", "ttft", 60, 0, 40, 41, 30, 90, 0, 2, 0, 40, 45, 50, 55, 60, 70, 80, 90, 90, 90, 90])
        w.writerow(["", "Aggregated", 60, 0, 40, 41, 30, 90, 0, 2, 0, 40, 45, 50, 55, 60, 70, 80, 90, 90, 90, 90])
    with open(f"{prefix}_stats_history.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "User Count", "Type", "Name", "Requests/s"])
        for t in range(30):
            w.writerow([1_700_000_000 + t, 4 if t < 15 else 8, "", "Aggregated", 2.0])
    png = tmp_path / "out" / "latency.png"
    summary = tmp_path / "summary.json"
    rc = plot.main(["--latency-csv", str(latency), "--locust-csv", str(prefix),
                    "--out", str(png), "--summary-json", str(summary)])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    data = json.loads(summary.read_text())
    assert data["protocols"]["all"]["requests"] == 120
    assert data["protocols"]["all"]["failures"] == 3
    assert 0.03 <= data["protocols"]["all"]["ttft_s"]["p50"] <= 0.09
    assert data["tokens_per_s"] > 0
