#!/usr/bin/env bash
# Loopback P/D demo on one box: one prefill node and one decode node (TP=2 each, real NIXL
# over UCX, CPU memory) and, when the proxy is installed, pd-proxy in front of them. Waits
# until all are healthy, sends one streamed request, prints it, and stops exactly the
# processes it started (by PID).
#
#   scripts/run_loopback.sh [--tp N] [--model tiny|DIR] [--prompt TEXT] [--max-tokens N] [--no-proxy]
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

TP=${TP:-2}
MODEL=${MODEL:-tiny}
PROMPT=${PROMPT:-"The capital of France is"}
MAX_TOKENS=${MAX_TOKENS:-24}
USE_PROXY=1
PY=${PYTHON:-python3}
export PYTHON=$PY
while [ $# -gt 0 ]; do
  case "$1" in
    --tp) TP=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --prompt) PROMPT=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --no-proxy) USE_PROXY=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "run_loopback.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done

workdir=$(mktemp -d -t pdserve-loopback.XXXXXX)
pids=()
cleanup() {
  local rc=$?
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ $rc -ne 0 ]; then
    echo "--- logs (failure) ---" >&2
    tail -n 30 "$workdir"/*.log >&2 2>/dev/null || true
  fi
  rm -rf "$workdir"
  exit $rc
}
trap cleanup EXIT INT TERM

# Three distinct ports (P, D, proxy) below the kernel's ephemeral range, or in
# $PDSERVE_PORT_RANGE ("LOW-HIGH") when set (engine/bench/cluster.py: free_port).
free_ports() { "$PY" -c 'from engine.bench.cluster import free_port as f; print(f(), f(), f())'; }
wait_healthy() {  # url pid name
  pds_wait_healthy "$1" "$2" 300 || { echo "run_loopback.sh: $3 did not become healthy" >&2; return 1; }
}

read -r P_PORT D_PORT X_PORT < <(free_ports)
common=(--model "$MODEL" --tp "$TP" --num-blocks 512 --kv-connector nixl --log-level WARNING)
"$PY" -m prefill_node "${common[@]}" --port "$P_PORT" >"$workdir/prefill.log" 2>&1 &
pids+=($!)
"$PY" -m decode_node "${common[@]}" --port "$D_PORT" >"$workdir/decode.log" 2>&1 &
pids+=($!)
P_URL=http://127.0.0.1:$P_PORT; D_URL=http://127.0.0.1:$D_PORT
wait_healthy "$P_URL" "${pids[0]}" "prefill node"
wait_healthy "$D_URL" "${pids[1]}" "decode node"
echo "prefill node: $P_URL (tp=$TP)   decode node: $D_URL (tp=$TP)"

if [ "$USE_PROXY" = 1 ] && "$PY" -c 'import proxy.app' 2>/dev/null; then
  "$PY" -m proxy serve --prefill "$P_URL" --decode "$D_URL" --port "$X_PORT" >"$workdir/proxy.log" 2>&1 &
  pids+=($!)
  X_URL=http://127.0.0.1:$X_PORT
  wait_healthy "$X_URL" "${pids[2]}" "proxy"
  echo "proxy: $X_URL"
  echo "--- streamed completion through the proxy ---"
  "$PY" -m proxy complete "$PROMPT" --url "$X_URL" --max-tokens "$MAX_TOKENS" --temperature 0 --stream
else
  echo "--- streamed completion, P/D paired by hand ---"
  "$PY" "$(dirname "$0")/pd_request.py" --prefill "$P_URL" --decode "$D_URL" \
    --prompt "$PROMPT" --max-tokens "$MAX_TOKENS"
fi
echo
echo "--- transfer metrics (prefill node) ---"
"$PY" - "$P_URL" <<'PYEOF'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5).read().decode()
for line in text.splitlines():
    if line.startswith(("pdserve_engine_kv_bytes_sent_total", "pdserve_engine_kv_descriptors_total",
                        "pdserve_engine_kv_transfers_started_total", "pdserve_kv_transfer_duration_seconds_count",
                        "pdserve_kv_transfer_descriptors_sum")):
        print(line)
PYEOF
