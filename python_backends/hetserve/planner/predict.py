"""Prediction: the cost components of model.py combined into latency, throughput and cost of one deployment
under a workload, including KV-aware routing (model.Routing):

* each prompt of ``P`` tokens has ``held = floor(prefix_hit * P)`` in the caches and ``U = P - held`` uncached;
  with KV-aware routing the prefill computes ``U`` tokens (its own prefix cache holds the history too) and sends
  the KV of ``U`` (the decode server holds the rest); the old path sends all ``P``;
* **conditional disaggregation** as the router decides it: a prompt with ``U <= local_prefill_max_tokens``
  and ``held >= max(local_prefill_min_hit_tokens, local_prefill_min_hit_share x P)`` is prefilled on its
  decode instance when ``U x streams there <= max(local_prefill_stall_tokens, prompt tokens queued at the
  prefill instances)``; ``streams`` is the decode batch less itself and the queue follows from Little's law
  on the prefill side (one refinement: the split is decided on the operating point with only the
  non-candidates at the prefill side, then everything is priced with the split);
* a local prefill skips the prefill queue and the transfer (TTFT = its prefill time on the decode hardware) and
  takes ``rho_local = local prefills/s x their mean time`` of its decode instance, during which that
  instance's streams wait: TPOT = step / (1 - rho_local) at the batch where ``N = rate x TPOT``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..stages.router import local_prefill_eligible, local_prefill_stall_ok
from .model import (
    MAX_BATCH,
    SLO,
    Deployment,
    PhaseCost,
    PlanWarning,
    Workload,
    _finite,
    _percentile,
    _rank_violation,
    _tier_rank,
    context_tokens,
    kv_mismatch,
    kv_transfer,
    mg1_wait,
    prefill_occupancy,
    repack_time,
    violation,
)
from .profiles import PRECISION_RANK, ModelConfig


@dataclass(frozen=True)
class Prediction:
    deployment: Deployment
    ttft_mean_s: float
    ttft_p_s: float  # at ``percentile``
    percentile: float
    tpot_s: float
    prefill_s: float  # mean prefill service time
    queue_wait_s: float  # mean prefill queue wait
    kv_transfer_s: float  # mean total KV transfer time
    kv_exposed_s: float  # mean transfer (+ re-pack) time not hidden behind prefill
    kv_bytes_per_request: float  # KV moved from prefill to decode, mean over requests (0 for a local prefill)
    prefill_utilization: float
    decode_batch: float
    throughput_tok_s: float  # output tokens/s actually served
    max_qps: float
    cost_per_hour: float
    cost_per_1m_output: float
    cost_per_1m_tokens: float  # prompt + output tokens
    meets_slo: bool
    slo_violation: float
    warnings: tuple[PlanWarning, ...] = ()
    local_prefill_share: float = 0.0  # requests prefilled on their decode instance (KV-aware routing)
    decode_prefill_utilization: float = 0.0  # share of a decode instance's time spent on local prefills

    @property
    def errors(self) -> tuple[PlanWarning, ...]:
        return tuple(w for w in self.warnings if w.severity == "error")

    def rank_key(self) -> tuple:
        d = self.deployment
        return (not self.meets_slo, *_rank_violation(self.slo_violation), self.cost_per_1m_output,
                any(w.code == "kv_transfer_not_hidden" for w in self.warnings),
                kv_mismatch(d.prefill, d.decode), d.link.tier,
                PRECISION_RANK[d.prefill.precision] + PRECISION_RANK[d.decode.precision],
                _tier_rank(d.kv_tier),
                self.ttft_p_s)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"deployment": self.deployment.to_dict()}
        for f in dataclasses.fields(self):
            if f.name in ("deployment", "warnings"):
                continue
            v = getattr(self, f.name)
            out[f.name] = _finite(v) if isinstance(v, float) else v
        out["warnings"] = [w.to_dict() for w in self.warnings]
        return out


def _split(work: Workload, d: Deployment, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uncached tokens, KV tokens a remote prefill sends, local-prefill candidates) per prompt sample."""
    held = np.floor(prompt * work.prefix_hit)
    uncached = np.maximum(prompt - held, 1.0)
    r = d.routing
    if not r.kv_aware:
        return uncached, prompt, np.zeros(prompt.shape, dtype=bool)
    candidate = local_prefill_eligible(r, uncached, held, prompt)  # the router's rule (0 floors: held or not)
    return uncached, uncached, candidate


def _mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float(x[mask].mean()) if mask.any() else 0.0


def _sides(pc: PhaseCost, dc: PhaseCost, d: Deployment, work: Workload, prompt: np.ndarray,
           uncached: np.ndarray, sent: np.ndarray, local: np.ndarray, pct: float) -> dict[str, Any]:
    """Prefill side (remote requests) and local-prefill load for one split."""
    remote = ~local
    share_r = float(remote.mean())
    service = pc.prefill_time(uncached)
    transfer, exposed = (x[0] for x in kv_transfer(pc, dc, (d.link,), d.kv_tier, sent, service, d.layerwise))
    busy = prefill_occupancy(service, transfer)
    b = busy[remote] if remote.any() else np.zeros(1)
    rho, wait, wait_p = (float(x) for x in mg1_wait(work.qps * share_r / d.prefill.instances,
                                                     float(b.mean()), float(np.mean(b ** 2)), pct))
    local_s = dc.prefill_time(uncached)
    rho_local = work.qps * float(local.mean()) / d.decode.instances * _mean(local_s, local)
    # prompt tokens at the prefill instances (Little): what the router compares a local prefill's stall with
    queued = work.qps * share_r * (wait * _mean(uncached, remote) + _mean(busy * uncached, remote)) \
        if math.isfinite(wait) else math.inf
    return dict(service=service, transfer=transfer, exposed=exposed, busy=busy, rho=rho, wait=wait,
                wait_p=wait_p, local_s=local_s, rho_local=rho_local, queued=queued, share_r=share_r)


def _decode_point(step, cap: float, rate: float, rho_local: float,
                  decode_batch: Optional[float]) -> tuple[float, float]:
    """(batch, TPOT) of a decode instance that spends rho_local of its time on local prefills."""
    if cap < 1 or rho_local >= 1:
        return math.inf, math.inf
    if decode_batch is not None:
        if decode_batch < 1:
            raise ValueError("decode_batch must be >= 1")
        batch = float(min(decode_batch, cap))
        return batch, float(step.time(batch)) / (1.0 - rho_local)
    batch, step_s = (float(x) for x in step.operating_point(rate / (1.0 - rho_local), cap))
    return batch, step_s / (1.0 - rho_local)


def predict(model: ModelConfig, deployment: Deployment, workload: Workload,
            slo: Optional[SLO] = None, decode_batch: Optional[float] = None) -> Prediction:
    """Predict latency, throughput and cost of one deployment under ``workload``.

    ``decode_batch`` fixes the decode batch per instance (a closed-loop benchmark with that many
    concurrent streams) instead of the Little's-law operating point at ``workload.qps``; it is capped
    by the KV capacity."""
    d = deployment
    pct = slo.percentile if slo else 90.0
    prompt, output = workload.samples()
    ctx = context_tokens(prompt, output)
    out_mean = float(output.mean())
    pc, dc = PhaseCost(model, d.prefill), PhaseCost(model, d.decode)
    warns = pc.warnings("prefill") + dc.warnings("decode")

    # Memory: the longest prompt on a prefill instance, the longest sequence on a decode instance.
    p_hi, seq_hi = _percentile(prompt, 99), _percentile(prompt + output, 99)
    if pc.weights_fit and pc.weight_bytes + p_hi * pc.kv_bytes_per_token > pc.memory_bytes:
        warns.append(PlanWarning("kv_does_not_fit", (
            f"prefill: KV of a {p_hi:.0f}-token prompt does not fit next to the weights on "
            f"{d.prefill.tp} x {d.prefill.hardware.name}"), "error"))
    kv_capacity = dc.kv_capacity_bytes(d.kv_tier)
    if dc.weights_fit and seq_hi * dc.kv_bytes_per_token > kv_capacity:
        warns.append(PlanWarning("kv_does_not_fit", (
            f"decode: KV of one {seq_hi:.0f}-token sequence ({seq_hi * dc.kv_bytes_per_token / 1e9:.2f} GB) "
            f"exceeds the {d.kv_tier.name} tier ({kv_capacity / 1e9:.2f} GB)"), "error"))

    # Which prompts are prefilled where (KV-aware routing), then prefill, KV transfer, queueing -> TTFT.
    uncached, sent, candidate = _split(workload, d, prompt)
    step = dc.decode_step(d.kv_tier, ctx)
    cap = dc.batch_cap(d.kv_tier, ctx)
    rate = workload.qps * out_mean / d.decode.instances
    local = candidate
    if candidate.any():  # the router's stall rule at the operating point with only the others at prefill
        first = _sides(pc, dc, d, workload, prompt, uncached, sent, np.zeros_like(candidate), pct)
        streams = _decode_point(step, cap, rate, 0.0, decode_batch)[0] - 1.0
        local = candidate & local_prefill_stall_ok(d.routing, uncached, streams, first["queued"])
    sides = _sides(pc, dc, d, workload, prompt, uncached, sent, local, pct)
    service, transfer, exposed, busy = sides["service"], sides["transfer"], sides["exposed"], sides["busy"]
    rho, wait, wait_p, rho_local = sides["rho"], sides["wait"], sides["wait_p"], sides["rho_local"]
    remote = ~local
    overhead = d.prefill.hardware.request_overhead_s
    if local.any():
        ttft_mean = overhead + float(np.mean(np.where(local, sides["local_s"], wait + service + exposed)))
        ttft_p = overhead + _percentile(np.where(local, sides["local_s"], wait_p + service + exposed), pct)
    else:
        ttft_mean = overhead + wait + float(np.mean(service + exposed))
        ttft_p = overhead + wait_p + _percentile(service + exposed, pct)

    repack_ms = float(np.mean(repack_time(pc, dc, sent))) * 1e3
    for what, src, dst in (("dtype", d.prefill.kv_dtype, d.decode.kv_dtype),
                           ("layout", d.prefill.layout, d.decode.layout)):
        if src != dst:
            warns.append(PlanWarning(f"kv_{what}_mismatch", (
                f"prefill writes KV {what} {src}, decode expects {dst}: the decode side re-packs it "
                f"(+{repack_ms:.2f} ms per request)")))
    xfer_mean, service_mean = _mean(transfer, remote), _mean(service, remote)
    if remote.any() and ((xfer_mean > service_mean) if d.layerwise else (xfer_mean > 0.05 * service_mean)):
        how = "layer-wise streaming cannot hide it" if d.layerwise else "layer-wise overlap is off"
        warns.append(PlanWarning("kv_transfer_not_hidden", (
            f"KV transfer over {d.link.name} takes {xfer_mean * 1e3:.2f} ms vs {service_mean * 1e3:.2f} ms "
            f"prefill ({how}); {_mean(exposed, remote) * 1e3:.2f} ms lands on TTFT")))

    # Decode operating point -> TPOT (local prefills take rho_local of each decode instance's time).
    batch, tpot = _decode_point(step, cap, rate, rho_local, decode_batch)

    share_r = sides["share_r"]
    prefill_qps = d.prefill.instances / (share_r * _mean(busy, remote)) if share_r > 0 else math.inf
    # decode instance-seconds per request: its tokens at full speed + its share of local prefills
    per_request = (out_mean / step.max_token_rate(cap) if cap >= 1 else math.inf) \
        + float(local.mean()) * _mean(sides["local_s"], local)
    decode_qps = d.decode.instances / per_request if cap >= 1 else 0.0
    # KV arriving at the decode instances' links
    ingest_qps = d.decode.instances / (share_r * xfer_mean) if share_r * xfer_mean > 0 else math.inf
    max_qps = min(prefill_qps, decode_qps, ingest_qps)
    if rho >= 1 or not math.isfinite(batch) or workload.qps >= ingest_qps:
        memory_bound = cap < MAX_BATCH and decode_qps == max_qps
        warns.append(PlanWarning("kv_does_not_fit" if memory_bound else "overloaded", (
            f"offered {workload.qps:g} req/s exceeds capacity {max_qps:.3g} req/s (prefill "
            f"{prefill_qps:.3g}, decode {decode_qps:.3g}, KV ingest over {d.link.name} {ingest_qps:.3g}"
            + (f"; decode KV holds only {cap:.0f} sequences per instance" if memory_bound else "") + ")"),
            "error"))

    served_qps = min(workload.qps, max_qps)
    tokens_per_hour = served_qps * 3600
    cost = d.cost_per_hour
    cost_out = cost / (tokens_per_hour * out_mean) * 1e6 if tokens_per_hour > 0 else math.inf
    cost_all = cost / (tokens_per_hour * (out_mean + float(prompt.mean()))) * 1e6 if tokens_per_hour > 0 else math.inf

    errors = any(w.severity == "error" for w in warns)
    if slo:
        v = max(violation(ttft_p, slo.ttft_s), violation(tpot, slo.tpot_s))
        for code, name, value, target in (("slo_ttft", f"TTFT p{pct:g}", ttft_p, slo.ttft_s),
                                          ("slo_tpot", "TPOT", tpot, slo.tpot_s)):
            if math.isfinite(value) and value > target:
                warns.append(PlanWarning(code, f"{name} {value * 1e3:.1f} ms exceeds the SLO {target * 1e3:.1f} ms"))
    else:
        v = 0.0
    v = math.inf if errors else v
    return Prediction(
        deployment=d, ttft_mean_s=ttft_mean, ttft_p_s=ttft_p, percentile=pct, tpot_s=tpot,
        prefill_s=service_mean, queue_wait_s=wait, kv_transfer_s=xfer_mean,
        kv_exposed_s=_mean(exposed, remote),
        kv_bytes_per_request=float(np.mean(np.where(local, 0.0, sent))) * pc.kv_bytes_per_token,
        prefill_utilization=rho, decode_batch=batch, throughput_tok_s=served_qps * out_mean, max_qps=max_qps,
        cost_per_hour=cost, cost_per_1m_output=cost_out, cost_per_1m_tokens=cost_all,
        meets_slo=v == 0.0, slo_violation=v, warnings=tuple(warns),
        local_prefill_share=float(local.mean()), decode_prefill_utilization=rho_local)


__all__ = ["Prediction", "predict"]
