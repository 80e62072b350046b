#!/usr/bin/env python3
"""Turn a load-test run into a PNG of latency distributions.

Inputs
  --latency-csv   per-generation rows written by loadtest/locustfile.py
                  (HETSERVE_LATENCY_CSV): ttft_s, tpot_s, e2e_s, n_tokens, ...
  --locust-csv    the prefix given to ``locust --csv`` (reads PREFIX_stats.csv
                  and PREFIX_stats_history.csv when present; optional)

Output
  --out           PNG: TTFT / TPOT histograms, end-to-end latency CDF, TTFT over
                  time, users + requests/s + tokens/s over time, Locust
                  percentile table per request name.
  --summary-json  optional JSON with p50/p90/p99 per protocol and throughput.

    python3 loadtest/plot.py --latency-csv out/latency.csv --locust-csv out/locust \
        --out out/latency.png --summary-json out/summary.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PERCENTILES = (50, 90, 99)


def _float(value: str | None) -> float | None:
    if value is None or value == "" or value == "N/A":
        return None
    try:
        out = float(value)
    except ValueError:
        return None
    return None if math.isnan(out) else out


def read_latency_csv(path: str) -> list[dict]:
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for raw in csv.DictReader(f):
            rows.append({
                "start_time": _float(raw.get("start_time")) or 0.0,
                "protocol": raw.get("protocol") or "?",
                "prompt_kind": raw.get("prompt_kind") or "?",
                "n_tokens": int(_float(raw.get("n_tokens")) or 0),
                "ttft_s": _float(raw.get("ttft_s")),
                "tpot_s": _float(raw.get("tpot_s")),
                "e2e_s": _float(raw.get("e2e_s")),
                "ok": (raw.get("ok") or "0").strip() in ("1", "True", "true"),
            })
    return rows


def read_locust_stats(prefix: str | None) -> tuple[list[dict], list[dict]]:
    stats, history = [], []
    if not prefix:
        return stats, history
    for suffix, sink in (("_stats.csv", stats), ("_stats_history.csv", history)):
        path = prefix + suffix
        if os.path.exists(path):
            with open(path, newline="", encoding="utf-8") as f:
                sink.extend(csv.DictReader(f))
    return stats, history


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    out["n"] = int(arr.size)
    return out


def summarize(rows: list[dict]) -> dict:
    summary: dict = {"protocols": {}}
    by_proto: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_proto[row["protocol"]].append(row)
    by_proto["all"] = rows
    for proto, group in by_proto.items():
        ok = [r for r in group if r["ok"]]
        entry = {
            "requests": len(group),
            "failures": len(group) - len(ok),
            "tokens": sum(r["n_tokens"] for r in ok),
        }
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            entry[key] = percentiles([r[key] for r in ok if r[key] is not None])
        summary["protocols"][proto] = entry
    if rows:
        t0 = min(r["start_time"] for r in rows)
        t1 = max(r["start_time"] + (r["e2e_s"] or 0.0) for r in rows)
        wall = max(t1 - t0, 1e-9)
        tokens = sum(r["n_tokens"] for r in rows if r["ok"])
        summary["wall_s"] = wall
        summary["requests_per_s"] = len(rows) / wall
        summary["tokens_per_s"] = tokens / wall
    return summary


def _hist(ax, rows, key, title, scale=1000.0, unit="ms"):
    groups: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["ok"] and r[key] is not None:
            groups[r["protocol"]].append(r[key] * scale)
    if not groups:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        every = np.concatenate([np.asarray(v) for v in groups.values()])
        bins = np.histogram_bin_edges(every, bins=min(60, max(5, int(math.sqrt(every.size)) * 2)))
        for proto, vals in sorted(groups.items()):
            ax.hist(vals, bins=bins, alpha=0.55, label=f"{proto} (n={len(vals)})")
        for p, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(every, p))
            ax.axvline(v, color="k", linestyle=style, linewidth=1)
            ax.text(v, ax.get_ylim()[1] * 0.95, f" p{p}={v:.1f}{unit}", fontsize=7, va="top")
        ax.legend(fontsize=7)
    ax.set_title(title)
    ax.set_xlabel(unit)
    ax.set_ylabel("generations")


def _cdf(ax, rows):
    groups: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["ok"] and r["e2e_s"] is not None:
            groups[r["protocol"]].append(r["e2e_s"] * 1000.0)
    for proto, vals in sorted(groups.items()):
        xs = np.sort(np.asarray(vals))
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=proto)
    if not groups:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.set_title("End-to-end latency CDF")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _ttft_over_time(ax, rows, t0):
    kinds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r["ok"] and r["ttft_s"] is not None:
            kinds[r["prompt_kind"]].append((r["start_time"] - t0, r["ttft_s"] * 1000.0))
    for kind, pts in sorted(kinds.items()):
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, s=6, alpha=0.6, label=kind)
    failed = [r["start_time"] - t0 for r in rows if not r["ok"]]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", color="red", s=14, label=f"failed ({len(failed)})")
    if kinds or failed:
        ax.legend(fontsize=7, markerscale=2)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("TTFT over time (by prompt kind)")
    ax.set_xlabel("s since start")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)


def _throughput(ax, rows, history, t0):
    if rows:
        end = max(r["start_time"] + (r["e2e_s"] or 0.0) for r in rows) - t0
        nbins = max(1, int(math.ceil(end)))
        req = np.zeros(nbins)
        tok = np.zeros(nbins)
        for r in rows:
            done = min(nbins - 1, int(r["start_time"] - t0 + (r["e2e_s"] or 0.0)))
            req[done] += 1
            if r["ok"]:
                tok[done] += r["n_tokens"]
        xs = np.arange(nbins)
        ax.plot(xs, tok, label="tokens/s", color="tab:green")
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot(xs, req, label="requests/s", color="tab:blue", alpha=0.7)
        users = [(float(h["Timestamp"]) - t0, float(h["User Count"])) for h in history
                 if h.get("Name") == "Aggregated" and _float(h.get("Timestamp")) is not None]
        if users:
            ux, uy = zip(*users)
            ax2.step(ux, uy, where="post", label="users", color="tab:orange")
        ax2.set_ylabel("requests/s, users")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Throughput (completions per second)")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)


def _locust_table(ax, stats):
    ax.axis("off")
    ax.set_title("Locust response times (ms)")
    rows = [s for s in stats if s.get("Name") != "Aggregated"]
    if not rows:
        ax.text(0.5, 0.5, "no Locust stats", ha="center", va="center", transform=ax.transAxes)
        return
    cols = ["Request Count", "Failure Count", "50%", "90%", "99%", "Max Response Time"]
    header = ["type/name", "reqs", "fails", "p50", "p90", "p99", "max"]
    cells = []
    for s in rows:
        vals = []
        for c in cols:
            v = _float(s.get(c))
            vals.append("-" if v is None else f"{v:.0f}")
        cells.append([f"{s.get('Type', '')}/{s.get('Name', '')}"] + vals)
    table = ax.table(cellText=cells, colLabels=header, loc="center", cellLoc="right")
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    table.scale(1, 1.3)


def plot(rows: list[dict], stats: list[dict], history: list[dict], out: str, title: str) -> None:
    t0 = min((r["start_time"] for r in rows), default=0.0)
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    _hist(axes[0][0], rows, "ttft_s", "Time to first token")
    _hist(axes[0][1], rows, "tpot_s", "Time per output token")
    _cdf(axes[0][2], rows)
    _ttft_over_time(axes[1][0], rows, t0)
    _throughput(axes[1][1], rows, history, t0)
    _locust_table(axes[1][2], stats)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-csv", default=os.environ.get("HETSERVE_LATENCY_CSV"),
                    help="per-request CSV from the locustfile (default: $HETSERVE_LATENCY_CSV)")
    ap.add_argument("--locust-csv", default=None, help="prefix passed to locust --csv")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--summary-json", default=None, help="also write a JSON summary here")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)

    if not args.latency_csv or not os.path.exists(args.latency_csv):
        print(f"plot.py: latency CSV not found: {args.latency_csv!r}", file=sys.stderr)
        return 2
    rows = read_latency_csv(args.latency_csv)
    stats, history = read_locust_stats(args.locust_csv)
    summary = summarize(rows)
    scenario = ""
    with open(args.latency_csv, newline="", encoding="utf-8") as f:
        first = next(csv.DictReader(f), None)
        if first:
            scenario = first.get("scenario", "")
    title = args.title or f"hetserve load test: {scenario or 'unknown scenario'} ({len(rows)} generations)"
    plot(rows, stats, history, args.out, title)

    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    for proto, entry in sorted(summary["protocols"].items()):
        parts = [f"{proto:>5}: {entry['requests']} reqs, {entry['failures']} failed, {entry['tokens']} tokens"]
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            p = entry[key]
            if p:
                parts.append(f"{key[:-2]} p50={p['p50'] * 1e3:.1f}ms p99={p['p99'] * 1e3:.1f}ms")
        print(" | ".join(parts))
    if "tokens_per_s" in summary:
        print(f"throughput: {summary['requests_per_s']:.2f} req/s, {summary['tokens_per_s']:.1f} tokens/s "
              f"over {summary['wall_s']:.1f}s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
