"""Design-space planner (hetserve.planner): published figures, cost-model pieces, search, calibration, CLI."""
from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math

import numpy as np
import pytest

from hetserve.planner import cli
from hetserve.planner.calibration import (
    Measurements,
    calibrate,
    calibrate_link,
    link_transfer_s,
    measurement_predictions,
    predict_points,
)
from hetserve.planner.measure import (
    default_holdout,
    holdout_report,
    max_holdout_error,
    median_rse,
    overlap_tpot,
    render_holdout,
)
from hetserve.planner.model import (
    SLO,
    Deployment,
    LengthDist,
    Phase,
    PhaseCost,
    Routing,
    StepCost,
    Workload,
    default_kv_dtype,
    fewest_instances,
    kv_transfer,
    mg1_wait,
    quantile_points,
    roofline,
)
from hetserve.planner.predict import predict
from hetserve.planner.profiles import HARDWARE, KV_TIERS, LINKS, MODELS, PRECISIONS, HardwareProfile, ModelConfig
from hetserve.planner.search import SearchSpace, plan

GiB = 2 ** 30
DEVICE = KV_TIERS["device"]


def _phase(hw: str, precision: str = "fp16", tp: int = 1, instances: int = 1, kv: str | None = None) -> Phase:
    h = HARDWARE[hw]
    return Phase(h, precision, kv or default_kv_dtype(precision, h), tp, instances)


def _codes(pred) -> set[str]:
    return {w.code for w in pred.warnings}


def _fixed(qps: float, prompt: float, output: float) -> Workload:
    return Workload(qps, LengthDist(prompt), LengthDist(output))


# ---------------------------------------------------------------------------------------------
# Published figures
# ---------------------------------------------------------------------------------------------

def test_distserve_opt66b_kv_cache_of_512_token_prompt_is_1_13_gb():
    # DistServe (Zhong et al., OSDI'24): "the KV cache of a single 512-token request on OPT-66B is ~1.13 GB".
    opt = MODELS["opt-66b"]
    kv = opt.kv_bytes_per_token("fp16") * 512
    assert kv == 2 * 64 * 9216 * 2 * 512 == 1_207_959_552
    assert kv / GiB == pytest.approx(1.13, rel=0.01)


def test_splitwise_h100_vs_a100_ratios():
    # Splitwise (Patel et al., ISCA'24) Table II: H100 has 3.43x the compute, 1.64x the memory
    # bandwidth and 2.16x the cost of an A100 (DGX-H100 $38/h vs DGX-A100 $17.6/h).
    h100, a100 = HARDWARE["h100"], HARDWARE["a100"]
    assert h100.tflops["fp32"] / a100.tflops["fp32"] == pytest.approx(3.43, rel=0.02)
    assert h100.mem_bw_gbs / a100.mem_bw_gbs == pytest.approx(1.64, rel=0.02)
    assert h100.price_per_hour / a100.price_per_hour == pytest.approx(2.16, rel=0.02)
    # Dense tensor-core fp16 (989.4 vs 312) is the 3.17x figure, not Splitwise's.
    assert h100.tflops["fp16"] / a100.tflops["fp16"] == pytest.approx(3.17, rel=0.01)


def test_kv_bytes_per_token_of_presets():
    assert MODELS["llama2-70b"].kv_bytes_per_token("fp16") == 320 * 1024  # widely quoted 320 KiB/token
    assert MODELS["llama3-8b"].kv_bytes_per_token("bf16") == 128 * 1024
    assert MODELS["llama3-8b"].kv_bytes_per_token("fp8") == 64 * 1024
    # hetserve's CPU path keeps an fp32 pool: 2 * 30 layers * 3 KV heads * 64 * 4 bytes.
    assert MODELS["smollm2-135m"].kv_bytes_per_token("fp32") == 46_080


@pytest.mark.parametrize("name", sorted(MODELS))
def test_preset_parameter_counts_match_architecture(name):
    m = MODELS[name]
    assert m.estimate_params() == pytest.approx(m.params, rel=0.02)


def test_smollm2_preset_matches_issue():
    m = MODELS["smollm2-135m"]
    assert (m.layers, m.heads, m.kv_heads, m.head_dim, m.hidden, m.intermediate, m.vocab) == \
        (30, 9, 3, 64, 576, 1536, 49152)
    assert m.params == pytest.approx(135e6, rel=0.01)
    opt = MODELS["opt-66b"]
    assert (opt.layers, opt.hidden, opt.heads, opt.kv_heads) == (64, 9216, 72, 72)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def test_hardware_table_complete_and_sourced():
    expected = {"h100", "h200", "a100", "h20", "l40s", "l4", "mi300x", "gaudi3", "ascend910b", "cpu-local"}
    assert expected <= set(HARDWARE)
    for hw in HARDWARE.values():
        assert set(hw.tflops) == set(PRECISIONS)
        assert hw.source and hw.mem_bw_gbs > 0 and hw.mem_gb > 0 and hw.price_per_hour > 0
        assert hw.supports("fp32")
        assert all(v is None or v > 0 for v in hw.tflops.values())


def test_unsupported_precisions_marked():
    assert not HARDWARE["a100"].supports("fp8") and HARDWARE["a100"].supports("int8")
    assert HARDWARE["l4"].supports("fp8")
    assert not HARDWARE["ascend910b"].supports("fp8")
    assert not HARDWARE["gaudi3"].supports("int8")
    cpu = HARDWARE["cpu-local"]
    assert cpu.supported_precisions() == ("fp32", "int8") and cpu.kind == "cpu"
    assert HARDWARE["a100"].compute_precision("fp8") == "fp16"
    assert cpu.compute_precision("bf16") == "fp32"


def test_links_and_connectivity():
    assert {"pcie-gen4-x16", "pcie-gen5-x16", "nvlink", "rdma-100g", "rdma-200g", "rdma-400g",
            "tcp-10g", "tcp-25g", "loopback-shm"} <= set(LINKS)
    assert LINKS["nvlink"].gbytes_per_s * 2 == 900  # H100 NVLink: 900 GB/s bidirectional
    assert LINKS["rdma-400g"].gbytes_per_s == 50 and LINKS["tcp-10g"].gbytes_per_s == 1.25
    h100, a100, cpu = HARDWARE["h100"], HARDWARE["a100"], HARDWARE["cpu-local"]
    assert LINKS["nvlink"].connects(h100, h100) and not LINKS["nvlink"].connects(h100, a100)
    assert LINKS["loopback-shm"].connects(cpu, cpu) and not LINKS["loopback-shm"].connects(h100, h100)
    assert not LINKS["pcie-gen5-x16"].connects(cpu, h100) and LINKS["tcp-10g"].connects(cpu, h100)
    l4 = HARDWARE["l4"]  # PCIe Gen4 card
    assert LINKS["pcie-gen4-x16"].connects(l4, h100) and not LINKS["pcie-gen5-x16"].connects(l4, h100)
    assert LINKS["pcie-gen5-x16"].connects(h100, HARDWARE["mi300x"])


def test_profile_and_model_round_trip():
    for hw in HARDWARE.values():
        assert HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    hf = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192}
    m = ModelConfig.from_dict(hf, name="hf-llama3")
    assert m.kv_bytes_per_token("bf16") == MODELS["llama3-8b"].kv_bytes_per_token("bf16")
    assert m.params == pytest.approx(8.03e9, rel=0.01)
    with pytest.raises(ValueError):
        ModelConfig.from_dict({"hidden_size": 64})


# ---------------------------------------------------------------------------------------------
# Cost-model pieces
# ---------------------------------------------------------------------------------------------

def test_prefill_compute_bound_decode_memory_bound():
    # Splitwise's premise: the prompt phase is compute bound, the token phase memory bound.
    cost = PhaseCost(MODELS["llama3-8b"], _phase("h100", "bf16"))
    p = np.array([2048.0])
    compute = cost.prefill_flops(p) / cost.flops_per_s
    memory = (cost.weight_read_bytes + p * cost.kv_bytes_per_token) / cost.bytes_per_s
    assert compute[0] > 5 * memory[0]
    assert cost.prefill_time(p)[0] == pytest.approx(compute[0])
    step = cost.decode_step(DEVICE, 1024)
    assert step.weights_s > 10 * step.compute_s_per_seq
    assert float(step.time(1)) == pytest.approx(step.weights_s + step.kv_s_per_seq)
    # Weights of an 8B bf16 model (~15 GB read) at 80% of 3.35 TB/s: ~5.6 ms per step.
    assert step.weights_s == pytest.approx(15.0e9 / (3352e9 * 0.8), rel=0.01)


def test_tensor_parallel_scales_and_memory_fit():
    m = MODELS["llama2-70b"]
    one, eight = PhaseCost(m, _phase("h100", "bf16", tp=1)), PhaseCost(m, _phase("h100", "bf16", tp=8))
    assert not one.weights_fit and eight.weights_fit
    assert eight.bytes_per_s / one.bytes_per_s == pytest.approx(8 * 0.9 ** 3)


def test_layerwise_overlap_exposes_one_layer_when_hidden():
    m = MODELS["llama3-8b"]
    pc, dc = PhaseCost(m, _phase("h100", "bf16")), PhaseCost(m, _phase("h100", "bf16"))
    prompt = np.array([1024.0])
    link = dataclasses.replace(LINKS["rdma-400g"], latency_s=0.0)
    bytes_ = 1024 * pc.kv_bytes_per_token
    x = bytes_ / link.bytes_per_s
    # Transfer shorter than prefill: only the last layer's transfer is exposed.
    total, exposed = kv_transfer(pc, dc, [link], DEVICE, prompt, np.array([10 * x]), True)
    assert total[0, 0] == pytest.approx(x)
    assert exposed[0, 0] == pytest.approx(x / m.layers)
    # Transfer longer than prefill: the excess plus one layer.
    _, exposed = kv_transfer(pc, dc, [link], DEVICE, prompt, np.array([x / 2]), True)
    assert exposed[0, 0] == pytest.approx(x / 2 + x / m.layers)
    # Without layer-wise streaming everything is exposed.
    _, exposed = kv_transfer(pc, dc, [link], DEVICE, prompt, np.array([10 * x]), False)
    assert exposed[0, 0] == pytest.approx(x)


def test_md1_queue_wait():
    s = 0.1
    for rho in (0.2, 0.5, 0.9):
        r, w, wp = mg1_wait(rho / s, s, s * s, 90.0)
        assert float(r) == pytest.approx(rho)
        assert float(w) == pytest.approx(rho * s / (2 * (1 - rho)))  # M/D/1
        assert float(wp) >= 0
    _, w, wp = mg1_wait(1 / s, s, s * s, 90.0)
    assert math.isinf(float(w)) and math.isinf(float(wp))


def test_decode_operating_point_is_littles_law_fixed_point():
    step = StepCost(fixed_s=0.001, weights_s=0.02, kv_s_per_seq=0.0005, compute_s_per_seq=0.002)
    batch, tpot = step.operating_point(np.array([1e-9, 50.0, 200.0]), batch_cap=256)
    assert batch[0] == pytest.approx(1.0) and tpot[0] == pytest.approx(float(step.time(1)))
    for r, b, t in zip((50.0, 200.0), batch[1:], tpot[1:]):
        assert b - 1 == pytest.approx(r * float(step.time(b)))  # N = rate * TPOT
        assert t == pytest.approx(float(step.time(b)))
    assert tpot[2] > tpot[1] > tpot[0]
    capacity = step.max_token_rate(256)
    batch, tpot = step.operating_point(np.array([0.9 * capacity, 1.1 * capacity]), batch_cap=256)
    assert math.isfinite(tpot[0]) and math.isinf(tpot[1])


def test_quantile_points_and_sizing():
    x = np.random.default_rng(1).lognormal(5, 0.7, 999)
    f = lambda v: 3 * v + v ** 2  # noqa: E731  any non-decreasing function
    for q in (50, 90, 99):
        pts, w = quantile_points(x, q)
        assert f(pts) @ w == pytest.approx(np.percentile(f(x), q))
    lat = np.array([[9.0, 5.0, 3.0, 2.0, 2.0], [np.inf, 30.0, 20.0, 15.0, 14.0], [np.inf] * 5])
    assert list(fewest_instances(lat, 4.0)) == [2, 3, 4]  # meets; best effort within 10%; unbounded


def test_lognormal_lengths_have_requested_moments():
    p, _ = Workload(1.0, LengthDist(1000, 500, "lognormal"), LengthDist(100)).samples()
    assert p.mean() == pytest.approx(1000, rel=0.05) and p.std() == pytest.approx(500, rel=0.1)
    with pytest.raises(ValueError):
        LengthDist(100, 10, "pareto")


# ---------------------------------------------------------------------------------------------
# predict() and its warnings
# ---------------------------------------------------------------------------------------------

def test_ttft_grows_with_load_until_overloaded():
    m = MODELS["llama3-8b"]
    dep = Deployment(_phase("a100", "bf16"), _phase("a100", "bf16"), LINKS["rdma-200g"])
    ttfts = [predict(m, dep, _fixed(q, 1024, 64)).ttft_mean_s for q in (0.1, 2.0, 4.0)]
    assert ttfts[0] < ttfts[1] < ttfts[2]
    over = predict(m, dep, _fixed(50.0, 1024, 64))
    assert "overloaded" in _codes(over) and not over.meets_slo and over.max_qps < 50


def test_warning_precision_unsupported_and_dtype_mismatch():
    m = MODELS["llama3-8b"]
    dep = Deployment(_phase("a100", "fp8"), _phase("a100", "fp16"), LINKS["rdma-200g"])
    pred = predict(m, dep, _fixed(1.0, 512, 64))
    assert {"precision_unsupported", "kv_dtype_mismatch"} <= _codes(pred)
    fine = predict(m, Deployment(_phase("l4", "fp8"), _phase("l4", "fp8"), LINKS["rdma-200g"]), _fixed(1.0, 512, 64))
    assert not {"precision_unsupported", "kv_dtype_mismatch"} & _codes(fine)


def test_warning_layout_mismatch_between_vendors():
    m = MODELS["llama3-8b"]
    dep = Deployment(_phase("gaudi3", "bf16"), _phase("h100", "bf16"), LINKS["rdma-400g"])
    pred = predict(m, dep, _fixed(1.0, 512, 64))
    assert "kv_layout_mismatch" in _codes(pred) and "kv_dtype_mismatch" not in _codes(pred)


def test_warning_kv_transfer_not_hidden():
    m = MODELS["opt-66b"]
    slow = Deployment(_phase("a100", "fp16", tp=4), _phase("a100", "fp16", tp=4), LINKS["tcp-10g"])
    fast = dataclasses.replace(slow, link=LINKS["rdma-400g"])
    work = _fixed(0.5, 512, 64)
    p_slow, p_fast = predict(m, slow, work), predict(m, fast, work)
    assert "kv_transfer_not_hidden" in _codes(p_slow) and "kv_transfer_not_hidden" not in _codes(p_fast)
    assert p_slow.kv_exposed_s > 10 * p_fast.kv_exposed_s
    assert p_slow.kv_bytes_per_request == pytest.approx(1_207_959_552)


def test_warning_weights_and_kv_do_not_fit():
    m = MODELS["llama2-70b"]
    work = _fixed(0.1, 512, 64)
    pred = predict(m, Deployment(_phase("h100", "bf16"), _phase("h100", "bf16"), LINKS["rdma-400g"]), work)
    assert "weights_do_not_fit" in _codes(pred) and math.isinf(pred.slo_violation)
    tight = Deployment(_phase("h100", "fp8", tp=2), _phase("h100", "fp8"), LINKS["rdma-400g"])
    pred = predict(m, tight, _fixed(0.1, 32768, 64))
    assert "kv_does_not_fit" in _codes(pred) and not pred.meets_slo


def test_slo_check_and_cost():
    m = MODELS["llama3-8b"]
    dep = Deployment(_phase("h100", "bf16"), _phase("h100", "bf16", instances=2), LINKS["nvlink"])
    work = _fixed(2.0, 512, 128)
    ok = predict(m, dep, work, SLO(1.0, 0.1))
    assert ok.meets_slo and not ok.warnings
    assert ok.cost_per_hour == pytest.approx(3 * HARDWARE["h100"].price_per_hour)
    assert ok.cost_per_1m_output == pytest.approx(ok.cost_per_hour / (2.0 * 128 * 3600) * 1e6)
    tight = predict(m, dep, work, SLO(1e-4, 1e-4))
    assert not tight.meets_slo and {"slo_ttft", "slo_tpot"} <= _codes(tight)


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------

def _space(**kw) -> SearchSpace:
    base = dict(prefill_hardware=(HARDWARE["a100"],), decode_hardware=(HARDWARE["a100"],),
                links=(LINKS["rdma-200g"],), kv_tiers=(DEVICE,), precisions=("bf16",), tp_degrees=(1,))
    base.update(kw)
    return SearchSpace(**base)


def test_plan_ratio_follows_the_workload():
    m, slo = MODELS["llama3-8b"], SLO(0.5, 0.05)
    prompt_heavy = plan(m, _fixed(8.0, 2048, 16), slo, _space())
    output_heavy = plan(m, _fixed(20.0, 64, 1024), slo, _space())
    assert prompt_heavy.feasible and output_heavy.feasible
    pd = prompt_heavy.best.deployment
    dd = output_heavy.best.deployment
    assert pd.prefill.instances > pd.decode.instances
    assert dd.decode.instances > dd.prefill.instances
    for best in (prompt_heavy.best, output_heavy.best):
        assert best.ttft_p_s <= slo.ttft_s and best.tpot_s <= slo.tpot_s


def test_plan_is_minimal_and_consistent_with_predict():
    m, slo = MODELS["llama3-8b"], SLO(0.5, 0.05)
    work = Workload(6.0, LengthDist(1024, 400, "lognormal"), LengthDist(200, 100, "normal"))
    best = plan(m, work, slo, _space()).best
    assert best.meets_slo
    assert predict(m, best.deployment, work, slo) == best
    d = best.deployment
    for role in ("prefill", "decode"):  # one instance fewer on either side breaks an SLO
        phase = getattr(d, role)
        if phase.instances > 1:
            fewer = dataclasses.replace(d, **{role: dataclasses.replace(phase, instances=phase.instances - 1)})
            assert not predict(m, fewer, work, slo).meets_slo


def test_plan_prefers_cheaper_hardware_and_precision_when_it_meets_slo():
    m = MODELS["llama3-8b"]
    space = SearchSpace(prefill_hardware=(HARDWARE["h100"], HARDWARE["l4"]),
                        decode_hardware=(HARDWARE["h100"], HARDWARE["l4"]), tp_degrees=(1,))
    result = plan(m, _fixed(0.5, 256, 64), SLO(2.0, 0.2), space)
    assert result.feasible
    d = result.best.deployment
    assert d.prefill.hardware.name == d.decode.hardware.name == "l4"
    assert d.link.name == "tcp-10g"  # cheapest transport that still hides the transfer
    assert not {"kv_transfer_not_hidden", "kv_dtype_mismatch"} & _codes(result.best)
    keys = [p.rank_key() for p in (result.best, *result.alternatives)]
    assert keys == sorted(keys)


def test_plan_picks_tensor_parallelism_for_big_models():
    m = MODELS["llama2-70b"]
    result = plan(m, _fixed(1.0, 1024, 128), SLO(1.0, 0.1),
                  _space(prefill_hardware=(HARDWARE["h100"],), decode_hardware=(HARDWARE["h100"],),
                         tp_degrees=(1, 2, 4, 8), links=(LINKS["nvlink"],)))
    assert result.feasible
    assert result.best.deployment.prefill.tp >= 2 and result.best.deployment.decode.tp >= 2


def test_plan_best_effort_when_infeasible():
    result = plan(MODELS["llama3-8b"], _fixed(1.0, 512, 64), SLO(1e-3, 1e-3), _space())
    assert not result.feasible and result.best is not None
    assert {"slo_ttft", "slo_tpot"} <= _codes(result.best)
    none = plan(MODELS["llama2-70b"], _fixed(1.0, 512, 64), SLO(1, 1), _space(decode_hardware=(HARDWARE["l4"],)))
    assert not none.feasible and none.best is None and none.notes[0].code == "no_candidate"


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------

# The single-point synthetic tests use the plain roofline (overlap 1), where a per-step overhead is
# identifiable; cpu-local itself is additive (overlap 0), tested on per-point tables further down.
ROOFLINE_CPU = dataclasses.replace(HARDWARE["cpu-local"], overlap=1.0, attn_score_passes=0.0)
TRUTH = dataclasses.replace(ROOFLINE_CPU, mfu=0.21, bw_eff=0.33, step_overhead_s=0.003,
                            request_overhead_s=0.008)
TEMPLATE = dict(prefill_tokens_per_s=1.0, decode_step_s_at_batch={"1": 1.0, "4": 1.0, "16": 1.0}, kv_transfer_gbps=24.0,
                ttft_ms=1.0, tpot_ms=1.0, prompt_tokens=128, output_tokens=64, qps=0.0)


def _synthetic(noise: float = 0.0, **template) -> dict:
    """Measurements the 'true' profile would produce, optionally perturbed by +-noise."""
    raw = {**TEMPLATE, **template}
    meas = Measurements.from_dict(raw)
    true = measurement_predictions(TRUTH, meas, MODELS["smollm2-135m"])
    signs = iter([1, -1, 1, -1, 1, -1, 1])
    jitter = lambda v: v * (1 + noise * next(signs))  # noqa: E731
    out = {k: v for k, v in raw.items() if k not in ("prefill_tokens_per_s", "decode_step_s_at_batch",
                                                      "ttft_ms", "tpot_ms")}
    if raw.get("prefill_tokens_per_s"):
        out["prefill_tokens_per_s"] = jitter(true["prefill_tokens_per_s"])
    if raw.get("decode_step_s_at_batch"):
        out["decode_step_s_at_batch"] = {b: jitter(true[f"decode_step_s@{b}"]) for b in raw["decode_step_s_at_batch"]}
    for name in ("ttft", "tpot"):
        if raw.get(f"{name}_ms"):
            out[f"{name}_ms"] = jitter(true[f"{name}_s"]) * 1e3
    return out


def _within(profile: HardwareProfile, raw: dict, tol: float) -> None:
    meas = Measurements.from_dict(raw)
    predicted = measurement_predictions(profile, meas, MODELS["smollm2-135m"])
    for key, value in meas.observed().items():
        assert predicted[key] == pytest.approx(value, rel=tol), key


def test_calibration_recovers_synthetic_profile():
    raw = _synthetic()
    base = ROOFLINE_CPU
    with pytest.raises(AssertionError):
        _within(base, raw, 0.2)  # the uncalibrated table is off by more than 20%
    fitted = calibrate(base, raw)
    _within(fitted, raw, 0.2)
    _within(fitted, raw, 0.02)
    assert fitted.mfu == pytest.approx(TRUTH.mfu, rel=0.05)
    assert fitted.bw_eff == pytest.approx(TRUTH.bw_eff, rel=0.05)
    assert fitted.request_overhead_s == pytest.approx(TRUTH.request_overhead_s, rel=0.2)
    assert fitted.name == "cpu-local" and "calibrated" in fitted.source


def test_calibration_with_noise_and_partial_measurements():
    _within(calibrate(ROOFLINE_CPU, _synthetic(noise=0.08)), _synthetic(noise=0.08), 0.2)
    only_latency = _synthetic(prefill_tokens_per_s=None, decode_step_s_at_batch=None)
    assert set(Measurements.from_dict(only_latency).observed()) == {"ttft_s", "tpot_s"}
    fitted = calibrate(ROOFLINE_CPU, only_latency)
    _within(fitted, only_latency, 0.2)


def test_calibrated_profile_predicts_serving_metrics():
    raw = _synthetic()
    fitted = calibrate(ROOFLINE_CPU, raw)
    meas = Measurements.from_dict(raw)
    m = MODELS["smollm2-135m"]
    link = dataclasses.replace(LINKS["loopback-shm"], efficiency=24 / 8 / LINKS["loopback-shm"].gbytes_per_s)
    for qps in (0.0, 0.5, 1.0):  # also away from the calibration point
        work = _fixed(qps, meas.prompt_tokens, meas.output_tokens)
        true = predict(m, Deployment(Phase(TRUTH, "fp32", "fp32"), Phase(TRUTH, "fp32", "fp32"), link), work)
        got = predict(m, Deployment(Phase(fitted, "fp32", "fp32"), Phase(fitted, "fp32", "fp32"), link), work)
        assert got.ttft_mean_s == pytest.approx(true.ttft_mean_s, rel=0.2)
        assert got.tpot_s == pytest.approx(true.tpot_s, rel=0.2)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    return cli.run(cli.build_parser().parse_args(argv), out), out.getvalue()


# ---------------------------------------------------------------------------------------------
# KV-aware routing (issue 29): partial handoffs and local prefill
# ---------------------------------------------------------------------------------------------

def _multi_turn(routing: Routing, qps: float = 0.3, hit: float = 0.75, decode_batch=None):
    """A 4-turn chat's follow-up on this box's profile: 1,200-token prompts of which `hit` is history."""
    m = MODELS["smollm2-135m"]
    dep = Deployment(_phase("cpu-local", "fp32"), _phase("cpu-local", "fp32", instances=2), LINKS["loopback-shm"],
                     routing=routing)
    return predict(m, dep, Workload(qps, LengthDist(1200), LengthDist(32), prefix_hit=hit),
                   decode_batch=decode_batch)


def test_kv_aware_routing_moves_only_uncached_kv_and_prefills_short_suffixes_on_decode():
    old = _multi_turn(Routing(kv_aware=False))
    remote = _multi_turn(Routing(local_prefill_max_tokens=0))  # partial handoffs only
    local = _multi_turn(Routing())
    kv_token = MODELS["smollm2-135m"].kv_bytes_per_token("fp32")
    assert old.kv_bytes_per_request == pytest.approx(1200 * kv_token)  # the whole history every turn
    assert remote.kv_bytes_per_request == pytest.approx(300 * kv_token)  # only what the decode server lacks
    assert old.local_prefill_share == remote.local_prefill_share == 0.0
    # 300 uncached <= 512, 900 held >= 64, an idle decode server: prefilled there, no KV moves, no prefill queue
    assert local.local_prefill_share == 1.0 and local.kv_bytes_per_request == 0.0
    assert local.prefill_utilization == 0.0 and local.queue_wait_s == 0.0
    assert local.ttft_mean_s < remote.ttft_mean_s <= old.ttft_mean_s
    # ... and the decode instances pay for it: their time goes to prefill, their streams wait
    assert 0.0 < local.decode_prefill_utilization < 1.0
    assert local.tpot_s == pytest.approx(remote.tpot_s / (1 - local.decode_prefill_utilization), rel=0.05)
    assert local.tpot_s > remote.tpot_s
    # no history: nothing changes (the old predictions stand)
    assert _multi_turn(Routing(), hit=0.0).ttft_mean_s == _multi_turn(Routing(kv_aware=False), hit=0.0).ttft_mean_s


def test_router_stall_rule_keeps_busy_decode_instances_decoding():
    """16 streams per decode instance: a 300-token local prefill would stall 15 streams by 4,500 token-times,
    far over 256, and at 0.3 req/s almost nothing is queued at prefill: every prompt goes to the prefill side.
    With a stall budget that large they stay local."""
    busy = _multi_turn(Routing(), decode_batch=16)
    assert busy.local_prefill_share == 0.0 and busy.decode_prefill_utilization == 0.0
    assert busy.kv_bytes_per_request > 0
    assert _multi_turn(Routing(local_prefill_stall_tokens=4500), decode_batch=16).local_prefill_share == 1.0
    with pytest.raises(ValueError):
        Workload(1.0, LengthDist(10), LengthDist(10), prefix_hit=1.0)
    with pytest.raises(ValueError):
        Routing(local_prefill_max_tokens=-1)


def test_cli_shows_the_routing_split():
    args = ["--hw", "cpu-local", "--precisions", "fp32", "--prefill-instances", "1", "--decode-instances", "2",
            "--qps", "0.3", "--prompt-len", "1200", "--output-len", "32", "--prefix-hit", "0.75"]
    rc, text = _run(args)
    assert "(75% cached)" in text and "KV-aware: 100% of prompts prefilled on their decode instance" in text
    rc, text = _run(args + ["--no-kv-routing", "--json"])
    doc = json.loads(text)
    rec = doc["recommendation"]
    assert rec["local_prefill_share"] == 0.0 and rec["deployment"]["routing"]["kv_aware"] is False
    assert doc["workload"]["prefix_hit"] == 0.75


def test_cli_feasible_table():
    rc, text = _run(["--model", "llama3-8b", "--hw", "a100,l4", "--tp", "1", "--qps", "2"])
    assert rc == 0
    for needle in ("RECOMMENDED", "P:D ratio", "transport", "KV tier", "TTFT", "TPOT", "per 1M output tokens"):
        assert needle in text


def test_cli_infeasible_json_exit_2():
    rc, text = _run(["--model", "opt-66b", "--hw", "a100", "--link", "tcp-10g", "--ttft-ms", "50",
                     "--tpot-ms", "5", "--json", "--tp", "4,8"])
    assert rc == 2
    doc = json.loads(text)
    assert doc["feasible"] is False
    rec = doc["recommendation"]
    assert rec["deployment"]["transport"] == "tcp-10g"
    assert {"kv_transfer_not_hidden", "slo_ttft"} <= {w["code"] for w in rec["warnings"]}
    for key in ("ttft_p_s", "tpot_s", "throughput_tok_s", "cost_per_1m_output"):
        assert key in rec


def test_cli_bad_input_and_listing(tmp_path):
    assert _run(["--hw", "tpu-v9"])[0] == 1
    assert _run(["--model", "gpt-17"])[0] == 1
    rc, text = _run(["--list"])
    assert rc == 0 and "ascend910b" in text and "loopback-shm" in text
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(MODELS["smollm2-135m"].to_dict()))
    assert _run(["--model-config", str(model_file), "--hw", "l4", "--tp", "1"])[0] == 0


def test_cli_calibrate_round_trip(tmp_path):
    meas, saved, roofline = tmp_path / "meas.json", tmp_path / "cpu.json", tmp_path / "roofline.json"
    meas.write_text(json.dumps(_synthetic()))
    roofline.write_text(json.dumps(ROOFLINE_CPU.to_dict()))
    argv = ["--hw-file", str(roofline), "--calibrate", str(meas), "--save-profile", str(saved),
            "--prompt-len", "128", "--output-len", "64",
            "--qps", "0.5", "--ttft-ms", "3000", "--tpot-ms", "200", "--json"]
    rc, text = _run(argv)
    doc = json.loads(text)
    assert rc == 0
    assert doc["recommendation"]["deployment"]["prefill"]["hardware"] == "cpu-local"
    assert doc["recommendation"]["deployment"]["transport"] == "loopback-shm"
    assert all(abs(row["error"]) < 0.2 for row in doc["calibration"]["fit"].values())
    profile = HardwareProfile.from_dict(json.loads(saved.read_text()))
    assert profile.mfu == pytest.approx(TRUTH.mfu, rel=0.05)
    rc, text = _run(["--hw-file", str(saved), "--hw", "cpu-local", "--prompt-len", "128", "--output-len", "64",
                     "--qps", "0.5", "--ttft-ms", "3000", "--tpot-ms", "200"])
    assert rc == 0 and "cpu-local" in text


def test_main_entry_point(capsys):
    assert cli.main(["--model", "smollm2-135m", "--hw", "l4", "--tp", "1", "--ttft-ms", "0.001"]) == 2
    assert "BEST EFFORT" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Additive (CPU) cost model, per-point measurements, hold-out validation
# ---------------------------------------------------------------------------------------------

SMOL = MODELS["smollm2-135m"]


def test_roofline_overlap_and_step_pieces():
    assert roofline(3.0, 2.0, 1.0) == 3.0 and roofline(3.0, 2.0, 0.0) == 5.0 and roofline(2.0, 3.0, 0.5) == 4.0
    for overlap in (0.0, 0.4, 1.0):
        step = StepCost(0.002, 0.03, 0.0004, 0.0015, seq_s=0.003, overlap=overlap)
        b = np.array([1.0, 3.0, 17.0, 200.0])
        (c1, s1), (c2, s2) = step.pieces()
        assert np.allclose(step.time(b), np.maximum(c1 + s1 * b, c2 + s2 * b))
        batch, tpot = step.operating_point(np.array([50.0]), 512)  # Little's law fixed point
        assert batch[0] - 1 == pytest.approx(50.0 * tpot[0], rel=1e-9)


def test_predict_fixed_decode_batch():
    cpu = HARDWARE["cpu-local"]
    dep = Deployment(Phase(cpu, "fp32", "fp32"), Phase(cpu, "fp32", "fp32"), LINKS["loopback-grpc"], layerwise=False)
    work = _fixed(0.0, 64, 48)
    step = PhaseCost(SMOL, dep.decode).decode_step(KV_TIERS["device"], 64 + 24)
    for b in (1, 4, 8):
        pred = predict(SMOL, dep, work, decode_batch=b)
        assert pred.decode_batch == b and pred.tpot_s == pytest.approx(float(step.time(b)))
    assert predict(SMOL, dep, work, decode_batch=1).tpot_s == pytest.approx(predict(SMOL, dep, work).tpot_s)
    with pytest.raises(ValueError):
        predict(SMOL, dep, work, decode_batch=0)


def test_cpu_profile_is_additive_with_unfused_attention():
    cpu = HARDWARE["cpu-local"]
    assert cpu.overlap == 0.0 and cpu.attn_score_passes > 0
    pc = PhaseCost(SMOL, Phase(cpu, "fp32", "fp32"))
    p = np.array([16.0, 512.0])
    memory, compute = pc.prefill_bytes(p) / pc.bytes_per_s, pc.prefill_flops(p) / pc.flops_per_s
    assert np.allclose(pc.prefill_time(p), memory + compute)  # overheads are 0 in the table
    scores = cpu.attn_score_passes * 4 * SMOL.layers * SMOL.heads * p ** 2
    assert np.allclose(pc.prefill_bytes(p) - scores, pc.weight_read_bytes + p * pc.kv_bytes_per_token)


# A 'true' CPU box for synthetic per-point measurements (what `hetserve plan --measure` records).
TRUE_CPU = dataclasses.replace(HARDWARE["cpu-local"], mfu=0.9, bw_eff=0.35, request_overhead_s=0.006,
                               seq_overhead_s=0.0025, attn_score_passes=11.0)
TRUE_GRPC = dataclasses.replace(LINKS["loopback-grpc"], efficiency=0.03, latency_s=1e-4)
PROMPTS, BATCHES = (16, 64, 128, 256, 512), (1, 2, 4, 8)


def _per_point(profile=TRUE_CPU, link=TRUE_GRPC, noise=0.0) -> dict:
    """Per-point measurements the true profile/link would produce (+-noise, alternating)."""
    skeleton = Measurements.from_dict({
        "link": "loopback-grpc", "layerwise": False, "kv_dtype": "fp32", "prompt_tokens": 32, "output_tokens": 48,
        "ttft_ms_at_prompt": {p: 1 for p in PROMPTS}, "prefill_ms_at_prompt": {p: 1 for p in PROMPTS},
        "tpot_ms_at_batch": {b: 1 for b in BATCHES}})
    true = predict_points(profile, skeleton, SMOL, link)
    signs = itertools.cycle([1, -1])
    ms = {k: v * 1e3 * (1 + noise * next(signs)) for k, v in true.items()}
    kv = {p * SMOL.kv_bytes_per_token("fp32"): float(link_transfer_s(link, p * SMOL.kv_bytes_per_token("fp32"),
                                                                       SMOL.layers)) * 1e3 for p in PROMPTS}
    return {"model": "smollm2-135m", "hardware": "cpu-local", "link": "loopback-grpc", "precision": "fp32",
            "kv_dtype": "fp32", "layerwise": False, "prompt_tokens": 32, "output_tokens": 48,
            "ttft_ms_at_prompt": {p: ms[f"ttft_s@P={p}"] for p in PROMPTS},
            "prefill_ms_at_prompt": {p: ms[f"prefill_s@P={p}"] for p in PROMPTS},
            "tpot_ms_at_batch": {b: ms[f"tpot_s@b={b}"] for b in BATCHES},
            "kv_transfer_ms": {"loopback-grpc": {str(k): v for k, v in kv.items()}}}


def test_measurements_tables_and_split():
    raw = _per_point()
    meas = Measurements.from_dict(json.loads(json.dumps(raw)))  # string keys, as in a JSON file
    assert meas.prompt_lengths == list(PROMPTS) and meas.batch_sizes == list(BATCHES)
    assert meas.ttft_s_at_prompt[16] == pytest.approx(raw["ttft_ms_at_prompt"][16] / 1e3)
    assert not meas.layerwise and len(meas.kv_transfer_s["loopback-grpc"]) == len(PROMPTS)
    train, test = meas.split([64, 256], [2], SMOL)
    assert train.prompt_lengths == [16, 128, 512] and test.prompt_lengths == [64, 256]
    assert train.batch_sizes == [1, 4, 8] and test.batch_sizes == [2]
    held_bytes = {64 * 46080, 256 * 46080}
    assert set(test.kv_transfer_s["loopback-grpc"]) == held_bytes
    assert not held_bytes & set(train.kv_transfer_s["loopback-grpc"])
    with pytest.raises(ValueError, match="not measured"):
        meas.split([100])
    for bad in ({"ttft_ms_at_prompt": {"16": -3}}, {"tpot_ms_at_batch": {"x": 3}}, {"kv_transfer_ms": {"l": {"1": 0}}},
                {"kv_transfer_ms": {"1000": 5.0}}, {"ttft_ms_at_prompt": [1, 2]}):
        with pytest.raises(ValueError):
            Measurements.from_dict(bad)


def test_vectorised_predictions_match_predict():
    meas = Measurements.from_dict(_per_point())
    fast = measurement_predictions(TRUE_CPU, meas, SMOL, TRUE_GRPC)
    slow = predict_points(TRUE_CPU, meas, SMOL, TRUE_GRPC)
    assert set(slow) <= set(fast) and all(fast[k] == pytest.approx(v, rel=1e-12) for k, v in slow.items())


def test_link_fit_recovers_latency_and_efficiency():
    meas = Measurements.from_dict(_per_point())
    link = calibrate_link(LINKS["loopback-grpc"], meas, SMOL)
    assert link.efficiency == pytest.approx(TRUE_GRPC.efficiency, rel=1e-6)
    assert link.latency_s == pytest.approx(TRUE_GRPC.latency_s, rel=1e-6)
    one = Measurements.from_dict({"link": "loopback-grpc", "kv_transfer_ms": {"loopback-grpc": {"1000000": 5.0}}})
    fitted = calibrate_link(LINKS["loopback-grpc"], one, SMOL)
    assert float(link_transfer_s(fitted, 1e6, SMOL.layers)) == pytest.approx(5e-3)


def test_calibrate_per_point_recovers_cpu_profile():
    fitted = calibrate(HARDWARE["cpu-local"], _per_point())
    for name in ("mfu", "bw_eff", "request_overhead_s", "seq_overhead_s", "attn_score_passes"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_CPU, name), rel=0.03), name
    assert fitted.step_overhead_s == 0.0  # not identifiable when memory and compute add (overlap 0)


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_holdout_report_predicts_held_out_points(noise):
    report = holdout_report(_per_point(noise=noise))
    assert report["holdout"] == {"prompts": [64, 256], "batches": [2]}
    held = [r for r in report["points"] if r["held_out"]]
    assert {r["metric"] for r in held} == {"ttft", "prefill", "tpot"} and len(held) == 2 + 2 + 1
    assert max_holdout_error(report) < (0.005 if noise == 0 else 0.2)
    text = render_holdout(report)
    assert "| ttft | P=64 | held out |" in text and "| tpot | b=2 | held out |" in text
    assert "loopback-grpc" in text


def test_measure_helpers():
    assert default_holdout([16, 64, 128, 256, 512]) == [64, 256] and default_holdout([1, 2, 4, 8]) == [2]
    assert default_holdout([1, 8]) == [] and default_holdout([1, 2, 3, 4, 6, 8]) == [2, 4]
    assert median_rse([1.0, 1.0, 1.0]) == 0.0 and median_rse([1.0]) == math.inf
    # two streams, 10 ms steps; stream 2 joins 25 ms later; a 200 ms stall outside the common window
    a = [0.0] + [0.005 + 0.01 * i for i in range(20)]
    b = [0.02] + [0.03 + 0.01 * i for i in range(20)] + [0.43]
    r = overlap_tpot([a, b])
    assert r["tpot_s"] == pytest.approx(0.01) and r["window_s"] == pytest.approx(0.195 - 0.03)
    late = [1.0, 1.01, 1.02]  # no overlap at all: whole-stream gaps
    assert overlap_tpot([a, late])["window_s"] == 0.0


def test_cli_calibrate_per_point_prints_validation(tmp_path):
    f = tmp_path / "measured.json"
    f.write_text(json.dumps(_per_point(noise=0.03)))
    base = ["--calibrate", str(f), "--prompt-len", "128", "--output-len", "32", "--qps", "0.2",
            "--ttft-ms", "5000", "--tpot-ms", "500"]
    rc, text = _run(base)
    assert rc == 0 and "| ttft | P=64 | held out |" in text and "link loopback-grpc" in text
    rc, text = _run(base + ["--json", "--holdout-prompts", "16,512", "--holdout-batches", "none"])
    doc = json.loads(text)
    assert rc == 0 and doc["validation"]["holdout"] == {"prompts": [16, 512], "batches": []}
    assert doc["recommendation"]["deployment"]["prefill"]["hardware"] == "cpu-local"
    assert _run(base + ["--holdout-prompts", "7"])[0] == 1  # not a measured point
    assert _run(base + ["--holdout-prompts", "a,b"])[0] == 1


def test_cli_measure_bad_url_is_an_input_error():
    assert _run(["--measure", "nohost"])[0] == 1  # no port: cannot derive the decode URL
    assert _run(["--measure", "127.0.0.1:1", "--quiet-wait", "0"])[0] == 1  # nothing listens there
    assert _run(["--measure", "127.0.0.1:1", "--measure-transports", "rdma"])[0] == 1
    with pytest.raises(SystemExit) as exc:  # argparse: --measure and --calibrate exclude each other
        _run(["--measure", "127.0.0.1:1", "--calibrate", "x.json"])
    assert exc.value.code == 2
