#!/usr/bin/env bash
# Start ONE pdserve node in the background on this host, wait until it is healthy, and
# print where it listens and how to stop it. Used as-is on every host of a deployment.
#
#   scripts/launch_prefill.sh [--model M] [--tp N] [--gpus 0,1] [--port P] [--host H]
#       [--side-channel-host IP] [--side-channel-port P] [--log-dir D] [--run-dir D]
#       [-- extra node flags...]
#
# Every flag has an environment twin: MODEL, TP, GPUS (-> CUDA_VISIBLE_DEVICES), PORT,
# HOST, SIDE_CHANNEL_HOST, SIDE_CHANNEL_PORT, DEVICE (cpu|cuda; default cuda when GPUS is
# set), LOG_DIR, RUN_DIR, STARTUP_TIMEOUT (s), PYTHON. UCX_* variables (UCX_TLS,
# UCX_NET_DEVICES, UCX_LOG_LEVEL, ...) are passed through to the node unchanged.
# scripts/launch_decode.sh is the same script with ROLE=decode.
# Across hosts, name the peers and sign the side channel: export PDSERVE_KV_SECRET (the
# same on every node) and pass `-- --kv-allowed-peers HOST[,HOST|CIDR...]` (the default
# allows loopback only).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

ROLE="${ROLE:-prefill}"
case "$ROLE" in
  prefill) DEFAULT_PORT=8100 ;;
  decode) DEFAULT_PORT=8200 ;;
  *) echo "ROLE must be prefill or decode, got '$ROLE'" >&2; exit 2 ;;
esac
MODEL="${MODEL:-tiny}"; TP="${TP:-1}"; GPUS="${GPUS:-}"; PORT="${PORT:-$DEFAULT_PORT}"
HOST="${HOST:-127.0.0.1}"; SIDE_CHANNEL_HOST="${SIDE_CHANNEL_HOST:-}"
SIDE_CHANNEL_PORT="${SIDE_CHANNEL_PORT:-0}"; DEVICE="${DEVICE:-}"
LOG_DIR="${LOG_DIR:-./logs}"; RUN_DIR="${RUN_DIR:-./run}"; STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-600}"
PYTHON="${PYTHON:-python}"
EXTRA=()

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "$1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) need "$@"; MODEL="$2"; shift 2 ;;
    --tp) need "$@"; TP="$2"; shift 2 ;;
    --gpus) need "$@"; GPUS="$2"; shift 2 ;;
    --port) need "$@"; PORT="$2"; shift 2 ;;
    --host) need "$@"; HOST="$2"; shift 2 ;;
    --device) need "$@"; DEVICE="$2"; shift 2 ;;
    --side-channel-host) need "$@"; SIDE_CHANNEL_HOST="$2"; shift 2 ;;
    --side-channel-port) need "$@"; SIDE_CHANNEL_PORT="$2"; shift 2 ;;
    --log-dir) need "$@"; LOG_DIR="$2"; shift 2 ;;
    --run-dir) need "$@"; RUN_DIR="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown flag $1 (node flags go after --)" >&2; exit 2 ;;
  esac
done

if [[ -z "$SIDE_CHANNEL_HOST" ]]; then
  # Peers on other hosts must reach the side channel: advertise this host's address.
  if [[ "$HOST" == "0.0.0.0" || "$HOST" == "::" ]]; then
    SIDE_CHANNEL_HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
    SIDE_CHANNEL_HOST="${SIDE_CHANNEL_HOST:-127.0.0.1}"
  else
    SIDE_CHANNEL_HOST="$HOST"
  fi
fi
if [[ -n "$GPUS" ]]; then
  export CUDA_VISIBLE_DEVICES="$GPUS"
  DEVICE="${DEVICE:-cuda}"
fi
DEVICE="${DEVICE:-cpu}"

mkdir -p "$LOG_DIR" "$RUN_DIR"
LOG="$LOG_DIR/$ROLE-$PORT.log"
PIDFILE="$RUN_DIR/$ROLE-$PORT.pid"
if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "a $ROLE node already runs with pid $(cat "$PIDFILE") ($PIDFILE); stop it first" >&2
  exit 1
fi

nohup "$PYTHON" -m "${ROLE}_node" --model "$MODEL" --tp "$TP" --device "$DEVICE" \
  --host "$HOST" --port "$PORT" --kv-connector nixl \
  --side-channel-host "$SIDE_CHANNEL_HOST" --side-channel-port "$SIDE_CHANNEL_PORT" \
  "${EXTRA[@]}" >"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PIDFILE"

CHECK_HOST="$HOST"
[[ "$HOST" == "0.0.0.0" || "$HOST" == "::" ]] && CHECK_HOST=127.0.0.1
URL="http://$CHECK_HOST:$PORT"
status=0
pds_wait_healthy "$URL" "$PID" "$STARTUP_TIMEOUT" || status=$?
if [[ $status == 1 ]]; then
  echo "$ROLE node exited during startup; last log lines ($LOG):" >&2
  tail -n 20 "$LOG" >&2
  rm -f "$PIDFILE"
  exit 1
elif [[ $status == 2 ]]; then
  echo "$ROLE node not healthy after ${STARTUP_TIMEOUT}s (pid $PID still running, log $LOG)" >&2
  exit 1
fi

# The endpoint needs the node's key when it has one: $PDSERVE_API_KEY ($VLLM_API_KEY), or --api-key given
# after -- (the last one wins, as for the node).
KEY="${PDSERVE_API_KEY:-${VLLM_API_KEY:-}}"
for ((i = 0; i < ${#EXTRA[@]}; i++)); do
  case "${EXTRA[i]}" in
    --api-key) KEY="${EXTRA[i + 1]:-}" ;;
    --api-key=*) KEY="${EXTRA[i]#--api-key=}" ;;
  esac
done
SIDE="$(PDS_INFO_KEY="$KEY" "$PYTHON" - "$URL/v1/kv_transfer_info" <<'PY' 2>/dev/null || true
import json, os, sys, urllib.request
req = urllib.request.Request(sys.argv[1])
if os.environ.get("PDS_INFO_KEY"):
    req.add_header("Authorization", "Bearer " + os.environ["PDS_INFO_KEY"])
print(json.load(urllib.request.urlopen(req, timeout=5)).get("side_channel", "?"))
PY
)"
echo "$ROLE node listening on http://$HOST:$PORT (pid $PID, model $MODEL, tp $TP, device $DEVICE)"
echo "  KV side channel: ${SIDE:-unknown}   UCX_TLS=${UCX_TLS:-<unset>} UCX_NET_DEVICES=${UCX_NET_DEVICES:-<unset>}"
echo "  log: $LOG   pid file: $PIDFILE"
echo "  stop: kill $PID    (or: kill \$(cat $PIDFILE))"
# The node's start-up warnings about its side channel: an address its own
# --kv-allowed-peers refuses (every prompt would be prefilled on the decode node), and,
# when it listens beyond loopback, an unsigned side channel.
WARN="is outside --kv-allowed-peers"
[[ "$HOST" == 127.* || "$HOST" == "localhost" || "$HOST" == "::1" ]] || WARN="$WARN|side channel unsigned"
grep -E "WARNING .*($WARN)" "$LOG" 2>/dev/null \
  | sed 's/^.*WARNING [0-9]* [a-z_.]*: /  warning: /' >&2 || true
