"""``hetserve plan``: recommend a prefill/decode deployment for a model, load and SLOs.

``--measure URL`` first measures the running prefill + decode servers (planner/measure.py),
``--calibrate FILE`` reads such measurements; either fits the hardware profile and links, reports
predicted vs measured on held-out points, and then plans with the fitted profile.

Exit status: 0 when a configuration meets the SLOs, 2 when none does (the best effort is still
printed with its warnings), 1 on invalid input or a failed measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Optional, Sequence, TextIO

from .calibration import Measurements, calibrate, calibrate_links, calibration_report
from .measure import MeasureConfig, MeasureError, holdout_report, measure, render_holdout
from .model import SLO, LengthDist, Routing, Workload
from .predict import Prediction
from .profiles import (
    HARDWARE,
    KV_TIERS,
    LINKS,
    MODELS,
    PRECISIONS,
    HardwareProfile,
    LinkProfile,
    ModelConfig,
    check_precision,
    lookup,
)
from .search import PlanResult, SearchSpace, plan

EXIT_FEASIBLE, EXIT_INPUT, EXIT_INFEASIBLE = 0, 1, 2


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="smollm2-135m", help=f"preset: {', '.join(MODELS)} (default %(default)s)")
    m.add_argument("--model-config", metavar="FILE",
                   help="JSON model config (planner fields or a Hugging Face config.json); overrides --model")

    h = parser.add_argument_group("hardware and transport")
    h.add_argument("--hw", help=f"comma list for both phases (default: all but cpu-local): {', '.join(HARDWARE)}")
    h.add_argument("--prefill-hw", help="comma list of prefill hardware (overrides --hw)")
    h.add_argument("--decode-hw", help="comma list of decode hardware (overrides --hw)")
    h.add_argument("--hw-file", action="append", default=[], metavar="FILE",
                   help="JSON hardware profile (or list of them) to add/override; repeatable")
    h.add_argument("--link", help=f"comma list of KV transports (default: all): {', '.join(LINKS)}")
    h.add_argument("--kv-tier", help=f"comma list of decode KV tiers (default: all): {', '.join(KV_TIERS)}")
    h.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees to consider (default %(default)s)")
    h.add_argument("--max-instances", type=int, default=64, help="per phase (default %(default)s)")
    h.add_argument("--prefill-instances", type=int, help="fix the number of prefill instances")
    h.add_argument("--decode-instances", type=int, help="fix the number of decode instances")
    h.add_argument("--no-layerwise", action="store_true", help="KV is sent after prefill, not layer by layer")

    p = parser.add_argument_group("precision")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="precisions the search may use (default %(default)s)")
    p.add_argument("--prefill-precision", help="force the prefill precision")
    p.add_argument("--decode-precision", help="force the decode precision")
    p.add_argument("--kv-dtype", help="force the KV dtype of both phases (default: follows precision)")
    p.add_argument("--prefill-kv-dtype", help="force the prefill KV dtype")
    p.add_argument("--decode-kv-dtype", help="force the decode KV dtype")

    s = parser.add_argument_group("SLOs and load")
    s.add_argument("--ttft-ms", type=float, default=1000.0, help="TTFT SLO (default %(default)s)")
    s.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT SLO (default %(default)s)")
    s.add_argument("--slo-percentile", type=float, default=90.0, help="TTFT percentile (default %(default)s)")
    s.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate, req/s (default %(default)s)")
    for name, mean in (("prompt", 512), ("output", 128)):
        s.add_argument(f"--{name}-len", type=float, default=float(mean),
                       help=f"mean {name} tokens (default %(default)s)")
        s.add_argument(f"--{name}-std", type=float, default=0.0, help=f"{name} length std (default 0)")
        s.add_argument(f"--{name}-dist", choices=("fixed", "normal", "lognormal"),
                       help=f"{name} length distribution (default: fixed, lognormal when --{name}-std > 0)")

    r = parser.add_argument_group("KV-aware routing (multi-turn: README 'KV-aware routing')")
    r.add_argument("--prefix-hit", type=float, default=0.0, metavar="SHARE",
                   help="share of each prompt already in the caches, e.g. 0.75 for 4-turn chats (default 0)")
    r.add_argument("--no-kv-routing", action="store_true",
                   help="the old path: the whole prompt's KV moves, every prompt prefilled on prefill")
    for name, default in (("max", Routing.local_prefill_max_tokens), ("min-hit", Routing.local_prefill_min_hit_tokens),
                          ("stall", Routing.local_prefill_stall_tokens)):
        r.add_argument(f"--local-prefill-{name}-tokens", type=int, default=default,
                       help=f"HETSERVE_LOCAL_PREFILL_{name.upper().replace('-', '_')}_TOKENS (default %(default)s)")
    r.add_argument("--local-prefill-min-hit-share", type=float, default=Routing.local_prefill_min_hit_share,
                   help="HETSERVE_LOCAL_PREFILL_MIN_HIT_SHARE (default %(default)s)")

    o = parser.add_argument_group("calibration and output")
    cal = o.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", metavar="FILE", help="measurements JSON; fits that hardware profile first")
    cal.add_argument("--measure", metavar="URL",
                     help="measure the running servers through this prefill gRPC URL (the llm model), then "
                          "calibrate as --calibrate does")
    o.add_argument("--decode-url", metavar="URL",
                   help="decode server gRPC URL for --measure (default: the prefill port + 1000)")
    o.add_argument("--measure-out", metavar="FILE", help="write the --measure measurements JSON here")
    defaults = MeasureConfig()
    o.add_argument("--measure-prompts", default=",".join(map(str, defaults.prompt_lens)),
                   help="prompt lengths to measure TTFT/prefill/KV at (default %(default)s)")
    o.add_argument("--measure-batches", default=",".join(map(str, defaults.batches)),
                   help="concurrent decode streams to measure TPOT at (default %(default)s)")
    o.add_argument("--measure-transports", default=",".join(defaults.transports),
                   help="KV transports to time (default %(default)s)")
    o.add_argument("--repeats", type=int, default=defaults.repeats, help="rounds per point (default %(default)s)")
    o.add_argument("--quiet-wait", type=float, default=defaults.quiet_wait_s, metavar="S",
                   help="wait up to S seconds in all for the box to be idle before rounds (default %(default)s)")
    o.add_argument("--holdout-prompts", default="auto",
                   help="prompt lengths left out of the fit and predicted: 'auto' (every other interior "
                        "point), 'none' or a comma list")
    o.add_argument("--holdout-batches", default="auto", help="the same for decode batch sizes")
    o.add_argument("--save-profile", metavar="FILE",
                   help="write the calibrated profile (fitted on all points; for --hw-file)")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--top", type=int, default=5, help="configurations to report (default %(default)s)")
    o.add_argument("--list", action="store_true", help="list models, hardware, links and KV tiers, then exit")


# --------------------------------------------------------------------------------------------
# Input assembly
# --------------------------------------------------------------------------------------------

def _load_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hardware_table(files: Sequence[str]) -> dict[str, HardwareProfile]:
    table = dict(HARDWARE)
    for path in files:
        data = _load_json(path)
        for entry in data if isinstance(data, list) else [data]:
            hw = HardwareProfile.from_dict(entry)
            table[hw.name] = hw
    return table


def _model(args: argparse.Namespace) -> ModelConfig:
    if args.model_config:
        return ModelConfig.from_dict(_load_json(args.model_config), name=args.model_config)
    return lookup(MODELS, args.model, "model")


def _length(args: argparse.Namespace, name: str) -> LengthDist:
    std = getattr(args, f"{name}_std")
    kind = getattr(args, f"{name}_dist") or ("lognormal" if std > 0 else "fixed")
    return LengthDist(getattr(args, f"{name}_len"), std, kind)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in _names(text))
    except ValueError:
        raise ValueError(f"{what}: expected a comma list of integers, got {text!r}") from None


def _holdout(text: str, what: str) -> Optional[tuple[int, ...]]:
    """None: the default choice; () for 'none'."""
    return None if text == "auto" else () if text == "none" else _ints(text, what)


def _measurements(args: argparse.Namespace) -> dict[str, Any]:
    if not args.measure:
        return _load_json(args.calibrate)
    cfg = MeasureConfig(prompt_lens=_ints(args.measure_prompts, "--measure-prompts"),
                        batches=_ints(args.measure_batches, "--measure-batches"),
                        transports=tuple(_names(args.measure_transports)), repeats=args.repeats,
                        quiet_wait_s=args.quiet_wait)
    raw = measure(args.measure, args.decode_url, cfg, log=lambda msg: print(f"measure: {msg}", file=sys.stderr))
    if args.measure_out:
        with open(args.measure_out, "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=1)
    return raw


def _opt_precision(value: Optional[str]) -> Optional[str]:
    return check_precision(value) if value else None


def _search_space(args: argparse.Namespace, table: dict[str, HardwareProfile],
                  links: dict[str, LinkProfile], default_hw: list[str]) -> SearchSpace:
    def hw_list(specific: Optional[str]) -> tuple[HardwareProfile, ...]:
        names = _names(specific or args.hw or "") or default_hw
        return tuple(lookup(table, n, "hardware") for n in names)

    kv = args.kv_dtype
    return SearchSpace(
        prefill_hardware=hw_list(args.prefill_hw), decode_hardware=hw_list(args.decode_hw),
        links=tuple(lookup(links, n, "link") for n in (_names(args.link) if args.link else links)),
        kv_tiers=tuple(lookup(KV_TIERS, n, "KV tier") for n in (_names(args.kv_tier) if args.kv_tier else KV_TIERS)),
        precisions=tuple(check_precision(p) for p in _names(args.precisions)),
        prefill_precision=_opt_precision(args.prefill_precision),
        decode_precision=_opt_precision(args.decode_precision),
        prefill_kv_dtype=_opt_precision(args.prefill_kv_dtype or kv),
        decode_kv_dtype=_opt_precision(args.decode_kv_dtype or kv),
        tp_degrees=tuple(int(t) for t in _names(args.tp)),
        max_instances=args.max_instances, prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances, layerwise=not args.no_layerwise,
        routing=Routing(not args.no_kv_routing, args.local_prefill_max_tokens, args.local_prefill_min_hit_tokens,
                        args.local_prefill_min_hit_share, args.local_prefill_stall_tokens))


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if math.isfinite(seconds) else "unbounded"


def _usd(x: float) -> str:
    return f"${x:,.4g}" if math.isfinite(x) else "n/a"


def _phase(pred: Prediction, role: str) -> str:
    ph = getattr(pred.deployment, role)
    return f"{ph.instances} x {ph.hardware.name} tp{ph.tp} {ph.precision}"


def render_listing(table: dict[str, HardwareProfile], out: TextIO) -> None:
    print("models:", file=out)
    for m in MODELS.values():
        print(f"  {m.name:14} {m.layers} layers, {m.heads}/{m.kv_heads} heads x {m.head_dim}, hidden {m.hidden}, "
              f"{m.params / 1e9:.3g}B params, KV {m.kv_bytes_per_token('fp16') / 1024:.0f} KiB/token fp16", file=out)
    print("hardware (dense TFLOPs fp32/bf16/fp16/fp8/int8, GB/s, GB, $/h):", file=out)
    for h in table.values():
        tf = "/".join("-" if h.tflops.get(p) is None else f"{h.tflops[p]:g}" for p in PRECISIONS)
        print(f"  {h.name:11} {tf:34} {h.mem_bw_gbs:7g} {h.mem_gb:5g} {h.price_per_hour:6.2f}", file=out)
    print("links (GB/s per direction, latency):", file=out)
    for link in LINKS.values():
        print(f"  {link.name:14} {link.gbytes_per_s:7.4g} GB/s  {link.latency_s * 1e6:4.0f} us", file=out)
    print("KV tiers: " + ", ".join(KV_TIERS), file=out)


def _routing(pred: Prediction) -> str:
    r = pred.deployment.routing
    if not r.kv_aware:
        return "old path: every prompt prefilled on prefill, its whole KV moved"
    return (f"KV-aware: {pred.local_prefill_share:.0%} of prompts prefilled on their decode instance "
            f"(<= {r.local_prefill_max_tokens} uncached tokens; {pred.decode_prefill_utilization:.0%} of its time), "
            "the rest send only the uncached KV")


def render_report(result: PlanResult, model: ModelConfig, workload: Workload, slo: SLO, out: TextIO) -> None:
    hit = f" ({workload.prefix_hit:.0%} cached)" if workload.prefix_hit > 0 else ""
    print(f"hetserve plan: {model.name} | {workload.qps:g} req/s, prompt {workload.prompt.describe()}{hit}, "
          f"output {workload.output.describe()} tokens | SLO TTFT p{slo.percentile:g} <= {_ms(slo.ttft_s)}, "
          f"TPOT <= {_ms(slo.tpot_s)}", file=out)
    for note in result.notes:
        print(f"  ! [{note.code}] {note.message}", file=out)
    best = result.best
    if best is None:
        return
    d = best.deployment
    print("\nRECOMMENDED (meets SLOs)" if result.feasible else "\nBEST EFFORT (no configuration meets the SLOs)",
          file=out)
    rows = [
        ("prefill", f"{_phase(best, 'prefill')}  (KV {d.prefill.kv_dtype}, {d.prefill.layout})"),
        ("decode", f"{_phase(best, 'decode')}  (KV {d.decode.kv_dtype}, {d.decode.layout}), KV tier {d.kv_tier.name}"),
        ("P:D ratio", f"{d.ratio}  ({d.prefill.devices} + {d.decode.devices} devices)"),
        ("transport", f"{d.link.name}, {'layer-wise overlap' if d.layerwise else 'after prefill'}, "
                      f"{best.kv_bytes_per_request / 2**20:.1f} MiB KV per request"),
        ("TTFT", f"mean {_ms(best.ttft_mean_s)}, p{best.percentile:g} {_ms(best.ttft_p_s)}  (prefill "
                 f"{_ms(best.prefill_s)}, queue {_ms(best.queue_wait_s)}, KV exposed {_ms(best.kv_exposed_s)})"),
        ("TPOT", f"{_ms(best.tpot_s)}  (decode batch {best.decode_batch:.1f})"),
        *([("routing", _routing(best))] if workload.prefix_hit > 0 else []),
        ("throughput", f"{best.throughput_tok_s:,.0f} output tok/s (capacity {best.max_qps:.3g} req/s, "
                       f"prefill utilisation {best.prefill_utilization:.0%})"),
        ("cost", f"{_usd(best.cost_per_hour)}/h -> {_usd(best.cost_per_1m_output)} per 1M output tokens, "
                 f"{_usd(best.cost_per_1m_tokens)} per 1M tokens"),
    ]
    for label, text in rows:
        print(f"  {label:<11} {text}", file=out)
    if best.warnings:
        print("  warnings", file=out)
        for w in best.warnings:
            print(f"    - [{w.code}] {w.message}", file=out)
    if result.alternatives:
        print("\nAlternatives", file=out)
        header = f"  {'prefill':<26} {'decode':<26} {'P:D':>5} {'transport':<14} {'tier':<6} " \
                 f"{'TTFT p' + format(slo.percentile, 'g'):>10} {'TPOT':>10} {'$/1M out':>9}  SLO"
        print(header, file=out)
        for p in result.alternatives:
            print(f"  {_phase(p, 'prefill'):<26} {_phase(p, 'decode'):<26} {p.deployment.ratio:>5} "
                  f"{p.deployment.link.name:<14} {p.deployment.kv_tier.name:<6} {_ms(p.ttft_p_s):>10} "
                  f"{_ms(p.tpot_s):>10} {_usd(p.cost_per_1m_output):>9}  {'ok' if p.meets_slo else 'miss'}",
                  file=out)


def render_calibration(report: dict[str, Any], out: TextIO) -> None:
    print(f"calibrated {report['hardware']} on {report['model']} measurements "
          f"(fitted: {', '.join(report['fitted']) or 'nothing'}):", file=out)
    for name, v in report["parameters"].items():
        print(f"  {name:<19} {v['before']:.4g} -> {v['after']:.4g}", file=out)
    for name, link in report["links"].items():
        print(f"  link {name:<14} efficiency {link['efficiency']:.3g}, latency {link['latency_s'] * 1e6:.0f} us/layer",
              file=out)
    for key, row in report["fit"].items():
        err = row["error"]
        print(f"  {key:<24} measured {row['measured']:.4g}  predicted {row['predicted']:.4g}"
              f"  ({'n/a' if err is None else f'{err:+.1%}'})", file=out)
    print(file=out)


def _validation_json(report: dict[str, Any]) -> dict[str, Any]:
    """holdout_report as JSON: profile and links as dicts, non-finite numbers as null."""
    def finite(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]

    return {**{k: v for k, v in report.items() if k not in ("profile", "links", "points", "kv")},
            "profile": report["profile"].to_dict(), "links": {n: l.to_dict() for n, l in report["links"].items()},
            "points": finite(report["points"]), "kv": finite(report["kv"])}


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    try:
        table = _hardware_table(args.hw_file)
        if args.list:
            render_listing(table, out)
            return EXIT_FEASIBLE
        model = _model(args)
        links = dict(LINKS)
        default_hw = [n for n, h in table.items() if h.kind != "cpu"]
        calibration = validation = None
        if args.calibrate or args.measure:
            raw = _measurements(args)
            meas = Measurements.from_dict(raw)
            base = lookup(table, meas.hardware, "hardware")
            cal_model = lookup(MODELS, meas.model, "model") if "model" in raw else model
            hp = _holdout(args.holdout_prompts, "--holdout-prompts")
            hb = _holdout(args.holdout_batches, "--holdout-batches")
            if (meas.prompt_lengths or meas.batch_sizes) and (hp != () or hb != ()):
                validation = holdout_report(meas, hp, hb, base, cal_model)
            fitted = calibrate(base, meas, cal_model)
            table[fitted.name] = fitted
            links.update(calibrate_links(meas, cal_model))
            default_hw = [fitted.name]
            calibration = calibration_report(base, fitted, meas, cal_model)
            if args.save_profile:
                with open(args.save_profile, "w", encoding="utf-8") as f:
                    json.dump(fitted.to_dict(), f, indent=2)
        workload = Workload(args.qps, _length(args, "prompt"), _length(args, "output"), args.prefix_hit)
        slo = SLO(args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.slo_percentile)
        space = _search_space(args, table, links, default_hw)
    except (OSError, ValueError, TypeError, json.JSONDecodeError, MeasureError) as e:
        print(f"hetserve plan: error: {e}", file=sys.stderr)
        return EXIT_INPUT

    result = plan(model, workload, slo, space, top_k=max(1, args.top))
    if args.json:
        doc = {"model": model.to_dict(), "workload": workload.to_dict(), "slo": dataclasses.asdict(slo),
               **result.to_dict()}
        if calibration:
            doc["calibration"] = calibration
        if validation:
            doc["validation"] = _validation_json(validation)
        json.dump(doc, out, indent=2, allow_nan=False)
        print(file=out)
    else:
        if calibration:
            render_calibration(calibration, out)
        if validation:
            print(render_holdout(validation), file=out)
            print(file=out)
        render_report(result, model, workload, slo, out)
    return EXIT_FEASIBLE if result.feasible else EXIT_INFEASIBLE


def build_parser(prog: str = "hetserve plan") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Recommend a prefill:decode deployment (hardware, ratio, precision, transport, KV tier) for "
        "a model, load and SLOs. Exit 0: SLOs met; 2: best effort only; 1: bad input."))
    add_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
