"""The design-space search: every prefill x decode hardware, precision, TP degree and KV tier in a
:class:`SearchSpace`, sized to the fewest instances that meet the SLO (predict.predict prices each)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from .model import (
    SLO,
    Deployment,
    Phase,
    PhaseCost,
    PlanWarning,
    Routing,
    Workload,
    _percentile,
    _rank_violation,
    _tier_rank,
    context_tokens,
    default_kv_dtype,
    fewest_instances,
    kv_mismatch,
    kv_transfer,
    mg1_wait,
    prefill_occupancy,
    quantile_points,
    violation,
)
from .predict import Prediction, predict
from .profiles import (
    DTYPE_BYTES,
    KV_TIERS,
    LINKS,
    PRECISION_RANK,
    PRECISIONS,
    HardwareProfile,
    KVTier,
    LinkProfile,
    ModelConfig,
)

TP_DEGREES = (1, 2, 4, 8)

@dataclass(frozen=True)
class SearchSpace:
    prefill_hardware: tuple[HardwareProfile, ...]
    decode_hardware: tuple[HardwareProfile, ...]
    links: tuple[LinkProfile, ...] = tuple(LINKS.values())
    kv_tiers: tuple[KVTier, ...] = tuple(KV_TIERS.values())
    precisions: tuple[str, ...] = PRECISIONS  # allowed when a phase's precision is not forced
    prefill_precision: Optional[str] = None
    decode_precision: Optional[str] = None
    prefill_kv_dtype: Optional[str] = None
    decode_kv_dtype: Optional[str] = None
    tp_degrees: tuple[int, ...] = TP_DEGREES
    max_instances: int = 64
    prefill_instances: Optional[int] = None
    decode_instances: Optional[int] = None
    layerwise: bool = True
    routing: Routing = Routing()  # the orchestrator's KV-aware routing (matters when workload.prefix_hit > 0)

    def phases(self, model: ModelConfig, role: str) -> Iterator[Phase]:
        prefill = role == "prefill"
        forced = self.prefill_precision if prefill else self.decode_precision
        kv = self.prefill_kv_dtype if prefill else self.decode_kv_dtype
        for hw in self.prefill_hardware if prefill else self.decode_hardware:
            for precision in (forced,) if forced else (p for p in self.precisions if hw.supports(p)):
                for tp in self.tp_degrees:
                    if tp <= hw.max_tp and model.heads % tp == 0:
                        yield Phase(hw, precision, kv or default_kv_dtype(precision, hw), tp)

    def counts(self, role: str) -> np.ndarray:
        forced = self.prefill_instances if role == "prefill" else self.decode_instances
        return np.array([forced]) if forced else np.arange(1, self.max_instances + 1)


@dataclass(frozen=True)
class PlanResult:
    feasible: bool
    best: Optional[Prediction]
    alternatives: tuple[Prediction, ...]
    notes: tuple[PlanWarning, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"feasible": self.feasible,
                "recommendation": self.best.to_dict() if self.best else None,
                "alternatives": [p.to_dict() for p in self.alternatives],
                "notes": [w.to_dict() for w in self.notes]}


@dataclass(frozen=True)
class _DecodeChoice:
    phase: Phase  # instances already sized
    cost: PhaseCost
    tier: KVTier
    violation: float
    score: tuple


def _decode_choices(model: ModelConfig, workload: Workload, slo: SLO, space: SearchSpace,
                    ctx: float, seq_hi: float, out_mean: float) -> list[_DecodeChoice]:
    """Size every decode option for the TPOT SLO; keep the best per (hardware, KV dtype)."""
    counts = space.counts("decode")
    best: dict[tuple[str, str], _DecodeChoice] = {}
    for phase in space.phases(model, "decode"):
        cost = PhaseCost(model, phase)
        if not cost.weights_fit:
            continue
        for tier in space.kv_tiers:
            cap = cost.batch_cap(tier, ctx)
            if cap < 1 or seq_hi * cost.kv_bytes_per_token > cost.kv_capacity_bytes(tier):
                continue
            _, tpot = cost.decode_step(tier, ctx).operating_point(workload.qps * out_mean / counts, cap)
            i = int(fewest_instances(tpot, slo.tpot_s))
            sized = dataclasses.replace(phase, instances=int(counts[i]))
            v = violation(float(tpot[i]), slo.tpot_s)
            score = (*_rank_violation(v), sized.cost_per_hour, PRECISION_RANK[phase.precision],
                     _tier_rank(tier), float(tpot[i]))
            key = (phase.hardware.name, phase.kv_dtype)
            if key not in best or score < best[key].score:
                best[key] = _DecodeChoice(sized, PhaseCost(model, sized), tier, v, score)
    return list(best.values())


def _signature(dep: Deployment) -> tuple:
    """Alternatives differ in hardware or precision width, not just in transport or fp16 vs bf16."""
    return tuple((ph.hardware.name, ph.tp, DTYPE_BYTES[ph.precision]) for ph in (dep.prefill, dep.decode))


def plan(model: ModelConfig, workload: Workload, slo: SLO, space: SearchSpace, top_k: int = 5) -> PlanResult:
    """Cheapest deployment meeting the SLOs (or the closest one), plus ranked alternatives.

    The decode side is sized independently for TPOT; the prefill side is then sized for TTFT for
    every (prefill option, decode choice, link), since KV transfer couples the two only through TTFT.
    The best candidates are re-evaluated with :func:`predict`, which produces the reported numbers.
    """
    prompt, output = workload.samples()
    ctx, out_mean = context_tokens(prompt, output), float(output.mean())
    p_hi, seq_hi = _percentile(prompt, 99), _percentile(prompt + output, 99)
    decode = _decode_choices(model, workload, slo, space, ctx, seq_hi, out_mean)
    counts = space.counts("prefill")
    # TTFT's percentile needs two prompt lengths (see quantile_points) and the mean one more; the
    # queue needs every sample (busy time = max(prefill, transfer)): evaluate them in one array.
    points, weights = quantile_points(prompt, slo.percentile)
    n = len(prompt)
    lengths = np.concatenate([prompt, points, [prompt.mean()]])
    scored: list[tuple[tuple, Phase, int, _DecodeChoice, LinkProfile]] = []
    for phase in space.phases(model, "prefill"):
        pc = PhaseCost(model, phase)
        if not pc.weights_fit or pc.weight_bytes + p_hi * pc.kv_bytes_per_token > pc.memory_bytes:
            continue
        service = pc.prefill_time(lengths)
        service_mean = float(service[:n].mean())
        for choice in decode:
            links = [link for link in space.links if link.connects(phase.hardware, choice.phase.hardware)]
            if not links:
                continue
            transfer, exposed = kv_transfer(pc, choice.cost, links, choice.tier, lengths, service, space.layerwise)
            busy = prefill_occupancy(service[:n], transfer[:, :n])
            _, _, wait_p = mg1_wait(workload.qps / counts, busy.mean(axis=1, keepdims=True),
                                    np.mean(busy ** 2, axis=1, keepdims=True), slo.percentile)  # (links, counts)
            tail = (service[n:n + 2] + exposed[:, n:n + 2]) @ weights
            ttft_p = phase.hardware.request_overhead_s + wait_p + tail[:, None]
            sizes = fewest_instances(ttft_p, slo.ttft_s)
            xfer_mean = transfer[:, -1]
            for k, link in enumerate(links):
                ttft = float(ttft_p[k, sizes[k]])
                ingest_ok = workload.qps * xfer_mean[k] < choice.phase.instances
                v = max(violation(ttft, slo.ttft_s), choice.violation) if ingest_ok else math.inf
                instances = int(counts[sizes[k]])
                cost = instances * phase.cost_per_hour + choice.phase.cost_per_hour
                score = (*_rank_violation(v), cost, xfer_mean[k] > service_mean, kv_mismatch(phase, choice.phase),
                         link.tier, PRECISION_RANK[phase.precision] + PRECISION_RANK[choice.phase.precision], ttft)
                scored.append((score, phase, instances, choice, link))
    if not scored:
        return PlanResult(False, None, (), (PlanWarning("no_candidate", (
            f"no hardware/precision/tp combination in the search space holds {model.name} "
            f"(weights + KV) and connects prefill to decode"), "error"),))
    scored.sort(key=lambda c: c[0])
    finalists: dict[tuple, Deployment] = {}
    for _, phase, instances, choice, link in scored:
        dep = Deployment(dataclasses.replace(phase, instances=instances), choice.phase, link, choice.tier,
                         space.layerwise, space.routing)
        finalists.setdefault(_signature(dep), dep)
        if len(finalists) >= 2 * top_k + 2:
            break
    preds = sorted((predict(model, dep, workload, slo) for dep in finalists.values()), key=Prediction.rank_key)
    return PlanResult(preds[0].meets_slo, preds[0], tuple(preds[1:top_k]))

