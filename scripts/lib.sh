# Shared shell helpers of the pdserve scripts (sourced, not run).

# pds_wait_healthy URL PID TIMEOUT_S: poll URL/health until it answers 200.
# Returns 0 when healthy, 1 when process PID exited, 2 after TIMEOUT_S seconds.
pds_wait_healthy() {
  local url=$1 pid=$2 deadline=$((SECONDS + $3))
  until "${PYTHON:-python3}" - "$url/health" <<'PY' 2>/dev/null
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
PY
  do
    kill -0 "$pid" 2>/dev/null || return 1
    (( SECONDS > deadline )) && return 2
    sleep 0.5
  done
  return 0
}
