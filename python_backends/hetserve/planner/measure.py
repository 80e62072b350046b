"""Measure the running prefill + decode servers, calibrate the planner on part of the points and check
its predictions on the rest (``hetserve plan --measure URL``).

Every point goes through the real serving path over Triton gRPC:

* **TTFT** at each prompt length: the ``llm`` model (BLS: prefill -> KV push to the decode server ->
  decode stream) with exact ``input_ids``, greedy, ``ignore_eos``, one request at a time. ``max_tokens=2``
  so the decode server consumes the pushed KV (one decode step, after the first token).
* **Prefill and KV transfer** at each prompt length and transport: the ``prefill`` model directly. Its
  ``prefill_ms`` output is the engine time; the KV cost is the extra client-observed time of a call that
  pushes the KV over one transport versus one with ``skip_transfer`` (wire encode + checksum + send +
  ingest on the decode server). The pushed KV is then released on the decode server (a ``decode``
  generate with ``max_tokens=1`` takes it without generating).
* **TPOT** at each decode batch ``b``: ``b`` concurrent ``llm`` streams; the median token gap is taken
  only over the window in which all ``b`` streams are decoding, so it is the decode step time at batch
  ``b`` (admission stagger and the last stragglers are excluded).

Each round visits every point once, in a random order, so load from elsewhere falls on fitted and
held-out points alike; before each point, while the servers are idle, it waits (bounded) until the
box is quiet. Each point keeps the median of its rounds. The result is a measurements dict in the format
:meth:`hetserve.planner.calibration.Measurements.from_dict` reads, with the raw samples under ``samples``.
:func:`holdout_report` then calibrates on part of the points and predicts the rest.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from .calibration import Measurements, calibrate, calibrate_links, fit_parameters, link_transfer_s, predict_points
from .profiles import HARDWARE, MODELS, HardwareProfile, ModelConfig, lookup

TRANSPORT_LINKS = {"grpc": "loopback-grpc", "shm": "loopback-shm", "nixl": "loopback-nixl"}  # transport -> link
TOKEN_RANGE = (256, 32000)  # prompt token ids are drawn from here (ordinary tokens of any >= 32k vocabulary)


class MeasureError(RuntimeError):
    """A measurement request failed or returned something unexpected."""


@dataclass(frozen=True)
class MeasureConfig:
    prompt_lens: tuple[int, ...] = (16, 64, 128, 256, 512)  # TTFT and prefill/KV points
    batches: tuple[int, ...] = (1, 2, 4, 8)  # concurrent decode streams for TPOT
    transports: tuple[str, ...] = ("grpc", "shm")  # KV transports to time
    transport: str = "grpc"  # the transport the llm (TTFT/TPOT) requests use
    kv_dtype: str = "fp32"
    decode_precision: str = "fp32"
    repeats: int = 3  # rounds (each point once per round, in random order); the median is kept
    # Before each point (servers idle), wait while other work keeps more than ``quiet_below`` of the
    # box's CPU time busy, for at most ``quiet_wait_s`` in all (0: never wait); the load is recorded.
    quiet_below: float = 0.2
    quiet_wait_s: float = 60.0
    warmup: int = 2  # unmeasured llm requests first
    decode_prompt: int = 32  # prompt length of the TPOT streams (short: they are admitted one by one)
    output_tokens: int = 48  # tokens per TPOT stream
    seed: int = 0  # order of the points within rounds (prompts are always fresh random tokens)
    timeout_s: float = 120.0
    model: str = "smollm2-135m"  # planner model preset the servers run
    hardware: str = "cpu-local"  # planner hardware profile both servers run on

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0 or self.decode_prompt < 1 or self.output_tokens < 4:
            raise ValueError("repeats >= 1, warmup >= 0, decode_prompt >= 1 and output_tokens >= 4 are required")
        if not self.prompt_lens or min(self.prompt_lens) < 1 or not self.batches or min(self.batches) < 1:
            raise ValueError("prompt lengths and batch sizes must be >= 1")
        for t in (self.transport, *self.transports):
            if t not in TRANSPORT_LINKS:
                raise ValueError(f"unknown transport {t!r}; use one of {', '.join(TRANSPORT_LINKS)}")


def default_decode_url(prefill_url: str) -> str:
    """The local topology's convention: the decode server's gRPC port is the prefill's + 1000."""
    host, _, port = prefill_url.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cannot derive the decode server URL from {prefill_url!r} (want host:port); "
                         f"give it explicitly (--decode-url)")
    return f"{host}:{int(port) + 1000}"


def cpu_busy(interval_s: float = 0.5) -> Optional[float]:
    """Fraction of all CPUs' time spent busy over ``interval_s`` (Linux /proc/stat; None elsewhere)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(interval_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else None


def wait_for_quiet(below: float, budget_s: float, interval_s: float = 0.25) -> tuple[Optional[float], float]:
    """Sample the CPU load until it is under ``below`` or ``budget_s`` is spent: (last load, waited s)."""
    t0 = time.perf_counter()
    while True:
        busy = cpu_busy(interval_s)
        waited = time.perf_counter() - t0
        if busy is None or busy < below or waited >= budget_s:
            return busy, waited
        time.sleep(min(1.0, max(0.0, budget_s - waited)))


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class Prober:
    """Single probes of the live servers (times in seconds); failures raise :class:`MeasureError`."""

    def __init__(self, prefill_url: str, decode_url: str, config: MeasureConfig):
        import tritonclient.grpc as grpcclient

        self.prefill_url, self.decode_url, self.cfg = prefill_url, decode_url, config
        self.rng = np.random.default_rng()  # fresh entropy: no prompt repeats across measurements either
        self._lock = threading.Lock()
        self._client = grpcclient.InferenceServerClient(prefill_url)

    def close(self) -> None:
        self._client.close()

    def prompt(self, n: int) -> list[int]:
        """Fresh random token ids: no two probes share a prefix, so the prefill server's prefix cache
        cannot shorten them (not within one measurement, nor across repeated ones)."""
        with self._lock:
            return [int(x) for x in self.rng.integers(*TOKEN_RANGE, n)]

    def _llm_params(self, max_tokens: int) -> dict[str, Any]:
        c = self.cfg
        return dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, transport=c.transport,
                    kv_dtype=c.kv_dtype, decode_precision=c.decode_precision)

    def ttft(self, n: int) -> float:
        from tritonclient.utils import InferenceServerException

        from ..client import GenerationError, generate

        try:
            g = generate(self.prefill_url, None, model="llm", input_ids=self.prompt(n), timeout_s=self.cfg.timeout_s,
                         **self._llm_params(2))
        except (GenerationError, InferenceServerException) as e:
            raise MeasureError(f"llm request ({n}-token prompt) failed: {e}") from e
        if g.ttft_s is None or len(g.token_ids) != 2:
            raise MeasureError(f"llm returned {len(g.token_ids)} tokens for max_tokens=2 (ignore_eos)")
        return g.ttft_s

    def prefill(self, n: int, transport: Optional[str]) -> dict[str, float]:
        """One ``prefill`` call; ``transport=None`` skips the KV push. Round trip, engine time, KV bytes."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        from ..client import admin_parameters, build_inputs

        ids, rid = self.prompt(n), uuid.uuid4().hex
        ins = build_inputs(None, input_ids=ids, request_id=rid, decode_url=self.decode_url, max_tokens=2,
                           kv_dtype=self.cfg.kv_dtype, transport=transport or self.cfg.transport)
        skip = grpcclient.InferInput("skip_transfer", [1], "BOOL")
        skip.set_data_from_numpy(np.array([transport is None]))
        ins.append(skip)
        t0 = time.perf_counter()
        try:
            r = self._client.infer("prefill", ins, client_timeout=self.cfg.timeout_s,
                                   parameters=admin_parameters())  # an operator tool: it may pick decode_url
        except InferenceServerException as e:
            raise MeasureError(f"prefill request ({n}-token prompt) failed: {e.message()}") from e
        rt = time.perf_counter() - t0
        out = {k: float(r.as_numpy(k).reshape(-1)[0]) for k in ("prefill_ms", "transfer_ms", "kv_bytes")}
        if transport is not None:
            if not bool(r.as_numpy("transfer_ok").reshape(-1)[0]):
                raise MeasureError(f"KV transfer over {transport} failed (see the prefill server log)")
            used = r.as_numpy("transport_used").reshape(-1)[0].decode()
            if used != transport:
                raise MeasureError(f"KV went over {used}, not {transport} (e.g. its staging region was full)")
            self._release(rid, ids, int(r.as_numpy("first_token").reshape(-1)[0]))
        return {"round_trip_s": rt, "prefill_s": out["prefill_ms"] / 1e3, "send_s": out["transfer_ms"] / 1e3,
                "kv_bytes": out["kv_bytes"]}

    def _release(self, rid: str, ids: list[int], first: int) -> None:
        """Drop the KV a bare prefill call parked on the decode server (no generate will claim it)."""
        from tritonclient.utils import InferenceServerException

        from ..client import GenerationError, stream

        try:
            for _ in stream(self.decode_url, None, model="decode", timeout_s=self.cfg.timeout_s, op="generate",
                            request_id=rid, input_ids=ids, output_ids=[first], max_tokens=1):
                pass
        except (GenerationError, InferenceServerException) as e:
            raise MeasureError(f"releasing KV {rid} on the decode server failed: {e}") from e

    def tpot(self, batch: int) -> dict[str, float]:
        """``batch`` concurrent streams -> inter-token time while all of them decode."""
        from ..client import stream

        times: list[list[float]] = [[] for _ in range(batch)]
        errors: list[BaseException] = []
        gate = threading.Barrier(batch)
        params = self._llm_params(self.cfg.output_tokens)
        prompts = [self.prompt(self.cfg.decode_prompt) for _ in range(batch)]

        def run(i: int) -> None:
            try:
                gate.wait()
                for chunk in stream(self.prefill_url, None, model="llm", input_ids=prompts[i],
                                    timeout_s=self.cfg.timeout_s, **params):
                    times[i].extend([chunk.t] * len(chunk.token_ids))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise MeasureError(f"decode stream failed at batch {batch}: {errors[0]}") from errors[0]
        if any(len(t) != self.cfg.output_tokens for t in times):
            raise MeasureError(f"streams returned {[len(t) for t in times]} tokens, not {self.cfg.output_tokens}")
        return overlap_tpot(times)


def overlap_tpot(times: Sequence[Sequence[float]], min_gaps: int = 2) -> dict[str, float]:
    """Median inter-token time over the window in which every stream is decoding.

    Each stream's first token comes from prefill, so its decode starts at its second token; the
    window runs from the latest decode start to the earliest last token, and the result is the
    median of every stream's token gaps inside it (a median per step, so a burst of other load on
    the box moves it little). When the window holds fewer than ``min_gaps`` gaps of some stream
    (too much admission stagger), the gaps of the whole streams are used and ``window_s`` is 0."""
    start = max(t[1] for t in times)
    end = min(t[-1] for t in times)
    window = [np.diff([x for x in t if start <= x <= end]) for t in times]
    if end > start and all(len(g) >= min_gaps for g in window):
        return {"tpot_s": float(np.median(np.concatenate(window))), "window_s": end - start}
    return {"tpot_s": float(np.median(np.concatenate([np.diff(t[1:]) for t in times]))), "window_s": 0.0}


def median_rse(samples: Sequence[float]) -> float:
    """Relative standard error of a sample median, from the median absolute deviation
    (``1.2533 * 1.4826 * MAD / sqrt(n) / median``, the normal-theory approximation)."""
    x = np.asarray(samples, dtype=float)
    med = float(np.median(x))
    if len(x) < 2 or med <= 0:
        return math.inf
    return 1.2533 * 1.4826 * float(np.median(np.abs(x - med))) / math.sqrt(len(x)) / med


def measure(prefill_url: str, decode_url: Optional[str] = None, config: MeasureConfig = MeasureConfig(),
            log: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Measure the live servers; returns a measurements dict (see the module docstring)."""
    cfg, say = config, log or (lambda _msg: None)
    decode_url = decode_url or default_decode_url(prefill_url)
    probe = Prober(prefill_url, decode_url, cfg)
    t_start = time.perf_counter()
    raw: dict[str, Any] = {"ttft_s": {}, "prefill_s": {}, "tpot_s": {}, "tpot_window_s": {},
                           "kv_extra_s": {t: {} for t in cfg.transports}, "kv_send_s": {t: {} for t in cfg.transports},
                           "kv_bytes": {}, "bare_prefill_overhead_s": [], "rounds": []}
    try:
        for _ in range(cfg.warmup):
            probe.ttft(min(cfg.prompt_lens))
            probe.prefill(min(cfg.prompt_lens), None)
        if cfg.warmup:  # the decode server sizes its batch buffers on first use
            probe.tpot(max(cfg.batches))
        # Each round visits every point once, in a fresh random order: whatever else loads the box
        # then falls on all points alike (fitted and held-out), and the medians stay comparable.
        tasks = [("prompt", n) for n in cfg.prompt_lens] + [("batch", b) for b in cfg.batches]
        order = np.random.default_rng(cfg.seed + 1)
        budget = cfg.quiet_wait_s
        for rnd in range(1, cfg.repeats + 1):
            loads, waited = [], 0.0
            for i in order.permutation(len(tasks)):
                busy, w = wait_for_quiet(cfg.quiet_below, budget)
                budget, waited = budget - w, waited + w
                loads.append(busy)
                kind, n = tasks[i]
                if kind == "batch":
                    r = probe.tpot(n)
                    raw["tpot_s"].setdefault(n, []).append(r["tpot_s"])
                    raw["tpot_window_s"].setdefault(n, []).append(r["window_s"])
                    continue
                raw["ttft_s"].setdefault(n, []).append(probe.ttft(n))
                bare = probe.prefill(n, None)
                raw["prefill_s"].setdefault(n, []).append(bare["prefill_s"])
                overhead = bare["round_trip_s"] - bare["prefill_s"]
                raw["bare_prefill_overhead_s"].append(overhead)
                for t in cfg.transports:
                    p = probe.prefill(n, t)
                    raw["prefill_s"][n].append(p["prefill_s"])
                    raw["kv_bytes"][n] = p["kv_bytes"]
                    raw["kv_extra_s"][t].setdefault(n, []).append(p["round_trip_s"] - p["prefill_s"] - overhead)
                    raw["kv_send_s"][t].setdefault(n, []).append(p["send_s"])
            worst = max((x for x in loads if x is not None), default=None)
            raw["rounds"].append({"cpu_busy_before_max": None if worst is None else round(worst, 3),
                                  "waited_s": round(waited, 1)})
            say(f"round {rnd}/{cfg.repeats} done ({time.perf_counter() - t_start:.0f} s; box at most "
                f"{'?' if worst is None else f'{worst:.0%}'} busy before its points, waited {waited:.0f} s)")
    finally:
        probe.close()

    def ms(table: Mapping[int, Sequence[float]]) -> dict[str, float]:
        return {str(k): round(_median(v) * 1e3, 3) for k, v in sorted(table.items())}

    kv = {TRANSPORT_LINKS[t]: {str(int(raw["kv_bytes"][n])): round(max(1e-6, _median(v)) * 1e3, 3)
                               for n, v in sorted(raw["kv_extra_s"][t].items())} for t in cfg.transports}
    return {
        "model": cfg.model, "hardware": cfg.hardware, "link": TRANSPORT_LINKS[cfg.transport],
        "precision": cfg.decode_precision, "kv_dtype": cfg.kv_dtype, "layerwise": False, "qps": 0.0,
        "ttft_ms_at_prompt": ms(raw["ttft_s"]), "prefill_ms_at_prompt": ms(raw["prefill_s"]),
        "tpot_ms_at_batch": ms(raw["tpot_s"]), "kv_transfer_ms": kv,
        "prompt_tokens": cfg.decode_prompt, "output_tokens": cfg.output_tokens,
        "measured": {"prefill_url": prefill_url, "decode_url": decode_url, "rounds": raw["rounds"],
                     "seconds": round(time.perf_counter() - t_start, 1),
                     "median_rse": {k: {str(n): round(median_rse(v), 4) for n, v in sorted(raw[k].items())}
                                    for k in ("ttft_s", "prefill_s", "tpot_s")},
                     "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": dataclasses.asdict(cfg)},
        "samples": {"ttft_ms": _samples_ms(raw["ttft_s"]), "prefill_ms": _samples_ms(raw["prefill_s"]),
                    "tpot_ms": _samples_ms(raw["tpot_s"]), "tpot_window_s": _samples_ms(raw["tpot_window_s"], 1.0),
                    "kv_extra_ms": {t: _samples_ms(v) for t, v in raw["kv_extra_s"].items()},
                    "kv_send_ms": {t: _samples_ms(v) for t, v in raw["kv_send_s"].items()},
                    "bare_prefill_overhead_ms": [round(x * 1e3, 3) for x in raw["bare_prefill_overhead_s"]]},
    }


def _samples_ms(table: Mapping[int, Sequence[float]], scale: float = 1e3) -> dict[str, list[float]]:
    return {str(k): [round(x * scale, 3) for x in v] for k, v in sorted(table.items())}


# --------------------------------------------------------------------------------------------
# Calibrate on part of the points, predict the rest
# --------------------------------------------------------------------------------------------

def default_holdout(points: Sequence[int]) -> list[int]:
    """Every other interior point (the 2nd, 4th, ...; never the largest): predictions are then
    interpolations between calibration points."""
    pts = sorted(points)
    return [p for i, p in enumerate(pts) if i % 2 == 1 and i < len(pts) - 1]


def holdout_report(measurements: Any, holdout_prompts: Optional[Iterable[int]] = None,
                   holdout_batches: Optional[Iterable[int]] = None, profile: Optional[HardwareProfile] = None,
                   model: Optional[ModelConfig] = None) -> dict[str, Any]:
    """Calibrate ``profile`` (default: the measurements' hardware) and the links on the training
    points only, then predict every point, held out or not, through :func:`predict` (via
    :func:`~hetserve.planner.calibration.predict_points`). Returns the fitted profile and links and one
    row per point: measured, predicted, relative error and whether it was held out."""
    meas = measurements if isinstance(measurements, Measurements) else Measurements.from_dict(measurements)
    model = model or lookup(MODELS, meas.model, "model")
    base = profile or lookup(HARDWARE, meas.hardware, "hardware")
    hp = default_holdout(meas.prompt_lengths) if holdout_prompts is None else sorted(set(holdout_prompts))
    hb = default_holdout(meas.batch_sizes) if holdout_batches is None else sorted(set(holdout_batches))
    train, test = meas.split(hp, hb, model)
    fitted = calibrate(base, train, model)
    links = calibrate_links(train, model)
    link = links[meas.link]
    rows = []
    for part, held in ((train, False), (test, True)):
        predicted = predict_points(fitted, part, model, link)
        for key, value in part.observed().items():
            if key in predicted:
                metric, _, point = key.partition("@")
                rows.append({"metric": metric.removesuffix("_s"), "point": point, "held_out": held,
                             "measured_s": value, "predicted_s": predicted[key], "error": predicted[key] / value - 1})
    order = {"ttft": 0, "prefill": 1, "tpot": 2}
    rows.sort(key=lambda r: (order.get(r["metric"], 3), int(r["point"].split("=")[1])))
    kv_rows = []
    for name, points in meas.kv_transfer_s.items():
        for nbytes, seconds in points.items():
            pred = float(link_transfer_s(links[name], nbytes, model.layers))
            kv_rows.append({"link": name, "bytes": nbytes, "held_out": nbytes in test.kv_transfer_s.get(name, {}),
                            "measured_s": seconds, "predicted_s": pred, "error": pred / seconds - 1})
    return {"model": model.name, "hardware": fitted.name, "link": meas.link,
            "holdout": {"prompts": hp, "batches": hb}, "fitted": fit_parameters(train, base), "profile": fitted,
            "links": links, "parameters": {p: getattr(fitted, p) for p in REPORTED},
            "points": rows, "kv": kv_rows}


REPORTED = ("mfu", "bw_eff", "step_overhead_s", "request_overhead_s", "seq_overhead_s", "attn_score_passes", "overlap")


def max_holdout_error(report: Mapping[str, Any], metrics: Iterable[str] = ("ttft", "tpot")) -> float:
    """Largest |relative error| over the held-out points of ``metrics`` (nan when there are none)."""
    wanted = set(metrics)
    errs = [abs(r["error"]) for r in report["points"] if r["held_out"] and r["metric"] in wanted]
    return max(errs) if errs else math.nan


def render_holdout(report: Mapping[str, Any]) -> str:
    """Markdown table of predicted vs measured per point (the format docs/planner.md shows)."""
    p, h = report["parameters"], report["holdout"]
    lines = [f"calibrated {report['hardware']} on {report['model']}; held out: prompts {h['prompts'] or '-'}, "
             f"batches {h['batches'] or '-'}; fitted: {', '.join(report['fitted'])}",
             f"  mfu {p['mfu']:.3g}, bw_eff {p['bw_eff']:.3g}, overheads: step {p['step_overhead_s'] * 1e3:.2f} ms, "
             f"request {p['request_overhead_s'] * 1e3:.2f} ms, per sequence {p['seq_overhead_s'] * 1e3:.2f} ms; "
             f"attention-score passes {p['attn_score_passes']:.2f}; overlap {p['overlap']:g}"]
    for name, link in report["links"].items():
        lines.append(f"  link {name}: {link.bytes_per_s / 1e9:.3g} GB/s effective, "
                     f"{link.latency_s * 1e6:.0f} us per layer message")
    lines += ["", "| metric | point | set | measured ms | predicted ms | error |", "|---|---|---|---:|---:|---:|"]
    for r in report["points"]:
        lines.append(f"| {r['metric']} | {r['point']} | {'held out' if r['held_out'] else 'fit'} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} |")
    if report["kv"]:
        lines += ["", "| KV link | bytes | set | measured ms | predicted ms | error |", "|---|---:|---|---:|---:|---:|"]
        for r in report["kv"]:
            lines.append(f"| {r['link']} | {r['bytes']} | {'held out' if r['held_out'] else 'fit'} | "
                         f"{r['measured_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | {r['error']:+.1%} |")
    return "\n".join(lines)
