#!/usr/bin/env bash
# Start the pdserve proxy in the background, wait until it is ready (at least one healthy
# prefill and one healthy decode node), and print where it listens and how to stop it.
#
#   scripts/launch_proxy.sh --prefill "http://10.0.0.1:8100 http://10.0.0.2:8100" \
#       --decode "http://10.0.0.3:8200" [--port 8000] [--host 0.0.0.0] [-- extra flags]
#   scripts/launch_proxy.sh --port 8000 -- --registration-key KEY   # nodes register
#
# Environment twins: PREFILL_URLS, DECODE_URLS (space or comma separated), PORT, HOST,
# LOG_DIR, RUN_DIR, STARTUP_TIMEOUT (s), PYTHON. Any PDPROXY_* variable (PDPROXY_MAX_INFLIGHT,
# PDPROXY_CONFIG, ...) reaches the proxy too; see `pd-proxy serve --help`.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

PREFILL_URLS="${PREFILL_URLS:-${PDPROXY_PREFILL:-}}"; DECODE_URLS="${DECODE_URLS:-${PDPROXY_DECODE:-}}"
PORT="${PORT:-8000}"; HOST="${HOST:-127.0.0.1}"
LOG_DIR="${LOG_DIR:-./logs}"; RUN_DIR="${RUN_DIR:-./run}"; STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-120}"
PYTHON="${PYTHON:-python}"
EXTRA=()

need() { [[ $# -ge 2 && -n "$2" ]] || { echo "$1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefill) need "$@"; PREFILL_URLS="$2"; shift 2 ;;
    --decode) need "$@"; DECODE_URLS="$2"; shift 2 ;;
    --port) need "$@"; PORT="$2"; shift 2 ;;
    --host) need "$@"; HOST="$2"; shift 2 ;;
    --log-dir) need "$@"; LOG_DIR="$2"; shift 2 ;;
    --run-dir) need "$@"; RUN_DIR="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown flag $1 (proxy flags go after --)" >&2; exit 2 ;;
  esac
done
# Node lists are optional here: nodes may also be found by DNS (-- --prefill-dns ...) or
# register (-- --registration-key ...), or P may be left out (-- --prefill-fallback); the
# proxy refuses a role with none of these, naming each (its log tail is printed below).
read -r -a PREFILL <<<"${PREFILL_URLS//,/ }"
read -r -a DECODE <<<"${DECODE_URLS//,/ }"
LISTS=()
[[ ${#PREFILL[@]} -gt 0 ]] && LISTS+=(--prefill "${PREFILL[@]}")
[[ ${#DECODE[@]} -gt 0 ]] && LISTS+=(--decode "${DECODE[@]}")

mkdir -p "$LOG_DIR" "$RUN_DIR"
LOG="$LOG_DIR/proxy-$PORT.log"
PIDFILE="$RUN_DIR/proxy-$PORT.pid"
if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "a proxy already runs with pid $(cat "$PIDFILE") ($PIDFILE); stop it first" >&2
  exit 1
fi

nohup "$PYTHON" -m proxy serve --host "$HOST" --port "$PORT" \
  "${LISTS[@]}" "${EXTRA[@]}" >"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PIDFILE"

CHECK_HOST="$HOST"
[[ "$HOST" == "0.0.0.0" || "$HOST" == "::" ]] && CHECK_HOST=127.0.0.1
URL="http://$CHECK_HOST:$PORT"
ready=1
status=0
pds_wait_healthy "$URL" "$PID" "$STARTUP_TIMEOUT" || status=$?
if [[ $status == 1 ]]; then
  echo "proxy exited during startup; last log lines ($LOG):" >&2
  tail -n 20 "$LOG" >&2
  rm -f "$PIDFILE"
  exit 1
elif [[ $status == 2 ]]; then
  ready=0
  echo "warning: proxy runs but is not ready after ${STARTUP_TIMEOUT}s (no healthy P/D pair);" \
    "see $URL/health" >&2
fi
echo "proxy listening on http://$HOST:$PORT (pid $PID; ready: $([[ $ready == 1 ]] && echo yes || echo no))"
echo "  prefill: ${PREFILL[*]:--}"
echo "  decode:  ${DECODE[*]:--}"
echo "  log: $LOG   pid file: $PIDFILE"
if [[ -n "${PDPROXY_API_KEY:-}" ]]; then
  echo "  try: PDPROXY_API_KEY=... pd-proxy complete \"Hello\" --url http://$CHECK_HOST:$PORT --stream"
else
  echo "  try: pd-proxy complete \"Hello\" --url http://$CHECK_HOST:$PORT --stream"
fi
echo "  stop: kill $PID    (or: kill \$(cat $PIDFILE))"
