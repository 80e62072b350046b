"""`hetserve doctor`: preflight check of a prefill/decode server pair, with clear PASS/FAIL lines.

Sections (each check prints PASS, WARN, FAIL or SKIP; the exit code is 1 when any check FAILs):
  servers    both servers reachable and ready; Triton version from the server metadata
  precision  what each server can run (fp32/fp16/bf16/int8/fp8), asked of the server itself (admin `info`)
  versions   compat hash, manifest, wire format and engine agreement between prefill and decode
  latency    ping-pong p50/p99: client -> prefill, client -> decode, prefill -> decode (measured on prefill)
  link       KV-sized synthetic transfers pushed by the prefill server through each transport into the decode
             server (its decode model for grpc/shm, kv_ingest for nixl: header + HMAC tag verified, then
             discarded): MB/s and GB/s; and the refusal of a transfer with a wrong compat hash and of one with a
             corrupted payload
  kv         correctness set: prompt KV -> wire (fp32/fp16/int8) -> each transport -> decode, which decodes it
             and returns a digest (fp32 must be bit-exact) and its next-token logits from the received KV vs a
             full recompute of the prompt (max |diff| per dtype; int8: argmax agreement)

This module is the client half (Doctor, Report, format_text, main); what the servers run for it is
diagnostics.py, reached over each server's admin side channel (admin_channel.py: loopback by default, admin key
required), never through the data-plane models. Nothing here imports Triton's python backend.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .admin_channel import AdminClient, AdminError, default_addr
from .diagnostics import CHECK_PREFIX, DEFAULT_SIZES, PRECISIONS, PROBE_PREFIX, kv_digest, stats  # noqa: F401
from .kv.transport.registry import CPU_NAMES as CPU_TRANSPORTS  # link/kv probes by default: grpc, shm, nixl

# max |logit diff| (received KV vs full recompute on decode); int8 also needs argmax agreement (or a near tie)
THRESHOLDS = {"fp32": 1e-4, "fp16": 1e-2, "int8": 1.5}
DEFAULT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")


class DoctorError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Check:
    section: str
    name: str
    status: str  # PASS | WARN | FAIL | SKIP
    detail: str
    data: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.section}/{self.name}"


@dataclass
class Report:
    prefill_url: str
    decode_url: str
    checks: List[Check] = field(default_factory=list)
    sections: Dict[str, Any] = field(default_factory=dict)  # section -> its JSON (shapes vary)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.status == "FAIL" for c in self.checks)

    def counts(self) -> Dict[str, int]:
        out = {s: 0 for s in ("PASS", "WARN", "FAIL", "SKIP")}
        for c in self.checks:
            out[c.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "prefill_url": self.prefill_url, "decode_url": self.decode_url,
                "seconds": round(self.seconds, 3), "summary": self.counts(),
                "checks": [asdict(c) | {"id": c.id} for c in self.checks], "sections": self.sections}


def _err(e: Exception) -> str:
    msg = e.message() if hasattr(e, "message") and callable(e.message) else str(e)
    return " ".join(str(msg).split())


class Doctor:
    """Runs the checks against live servers; every network call has a timeout, so a dead server fails fast."""

    def __init__(self, prefill_url: str, decode_url: str, link_url: Optional[str] = None,
                 sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3, transports: Sequence[str] = CPU_TRANSPORTS,
                 probe_dtype: str = "fp16", kv_dtypes: Sequence[str] = ("fp32", "fp16", "int8"),
                 prompts: Sequence[str] = DEFAULT_PROMPTS, ping_n: int = 20, timeout_s: float = 10.0,
                 probe_compat_hash: Optional[str] = None, log=None, prefill_admin: Optional[str] = None,
                 decode_admin: Optional[str] = None):
        self.prefill_url, self.decode_url = prefill_url, decode_url
        # the servers' admin side channels (admin_channel.py); default: the launchers' gRPC port + 2
        self.prefill_admin = prefill_admin or default_addr(prefill_url)
        self.decode_admin = decode_admin or default_addr(decode_url)
        self._admins: Dict[str, AdminClient] = {}
        self.link_url = link_url or decode_url  # the decode server as the prefill server reaches it
        self.sizes, self.repeats, self.transports = list(sizes), int(repeats), list(transports)
        self.probe_dtype, self.kv_dtypes, self.prompts = probe_dtype, list(kv_dtypes), list(prompts)
        self.ping_n, self.timeout_s, self.probe_compat_hash = int(ping_n), float(timeout_s), probe_compat_hash
        self.log = log or (lambda s: None)
        self._clients: Dict[str, object] = {}
        self._dead: Dict[str, str] = {}  # transport -> error, when its link probe never reached the decode server
        self.report = Report(prefill_url, decode_url)

    # ---- plumbing -------------------------------------------------------------------------------------
    def _client(self, url):
        import tritonclient.grpc as grpcclient

        if url not in self._clients:
            self._clients[url] = grpcclient.InferenceServerClient(url)
        return self._clients[url]

    def close(self):
        for c in self._clients.values():
            try:
                c.close()
            except Exception as e:  # a channel already torn down
                logging.getLogger("hetserve.doctor").debug("client close: %s", e)
        self._clients.clear()

    def _add(self, section, name, status, detail, **data) -> Check:
        c = Check(section, name, status, detail, data)
        self.report.checks.append(c)
        self.log(format_check(c))
        return c

    def _admin(self, role: str) -> AdminClient:
        if role not in self._admins:
            from .server import admin_key

            addr = self.prefill_admin if role == "prefill" else self.decode_admin
            self._admins[role] = AdminClient(addr, admin_key(), self.timeout_s)
        return self._admins[role]

    def _call(self, role: str, op: str, args: Optional[dict], timeout_s: Optional[float], params: dict) -> dict:
        """One admin op on `role`'s admin side channel; params (decode_url, transport, kv_dtype, request_id,
        input_ids) travel in the same JSON object as the op's own arguments."""
        try:
            return self._admin(role).call(op, {**(args or {}), **params}, timeout_s or self.timeout_s)
        except AdminError as e:
            raise DoctorError(str(e)) from None

    def _prefill(self, op, args=None, timeout_s=None, **params) -> dict:
        return self._call("prefill", op, args, timeout_s, params)

    def _kv_ingest_ping(self):
        import tritonclient.grpc as grpcclient

        op = grpcclient.InferInput("op", [1], "BYTES")
        op.set_data_from_numpy(np.array([b"ping"], dtype=np.object_))
        self._client(self.decode_url).infer("kv_ingest", [op], client_timeout=self.timeout_s)

    def _decode(self, op, args=None, timeout_s=None, **params) -> dict:
        return self._call("decode", op, args, timeout_s, params)

    def _ping(self, fn) -> dict:
        secs = []
        for _ in range(self.ping_n):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        return stats(secs)

    # ---- checks ---------------------------------------------------------------------------------------
    def check_servers(self) -> Dict[str, bool]:
        up = {}
        for role, url, models in (("prefill", self.prefill_url, ["prefill"]),
                                  ("decode", self.decode_url, ["kv_ingest", "decode"])):
            try:
                c = self._client(url)
                if not c.is_server_live(client_timeout=self.timeout_s):
                    raise DoctorError("server is not live")
                meta = c.get_server_metadata(as_json=True, client_timeout=self.timeout_s)
                missing = [m for m in models if not c.is_model_ready(m, client_timeout=self.timeout_s)]
            except Exception as e:
                self._add("servers", role, "FAIL", f"{role} server at {url} unreachable: {_err(e)}", url=url)
                up[role] = False
                continue
            ver = meta.get("version", "?")
            self.report.sections.setdefault("servers", {})[role] = {"url": url, "triton": ver,
                                                                    "name": meta.get("name")}
            if missing:
                self._add("servers", role, "FAIL", f"{role} server at {url} (Triton {ver}): model(s) "
                          f"{', '.join(missing)} not ready", url=url, triton=ver)
                up[role] = False
            else:
                self._add("servers", role, "PASS", f"Triton {ver} at {url}; {', '.join(models)} ready",
                          url=url, triton=ver)
                up[role] = True
        return up

    def check_precision(self, up) -> Dict[str, dict]:
        infos = {}
        for role in ("prefill", "decode"):
            if not up[role]:
                self._add("precision", role, "SKIP", f"{role} server unreachable")
                continue
            try:
                info = self._prefill("info") if role == "prefill" else self._decode("info")
            except Exception as e:
                self._add("precision", role, "FAIL", f"{role} admin info failed: {_err(e)}")
                continue
            infos[role] = info
            self.report.sections.setdefault("precision", {})[role] = info
            sup = info["precision"]
            loaded = info["loaded"]
            bad = sorted({p for p in loaded.values() if not sup.get(p, {}).get("supported")})
            yes = [p for p in PRECISIONS if sup[p]["supported"]]
            if bad:
                self._add("precision", role, "FAIL", f"loaded engine precision(s) {bad} not runnable here",
                          supported=yes)
            else:
                self._add("precision", role, "PASS", f"runs {', '.join(yes)}; loaded "
                          f"{', '.join(f'{n} ({p})' for n, p in loaded.items())}", supported=yes)
        return infos

    def check_versions(self, infos) -> bool:
        srv = self.report.sections.get("servers", {})
        if set(infos) != {"prefill", "decode"}:
            self._add("versions", "agreement", "SKIP", "needs admin info from both servers")
            return False
        p, d = infos["prefill"], infos["decode"]
        tv = (srv.get("prefill", {}).get("triton"), srv.get("decode", {}).get("triton"))
        keys = ("compat_hash", "manifest_version", "wire_version", "kv_layout", "builder", "built_at", "source_hash")
        self.report.sections["versions"] = {"triton": {"prefill": tv[0], "decode": tv[1]},
                                            **{k: {"prefill": p.get(k), "decode": d.get(k)} for k in keys}}
        self._add("versions", "triton", "PASS" if tv[0] == tv[1] else "WARN",
                  f"Triton {tv[0]} on both" if tv[0] == tv[1] else f"Triton prefill {tv[0]} != decode {tv[1]}")
        ok = p["compat_hash"] == d["compat_hash"]
        self._add("versions", "compat_hash", "PASS" if ok else "FAIL",
                  f"{p['compat_hash']} on both" if ok else
                  f"compat hash mismatch: prefill {p['compat_hash']} != decode {d['compat_hash']} (engines built "
                  "from different checkpoints/configs; decode would refuse every KV transfer)")
        agree = ("manifest_version", "wire_version", "kv_layout")
        diff = [f"{k} prefill {p.get(k)} != decode {d.get(k)}" for k in agree if p.get(k) != d.get(k)]
        self._add("versions", "manifest", "FAIL" if diff else "PASS", "; ".join(diff) or
                  f"manifest v{p['manifest_version']}, wire v{p['wire_version']}, layout {p['kv_layout']}, "
                  f"builder {p.get('builder')} on both")
        shared = sorted(set(p["engines"]) & set(d["engines"]))
        differ = [n for n in shared if p["engines"][n]["sha256"] != d["engines"][n]["sha256"]]
        bw = p.get("builder") != d.get("builder")
        self._add("versions", "engines", "WARN" if differ or bw else "PASS",
                  (f"engines with the same name differ: {differ}; " if differ else "") +
                  (f"builder prefill {p.get('builder')} != decode {d.get('builder')}; " if bw else "") +
                  f"prefill runs {sorted(p['loaded'])}, decode runs {sorted(d['loaded'])}"
                  + ("" if differ else f"; {len(shared)} shared engine(s) identical (sha256)"))
        return ok and not diff

    def check_quality(self, infos) -> None:
        """Build-time KLD / same-top-1 vs FP32 (engines/quality.py) of the loaded engines and the KV wire dtypes,
        from each server's manifest; FAIL above quality.BOUNDS, WARN when a manifest has no figures."""
        from .engines.quality import BOUNDS

        for role, info in infos.items():
            rows = {n: (info["engines"].get(n, {}).get("quality"), p) for n, p in info["loaded"].items()}
            if role == "decode":
                rows.update({f"kv:{dt}": (q, f"kv:{dt}") for dt, q in (info.get("kv_quality") or {}).items()})
            for n, (q, key) in rows.items():
                if not q:
                    self._add("quality", f"{role}/{n}", "WARN" if n.startswith("decode_") else "SKIP",
                              "no quality figures in the manifest (rebuild with this hetserve)")
                    continue
                bound = BOUNDS.get(key)
                bad = bound is not None and q["mean_kld"] > bound
                self._add("quality", f"{role}/{n}", "FAIL" if bad else "PASS",
                          f"mean KLD {q['mean_kld']:.6f} (bound {bound}), same top-1 {q['same_top_pct']:.1f}% vs "
                          f"{q.get('reference', 'fp32')}, {q['tokens']} held-out tokens", **q)

    def check_latency(self, up):
        rows = {}
        for name, role, fn in (("client->prefill", "prefill", lambda: self._prefill("ping")),
                               ("client->decode", "decode", self._kv_ingest_ping),
                               ("prefill->decode", "both", None)):
            if (role == "both" and not (up["prefill"] and up["decode"])) or (role != "both" and not up[role]):
                self._add("latency", name, "SKIP", "server unreachable")
                continue
            try:
                if fn is None:
                    res = self._prefill("ping_decode", {"n": self.ping_n, "timeout_s": self.timeout_s,
                                                        "transports": self.transports},
                                        decode_url=self.link_url, kv_dtype=self.probe_dtype,
                                        timeout_s=self.timeout_s * (self.ping_n + 1) * (1 + len(self.transports)))
                    got = {name: res["empty"]}
                    got.update({f"{name}:{tr}": r for tr, r in res["kv_1token"].items()})
                else:
                    got = {name: self._ping(fn)}
            except Exception as e:
                self._add("latency", name, "FAIL", f"{name} ping failed: {_err(e)}")
                continue
            for n, st in got.items():
                rows[n] = st
                if st.get("error"):
                    self._add("latency", n, "FAIL", f"{n} failed: {st['error']}")
                else:
                    what = f"1-token {st['kv_dtype']} KV ({st['bytes'] / 1e3:.0f} KB): " if "bytes" in st else ""
                    self._add("latency", n, "PASS", f"{what}p50 {st['p50_ms']:.2f} ms, p99 {st['p99_ms']:.2f} ms "
                              f"(n={st['n']})", **{k: st[k] for k in ("n", "p50_ms", "p99_ms", "min_ms", "max_ms")})
        self.report.sections["latency"] = rows

    def _probe(self, args, timeout_s=None, **params) -> dict:
        n = max(1, len(args.get("tokens", [1]))) * (args.get("repeats", 1) + 1) * len(self.transports) + 1
        return self._prefill("probe_link", dict(args, timeout_s=self.timeout_s), decode_url=self.link_url,
                             timeout_s=timeout_s or self.timeout_s * n, **params)

    def check_link(self):
        try:
            res = self._probe({"tokens": self.sizes, "repeats": self.repeats, "transports": self.transports,
                               "compat_hash": self.probe_compat_hash}, kv_dtype=self.probe_dtype)
        except Exception as e:
            self._add("link", "probe", "FAIL", f"prefill op=probe_link failed: {_err(e)}")
            return
        rows = res["results"]
        self.report.sections["link"] = {"kv_dtype": self.probe_dtype, "repeats": self.repeats, "rows": rows}
        for tr in self.transports:
            mine = [r for r in rows if r["transport"] == tr]
            errs = [r for r in mine if r.get("error")]
            if errs:
                self._add("link", tr, "FAIL", f"{tr} transfer of {errs[0]['bytes']} B to {self.link_url} "
                          f"failed: {errs[0]['error']}")
                if "KV refused" not in errs[0]["error"]:  # never reached the decode server: don't retry it below
                    self._dead[tr] = errs[0]["error"]
                continue
            fell = sorted({u for r in mine for u in r.get("transport_used", []) if u != tr})
            best = max(mine, key=lambda r: r.get("gbps", 0.0))
            ok = all(r.get("gbps", 0) > 0 for r in mine)
            status = "FAIL" if not ok else ("WARN" if fell else "PASS")
            self._add("link", tr, status, f"{best['gbps']:.2f} GB/s ({best['mbps']:.0f} MB/s) at "
                      f"{best['tokens']} tokens ({best['bytes'] / 1e6:.1f} MB {self.probe_dtype}), p50 "
                      f"{best['p50_ms']:.1f} ms" + (f"; fell back to {fell} (staging region full)" if fell else ""),
                      gbps=best["gbps"])
        # safety: decode must refuse a wrong compat hash and a corrupted payload (garbled output otherwise)
        expect = {"wrong_hash": ({"compat_hash": "0" * 32}, "hash mismatch"),
                  "corrupted": ({"corrupt": True}, "checksum mismatch")}
        live = [t for t in self.transports if t not in self._dead]
        for name, (extra, needle) in expect.items():
            if not live:
                self._add("link", f"refuse_{name}", "SKIP", "no transport reached the decode server")
                continue
            try:
                r = self._probe({"tokens": [16], "repeats": 1, "transports": live[:1], "warmup": False, **extra})
                err = next((x.get("error", "") for x in r["results"] if x.get("error")), "")
            except Exception as e:
                self._add("link", f"refuse_{name}", "FAIL", f"probe failed: {_err(e)}")
                continue
            m = re.search(r"KV refused for request \S+: (.*)", err)
            if needle in err:
                self._add("link", f"refuse_{name}", "PASS", f"decode refused it: {(m.group(1) if m else err)[:140]}")
            elif not err:
                self._add("link", f"refuse_{name}", "FAIL", f"decode ACCEPTED a {name.replace('_', ' ')} transfer")
            else:
                self._add("link", f"refuse_{name}", "FAIL", f"expected a refusal mentioning {needle!r}, got: {err}")

    def check_kv(self):
        try:
            pending0 = self._decode("info").get("pending")
        except Exception as e:
            self._add("kv", "set", "FAIL", f"decode admin info failed: {_err(e)}")
            return
        rows = []
        for tr in self.transports:
            for dt in self.kv_dtypes:
                if tr in self._dead:
                    self._add("kv", f"{tr}/{dt}", "SKIP", f"{tr} did not reach the decode server (link/{tr})")
                    continue
                per = []
                for text in self.prompts:
                    per.append(self._kv_one(tr, dt, text))
                    if per[-1].get("error"):  # one failure says it; don't repeat it per prompt
                        break
                rows += per
                self._judge_kv(tr, dt, per)
        self.report.sections["kv"] = {"thresholds": THRESHOLDS, "rows": rows}
        try:
            pending1 = self._decode("info").get("pending")
            ok = pending0 is None or pending1 is None or pending1 <= pending0
            self._add("kv", "pending", "PASS" if ok else "FAIL",
                      f"decode pending KV entries before {pending0}, after {pending1}"
                      + ("" if ok else " (doctor transfers left KV behind)"))
        except Exception as e:
            self._add("kv", "pending", "FAIL", f"decode admin info failed: {_err(e)}")

    def _kv_one(self, tr, dt, text) -> dict:
        row = {"transport": tr, "kv_dtype": dt, "prompt": text}
        try:
            sent = self._prefill("kv_check", {"prompt": text, "timeout_s": self.timeout_s,
                                              "compat_hash": self.probe_compat_hash},
                                 decode_url=self.link_url, transport=tr, kv_dtype=dt, timeout_s=self.timeout_s * 3)
            row.update(sent)
            if sent.get("error"):
                return row
            got = self._decode("verify", {"timeout_s": self.timeout_s}, timeout_s=self.timeout_s * 2,
                               request_id=sent["request_id"], input_ids=sent["input_ids"])
            row["decode"] = got
            row["exact"] = got["digest"] == sent["digest_wire"]
            row["bit_exact_source"] = got["digest"] == sent["digest_source"]
        except Exception as e:
            row["error"] = _err(e)
        return row

    def _judge_kv(self, tr, dt, per):
        name = f"{tr}/{dt}"
        errs = [r for r in per if r.get("error")]
        if errs:
            self._add("kv", name, "FAIL", f"{errs[0]['error']}")
            return
        n = len(per)
        exact = sum(r["exact"] for r in per)
        src = sum(r["bit_exact_source"] for r in per)
        diff = max(r["decode"]["max_abs_diff"] for r in per)
        agree = sum(r["decode"]["argmax_received"] == r["decode"]["argmax_full"] for r in per)
        gap = max(r["decode"]["top1_gap"] for r in per)
        thr = THRESHOLDS[dt]
        why = []
        if exact < n:
            why.append(f"decoded KV differs from what was sent ({n - exact}/{n})")
        if dt == "fp32" and src < n:
            why.append(f"fp32 round trip not bit-exact ({n - src}/{n})")
        if diff > thr:
            why.append(f"max |dlogit| {diff:.2e} > {thr:g}")
        if agree < n and (dt != "int8" or gap > diff):
            why.append(f"argmax differs from full recompute ({n - agree}/{n}, top-1 gap {gap:.3f})")
        note = f"{'bit-exact' if dt == 'fp32' else 'lossless wire'} {exact}/{n}, max |dlogit| {diff:.2e} " \
               f"(<= {thr:g}), argmax {agree}/{n}" + (f" (near tie, gap {gap:.3f})" if agree < n else "") + \
               f", {per[0]['bytes'] / 1e3:.0f} KB for {per[0]['kv_tokens']} tokens"
        self._add("kv", name, "FAIL" if why else "PASS", "; ".join(why) if why else note,
                  max_abs_diff=diff, exact=exact, argmax_agree=agree, n=n)

    def run(self) -> Report:
        t0 = time.perf_counter()
        try:
            up = self.check_servers()
            infos = self.check_precision(up)
            self.check_versions(infos)
            self.check_quality(infos)
            self.check_latency(up)
            if up["prefill"] and up["decode"]:
                self.check_link()
                self.check_kv()
            else:
                down = " and ".join(r for r in ("prefill", "decode") if not up[r])
                for s in ("link", "kv"):
                    self._add(s, "all", "SKIP", f"{down} server unreachable")
        finally:
            self.close()
        self.report.seconds = time.perf_counter() - t0
        return self.report


# ---------------------------------------------------------------------------------------------------------
# text output
# ---------------------------------------------------------------------------------------------------------
def format_check(c: Check) -> str:
    return f"[{c.status}] {c.id:<28} {c.detail}"


def _table(header, rows) -> List[str]:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return ["  " + "  ".join(str(x).ljust(n) for x, n in zip(r, w)).rstrip() for r in [header] + rows]


def format_text(rep: Report) -> str:
    out = [f"hetserve doctor: prefill {rep.prefill_url}, decode {rep.decode_url}"]
    by: Dict[str, List[Check]] = {}
    for c in rep.checks:
        by.setdefault(c.section, []).append(c)
    s = rep.sections
    for sec in ("servers", "precision", "versions", "latency", "link", "kv"):
        out.append(f"\n== {sec}")
        if sec == "precision":
            for role, info in s.get("precision", {}).items():
                loaded: Dict[str, List[str]] = {}
                for n, p in info["loaded"].items():
                    loaded.setdefault(p, []).append(n)
                out.append(f"  {role} server (onnxruntime {info['runtime']['onnxruntime']}, providers "
                           f"{', '.join(info['runtime']['providers'])}, tensorrt {info['runtime']['tensorrt']}, "
                           f"GPUs {len(info['runtime']['cuda_devices'])}):")
                out += ["  " + x for x in _table(
                    ["precision", "runs", "engines loaded", "via / why not"],
                    [[p, "yes" if v["supported"] else "no", ",".join(loaded.get(p, [])) or "-",
                      v["via"] or v["reason"]] for p, v in info["precision"].items()])]
        if sec == "link" and "link" in s:
            L = s["link"]
            out.append(f"  synthetic {L['kv_dtype']} KV, median of {L['repeats']} (prefill -> decode server, "
                       "HMAC verified, discarded)")
            out += _table(["transport", "tokens", "MB", "p50 ms", "MB/s", "GB/s"],
                          [[r["transport"], r["tokens"], f"{r['bytes'] / 1e6:.2f}",
                            f"{r['p50_ms']:.1f}" if "p50_ms" in r else "-",
                            f"{r['mbps']:.0f}" if "mbps" in r else "-",
                            f"{r['gbps']:.3f}" if "gbps" in r else r.get("error", "-")[:60]]
                           for r in L["rows"]])
        for c in by.get(sec, []):
            out.append(format_check(c))
    n = rep.counts()
    out.append(f"\nsummary: {n['PASS']} PASS, {n['WARN']} WARN, {n['FAIL']} FAIL, {n['SKIP']} SKIP in "
               f"{rep.seconds:.1f}s -> {'PASS' if rep.ok else 'FAIL'}")
    return "\n".join(out)


def main(args) -> int:
    """Entry point of `hetserve doctor` (argparse namespace from cli.py)."""
    d = Doctor(args.prefill_url, args.decode_url, link_url=args.link_url, sizes=args.sizes, repeats=args.repeats,
               transports=args.transports, probe_dtype=args.probe_dtype, kv_dtypes=args.kv_dtypes,
               ping_n=args.ping, timeout_s=args.timeout, probe_compat_hash=args.probe_compat_hash,
               prompts=args.prompt or DEFAULT_PROMPTS, prefill_admin=args.prefill_admin,
               decode_admin=args.decode_admin)
    rep = d.run()
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        print(format_text(rep))
    sys.stdout.flush()
    return 0 if rep.ok else 1
