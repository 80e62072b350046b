"""Calibration of the cost model to measurements: :class:`Measurements` (what `hetserve plan --measure`
records), link and hardware-profile fits (Nelder-Mead in log space) and the held-in/held-out reports."""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from .model import (
    Deployment,
    LengthDist,
    Phase,
    PhaseCost,
    Workload,
    _finite,
    context_tokens,
    default_kv_dtype,
    kv_transfer,
)
from .predict import predict
from .profiles import HARDWARE, KV_TIERS, LINKS, MODELS, HardwareProfile, LinkProfile, ModelConfig, lookup

CALIBRATION_PRIOR = 1e-6  # weight of the pull towards the profile's mfu/bw_eff (log space)
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

