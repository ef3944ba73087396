#!/usr/bin/env bash
# The one GPU check: correctness tests marked `gpu`, the Triton kernel tests compiled, the
# offline and HTTP benchmarks (colocated, and P/D through the proxy with P and D sharing
# the GPU), a per-step profile, and a summary table against the targets of
# docs/performance.md. Everything it measures lands in $OUT (default /tmp/gpu_check).
#
#   scripts/gpu_check.sh            # on a CUDA host, from the repository root
#   SMOKE=1 scripts/gpu_check.sh    # the same steps at toy sizes on CPU (checks the script)
#
# Wheels in .whl/ (scripts/fetch_gpu_wheels.sh) are installed first into /tmp/site, for
# hosts without nixl/pyzmq/fastapi/uvicorn/pydantic. Budget: about 10 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${SMOKE:-0}" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
PY=python3
SMOKE="${SMOKE:-0}"
LOG="$OUT/gpu_check.log"
: >"$LOG"
PIDS=()
cleanup() {  # SIGTERM what this script started, wait up to 20 s, then SIGKILL
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for _ in $(seq 1 40); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5
  done
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  wait 2>/dev/null
  PIDS=()
}
trap cleanup EXIT
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
step() {  # step NAME TIMEOUT_S CMD...: run, log, never abort the whole check
  local name=$1 limit=$2; shift 2
  say "$name"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "$name rc=$rc" >>"$OUT/steps.txt"
  [ $rc -eq 0 ] || say "$name FAILED (rc=$rc)"
  return 0
}
wait_up() {  # wait_up URL PID
  for _ in $(seq 1 600); do
    $PY -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1]+'/health',timeout=2)" "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

if [ "$SMOKE" = 1 ]; then
  DEV=(--device cpu --dtype float32); PRESET=tiny-llama
  THR=(--num-prompts 4 --input-len 32 --output-len 8); LAT=(--num-prompts 1 --input-len 32 --output-len 8)
  PRE=(--num-prompts 1 --input-len 256 --output-len 1); SERVE=(--num-prompts 8 --max-concurrency 4 --input-len 64 --output-len 8)
  LOW=(--num-prompts 4 --max-concurrency 1 --input-len 64 --output-len 4); OVERHEAD_N=10
  NODE=(--device cpu --dtype float32 --num-blocks 512); PD_NODE=("${NODE[@]}")
  PROF=(--device cpu --batch 4 --context 64 --prefill-tokens 128 --iters 4)
  XFER=(--device cpu --layers 2 --kv-heads 2 --head-dim 16 --tokens 64 --tp 1 2 --reps 2)
else
  DEV=(--device cuda --dtype bfloat16); PRESET=llama-886m
  THR=(--workload throughput); LAT=(--workload latency); PRE=(--workload prefill)
  SERVE=(--num-prompts 64 --max-concurrency 32 --input-len 1024 --output-len 64)
  LOW=(--num-prompts 16 --max-concurrency 1 --input-len 1024 --output-len 16)  # low load
  OVERHEAD_N=300
  NODE=(--device cuda --dtype bfloat16 --max-num-seqs 64)
  PD_NODE=("${NODE[@]}" --gpu-memory-utilization 0.3 --num-blocks 8192)
  PROF=(--device cuda --batch 32 --context 512 --prefill-tokens 2048 --iters 20)
  XFER=(--device cuda --tokens 128 512 2048 8192 --tp 1 2)  # Llama-3-8B KV, VRAM, 3 GiB
  say "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"
fi
say "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

# 1. Correctness (each pytest run leaves its junit XML for the summary).
if [ "$SMOKE" != 1 ]; then
  step "pytest gpu" 240 $PY -m pytest -q -x -p no:cacheprovider --junitxml "$OUT/pytest_gpu.xml" tests/test_triton_attention.py tests/test_sampler.py tests/test_gpu.py
fi

# 2. Offline.
MODEL="$OUT/model-$PRESET"
[ -d "$MODEL" ] || step "make-model $PRESET" 120 $PY -m engine.bench make-model --out "$MODEL" --preset "$PRESET"
B=($PY -m engine.bench offline --model "$MODEL" "${DEV[@]}")
step "offline throughput (+transformers)" 240 "${B[@]}" "${THR[@]}" --compare-hf --json "$OUT/offline_throughput.json"
step "offline latency" 120 "${B[@]}" "${LAT[@]}" --json "$OUT/offline_latency.json"
step "offline latency eager" 120 "${B[@]}" "${LAT[@]}" --enforce-eager --json "$OUT/offline_latency_eager.json"
step "offline prefill" 180 "${B[@]}" "${PRE[@]}" --json "$OUT/offline_prefill.json"
step "profile" 180 $PY scripts/profile_step.py --model "$MODEL" "${PROF[@]}" --trace "$OUT/trace" --json "$OUT/profile.json"
# KV push P->D: the connector path vs raw NIXL vs a device-to-device copy, same bytes.
step "transfer" 180 $PY -m engine.bench transfer "${XFER[@]}" --json "$OUT/transfer.json"

# 3. HTTP: colocated node.
S=($PY -m engine.bench serve --no-progress --slo-ttft-ms 150 --slo-itl-ms 25 "${SERVE[@]}")
say "colocated node"
$PY -m decode_node --model "$MODEL" "${NODE[@]}" --port 8300 >"$OUT/node.log" 2>&1 &
PIDS+=($!)
if wait_up http://127.0.0.1:8300 "${PIDS[-1]}"; then
  step "serve colocated" 240 "${S[@]}" --base-url http://127.0.0.1:8300 --json "$OUT/serve_colocated.json" --plot "$OUT/serve_colocated.png"
  step "low load colocated" 120 "${S[@]}" "${LOW[@]}" --seed 1 --base-url http://127.0.0.1:8300 --json "$OUT/low_colocated.json"
  # The proxy's own overhead on this (quiet, fast) host: 1-token requests straight to the
  # node and through a proxy in front of it (decode node alone: --prefill-fallback), in turn.
  $PY -m proxy serve --decode http://127.0.0.1:8300 --prefill-fallback --port 8301 >"$OUT/proxy_solo.log" 2>&1 &
  PIDS+=($!)
  if wait_up http://127.0.0.1:8301 "${PIDS[-1]}"; then
    step "proxy overhead" 60 $PY scripts/bench_proxy_ab.py --node http://127.0.0.1:8300 --proxy http://127.0.0.1:8301 -n "$OVERHEAD_N" --json "$OUT/proxy_overhead.json"
  else
    echo "proxy overhead rc=start" >>"$OUT/steps.txt"
  fi
else
  say "colocated node did not start (see node.log)"; echo "serve colocated rc=start" >>"$OUT/steps.txt"
fi
cleanup

# 4. HTTP: P/D through the proxy, P and D on the same GPU; a second prefill node with the
# pipelined push (--kv-layer-group-size 4) behind a second proxy, same decode node.
say "P/D"
$PY -m prefill_node --model "$MODEL" "${PD_NODE[@]}" --port 8100 --kv-connector nixl >"$OUT/prefill.log" 2>&1 &
PIDS+=($!); P_PID=$!
$PY -m prefill_node --model "$MODEL" "${PD_NODE[@]}" --port 8101 --kv-connector nixl --kv-layer-group-size 4 >"$OUT/prefill_pipelined.log" 2>&1 &
PIDS+=($!); P2_PID=$!
$PY -m decode_node --model "$MODEL" "${PD_NODE[@]}" --port 8200 --kv-connector nixl >"$OUT/decode.log" 2>&1 &
PIDS+=($!); D_PID=$!
$PY -m proxy serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 >"$OUT/proxy.log" 2>&1 &
PIDS+=($!)
$PY -m proxy serve --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8200 --port 8001 >"$OUT/proxy_pipelined.log" 2>&1 &
PIDS+=($!)
if wait_up http://127.0.0.1:8100 $P_PID && wait_up http://127.0.0.1:8200 $D_PID && wait_up http://127.0.0.1:8000 "${PIDS[-2]}"; then
  step "serve P/D" 240 "${S[@]}" --base-url http://127.0.0.1:8000 --json "$OUT/serve_pd.json" --plot "$OUT/serve_pd.png"
  step "low load P/D" 120 "${S[@]}" "${LOW[@]}" --seed 2 --base-url http://127.0.0.1:8000 --json "$OUT/low_pd.json"
  curl -s http://127.0.0.1:8100/metrics >"$OUT/prefill_metrics.txt" 2>/dev/null
  if wait_up http://127.0.0.1:8101 $P2_PID && wait_up http://127.0.0.1:8001 "${PIDS[-1]}"; then
    step "low load P/D pipelined" 120 "${S[@]}" "${LOW[@]}" --seed 3 --base-url http://127.0.0.1:8001 --json "$OUT/low_pd_pipelined.json"
    curl -s http://127.0.0.1:8101/metrics >"$OUT/prefill_pipelined_metrics.txt" 2>/dev/null
  fi
  curl -s http://127.0.0.1:8200/metrics >"$OUT/decode_metrics.txt" 2>/dev/null
else
  say "P/D did not start (see prefill.log, decode.log, proxy.log)"; echo "serve P/D rc=start" >>"$OUT/steps.txt"
fi
cleanup

# A summary now, so that a run cut short in step 5 still leaves one; rewritten at the end.
$PY scripts/gpu_summary.py "$OUT" >"$OUT/summary.md" 2>&1

# 5. Last (longest, and least needed if the device time runs out): TP ranks sharing the
# GPU over gloo (P/D 2->2, 1->2, 2->1 in VRAM) and, on a host with more GPUs, P and D on
# different ones; on CPU (SMOKE) only its placement tests run, the others skip with reasons.
step "pytest multi-gpu" 420 $PY -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/pytest_multi_gpu.xml" tests/test_multi_gpu.py

# 6. Summary.
$PY scripts/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
