#!/usr/bin/env bash
# Headless, time-bounded Locust run against the hetserve `llm` model, then a PNG
# of the latency distributions.
#
#   loadtest/run.sh [steady|burst|long_prompts|mixed] [--dry-run]
#
# Environment (all optional):
#   HETSERVE_SCENARIO     scenario when not given as an argument (default steady)
#   HETSERVE_PROTOCOL     grpc | http | both (default both)
#   HETSERVE_USERS        -u   (default per scenario; ignored by burst's shape)
#   HETSERVE_SPAWN_RATE   -r   (default per scenario; ignored by burst's shape)
#   HETSERVE_DURATION     run time in seconds (default per scenario)
#   HETSERVE_HOST         target host (default 127.0.0.1; loopback only unless
#                         HETSERVE_ALLOW_REMOTE=1), HETSERVE_HTTP_PORT (8000),
#                         HETSERVE_GRPC_PORT (8001)
#   HETSERVE_LOADTEST_OUT output folder (default .hetserve/loadtest/<scenario>-<time>)
#   LOCUST                locust executable (default: locust, else python3 -m locust)
# Outputs in the folder: locust_stats.csv, locust_stats_history.csv,
# locust_failures.csv, latency.csv (one row per generation), latency.png,
# summary.json, locust.log.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

dry_run=0
scenario="${HETSERVE_SCENARIO:-steady}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    steady|burst|long_prompts|mixed) scenario="$arg" ;;
    *) echo "run.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

# Defaults mirror SCENARIOS in locustfile.py (which also enforces the bound).
case "$scenario" in
  steady)       users=8;  rate=2;  duration=60 ;;
  burst)        users=32; rate=32; duration=90 ;;
  long_prompts) users=4;  rate=1;  duration=60 ;;
  mixed)        users=8;  rate=2;  duration=60 ;;
  *) echo "run.sh: HETSERVE_SCENARIO must be steady|burst|long_prompts|mixed, got '$scenario'" >&2; exit 2 ;;
esac
users="${HETSERVE_USERS:-$users}"
rate="${HETSERVE_SPAWN_RATE:-$rate}"
duration="${HETSERVE_DURATION:-$duration}"

case "${HETSERVE_PROTOCOL:-both}" in
  grpc) user_classes=(TritonGrpcStreamUser) ;;
  http) user_classes=(TritonHttpStreamUser) ;;
  both) user_classes=(TritonGrpcStreamUser TritonHttpStreamUser) ;;
  *) echo "run.sh: HETSERVE_PROTOCOL must be grpc|http|both" >&2; exit 2 ;;
esac

out="${HETSERVE_LOADTEST_OUT:-$repo/.hetserve/loadtest/${scenario}-$(date +%Y%m%d-%H%M%S)}"

if [[ -n "${LOCUST:-}" ]]; then
  read -r -a locust_cmd <<<"$LOCUST"
elif command -v locust >/dev/null 2>&1; then
  locust_cmd=(locust)
else
  locust_cmd=(python3 -m locust)
fi

cmd=("${locust_cmd[@]}" -f "$here/locustfile.py" --headless
     --csv "$out/locust" --csv-full-history --only-summary
     --stop-timeout 10 --exit-code-on-error 0)
if [[ "$scenario" != burst ]]; then
  # burst is driven by BurstShape, which ignores -u/-r/-t.
  cmd+=(-u "$users" -r "$rate" -t "${duration}s")
fi
cmd+=("${user_classes[@]}")

export HETSERVE_SCENARIO="$scenario"
export HETSERVE_DURATION="$duration"
export HETSERVE_LATENCY_CSV="$out/latency.csv"

if (( dry_run )); then
  printf 'HETSERVE_SCENARIO=%s HETSERVE_DURATION=%s HETSERVE_LATENCY_CSV=%s\n' \
    "$scenario" "$duration" "$HETSERVE_LATENCY_CSV"
  printf '%q ' "${cmd[@]}"; echo
  echo "python3 $here/plot.py --latency-csv $out/latency.csv --locust-csv $out/locust --out $out/latency.png --summary-json $out/summary.json"
  exit 0
fi

mkdir -p "$out"
echo "run.sh: scenario=$scenario duration=${duration}s users=$users rate=$rate protocol=${HETSERVE_PROTOCOL:-both} -> $out"
# Hard outer bound on top of Locust's own: duration + stop timeout + start-up slack.
set +e
timeout --kill-after=10 "$(( duration + 60 ))" "${cmd[@]}" 2>&1 | tee "$out/locust.log"
rc=${PIPESTATUS[0]}
set -e

if [[ -s "$out/latency.csv" ]]; then
  python3 "$here/plot.py" --latency-csv "$out/latency.csv" --locust-csv "$out/locust" \
    --out "$out/latency.png" --summary-json "$out/summary.json"
else
  echo "run.sh: no generations recorded in $out/latency.csv (is the server up?)" >&2
  [[ $rc -eq 0 ]] && rc=1
fi
exit "$rc"
