"""Analytical cost model for prefill/decode-disaggregated serving, the design-space search and calibration.

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
* **Cost** = device-hours x price / tokens served.

Everything is plain numpy; per-request quantities are evaluated on deterministic samples of the
prompt/output length distributions.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from .profiles import (
    DTYPE_BYTES,
    HARDWARE,
    KV_TIERS,
    LINKS,
    MODELS,
    PRECISION_RANK,
    PRECISIONS,
    HardwareProfile,
    KVTier,
    LinkProfile,
    ModelConfig,
    check_precision,
    lookup,
)

MEM_UTIL = 0.9  # fraction of device memory for weights + KV; the rest is activations/workspace
MAX_BATCH = 512  # decode scheduler's batch ceiling per instance
TP_DEGREES = (1, 2, 4, 8)
TP_EFFICIENCY = 0.9  # share of linear speed-up kept per doubling of the tensor-parallel degree
SIZING_SLACK = 1.1  # best effort: fewest instances within 10% of the best achievable latency
CALIBRATION_PRIOR = 1e-6  # weight of the pull towards the profile's mfu/bw_eff (log space)
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

    def __post_init__(self) -> None:
        if self.qps < 0:
            raise ValueError("qps must be >= 0")

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
class Deployment:
    prefill: Phase
    decode: Phase
    link: LinkProfile
    kv_tier: KVTier = KV_TIERS["device"]
    layerwise: bool = True  # layer-wise KV streaming overlapped with prefill

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
                "layerwise": self.layerwise}


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


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------

def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


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
    kv_bytes_per_request: float
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

    # Prefill, KV transfer, queueing -> TTFT.
    service = pc.prefill_time(prompt)
    transfer, exposed = (x[0] for x in kv_transfer(pc, dc, (d.link,), d.kv_tier, prompt, service, d.layerwise))
    busy = prefill_occupancy(service, transfer)
    rho, wait, wait_p = (float(x) for x in mg1_wait(workload.qps / d.prefill.instances,
                                                     float(busy.mean()), float(np.mean(busy ** 2)), pct))
    overhead = d.prefill.hardware.request_overhead_s
    ttft_mean = overhead + wait + float(np.mean(service + exposed))
    ttft_p = overhead + wait_p + _percentile(service + exposed, pct)

    repack_ms = float(np.mean(repack_time(pc, dc, prompt))) * 1e3
    for what, src, dst in (("dtype", d.prefill.kv_dtype, d.decode.kv_dtype),
                           ("layout", d.prefill.layout, d.decode.layout)):
        if src != dst:
            warns.append(PlanWarning(f"kv_{what}_mismatch", (
                f"prefill writes KV {what} {src}, decode expects {dst}: the decode side re-packs it "
                f"(+{repack_ms:.2f} ms per request)")))
    xfer_mean, service_mean = float(transfer.mean()), float(service.mean())
    if (xfer_mean > service_mean) if d.layerwise else (xfer_mean > 0.05 * service_mean):
        how = "layer-wise streaming cannot hide it" if d.layerwise else "layer-wise overlap is off"
        warns.append(PlanWarning("kv_transfer_not_hidden", (
            f"KV transfer over {d.link.name} takes {xfer_mean * 1e3:.2f} ms vs {service_mean * 1e3:.2f} ms "
            f"prefill ({how}); {float(exposed.mean()) * 1e3:.2f} ms lands on TTFT")))

    # Decode operating point -> TPOT.
    step = dc.decode_step(d.kv_tier, ctx)
    cap = dc.batch_cap(d.kv_tier, ctx)
    batch, tpot = math.inf, math.inf
    if cap >= 1 and decode_batch is not None:
        if decode_batch < 1:
            raise ValueError("decode_batch must be >= 1")
        batch = float(min(decode_batch, cap))
        tpot = float(step.time(batch))
    elif cap >= 1:
        batch, tpot = (float(x) for x in step.operating_point(workload.qps * out_mean / d.decode.instances, cap))

    prefill_qps = d.prefill.instances / float(busy.mean())
    decode_qps = d.decode.instances * step.max_token_rate(cap) / out_mean if cap >= 1 else 0.0
    ingest_qps = d.decode.instances / xfer_mean  # KV arriving at the decode instances' links
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
        kv_exposed_s=float(exposed.mean()), kv_bytes_per_request=float(prompt.mean()) * pc.kv_bytes_per_token,
        prefill_utilization=rho, decode_batch=batch, throughput_tok_s=served_qps * out_mean, max_qps=max_qps,
        cost_per_hour=cost, cost_per_1m_output=cost_out, cost_per_1m_tokens=cost_all,
        meets_slo=v == 0.0, slo_violation=v, warnings=tuple(warns))


# --------------------------------------------------------------------------------------------
# Design-space search
# --------------------------------------------------------------------------------------------

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
                         space.layerwise)
        finalists.setdefault(_signature(dep), dep)
        if len(finalists) >= 2 * top_k + 2:
            break
    preds = sorted((predict(model, dep, workload, slo) for dep in finalists.values()), key=Prediction.rank_key)
    return PlanResult(preds[0].meets_slo, preds[0], tuple(preds[1:top_k]))


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------

POINT_TABLES = {  # Measurements field -> (JSON key in ms, observed-key prefix)
    "prefill_s_at_prompt": ("prefill_ms_at_prompt", "prefill_s@P="),
    "ttft_s_at_prompt": ("ttft_ms_at_prompt", "ttft_s@P="),
    "tpot_s_at_batch": ("tpot_ms_at_batch", "tpot_s@b="),
}


def _table(d: Optional[Mapping[Any, Any]], scale: float, what: str) -> dict[int, float]:
    if d is not None and not isinstance(d, Mapping):
        raise ValueError(f"{what}: expected an object of <integer>: <number>, got {d!r}")
    out = {}
    for k, v in (d or {}).items():
        try:
            key, value = int(k), float(v) * scale
        except (TypeError, ValueError):
            raise ValueError(f"{what}: {k!r}: {v!r} is not <integer>: <number>") from None
        if key < 1 or not value > 0 or not math.isfinite(value):
            raise ValueError(f"{what}: {k!r}: {v!r} must be a positive point with a positive time")
        out[key] = value
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Measurements:
    """Numbers measured on the running system (see docs/planner.md for the JSON format).

    The single-point fields suit a hand-written file. The ``*_at_*`` tables are what
    ``hetserve plan --measure`` (planner/measure.py) records: isolated requests at several prompt
    lengths, closed-loop decode at several batch sizes (``prompt_tokens`` prompts, ``output_tokens``
    each) and KV transfer times per link and size."""

    prefill_tokens_per_s: Optional[float] = None  # at ``prompt_tokens``
    decode_step_s_at_batch: Mapping[int, float] = field(default_factory=dict)  # at ``context_tokens``
    kv_transfer_gbps: Optional[float] = None  # Gbit/s achieved over ``link``
    ttft_s: Optional[float] = None  # mean, at ``qps`` (0: isolated requests)
    tpot_s: Optional[float] = None
    prefill_s_at_prompt: Mapping[int, float] = field(default_factory=dict)  # prompt tokens -> engine time
    ttft_s_at_prompt: Mapping[int, float] = field(default_factory=dict)  # prompt tokens -> TTFT, isolated
    tpot_s_at_batch: Mapping[int, float] = field(default_factory=dict)  # concurrent streams -> TPOT
    kv_transfer_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)  # link -> bytes -> s
    prompt_tokens: int = 128
    output_tokens: int = 64
    context_tokens: Optional[int] = None  # default: prompt_tokens + output_tokens / 2
    qps: float = 0.0
    model: str = "smollm2-135m"
    hardware: str = "cpu-local"
    link: str = "loopback-shm"
    precision: str = "fp32"
    kv_dtype: Optional[str] = None
    layerwise: bool = True  # KV streamed layer by layer during prefill (hetserve sends it after: false)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Measurements":
        """Accepts the field names above, plus ``ttft_ms``/``tpot_ms``, the tables in ms
        (``ttft_ms_at_prompt``, ``prefill_ms_at_prompt``, ``tpot_ms_at_batch``) and ``kv_transfer_ms``
        (link -> bytes -> ms); other keys are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        for name in ("ttft", "tpot"):
            if f"{name}_ms" in d and d[f"{name}_ms"] is not None:
                kw[f"{name}_s"] = float(d[f"{name}_ms"]) / 1e3
        kw["decode_step_s_at_batch"] = _table(kw.get("decode_step_s_at_batch"), 1.0, "decode_step_s_at_batch")
        for name, (ms_key, _) in POINT_TABLES.items():
            kw[name] = {**_table(d.get(ms_key), 1e-3, ms_key), **_table(kw.get(name), 1.0, name)}
        links: dict[str, dict[int, float]] = {}
        for key, scale in (("kv_transfer_ms", 1e-3), ("kv_transfer_s", 1.0)):
            if not isinstance(d.get(key) or {}, Mapping):
                raise ValueError(f"{key}: expected an object of link: {{bytes: time}}")
            for link, points in (d.get(key) or {}).items():
                links.setdefault(str(link), {}).update(_table(points, scale, f"{key}[{link}]"))
        kw["kv_transfer_s"] = links
        return cls(**kw)

    @property
    def decode_context(self) -> float:
        return float(self.context_tokens or self.prompt_tokens + self.output_tokens / 2)

    @property
    def prompt_lengths(self) -> list[int]:
        return sorted(set(self.prefill_s_at_prompt) | set(self.ttft_s_at_prompt))

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(set(self.decode_step_s_at_batch) | set(self.tpot_s_at_batch))

    def observed(self) -> dict[str, float]:
        """Measured values, keyed like :func:`measurement_predictions`."""
        out: dict[str, float] = {}
        if self.prefill_tokens_per_s:
            out["prefill_tokens_per_s"] = float(self.prefill_tokens_per_s)
        for b, s in sorted(self.decode_step_s_at_batch.items()):
            out[f"decode_step_s@{b}"] = float(s)
        if self.ttft_s:
            out["ttft_s"] = float(self.ttft_s)
        if self.tpot_s:
            out["tpot_s"] = float(self.tpot_s)
        for name, (_, prefix) in POINT_TABLES.items():
            for k, s in getattr(self, name).items():
                out[f"{prefix}{k}"] = float(s)
        return out

    def kv_bytes(self, prompt_tokens: int, model: ModelConfig) -> int:
        return prompt_tokens * model.kv_bytes_per_token(self.kv_dtype or self.precision)

    def split(self, prompts: Sequence[int] = (), batches: Sequence[int] = (),
              model: Optional[ModelConfig] = None) -> tuple["Measurements", "Measurements"]:
        """(train, held out): the per-point tables at ``prompts`` / ``batches`` (and the KV transfers
        of those prompts' sizes) move to the held-out set, which keeps none of the single-point fields."""
        model = model or lookup(MODELS, self.model, "model")
        held_p, held_b = {int(p) for p in prompts}, {int(b) for b in batches}
        held_bytes = {self.kv_bytes(p, model) for p in held_p}
        missing = (held_p - set(self.prompt_lengths)) | (held_b - set(self.batch_sizes))
        if missing:
            raise ValueError(f"held-out points {sorted(missing)} were not measured")

        def part(keep: Callable[[int, bool], bool], table: Mapping[int, float], is_batch: bool) -> dict[int, float]:
            return {k: v for k, v in table.items() if keep(k, is_batch)}

        def in_test(k: int, is_batch: bool) -> bool:
            return k in (held_b if is_batch else held_p)

        tables = {"prefill_s_at_prompt": False, "ttft_s_at_prompt": False, "tpot_s_at_batch": True}
        train = dataclasses.replace(self, **{n: part(lambda k, b: not in_test(k, b), getattr(self, n), b)
                                             for n, b in tables.items()},
                                    kv_transfer_s={l: {x: s for x, s in pts.items() if x not in held_bytes}
                                                   for l, pts in self.kv_transfer_s.items()})
        test = dataclasses.replace(
            self, prefill_tokens_per_s=None, decode_step_s_at_batch={}, kv_transfer_gbps=None, ttft_s=None,
            tpot_s=None, **{n: part(in_test, getattr(self, n), b) for n, b in tables.items()},
            kv_transfer_s={l: {x: s for x, s in pts.items() if x in held_bytes}
                           for l, pts in self.kv_transfer_s.items()})
        return train, test


def link_transfer_s(link: LinkProfile, nbytes: Union[float, np.ndarray], layers: int) -> np.ndarray:
    """KV transfer time over ``link`` as :func:`kv_transfer` models it (one message per layer, one lane)."""
    return layers * link.latency_s + np.asarray(nbytes, dtype=float) / link.bytes_per_s


def calibrate_link(link: LinkProfile, measurements: Measurements, model: Optional[ModelConfig] = None) -> LinkProfile:
    """Fit ``link`` to the measured KV transfers over it.

    With transfers of >= 2 sizes: ``seconds = layers * latency + bytes / (nominal * efficiency)`` by
    least squares on the relative error, both terms >= 0 (the per-transfer fixed cost becomes the
    per-layer-message latency of the model). With one size: the efficiency only. Otherwise the
    efficiency from ``kv_transfer_gbps``."""
    points = measurements.kv_transfer_s.get(link.name)
    if not points:
        if not measurements.kv_transfer_gbps:
            return link
        return dataclasses.replace(link, efficiency=measurements.kv_transfer_gbps / 8 / link.gbytes_per_s,
                                   source=f"{link.source} (calibrated)".strip())
    layers = (model or lookup(MODELS, measurements.model, "model")).layers
    x = np.array(list(points), dtype=float)
    y = np.array(list(points.values()), dtype=float)
    fixed = layers * link.latency_s
    if len(x) >= 2:
        (fixed, slope), *_ = np.linalg.lstsq(np.stack([1 / y, x / y], axis=1), np.ones_like(y), rcond=None)
        if fixed < 0:  # through the origin
            fixed, slope = 0.0, float(np.sum(x / y) / np.sum((x / y) ** 2))
    else:
        fixed = min(fixed, 0.5 * y[0])
        slope = (y[0] - fixed) / x[0]
    slope = max(float(slope), 1e-15)  # transfer time that does not grow with size: a very fast link
    return dataclasses.replace(link, latency_s=float(fixed) / layers,
                               efficiency=1.0 / (slope * link.gbytes_per_s * 1e9),
                               source=f"{link.source} (calibrated)".strip())


def calibrate_links(measurements: Measurements, model: Optional[ModelConfig] = None) -> dict[str, LinkProfile]:
    """Every link with measured transfers (and ``measurements.link``), calibrated."""
    names = dict.fromkeys([measurements.link, *measurements.kv_transfer_s])
    return {n: calibrate_link(lookup(LINKS, n, "link"), measurements, model) for n in names}


def measurement_deployment(profile: HardwareProfile, meas: Measurements, link: LinkProfile) -> Deployment:
    phase = Phase(profile, meas.precision, meas.kv_dtype or default_kv_dtype(meas.precision, profile))
    return Deployment(phase, phase, link, layerwise=meas.layerwise)


def _point_workload(meas: Measurements, prompt: Optional[int] = None) -> Workload:
    """Isolated requests (qps 0): one prompt length, ``output_tokens`` each."""
    return Workload(0.0, LengthDist(prompt or meas.prompt_tokens), LengthDist(meas.output_tokens))


def measurement_predictions(profile: HardwareProfile, meas: Measurements, model: ModelConfig,
                            link: Optional[LinkProfile] = None) -> dict[str, float]:
    """What the cost model predicts for every quantity present in ``meas``, under its conditions.

    The per-point tables are evaluated vectorised with the components :func:`predict` uses (this is
    the calibration loss); :func:`predict_points` gives the same numbers one :func:`predict` call per
    point, as ``hetserve plan`` reports them."""
    link = link or calibrate_link(lookup(LINKS, meas.link, "link"), meas, model)
    dep = measurement_deployment(profile, meas, link)
    cost = PhaseCost(model, dep.prefill)
    out: dict[str, float] = {}
    if meas.prefill_tokens_per_s:
        out["prefill_tokens_per_s"] = meas.prompt_tokens / float(cost.prefill_time(np.array([meas.prompt_tokens]))[0])
    step = cost.decode_step(KV_TIERS["device"], meas.decode_context)
    for b in sorted(meas.decode_step_s_at_batch):
        out[f"decode_step_s@{b}"] = float(step.time(b))
    if meas.ttft_s or meas.tpot_s:
        work = Workload(meas.qps, LengthDist(meas.prompt_tokens), LengthDist(meas.output_tokens))
        pred = predict(model, dep, work)
        if meas.ttft_s:
            out["ttft_s"] = pred.ttft_mean_s
        if meas.tpot_s:
            out["tpot_s"] = pred.tpot_s
    prompts = meas.prompt_lengths
    if prompts:  # isolated requests: no queueing, TTFT = overhead + prefill + exposed KV transfer
        p = np.array(prompts, dtype=float)
        service = cost.prefill_time(p)
        _, exposed = kv_transfer(cost, cost, (link,), dep.kv_tier, p, service, dep.layerwise)
        ttft = profile.request_overhead_s + service + exposed[0]
        for i, n in enumerate(prompts):
            if n in meas.prefill_s_at_prompt:
                out[f"prefill_s@P={n}"] = float(service[i])
            if n in meas.ttft_s_at_prompt:
                out[f"ttft_s@P={n}"] = float(ttft[i])
    if meas.tpot_s_at_batch:
        prompt, output = _point_workload(meas).samples()
        ctx = context_tokens(prompt, output)
        step, cap = cost.decode_step(dep.kv_tier, ctx), cost.batch_cap(dep.kv_tier, ctx)
        for b in meas.tpot_s_at_batch:
            out[f"tpot_s@b={b}"] = float(step.time(min(b, cap))) if cap >= 1 else math.inf
    return out


def predict_points(profile: HardwareProfile, meas: Measurements, model: ModelConfig,
                   link: Optional[LinkProfile] = None) -> dict[str, float]:
    """The per-point tables of ``meas`` predicted through :func:`predict` itself (the code path of
    ``hetserve plan``): prefill time and TTFT of an isolated request per prompt length, TPOT at each
    closed-loop decode batch."""
    link = link or calibrate_link(lookup(LINKS, meas.link, "link"), meas, model)
    dep = measurement_deployment(profile, meas, link)
    out: dict[str, float] = {}
    for n in meas.prompt_lengths:
        pred = predict(model, dep, _point_workload(meas, n))
        if n in meas.prefill_s_at_prompt:
            out[f"prefill_s@P={n}"] = pred.prefill_s
        if n in meas.ttft_s_at_prompt:
            out[f"ttft_s@P={n}"] = pred.ttft_mean_s
    for b in meas.tpot_s_at_batch:
        out[f"tpot_s@b={b}"] = predict(model, dep, _point_workload(meas), decode_batch=b).tpot_s
    return out


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.7,
                 iters: int = 300, tol: float = 1e-14) -> tuple[np.ndarray, float]:
    n = len(x0)
    simplex = np.vstack([x0] + [x0 + step * e for e in np.eye(n)])
    values = np.array([f(x) for x in simplex])
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if values[-1] - values[0] < tol:
            break
        centroid = simplex[:-1].mean(axis=0)
        reflected = 2 * centroid - simplex[-1]
        fr = f(reflected)
        if fr < values[0]:
            expanded = 3 * centroid - 2 * simplex[-1]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * ((reflected if fr < values[-1] else simplex[-1]) - centroid)
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best vertex
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                values[1:] = [f(x) for x in simplex[1:]]
    i = int(np.argmin(values))
    return simplex[i], float(values[i])


FIT_PARAMETERS = ("mfu", "bw_eff", "step_overhead_s", "request_overhead_s", "seq_overhead_s", "attn_score_passes")
_ADDITIVE = ("step_overhead_s", "request_overhead_s", "seq_overhead_s", "attn_score_passes")  # may fit to 0


def fit_parameters(meas: Measurements, profile: Optional[HardwareProfile] = None) -> list[str]:
    """The parameters of ``profile`` that ``meas`` pins down (see :func:`calibrate`)."""
    profile = profile or lookup(HARDWARE, meas.hardware, "hardware")
    prompts, batches = len(meas.prompt_lengths), len(meas.batch_sizes)
    prefill = bool(meas.prefill_tokens_per_s or meas.prefill_s_at_prompt)
    ttft = bool(meas.ttft_s or meas.ttft_s_at_prompt)
    return [name for name, needed in (
        ("mfu", prefill or ttft),
        ("bw_eff", batches > 0 or bool(meas.tpot_s)),
        ("step_overhead_s", batches >= 2 and profile.overlap > 0),
        ("request_overhead_s", prefill and ttft),
        ("seq_overhead_s", batches >= 2 and prompts >= 2),
        ("attn_score_passes", prompts >= 3),
    ) if needed]


def calibrate(profile: HardwareProfile, measurements: Union[Measurements, Mapping[str, Any]],
              model: Optional[ModelConfig] = None) -> HardwareProfile:
    """Fit the parameters of ``profile`` the measurements pin down so that
    :func:`measurement_predictions` matches them.

    Least squares on log(predicted / measured), minimised with Nelder-Mead (multi-start, restarted)
    over the log of each parameter. ``mfu`` is fitted from prefill or TTFT, ``bw_eff`` from decode
    steps or TPOT; the step overhead needs >= 2 decode batch sizes and ``overlap > 0`` (when memory
    and compute times add, it is indistinguishable from the weight-streaming time, which ``bw_eff``
    then carries); the request overhead needs both
    prefill (engine) and TTFT numbers; the per-sequence overhead needs >= 2 batch sizes and >= 2
    prompt lengths (so that the prefill slope separates it from compute); the attention-score passes
    need >= 3 prompt lengths (the curvature). ``overlap`` is a property of the profile, not fitted.
    The link is calibrated first (:func:`calibrate_link`).
    """
    meas = measurements if isinstance(measurements, Measurements) else Measurements.from_dict(measurements)
    model = model or lookup(MODELS, meas.model, "model")
    link = calibrate_link(lookup(LINKS, meas.link, "link"), meas, model)
    observed = meas.observed()
    free = fit_parameters(meas, profile)
    if not free:
        return profile
    keys = list(observed)
    target = np.log(np.array([observed[k] for k in keys]))

    # A weak pull towards the profile's efficiencies decides directions the data leaves flat
    # (e.g. bandwidth when every decode step measured is compute bound).
    efficiency = np.array([name in ("mfu", "bw_eff") for name in free])
    prior = np.array([math.log(getattr(profile, name)) for name in free if name in ("mfu", "bw_eff")])

    def build(x: np.ndarray) -> HardwareProfile:
        return dataclasses.replace(profile, **{name: float(math.exp(v)) for name, v in zip(free, x)})

    def loss(x: np.ndarray) -> float:
        if np.any(np.abs(x) > 40):
            return math.inf
        predicted = measurement_predictions(build(x), meas, model, link)
        p = np.array([predicted[k] for k in keys])
        ok = np.isfinite(p) & (p > 0)
        r = np.where(ok, np.log(np.where(ok, p, 1.0)) - target, 50.0)
        return float(np.dot(r, r) + CALIBRATION_PRIOR * np.sum((x[efficiency] - prior) ** 2))

    # Multi-start: each overhead from ~0 and from a fraction of its measured scale (the max() in the
    # roofline makes the loss non-convex), mfu/bw_eff/attention passes from the profile's values.
    steps = [v for k, v in observed.items() if k.startswith(("decode_step_s@", "tpot_s@b="))]
    ttfts = [v for k, v in observed.items() if k.startswith(("ttft_s@P=", "ttft_s"))]
    scale = {"step_overhead_s": min(steps, default=meas.tpot_s or 0.0),
             "request_overhead_s": min(ttfts, default=0.0) * 0.5,
             "seq_overhead_s": 0.1 * min(steps, default=0.0)}

    def starts_for(name: str) -> tuple[float, ...]:
        if name in ("mfu", "bw_eff"):
            return (math.log(max(getattr(profile, name), 1e-4)),)
        if name == "attn_score_passes":
            return (math.log(max(getattr(profile, name), 1.0)),)
        return tuple({math.log(1e-4), math.log(max(0.5 * scale[name], 1e-4))})

    best_x, best = np.zeros(len(free)), math.inf
    for start in itertools.product(*(starts_for(name) for name in free)):
        x, value = np.array(start), math.inf
        for _ in range(4):  # restarts re-expand a collapsed simplex
            x, new_value = _nelder_mead(loss, x)
            if value - new_value < 1e-12:
                break
            value = new_value
        if new_value < best:
            best_x, best = x, new_value
    fitted = build(best_x)
    tiny = {name: 0.0 for name in _ADDITIVE if name in free and getattr(fitted, name) < 1e-7}
    return dataclasses.replace(fitted, **tiny, source=f"{profile.source} (calibrated)".strip())


def _fit_rows(measured: Mapping[str, float], predicted: Mapping[str, float],
              before: Optional[Mapping[str, float]] = None) -> dict[str, dict[str, Optional[float]]]:
    rows = {}
    for k, v in measured.items():
        rows[k] = {"measured": v, **({"predicted_before": _finite(before[k])} if before is not None else {}),
                   "predicted": _finite(predicted[k]), "error": _finite(predicted[k] / v - 1)}
    return rows


def link_report(link: LinkProfile, meas: Measurements, model: ModelConfig) -> dict[str, Any]:
    """A calibrated link and its measured vs modelled transfer times (keyed by KV bytes)."""
    points = meas.kv_transfer_s.get(link.name, {})
    pred = {str(x): float(link_transfer_s(link, x, model.layers)) for x in points}
    return {**link.to_dict(), "fit": _fit_rows({str(x): s for x, s in points.items()}, pred)}


def calibration_report(profile: HardwareProfile, calibrated: HardwareProfile, meas: Measurements,
                       model: ModelConfig) -> dict[str, Any]:
    """Measured vs predicted, before and after calibration, plus the fitted parameters and links."""
    links = calibrate_links(meas, model)
    link = links[meas.link]
    before = measurement_predictions(profile, meas, model, link)
    after = measurement_predictions(calibrated, meas, model, link)
    return {"hardware": calibrated.name, "model": model.name, "link": link.to_dict(),
            "links": {name: link_report(l, meas, model) for name, l in links.items()},
            "fitted": fit_parameters(meas, profile),
            "parameters": {p: {"before": getattr(profile, p), "after": getattr(calibrated, p)} for p in FIT_PARAMETERS},
            "fit": _fit_rows(meas.observed(), after, before)}


__all__ = [
    "LengthDist", "Workload", "SLO", "Phase", "Deployment", "PlanWarning", "StepCost", "PhaseCost",
    "Prediction", "SearchSpace", "PlanResult", "Measurements", "predict", "plan", "calibrate",
    "calibrate_link", "calibrate_links", "calibration_report", "measurement_predictions", "predict_points",
    "fit_parameters", "link_transfer_s", "kv_transfer", "mg1_wait", "default_kv_dtype", "context_tokens",
    "roofline",
]
