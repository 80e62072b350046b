"""Analytical cost model for prefill/decode-disaggregated serving: its inputs and cost components
(predict.py combines them into a :class:`Prediction`, search.py searches over it, calibration.py fits it
to measurements).

Per request (prompt ``P`` tokens, ``O`` output tokens) on a deployment of ``n_p`` prefill and ``n_d``
decode instances:

* **Prefill** (roofline): ``S = overhead + roof(bytes / (bw * bw_eff), FLOPs / (peak * mfu))`` with
  ``FLOPs = 2 * block_params * P + 2 * layers * heads * head_dim * P^2 + 2 * vocab * hidden`` (causal
  attention, LM head on the last token) and ``bytes = weights + P * kv_bytes_per_token`` plus, for
  unfused attention, ``attn_score_passes * 4 * layers * heads * P^2``. ``roof(m, c) = max(m, c) +
  (1 - overlap) * min(m, c)``: the plain roofline at ``overlap = 1``, the sum at 0 (CPU).
* **KV transfer**: ``P * kv_bytes_per_token`` (``2 * layers * kv_heads * head_dim * dtype_bytes``) over
  the link, one message per layer. Layer-wise: layer i is sent while layer i+1 is computed, so the
  exposed time is ``max(0, transfer - prefill) + one layer's transfer``; otherwise all of it.
  A KV dtype or layout mismatch adds a re-pack pass on the decode side (read + write).
* **TTFT** = request overhead + M/G/1 queue wait (Pollaczek-Khinchine, arrivals split evenly over
  prefill instances) + ``S`` + exposed transfer. The percentile adds the queue-wait tail
  ``P(W > t) ~ rho * exp(-rho t / E[W])`` to the percentile of the rest (conservative).
* **Decode step** (bandwidth bound, continuous batching): ``step(b) = overhead + b * seq_overhead +
  roof((weights + b * ctx * kv_bytes_per_token) / bw, b * FLOPs_per_token / compute)``; the batch ``b``
  follows from Little's law ``N = lambda_d * E[O] * step(1 + N)`` and TPOT = ``step(1 + N)`` (or is
  given, for a closed-loop benchmark of ``b`` concurrent streams).
* **KV-aware routing** (a workload with ``prefix_hit`` > 0: multi-turn history held by the caches): the
  prefill computes and sends only the uncached ``U = P - held`` tokens; a request whose ``U`` is short
  enough is prefilled on its decode instance instead (no prefill queue, no KV moved), which takes that
  share of the decode instance's time from its streams (predict.py, :class:`Routing`).
* **Cost** = device-hours x price / tokens served.

Everything is plain numpy; per-request quantities are evaluated on deterministic samples of the
prompt/output length distributions.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..stages.router import RouterConfig
from .profiles import KV_TIERS, LINKS, HardwareProfile, KVTier, LinkProfile, ModelConfig, check_precision

MEM_UTIL = 0.9  # fraction of device memory for weights + KV; the rest is activations/workspace
MAX_BATCH = 512  # decode scheduler's batch ceiling per instance
TP_EFFICIENCY = 0.9  # share of linear speed-up kept per doubling of the tensor-parallel degree
SIZING_SLACK = 1.1  # best effort: fewest instances within 10% of the best achievable latency
N_SAMPLES = 1024  # samples of the length distributions (1 when both are fixed)
DISTRIBUTIONS = ("fixed", "normal", "lognormal")
TIER_ORDER = tuple(KV_TIERS)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution: ``fixed`` at ``mean``, or ``normal``/``lognormal`` with ``std``."""

    mean: float
    std: float = 0.0
    kind: str = "fixed"

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {self.kind!r}; choose from {', '.join(DISTRIBUTIONS)}")
        if self.mean < 1 or self.std < 0:
            raise ValueError("length mean must be >= 1 and std >= 0")

    @property
    def is_fixed(self) -> bool:
        return self.kind == "fixed" or self.std == 0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.is_fixed:
            x = np.full(n, float(self.mean))
        elif self.kind == "normal":
            x = rng.normal(self.mean, self.std, n)
        else:  # lognormal with the requested mean and std
            s2 = math.log1p((self.std / self.mean) ** 2)
            x = rng.lognormal(math.log(self.mean) - s2 / 2, math.sqrt(s2), n)
        return np.maximum(1.0, np.rint(x))

    def describe(self) -> str:
        return f"{self.mean:g}" if self.is_fixed else f"{self.kind}({self.mean:g}, sd {self.std:g})"


@dataclass(frozen=True)
class Workload:
    qps: float  # Poisson arrival rate, requests/s
    prompt: LengthDist
    output: LengthDist
    # share of each prompt that earlier turns left in the caches (the prefill server's prefix cache, and the
    # decode server the KV-aware router picks): a multi-turn conversation's history; 0: every prompt is new
    prefix_hit: float = 0.0

    def __post_init__(self) -> None:
        if self.qps < 0:
            raise ValueError("qps must be >= 0")
        if not 0.0 <= self.prefix_hit < 1.0:
            raise ValueError("prefix_hit must be in [0, 1)")

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        return _samples(self.prompt, self.output)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=32)
def _samples(prompt: LengthDist, output: LengthDist) -> tuple[np.ndarray, np.ndarray]:
    n = 1 if prompt.is_fixed and output.is_fixed else N_SAMPLES
    rng = np.random.default_rng(0)
    p, o = prompt.sample(n, rng), output.sample(n, rng)
    p.flags.writeable = o.flags.writeable = False
    return p, o


def context_tokens(prompt: np.ndarray, output: np.ndarray) -> float:
    """Time-averaged KV context of a decoding sequence: E[O * (P + O/2)] / E[O]."""
    return float(np.mean(output * (prompt + output / 2)) / np.mean(output))


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0  # TTFT percentile checked against ttft_s (TPOT uses the mean step)

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or not 0 < self.percentile < 100:
            raise ValueError("SLOs must be > 0 and the percentile in (0, 100)")


@dataclass(frozen=True)
class Phase:
    """One phase's instances: ``instances`` x (``tp`` devices of ``hardware``)."""

    hardware: HardwareProfile
    precision: str  # weight/compute precision
    kv_dtype: str
    tp: int = 1
    instances: int = 1
    kv_layout: Optional[str] = None  # None: the hardware's native layout

    def __post_init__(self) -> None:
        check_precision(self.precision)
        check_precision(self.kv_dtype)
        if self.tp < 1 or self.instances < 1:
            raise ValueError("tp and instances must be >= 1")

    @property
    def layout(self) -> str:
        return self.kv_layout or self.hardware.kv_layout

    @property
    def devices(self) -> int:
        return self.tp * self.instances

    @property
    def cost_per_hour(self) -> float:
        return self.devices * self.hardware.price_per_hour

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware.name, "precision": self.precision, "kv_dtype": self.kv_dtype,
                "kv_layout": self.layout, "tp": self.tp, "instances": self.instances,
                "devices": self.devices}


def default_kv_dtype(precision: str, hardware: HardwareProfile) -> str:
    """KV cache dtype that goes with a weight precision (int8 weights keep a 16-bit KV cache)."""
    if precision != "int8":
        return precision
    return next(p for p in ("fp16", "bf16", "fp32") if hardware.supports(p))


@dataclass(frozen=True)
class Routing:
    """The orchestrator's KV-aware routing (stages/router.py; the server's defaults): ``kv_aware=False`` is
    the old path (the whole prompt's KV moves, every prompt prefilled on a prefill instance)."""

    kv_aware: bool = True
    # HETSERVE_LOCAL_PREFILL_*: the router's own defaults (0 max tokens: never prefill on decode)
    local_prefill_max_tokens: int = RouterConfig.local_prefill_max_tokens
    local_prefill_min_hit_tokens: int = RouterConfig.local_prefill_min_hit_tokens
    local_prefill_min_hit_share: float = RouterConfig.local_prefill_min_hit_share
    local_prefill_stall_tokens: int = RouterConfig.local_prefill_stall_tokens

    def __post_init__(self) -> None:
        if min(self.local_prefill_max_tokens, self.local_prefill_min_hit_tokens, self.local_prefill_stall_tokens) < 0:
            raise ValueError("routing token bounds must be >= 0")
        if not 0.0 <= self.local_prefill_min_hit_share <= 1.0:
            raise ValueError("local_prefill_min_hit_share must be in [0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Deployment:
    prefill: Phase
    decode: Phase
    link: LinkProfile
    kv_tier: KVTier = KV_TIERS["device"]
    layerwise: bool = True  # layer-wise KV streaming overlapped with prefill
    routing: Routing = Routing()

    @property
    def ratio(self) -> str:
        g = math.gcd(self.prefill.instances, self.decode.instances)
        return f"{self.prefill.instances // g}:{self.decode.instances // g}"

    @property
    def cost_per_hour(self) -> float:
        return self.prefill.cost_per_hour + self.decode.cost_per_hour

    def to_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "ratio": self.ratio, "transport": self.link.name, "kv_tier": self.kv_tier.name,
                "layerwise": self.layerwise, "routing": self.routing.to_dict()}


@dataclass(frozen=True)
class PlanWarning:
    code: str  # kv_transfer_not_hidden | kv_does_not_fit | weights_do_not_fit | precision_unsupported
    #            | kv_dtype_mismatch | kv_layout_mismatch | overloaded | slo_ttft | slo_tpot | no_candidate
    message: str
    severity: str = "warning"  # "error" makes a configuration infeasible

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Cost components (shared by predict, plan and calibrate)
# --------------------------------------------------------------------------------------------

def tp_efficiency(tp: int) -> float:
    return TP_EFFICIENCY ** math.log2(tp)


def roofline(memory_s: Union[float, np.ndarray], compute_s: Union[float, np.ndarray],
             overlap: float = 1.0) -> np.ndarray:
    """Time of a pass that moves ``memory_s`` worth of bytes and does ``compute_s`` worth of math:
    ``max + (1 - overlap) * min`` (the roofline at ``overlap = 1``, the sum at 0)."""
    m, c = np.asarray(memory_s, dtype=float), np.asarray(compute_s, dtype=float)
    return np.maximum(m, c) + (1.0 - overlap) * np.minimum(m, c)


@dataclass(frozen=True)
class StepCost:
    """Decode step time as a function of batch:
    ``fixed + seq*b + roof(weights + kv*b, compute*b, overlap)``."""

    fixed_s: float
    weights_s: float
    kv_s_per_seq: float
    compute_s_per_seq: float
    seq_s: float = 0.0  # per-sequence fixed cost (sampling, streaming its token)
    overlap: float = 1.0

    def time(self, batch: Union[float, np.ndarray]) -> np.ndarray:
        b = np.asarray(batch, dtype=float)
        return (self.fixed_s + self.seq_s * b
                + roofline(self.weights_s + self.kv_s_per_seq * b, self.compute_s_per_seq * b, self.overlap))

    def pieces(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """``time(b) = max(c1 + s1*b, c2 + s2*b)``: the two affine pieces as (intercept, slope)."""
        keep = 1.0 - self.overlap
        return ((self.fixed_s + self.weights_s, self.seq_s + self.kv_s_per_seq + keep * self.compute_s_per_seq),
                (self.fixed_s + keep * self.weights_s,
                 self.seq_s + self.compute_s_per_seq + keep * self.kv_s_per_seq))

    def operating_point(self, token_rate: Union[float, np.ndarray], batch_cap: float) -> tuple[np.ndarray, np.ndarray]:
        """Steady-state (batch, TPOT) for ``token_rate`` output tokens/s offered to one instance.

        A request sees batch ``1 + N`` (itself plus the time-average N others, PASTA) and Little's law
        gives ``N = rate * step(1 + N)``. For each affine piece ``c + s*b`` of the step the fixed point is
        ``N = rate (c + s) / (1 - rate s)``; the least fixed point of their max is the max over pieces.
        Beyond ``batch_cap`` the batch saturates and the instance is stable iff ``rate * step(cap) <=
        cap``. Unstable points get batch and TPOT = inf.
        """
        r = np.asarray(token_rate, dtype=float)
        n = np.zeros_like(r)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for c, s in self.pieces():
                denom = 1.0 - r * s
                n = np.maximum(n, np.where(denom > 0, r * (c + s) / np.where(denom > 0, denom, 1.0), np.inf))
        saturated = 1.0 + n > batch_cap
        batch = np.where(saturated, batch_cap, 1.0 + n)
        stable = ~saturated | (r * self.time(batch_cap) <= batch_cap)
        batch = np.where(stable, batch, np.inf)
        tpot = np.where(stable, self.time(np.where(stable, batch, 1.0)), np.inf)
        return batch, tpot

    def max_token_rate(self, batch_cap: float) -> float:
        return float(batch_cap / self.time(batch_cap))


class PhaseCost:
    """Roofline quantities of one instance (``tp`` devices) of a :class:`Phase`."""

    def __init__(self, model: ModelConfig, phase: Phase):
        hw = phase.hardware
        self.model, self.phase, self.hardware = model, phase, hw
        scale = phase.tp * tp_efficiency(phase.tp)
        self.flops_per_s = hw.peak_flops(phase.precision) * hw.mfu * scale
        self.bytes_per_s = hw.mem_bw_gbs * 1e9 * hw.bw_eff * scale
        self.weight_bytes = model.weight_bytes(phase.precision)
        self.weight_read_bytes = model.weight_read_bytes(phase.precision)
        self.kv_bytes_per_token = model.kv_bytes_per_token(phase.kv_dtype)
        self.memory_bytes = MEM_UTIL * hw.mem_gb * 1e9 * phase.tp

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes <= self.memory_bytes

    def prefill_flops(self, prompt: np.ndarray) -> np.ndarray:
        m = self.model
        return (2 * m.block_params * prompt + 2 * m.layers * m.heads * m.head_dim * prompt ** 2
                + 2 * m.lm_head_params)

    def prefill_bytes(self, prompt: np.ndarray) -> np.ndarray:
        """Weights + the prompt's KV, plus the attention-score traffic of unfused attention (fp32)."""
        m = self.model
        scores = self.hardware.attn_score_passes * 4 * m.layers * m.heads * np.asarray(prompt, dtype=float) ** 2
        return self.weight_read_bytes + prompt * self.kv_bytes_per_token + scores

    def prefill_time(self, prompt: np.ndarray) -> np.ndarray:
        hw = self.hardware
        compute = self.prefill_flops(prompt) / self.flops_per_s
        memory = self.prefill_bytes(prompt) / self.bytes_per_s
        return hw.step_overhead_s + hw.seq_overhead_s + roofline(memory, compute, hw.overlap)

    def _host_tier(self, tier: KVTier) -> bool:
        return tier.name == "host" and self.hardware.host_link is not None

    def tier_bytes_per_s(self, tier: KVTier) -> float:
        if tier.read_gbs is not None:
            return tier.read_gbs * 1e9
        if self._host_tier(tier):
            return LINKS[self.hardware.host_link].bytes_per_s * self.phase.tp  # type: ignore[index]
        return self.bytes_per_s  # device memory (for a CPU, "host" is the same DRAM)

    def kv_capacity_bytes(self, tier: KVTier) -> float:
        if tier.capacity_gb is not None:
            return tier.capacity_gb * 1e9
        if self._host_tier(tier):
            return self.hardware.host_mem_gb * 1e9 * self.phase.tp
        return max(0.0, self.memory_bytes - self.weight_bytes)

    def batch_cap(self, tier: KVTier, context: float) -> float:
        return float(min(MAX_BATCH, math.floor(self.kv_capacity_bytes(tier) / (context * self.kv_bytes_per_token))))

    def decode_step(self, tier: KVTier, context: float) -> StepCost:
        m = self.model
        flops = 2 * (m.block_params + m.lm_head_params) + 4 * m.layers * m.heads * m.head_dim * context
        return StepCost(fixed_s=self.hardware.step_overhead_s + tier.latency_s,
                        weights_s=self.weight_read_bytes / self.bytes_per_s,
                        kv_s_per_seq=context * self.kv_bytes_per_token / self.tier_bytes_per_s(tier),
                        compute_s_per_seq=flops / self.flops_per_s,
                        seq_s=self.hardware.seq_overhead_s, overlap=self.hardware.overlap)

    def warnings(self, role: str) -> list[PlanWarning]:
        hw, ph, out = self.hardware, self.phase, []
        checks = {ph.precision: "precision"}
        checks[ph.kv_dtype] = "precision and KV dtype" if ph.kv_dtype == ph.precision else "KV dtype"
        for dtype, what in checks.items():
            if not hw.supports(dtype):
                out.append(PlanWarning("precision_unsupported", (
                    f"{role}: {what} {dtype} is not supported natively on {hw.name}; modelled as "
                    f"{dtype} storage with {hw.compute_precision(dtype)} compute")))
        if not self.weights_fit:
            out.append(PlanWarning("weights_do_not_fit", (
                f"{role}: {ph.precision} weights ({self.weight_bytes / 1e9:.1f} GB) exceed {MEM_UTIL:.0%} "
                f"of {ph.tp} x {hw.name} memory ({self.memory_bytes / 1e9:.1f} GB); raise tp"), "error"))
        return out


def kv_transfer(prefill: PhaseCost, decode: PhaseCost, links: Sequence[LinkProfile], tier: KVTier,
                prompt: np.ndarray, prefill_s: np.ndarray, layerwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """(total transfer time, time exposed on the TTFT path incl. any KV re-pack), shaped
    ``(len(links), len(prompt))``: one message per layer, at the link's bandwidth (x TP lanes when
    the link is per device), capped by the decode tier's bandwidth."""
    lanes = np.array([min(prefill.phase.tp, decode.phase.tp) if link.per_device else 1 for link in links])
    bandwidth = np.minimum(np.array([link.bytes_per_s for link in links]) * lanes, decode.tier_bytes_per_s(tier))
    latency = np.array([link.latency_s for link in links])
    layers = prefill.model.layers
    per_layer = latency[:, None] + prompt * (prefill.kv_bytes_per_token / layers) / bandwidth[:, None]
    total = layers * per_layer
    exposed = np.maximum(0.0, total - prefill_s) + per_layer if layerwise else total
    return total, exposed + repack_time(prefill, decode, prompt)


def prefill_occupancy(service: np.ndarray, transfer: np.ndarray) -> np.ndarray:
    """How long a request holds a prefill instance: compute and its outbound KV stream form a
    pipeline, so the slower stage sets the pace (the M/G/1 service time)."""
    return np.maximum(service, transfer)


def kv_mismatch(prefill: Phase, decode: Phase) -> bool:
    return prefill.kv_dtype != decode.kv_dtype or prefill.layout != decode.layout


def repack_time(prefill: PhaseCost, decode: PhaseCost, prompt: np.ndarray) -> np.ndarray:
    """Decode-side conversion pass (read source KV, write native KV) when dtype or layout differ."""
    if not kv_mismatch(prefill.phase, decode.phase):
        return np.zeros_like(prompt, dtype=float)
    return prompt * (prefill.kv_bytes_per_token + decode.kv_bytes_per_token) / decode.bytes_per_s


def mg1_wait(arrival_rate: Union[float, np.ndarray], mean_s: float, mean_sq_s: float,
             percentile: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """M/G/1 FCFS: (utilisation, mean wait, percentile wait); inf when utilisation >= 1."""
    lam = np.asarray(arrival_rate, dtype=float)
    rho = lam * mean_s
    tail = 1.0 - percentile / 100.0
    with np.errstate(divide="ignore", invalid="ignore"):
        wait = np.where(rho < 1, lam * mean_sq_s / (2 * np.maximum(1e-300, 1 - rho)), np.inf)
        wait_p = np.where(rho <= tail, 0.0, wait / rho * np.log(rho / tail))
    return rho, wait, wait_p


def violation(value: float, target: float) -> float:
    """Relative SLO overshoot (0 when met, inf when unbounded)."""
    return max(0.0, value / target - 1.0) if math.isfinite(value) else math.inf


def _tier_rank(tier: KVTier) -> int:
    return TIER_ORDER.index(tier.name) if tier.name in TIER_ORDER else len(TIER_ORDER)


def _rank_violation(v: float) -> tuple[bool, float]:
    """Ranking key: SLOs met first, then overshoot in steps of 1% of the target (so best-effort
    ranking does not trade cost for noise)."""
    return v > 0, round(v, 2)


def fewest_instances(latency: np.ndarray, target: float) -> np.ndarray:
    """Per row (last axis = instance counts): index of the fewest instances meeting ``target``;
    failing that, the fewest within ``SIZING_SLACK`` of the best achievable (best effort); the last
    index when the latency is unbounded everywhere."""
    best = np.min(latency, axis=-1)
    goal = np.maximum(target, SIZING_SLACK * best)
    first = np.argmax(latency <= np.expand_dims(goal, -1), axis=-1)
    return np.where(np.isfinite(best), first, latency.shape[-1] - 1)


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def _percentile(x: np.ndarray, q: float) -> float:
    return float(x[0]) if x.size == 1 else float(np.percentile(x, q))


def quantile_points(x: np.ndarray, percentile: float) -> tuple[np.ndarray, np.ndarray]:
    """Points and weights with ``weights @ f(points) == np.percentile(f(x), percentile)`` for any
    non-decreasing ``f`` (linear interpolation), so a percentile costs two evaluations."""
    s = np.sort(x)
    pos = (len(s) - 1) * percentile / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return np.array([s[lo], s[hi]]), np.array([1.0 - (pos - lo), pos - lo])


__all__ = [
    "LengthDist", "Workload", "SLO", "Phase", "Routing", "Deployment", "PlanWarning", "StepCost", "PhaseCost",
    "kv_transfer", "mg1_wait", "default_kv_dtype", "context_tokens", "roofline",
]
