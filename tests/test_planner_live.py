"""The planner calibrated on the running system: measure the live prefill + decode servers (session
``topology``) through the real client path, fit the cpu-local profile and the KV links on part of the
points, and check that ``predict()`` gets the held-out TTFT and TPOT within 20%.

The default-CI test is the cheap grid (about 30-40 s on 2 idle cores); the full grid behind
``-m slow`` goes through ``hetserve plan --measure`` and is the one docs/planner.md reports.
Set HETSERVE_CALIBRATION_OUT=<dir> to keep the measurements and the report.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from hetserve.planner import cli
from hetserve.planner.measure import MeasureConfig, holdout_report, max_holdout_error, measure, render_holdout

TOLERANCE = 0.20  # |predicted / measured - 1| on every held-out TTFT and TPOT point


def _keep(name: str, raw: dict, report_text: str) -> None:
    out = os.environ.get("HETSERVE_CALIBRATION_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(raw, indent=1))
        (Path(out) / f"{name}.md").write_text(report_text + "\n")


def _held_out_errors(report: dict) -> dict[str, float]:
    return {f"{r['metric']}@{r['point']}": r["error"] for r in report["points"]
            if r["held_out"] and r["metric"] in ("ttft", "tpot")}


def test_calibrated_planner_predicts_held_out_ttft_and_tpot(topology):
    cfg = MeasureConfig(prompt_lens=(16, 64, 128, 256), batches=(1, 2, 4), transports=("grpc",),
                        repeats=3, output_tokens=32, quiet_wait_s=60)
    hold_p, hold_b = (64,), (2,)
    raw = measure(topology.prefill_grpc, topology.decode_grpc, cfg, log=print)  # waits (bounded) for an idle box

    # what was measured is the live system: every point, plausible numbers, the KV really moved
    assert [int(p) for p in raw["ttft_ms_at_prompt"]] == list(cfg.prompt_lens)
    assert [int(b) for b in raw["tpot_ms_at_batch"]] == list(cfg.batches)
    ttft, prefill = raw["ttft_ms_at_prompt"], raw["prefill_ms_at_prompt"]
    assert all(ttft[p] > prefill[p] > 0 for p in ttft)  # TTFT = prefill + KV push + RPC/BLS overhead
    assert ttft["256"] > ttft["16"] and raw["tpot_ms_at_batch"]["4"] > 0
    kv = raw["kv_transfer_ms"]["loopback-grpc"]
    assert sorted(int(b) for b in kv) == [p * 46080 for p in cfg.prompt_lens]  # fp32 KV of SmolLM2-135M

    report = holdout_report(raw, hold_p, hold_b)
    text = render_holdout(report)
    print(text)
    _keep("calibration-quick", raw, text)
    assert report["holdout"] == {"prompts": [64], "batches": [2]}
    assert {"mfu", "bw_eff", "request_overhead_s", "seq_overhead_s"} <= set(report["fitted"])
    errors = _held_out_errors(report)
    assert set(errors) == {"ttft@P=64", "tpot@b=2"}
    assert max_holdout_error(report) <= TOLERANCE, (
        f"held-out errors {errors}\n{text}\nrounds (box load before each) {raw['measured']['rounds']}")


@pytest.mark.slow
def test_full_grid_calibration_via_cli(topology, tmp_path):
    """The docs/planner.md figures: `hetserve plan --measure` over the full grid, both transports."""
    out_file = tmp_path / "measured.json"
    argv = ["--measure", topology.prefill_grpc, "--decode-url", topology.decode_grpc, "--measure-out", str(out_file),
            "--measure-prompts", "16,32,64,128,256,384,512", "--measure-batches", "1,2,3,4,6,8",
            "--measure-transports", "grpc,shm", "--repeats", "5", "--quiet-wait", "240",
            "--prompt-len", "128", "--output-len", "48", "--qps", "0.5", "--ttft-ms", "2000", "--tpot-ms", "200",
            "--json"]
    buf = io.StringIO()
    rc = cli.run(cli.build_parser().parse_args(argv), buf)
    doc = json.loads(buf.getvalue())
    raw = json.loads(out_file.read_text())
    report = holdout_report(raw)  # what the CLI printed, with the profile objects for rendering
    text = render_holdout(report)
    print(text)
    _keep("calibration-full", raw, text)
    assert rc == 0 and doc["feasible"]
    assert doc["validation"]["holdout"] == {"prompts": [32, 128, 384], "batches": [2, 4]}
    assert doc["validation"]["points"] == json.loads(json.dumps(report["points"]))
    assert set(doc["calibration"]["links"]) == {"loopback-grpc", "loopback-shm"}
    assert max_holdout_error(report) <= TOLERANCE, f"held-out errors {_held_out_errors(report)}\n{text}"
