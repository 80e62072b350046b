"""Kubernetes deployment (deploy/k8s) and DNS discovery of the decode pool.

* DNS discovery, unit: DecodePool with a resolver stub (a fake getaddrinfo, said so below).
* DNS discovery, end to end: real tritonservers. Two decode servers on 127.0.0.2 and 127.0.0.3 (same ports, as pods
  behind a headless Service), and a prefill server whose orchestrator resolves `hetserve-decode.k8s.test`: the
  prefill tritonserver runs in its own mount namespace where /etc/hosts is this test's file, which the test then
  rewrites (a pod leaves, a pod comes back) while requests flow. Only loopback addresses.
* Manifests, offline: `kubectl kustomize` renders every overlay (a missing kubectl fails, never skips; .ci/run
  installs it), every object validates against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), and
  every reference resolves: Service/PDB selectors, HPA target, named ports, probes, ConfigMaps, Secrets, PVCs,
  $(VAR)s, the DNS name and ports the orchestrator uses, and the Triton flags server.py derives from each
  container's `hetserve serve` arguments.
"""
import copy
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import scrape, total, wait_for
from hetserve.kv.transport.negotiate import Negotiated
from hetserve.reliability import DecodePool, _resolve_all


def _grpc_only(url, timeout_s):
    """Stub negotiation for the DNS unit tests below (their members are made-up addresses: a real negotiation
    would dial 10.0.0.x)."""
    return Negotiated(("grpc",))


def _up(url, timeout_s):
    return 1.0  # stub health check: every made-up member is up

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
BASE_PORT = int(os.environ.get("HETSERVE_K8S_TEST_PORT", "27000"))  # not the shared topology fixture's ports


# ---- DNS discovery: unit (resolver stub) ----------------------------------------------------------------------
class FakeDNS:
    """Stand-in for socket.getaddrinfo (a fake: unit tests only). `records` maps a name to its A/AAAA records;
    `error` makes every lookup raise (a resolver outage)."""

    def __init__(self, records):
        self.records = dict(records)
        self.error = None
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, host, port, type=0, **kw):
        with self.lock:
            self.calls += 1
            if self.error is not None:
                raise self.error
            if host not in self.records:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                     (a, port, 0, 0) if ":" in a else (a, port)) for a in self.records[host]]


def test_dns_members_follow_the_records_every_round():
    dns = FakeDNS({"hetserve-decode": ["10.0.0.2", "10.0.0.3"]})
    pool = DecodePool([], dns="hetserve-decode:9001", resolver=dns, check=_up, negotiate=_grpc_only, start=False)
    assert sorted(pool.members) == ["10.0.0.2:9001", "10.0.0.3:9001"]
    assert pool.pick() == "10.0.0.2:9001"  # in flight on .2: its state must survive the re-resolution below
    dns.records["hetserve-decode"] = ["10.0.0.2", "10.0.0.3", "10.0.0.4"]  # HPA scaled up
    pool.check_all()
    assert sorted(pool.members) == ["10.0.0.2:9001", "10.0.0.3:9001", "10.0.0.4:9001"]
    assert pool.members["10.0.0.2:9001"].inflight == 1
    dns.records["hetserve-decode"] = ["10.0.0.2", "10.0.0.4"]  # a pod went unready / was drained
    pool.check_all()
    assert sorted(pool.members) == ["10.0.0.2:9001", "10.0.0.4:9001"]
    assert pool.pick() == "10.0.0.4:9001"  # least loaded
    pool.release("10.0.0.3:9001")  # a stream that ends on a member that left: harmless
    pool.close()


def test_dns_outage_keeps_the_last_answer_and_no_records_empties_the_pool():
    dns = FakeDNS({"hetserve-decode": ["10.0.0.2", "10.0.0.3"]})
    pool = DecodePool(["10.0.0.9:9001"], dns="hetserve-decode:9001", resolver=dns, check=_up, negotiate=_grpc_only,
                      start=False)
    assert len(pool.members) == 3
    dns.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    pool.check_all()
    assert sorted(pool.members) == ["10.0.0.2:9001", "10.0.0.3:9001", "10.0.0.9:9001"]  # not emptied by a hiccup
    dns.error = OSError("resolver socket error")
    pool.check_all()
    assert len(pool.members) == 3
    dns.error = None
    del dns.records["hetserve-decode"]  # headless Service with no ready pod: NXDOMAIN -> no DNS members
    pool.check_all()
    assert list(pool.members) == ["10.0.0.9:9001"]  # the static member stays
    pool.close()


def test_dns_names_ipv6_and_dedup():
    dns = FakeDNS({"a": ["10.0.0.2", "10.0.0.2"], "b": ["fd00::5"], "c": ["10.0.0.2"]})
    assert _resolve_all("a:9001, b:9001,c:9001", dns) == ["10.0.0.2:9001", "[fd00::5]:9001"]
    assert _resolve_all("", dns) == [] and _resolve_all(None, dns) == []
    assert _resolve_all("a:notaport", dns) is None  # a configuration error: logged, keeps what the pool had
    pool = DecodePool(["10.0.0.2:9001"], dns="a:9001", resolver=dns, check=_up, negotiate=_grpc_only, start=False)
    assert list(pool.members) == ["10.0.0.2:9001"]
    pool.close()


def test_dns_is_re_resolved_on_the_health_interval():
    dns = FakeDNS({"hetserve-decode": ["10.0.0.2"]})
    pool = DecodePool([], dns="hetserve-decode:9001", resolver=dns, interval_s=0.05, check=_up, negotiate=_grpc_only)
    try:
        dns.records["hetserve-decode"] = ["10.0.0.2", "10.0.0.7"]
        wait_for(lambda: len(pool.snapshot()) == 2, 5, "the health thread to pick up the new record")
        calls = dns.calls
        time.sleep(0.3)
        assert dns.calls >= calls + 3  # once per round, not once at start-up
    finally:
        pool.close()


# ---- DNS discovery: end to end (real tritonservers, /etc/hosts in a mount namespace) ---------------------------
HOSTS_NAME = "hetserve-decode.k8s.test"


def _write_hosts(path: Path, addrs):
    # in place (same inode): the prefill server sees this file through a bind mount
    with open(path, "w") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{a} {HOSTS_NAME}\n" for a in addrs))


def _finished(url: str) -> int:
    from hetserve.cluster import decode_op

    return int(decode_op(url, "stats")["scheduler"]["finished"])


def _pool_gauge(port: int):
    s = scrape(port)
    return total(s, "hetserve_decode_servers", state="healthy"), total(s, "hetserve_decode_servers", state="down")


def _generate(url: str, prompt: str, max_tokens: int = 6):
    """Greedy tokens for a raw prompt (no chat template: these short prompts share no whole KV block, so the
    KV-aware router spreads them by load alone)."""
    from hetserve.client import stream

    toks = [t for c in stream(url, prompt, model="llm", max_tokens=max_tokens, apply_chat_template=False)
            for t in c.token_ids]
    assert toks, "no tokens"
    return toks


def _local_prefills(url: str) -> int:
    from hetserve.cluster import decode_op

    return int(decode_op(url, "stats")["counters"]["local_prefill"])


HISTORY = ("Kubernetes runs containers in pods. A Deployment keeps a number of identical pods running and replaces "
           "the ones that fail. A Service gives the pods one stable name; a headless Service instead returns every "
           "pod's address in DNS, which is how the orchestrator finds each decode server. When a pod leaves, its "
           "address leaves the DNS answer, and the pool drops it on its next health round. ")


def test_dns_discovery_end_to_end(engine_dir, tmp_path, monkeypatch):
    from hetserve.server import ServerSpec, TritonProcess, tritonserver_binary

    assert shutil.which("unshare") and shutil.which("mount"), "util-linux unshare/mount are needed (Debian util-linux)"
    hosts = tmp_path / "hosts"
    _write_hosts(hosts, ["127.0.0.2", "127.0.0.3"])
    wrapper = tmp_path / "tritonserver-in-netns"
    userns = "" if os.geteuid() == 0 else "-r"  # root: a mount namespace is enough; else map ourselves to root
    wrapper.write_text("#!/bin/sh\n# tritonserver with the test's /etc/hosts (private mount namespace, same network)\n"
                       f"exec unshare {userns} -m /bin/sh -c 'mount --bind \"$0\" /etc/hosts && exec \"$@\"' "
                       f"{hosts} {tritonserver_binary()} \"$@\"\n")
    wrapper.chmod(0o755)
    dport = BASE_PORT + 100
    light = {"HETSERVE_THREADS": "1", "HETSERVE_DECODE_ENGINES": "decode_fp32"}
    decodes = {a: TritonProcess(ServerSpec("decode", dport, dport + 1, dport + 2, engine_dir, host=a, env=light,
                                           log_file=str(tmp_path / f"decode-{a}.log")))
               for a in ("127.0.0.2", "127.0.0.3")}
    prefill = TritonProcess(ServerSpec(
        "prefill", BASE_PORT, BASE_PORT + 1, BASE_PORT + 2, engine_dir, log_file=str(tmp_path / "prefill.log"),
        env={**light, "HETSERVE_DECODE_URL": "", "HETSERVE_DECODE_DNS": f"{HOSTS_NAME}:{dport + 1}",
             "HETSERVE_HEALTH_INTERVAL_S": "1", "HETSERVE_KV_TRANSPORT": "grpc", "HETSERVE_BREAKER_P99_MS": "60000",
             # a busy CI box must not fail canaries (a member marked down would skew the routing counts below)
             "HETSERVE_HEALTH_TIMEOUT_S": "20",
             # the router reads the members' published blocks every second (the follow-up below may come sooner:
             # it also counts what it routed itself)
             "HETSERVE_ROUTER_REFRESH_S": "1"}))
    procs = list(decodes.values()) + [prefill]
    try:
        for p in decodes.values():
            p.start()
        with monkeypatch.context() as m:
            m.setenv("HETSERVE_TRITONSERVER", str(wrapper))
            assert prefill.command()[0] == str(wrapper)
            prefill.start()
        for p in procs:
            p.wait_ready(300)
        grpc = f"127.0.0.1:{BASE_PORT + 1}"
        urls = {a: f"{a}:{dport + 1}" for a in decodes}
        # the test process itself cannot resolve the name: only the prefill server's namespace can
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo(HOSTS_NAME, 1)
        wait_for(lambda: _pool_gauge(BASE_PORT + 2) == (2, 0), 120, "both DNS members healthy in the pool")
        before = {a: _finished(u) for a, u in urls.items()}
        for i in range(4):
            _generate(grpc, f"Count to {i + 3}.")
        after = {a: _finished(u) for a, u in urls.items()}
        served = {a: after[a] - before[a] for a in urls}
        assert sum(served.values()) == 4 and all(n >= 1 for n in served.values()), served

        # KV-aware routing over DNS members: a conversation's follow-up goes back to the member holding its
        # history and is prefilled there; when that pod leaves the Service, it is prefilled and decoded elsewhere
        before = {a: (_finished(u), _local_prefills(u)) for a, u in urls.items()}
        _generate(grpc, HISTORY + "Question: what does a headless Service return?", max_tokens=4)
        holder = next(a for a, u in urls.items() if _finished(u) > before[a][0])
        other = next(a for a in urls if a != holder)
        follow_up = HISTORY + "Question: what happens when a pod leaves?"
        on_holder = _generate(grpc, follow_up, max_tokens=8)
        assert _finished(urls[holder]) == before[holder][0] + 2 and _finished(urls[other]) == before[other][0]
        assert _local_prefills(urls[holder]) == before[holder][1] + 1, "the follow-up was not prefilled on its holder"
        placement = scrape(BASE_PORT + 2)
        assert total(placement, "hetserve_prefill_placement_total", where="decode") >= 1

        _write_hosts(hosts, [other])  # the holder's pod leaves the Service
        wait_for(lambda: _pool_gauge(BASE_PORT + 2) == (1, 0), 60, "the pool to drop the member DNS no longer lists")
        before = {a: _finished(u) for a, u in urls.items()}
        local_before = _local_prefills(urls[other])
        assert _generate(grpc, follow_up, max_tokens=8) == on_holder, "greedy tokens differ across the two paths"
        assert _local_prefills(urls[other]) == local_before  # it held nothing: prefilled on the prefill server
        for i in range(2):
            _generate(grpc, f"Name {i + 2} colours.")
        assert _finished(urls[other]) - before[other] == 3
        assert _finished(urls[holder]) == before[holder]

        _write_hosts(hosts, ["127.0.0.2", "127.0.0.3"])  # and comes back
        wait_for(lambda: _pool_gauge(BASE_PORT + 2) == (2, 0), 60, "the pool to re-add the member")
        print(f"\nDNS e2e: 4 requests over 2 DNS members {served}; a follow-up prefilled on its holder {holder}, then "
              "on the prefill server and decoded on the other once the holder left DNS; member re-added")
    finally:
        for p in procs:
            p.stop()


# ---- manifests: render ----------------------------------------------------------------------------------------
def kubectl() -> str:
    """kubectl (kustomize is built in): the one deploy/k8s/ci-tools.sh unpacked when the machine's was missing or
    too old, else the machine's."""
    for k in (os.environ.get("HETSERVE_KUBECTL"), str(ROOT / ".hetserve/tools/kubectl"), shutil.which("kubectl")):
        if k and os.access(k, os.X_OK):
            return k
    pytest.fail("no kubectl: run `bash deploy/k8s/ci-tools.sh` (.ci/run does)")


def render(path: Path):
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {path} failed:\n{r.stderr}"
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert docs, f"{path} rendered nothing"
    return docs


@pytest.fixture(scope="module")
def rendered():
    return {o: render(K8S / "overlays" / o) for o in OVERLAYS}


@pytest.fixture(scope="module")
def with_servicemonitor(tmp_path_factory):
    """An overlay the way a Prometheus Operator user writes it: cpu + components/servicemonitor."""
    d = tmp_path_factory.mktemp("k8s-sm")
    rel = lambda p: os.path.relpath(p, d)  # noqa: E731 - kustomize refuses absolute paths
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "hetserve",
        "resources": [rel(K8S / "overlays" / "cpu")], "components": [rel(K8S / "components" / "servicemonitor")]}))
    return render(d)


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs):
    """name -> (object, pod template) for Deployments and Jobs."""
    return {d["metadata"]["name"]: (d, d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "Job")}


def containers(tpl, init=True):
    spec = tpl["spec"]
    return spec.get("containers", []) + (spec.get("initContainers", []) if init else [])


def env_map(docs, c) -> dict:
    """A container's environment as Kubernetes builds it: envFrom ConfigMaps first, then env in order, each
    value's $(VAR)s expanded against what is defined before it."""
    cms = by_kind(docs, "ConfigMap")
    out = {}
    for src in c.get("envFrom", []):
        out.update(cms[src["configMapRef"]["name"]]["data"])
    for e in c.get("env", []):
        out[e["name"]] = expand(e["value"], out) if "value" in e else "<from %s>" % next(iter(e["valueFrom"]))
    return out


def expand(s: str, env: dict) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), s)


# ---- manifests: schemas ---------------------------------------------------------------------------------------
K8S_VERSIONS = ("1.29.0", None)  # oldest we claim (docs/kubernetes.md) and the newest kubernetes-validate ships


def test_every_overlay_validates_against_the_kubernetes_schemas(rendered, with_servicemonitor):
    import kubernetes_validate as kv

    versions = [v or kv.latest_version() for v in K8S_VERSIONS]
    for name, docs in [*rendered.items(), ("cpu+servicemonitor", with_servicemonitor)]:
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "Job", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap",
                "PersistentVolumeClaim", "Namespace"} <= kinds, (name, kinds)
        for d in docs:
            if d["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: no upstream schema; checked in test_servicemonitor_selects_the_metrics_ports
            for v in versions:
                try:
                    kv.validate(d, v, strict=True)
                except kv.ValidationError as e:
                    pytest.fail(f"{name}: {d['kind']}/{d['metadata']['name']} invalid for Kubernetes {v}: {e}")
    # the validator catches what it must: an unknown field and a wrong type
    dep = copy.deepcopy(by_kind(rendered["cpu"], "Deployment")["hetserve-decode"])
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPrt"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, versions[-1], strict=True)
    dep = copy.deepcopy(by_kind(rendered["cpu"], "Deployment")["hetserve-decode"])
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, versions[-1], strict=True)


# ---- manifests: references ------------------------------------------------------------------------------------
def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_pdbs_hpa_and_probes_resolve(rendered, overlay):
    docs = rendered[overlay]
    deps = by_kind(docs, "Deployment")
    assert set(deps) == {"hetserve-prefill", "hetserve-decode", "hetserve-openai", "hetserve-redis"}
    for svc in by_kind(docs, "Service").values():
        sel = svc["spec"]["selector"]
        targets = [d for d in deps.values() if matches(sel, d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} Deployments"
        ports = {p["name"]: p["containerPort"] for c in containers(targets[0]["spec"]["template"], init=False)
                 for p in c.get("ports", [])}
        for sp in svc["spec"]["ports"]:
            tp = sp.get("targetPort", sp["port"])
            assert tp in ports or tp in ports.values(), f"{svc['metadata']['name']}: no container port {tp}"
            assert ports.get(tp, tp) == sp["port"], f"{svc['metadata']['name']}: {sp} vs container {ports}"
    for d in deps.values():
        assert matches(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert sum(matches(sel, d["spec"]["template"]["metadata"]["labels"]) for d in deps.values()) == 1
        assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable")
    assert {p["metadata"]["name"] for p in by_kind(docs, "PodDisruptionBudget").values()} >= {
        "hetserve-prefill", "hetserve-decode", "hetserve-openai"}
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    ref = hpa["spec"]["scaleTargetRef"]
    assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1" and ref["name"] in deps
    assert "replicas" not in deps[ref["name"]]["spec"], "the HPA owns the decode replica count"
    for name, (_, tpl) in workloads(docs).items():
        for c in containers(tpl, init=False):
            names = {p["name"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                for how in ("httpGet", "tcpSocket"):
                    if how in probe:
                        assert probe[how]["port"] in names, f"{name}/{c['name']} {kind} port {probe[how]['port']}"
            if c["name"] in ("prefill", "decode"):  # Triton's health endpoints
                assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
                assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            elif deps.get(name) is not None:
                assert c.get("readinessProbe") and c.get("livenessProbe"), f"{name}/{c['name']} has no probes"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmaps_secrets_volumes_and_env_resolve(rendered, overlay):
    docs = rendered[overlay]
    cms, pvcs = by_kind(docs, "ConfigMap"), by_kind(docs, "PersistentVolumeClaim")
    secret_keys = {}
    assert not by_kind(docs, "Secret"), "secrets are created by the operator, never rendered from the repository"
    for name, (obj, tpl) in workloads(docs).items():
        assert obj["metadata"].get("namespace") == "hetserve"
        for v in tpl["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
        vols = {v["name"] for v in tpl["spec"].get("volumes", [])}
        for c in containers(tpl):
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{name}/{c['name']} mounts unknown volume {m['name']}"
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in cms
            env = env_map(docs, c)
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    secret_keys.setdefault(ref["secretKeyRef"]["name"], set()).add(ref["secretKeyRef"]["key"])
                if "resourceFieldRef" in ref:
                    r = ref["resourceFieldRef"]
                    assert r["containerName"] == c["name"]
                    assert r["resource"].split(".", 1)[1] in c["resources"]["limits"]
            for s in [*env.values(), *c.get("args", []), *c.get("command", [])]:
                left = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand(s, env))
                assert not left, f"{name}/{c['name']}: $({left[0]}) is not defined before use"
    assert secret_keys == {"hetserve-secrets": {"admin-key", "redis-password"}}
    guide = (ROOT / "docs" / "kubernetes.md").read_text()
    cmd = re.search(r"kubectl (?:-n \S+ )?create secret generic hetserve-secrets[^\n]*", guide)
    assert cmd, "docs/kubernetes.md must show how to create hetserve-secrets"
    assert set(re.findall(r"--from-literal=([a-z-]+)=", cmd.group(0))) == secret_keys["hetserve-secrets"]


def _serve_args(c) -> list:
    """`hetserve serve ...` of a container as a list (command + args, $(VAR)s left as they are)."""
    argv = c.get("command", []) + c.get("args", [])
    assert argv[:2] == ["hetserve", "serve"], argv
    return argv[2:]


def _parse_serve(argv):
    """The real CLI parser: what `hetserve serve` would run with these arguments."""
    from hetserve import cli

    got = {}
    orig = cli.cmd_serve
    cli.cmd_serve = lambda a: got.setdefault("args", a) and 0
    try:
        cli.main(["serve", *argv])
    finally:
        cli.cmd_serve = orig
    return got["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_match_the_triton_flags_and_the_orchestrator_finds_decode(rendered, overlay, monkeypatch):
    from hetserve.server import ADMIN_HEADER, RESTRICTED_APIS, ServerSpec, TritonProcess

    docs = rendered[overlay]
    deps, svcs = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    monkeypatch.setenv("HETSERVE_ADMIN_KEY", "k8s-test-key")
    flags, engine_dirs = {}, {}
    for role in ("prefill", "decode"):
        (c,) = deps[f"hetserve-{role}"]["spec"]["template"]["spec"]["containers"]
        env = env_map(docs, c)
        a = _parse_serve([expand(x, env) for x in _serve_args(c)])
        assert a.role == role
        spec = ServerSpec(a.role, a.http_port, a.grpc_port, a.metrics_port, a.engine_dir, host=a.host)
        cmd = TritonProcess(spec).command()
        f = dict(x[2:].split("=", 1) for x in cmd[1:] if x.startswith("--") and "=" in x)
        flags[role] = f
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": int(f["http-port"]), "grpc": int(f["grpc-port"]), "metrics": int(f["metrics-port"])}
        # pods are reached on their pod IP (kubelet probes, other pods): every port must bind all interfaces
        assert f["http-address"] == f["grpc-address"] == f["metrics-address"] == "0.0.0.0"
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}=k8s-test-key"
        assert f["http-restricted-api"] == restricted and f["grpc-restricted-protocol"] == restricted
        assert env["HETSERVE_ADMIN_KEY"] == "<from secretKeyRef>"
        ann = deps[f"hetserve-{role}"]["spec"]["template"]["metadata"]["annotations"]
        assert int(ann["prometheus.io/port"]) == ports["metrics"]
        # engines: the server reads the directory its own pool's build Job writes
        (job_c,) = by_kind(docs, "Job")[f"hetserve-build-{role}"]["spec"]["template"]["spec"]["containers"]
        jenv = env_map(docs, job_c)
        out = re.search(r'--engine-dir "([^"]+)"', job_c["args"][0]).group(1)
        out = re.sub(r"\$\{(\w+)\}", lambda m, jenv=jenv: jenv[m.group(1)], out)
        assert out == a.engine_dir, (role, out, a.engine_dir)
        engine_dirs[role] = out
    # the orchestrator's pool: the headless Service's name and gRPC port, nothing static
    (pc,) = deps["hetserve-prefill"]["spec"]["template"]["spec"]["containers"]
    penv = env_map(docs, pc)
    host, port = penv["HETSERVE_DECODE_DNS"].rsplit(":", 1)
    dsvc = svcs[host]
    assert dsvc["spec"]["clusterIP"] == "None" and not dsvc["spec"].get("publishNotReadyAddresses")
    svc_ports = {p["name"]: p["port"] for p in dsvc["spec"]["ports"]}
    assert int(port) == int(flags["decode"]["grpc-port"]) == svc_ports["grpc"]
    assert penv["HETSERVE_DECODE_URL"] == ""
    assert penv["HETSERVE_KV_TRANSPORT"] == "grpc", "pods on different nodes share no /dev/shm"
    # no admin surface through a Service: decode's HTTP port is not published; client Services only
    assert {p["name"] for p in dsvc["spec"]["ports"]} == {"grpc", "metrics"}
    assert {p["name"] for p in svcs["hetserve-prefill"]["spec"]["ports"]} == {"http", "grpc"}
    for s in svcs.values():
        assert s["spec"].get("type", "ClusterIP") == "ClusterIP", f"{s['metadata']['name']} exposed outside"
    # Redis: the URL decode uses points at the Redis Service, with the Secret's password
    (dc,) = deps["hetserve-decode"]["spec"]["template"]["spec"]["containers"]
    raw = {e["name"]: e.get("value") for e in dc["env"]}
    assert env_map(docs, dc)["REDIS_PASSWORD"] == "<from secretKeyRef>"
    m = re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@([\w-]+):(\d+)/0", raw["HETSERVE_REDIS_URL"])
    assert m and int(m.group(2)) == svcs[m.group(1)]["spec"]["ports"][0]["port"]
    (rc,) = deps["hetserve-redis"]["spec"]["template"]["spec"]["containers"]
    assert "--requirepass" in rc["args"][0]
    # the OpenAI frontend talks to the prefill Service's gRPC port and reads the prefill pool's engines
    (oc,) = deps["hetserve-openai"]["spec"]["template"]["spec"]["containers"]
    oa = _parse_serve([expand(x, env_map(docs, oc)) for x in _serve_args(oc)])
    assert oa.role == "openai" and oa.host == "0.0.0.0"
    phost, pport = oa.triton_url.rsplit(":", 1)
    assert int(pport) == {p["name"]: p["port"] for p in svcs[phost]["spec"]["ports"]}["grpc"]
    assert oa.http_port == oc["ports"][0]["containerPort"]
    assert oa.engine_dir == engine_dirs["prefill"]


def test_pools_precisions_and_accelerators(rendered):
    for overlay, docs in rendered.items():
        w = workloads(docs)
        pools = {n: tpl["spec"]["nodeSelector"]["hetserve.io/pool"] for n, (_, tpl) in w.items()}
        assert pools["hetserve-prefill"] == pools["hetserve-build-prefill"] == "compute"
        assert pools["hetserve-decode"] == pools["hetserve-build-decode"] == "bandwidth"
        for n, (_, tpl) in w.items():
            tol = {(t["key"], t.get("value")) for t in tpl["spec"].get("tolerations", [])}
            assert ("hetserve.io/pool", pools[n]) in tol, f"{overlay}: {n} does not tolerate its pool's taint"
        gpus = {n: c["resources"].get("limits", {}).get("nvidia.com/gpu") for n, (_, tpl) in w.items()
                for c in containers(tpl, init=False)}
        env = {n: env_map(docs, containers(tpl, init=False)[0]) for n, (_, tpl) in w.items()}
        if overlay == "cpu":
            assert not any(gpus.values())
            assert env["hetserve-prefill"]["HETSERVE_PREFILL_ENGINE"] == "prefill_fp32"
        else:
            assert all(gpus[n] == 1 for n in ("hetserve-prefill", "hetserve-decode", "hetserve-build-prefill",
                                              "hetserve-build-decode"))
            assert env["hetserve-build-prefill"]["HETSERVE_BUILD_ARGS"] == "--tensorrt"
            pre = env["hetserve-prefill"]["HETSERVE_PREFILL_ENGINE"]
            dec = env["hetserve-decode"]["HETSERVE_DECODE_ENGINES"]
            assert pre == "prefill_fp16_trt" and dec in ("decode_int8_trt", "decode_fp8_trt")
            assert env["hetserve-prefill"]["HETSERVE_DECODE_PRECISION"] == env["hetserve-decode"][
                "HETSERVE_DECODE_PRECISION"] == dec.split("_")[1]
        engines = set(re.findall(r'"(\w+_(?:fp32|fp16|int8|fp8)(?:_trt|_native)?)"',
                                 (ROOT / "python_backends/hetserve/engines/builder.py").read_text()))
        named = {env["hetserve-prefill"]["HETSERVE_PREFILL_ENGINE"], *env["hetserve-decode"][
            "HETSERVE_DECODE_ENGINES"].split(",")}
        assert named <= engines | {"prefill_fp16_trt", "decode_int8_trt", "decode_fp8_trt"}, named - engines


def test_servicemonitor_selects_the_metrics_ports(with_servicemonitor):
    docs = with_servicemonitor
    (sm,) = by_kind(docs, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["namespace"] == "hetserve"
    sel = sm["spec"]["selector"]["matchLabels"]
    picked = [s for s in by_kind(docs, "Service").values() if matches(sel, s["metadata"]["labels"])]
    comps = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in picked}
    assert comps == {"prefill", "decode"}, comps
    for ep in sm["spec"]["endpoints"]:
        for s in picked:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}
    # plain Prometheus: the scrape job sets the labels the adapter rules (and so the HPA) select on
    job = yaml.safe_load((K8S / "monitoring" / "prometheus-scrape.yaml").read_text())["scrape_configs"][0]
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"namespace", "pod", "__address__"} <= targets
    for r in job["relabel_configs"]:
        re.compile(r.get("regex", "(.*)"))
    rules = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    for r in rules:
        assert set(r["resources"]["overrides"]) == {"namespace", "pod"}


def test_image_is_the_compose_triton_image_plus_hetserve(rendered):
    docker = (K8S / "image" / "Dockerfile").read_text()
    compose = (ROOT / "docker-compose.yml").read_text()
    base_image = re.search(r"^ARG TRITON_IMAGE=(\S+)$", docker, re.M).group(1)
    assert re.search(r"HETSERVE_TRITON_IMAGE:-([^}]+)\}", compose).group(1) == base_image
    uid, gid = re.search(r"^USER (\d+):(\d+)$", docker, re.M).groups()
    for docs in rendered.values():
        for name, (_, tpl) in workloads(docs).items():
            if name == "hetserve-redis":
                continue
            sc = tpl["spec"]["securityContext"]
            assert (str(sc["runAsUser"]), str(sc["runAsGroup"])) == (uid, gid) and sc["runAsNonRoot"]
            images = {c["image"] for c in containers(tpl)}
            assert len(images) == 1 and images.pop().split(":")[0] == "hetserve", name
    for c in re.findall(r"^COPY (\S+)", docker, re.M):
        assert (ROOT / c).exists(), f"the Dockerfile copies {c}, which is not in the repository"
