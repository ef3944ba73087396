#!/usr/bin/env bash
# The one GPU check: correctness tests marked `gpu`, the Triton kernel tests compiled, the
# offline and HTTP benchmarks (colocated, and P/D through the proxy with P and D sharing
# the GPU), a per-step profile, the KV push, and a summary table against the targets of
# docs/performance.md.
#
#   scripts/gpu_check.sh            # on a CUDA host, from the repository root
#   SMOKE=1 scripts/gpu_check.sh    # the same steps at toy sizes on CPU (checks the script)
#
# Made for the device tool (`run(command="OUT=$OUT bash scripts/gpu_check.sh",
# carry=[".whl"], timeout_s=540)`), whose limits shape it:
# - What comes back is at most 8 files of 16 MiB from $OUT. Everything is made in
#   $GPU_CHECK_WORK (default /tmp/gpu_check_work: the model, logs, traces, JSON); after
#   every step $OUT is refreshed with four files: summary.md (the target table so far),
#   steps.txt (each step's rc), gpu_check.log (its last 12 MiB) and results.tgz (the JSON,
#   junit XML, metrics, plots and node logs; no model).
# - The run has a wall-clock budget, GPU_CHECK_BUDGET_S (default 470 s, inside a 540 s
#   timeout_s). Steps run most valuable first; each one's limit is cut to what is left, and
#   a step that no longer fits is recorded as `rc=budget` rather than started.
# - GPU_CHECK_ONLY="key ..." runs only those steps (keys below: kernels model throughput
#   latency sync colocated pd gpu-tests prefill eager triton-ops executor profile transfer structured
#   multi-gpu), e.g. a rerun of what the budget cut. Steps that need the model build it
#   when it is missing.
# The summary is printed to stdout at the end (the tool's output tail) as well.
#
# Wheels in .whl/ (scripts/fetch_gpu_wheels.sh) are installed first into /tmp/site, for
# hosts without nixl/pyzmq/starlette/uvicorn (the set also holds fastapi and pydantic, which
# pdserve no longer imports: the list known to work there is kept whole). llguidance
# (structured outputs) is optional: without it the structured step is recorded as skipped,
# with the reason, and the other steps run as ever.
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "gpu_check.sh: takes no arguments, got '$1' (see --help)" >&2; exit 2 ;;
esac
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
ONLY="${GPU_CHECK_ONLY:-}"
RESERVE=20  # seconds kept for the last summary, the copy to $OUT and the cleanup
END=$((SECONDS + BUDGET))
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${SMOKE:-0}" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
PY=python3
SMOKE="${SMOKE:-0}"
LOG="$WORK/gpu_check.log"
: >"$LOG"
: >"$WORK/steps.txt"
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
say() { echo "== $(date +%T) [${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((END - SECONDS - RESERVE)); }
selected() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
publish() {  # refresh the few files $OUT holds (the device tool returns at most 8)
  $PY scripts/gpu_summary.py "$WORK" >"$WORK/summary.md" 2>&1
  cp "$WORK/summary.md" "$WORK/steps.txt" "$OUT/"
  tail -c $((12 * 1024 * 1024)) "$LOG" >"$OUT/gpu_check.log"
  (cd "$WORK" && find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.xml' -o -name '*.txt' \
    -o -name '*.png' -o -name '*.log' -o -name '*.md' \) ! -name gpu_check.log -print0 |
    xargs -0 -r tar -czf "$OUT/results.tgz.part" && mv "$OUT/results.tgz.part" "$OUT/results.tgz")
}
record() { echo "$1 rc=$2" >>"$WORK/steps.txt"; [ "$2" = 0 ] || say "$1: rc=$2"; }
step() {  # step NAME LIMIT_S MIN_S CMD...: run within the budget, log, never abort the check
  local name=$1 limit=$2 min=$3; shift 3
  local room; room=$(left)
  if [ "$room" -lt "$min" ]; then record "$name" budget; return 0; fi
  [ "$room" -lt "$limit" ] && limit=$room
  say "$name (limit ${limit}s)"
  # SIGINT first: pytest still writes its junit XML, benchmarks shut their engines down.
  timeout -s INT -k 20 "$limit" "$@" >>"$LOG" 2>&1
  record "$name" $?
  publish
}
wait_up() {  # wait_up URL PID: up to 120 s (less when the budget is short)
  local tries=$((2 * $(left)))
  [ $tries -gt 240 ] && tries=240
  for _ in $(seq 1 $tries); do
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
  STRUCT=(--num-prompts 4 --input-len 32)  # --structured's own --output-len (128): the grammars complete
  LOW=(--num-prompts 4 --max-concurrency 1 --input-len 64 --output-len 4); OVERHEAD_N=10
  NODE=(--device cpu --dtype float32 --num-blocks 512); PD_NODE=("${NODE[@]}")
  PROF=(--device cpu --batch 4 --context 64 --prefill-tokens 128 --iters 4)
  XFER=(--device cpu --layers 2 --kv-heads 2 --head-dim 16 --tokens 64 --tp 1 2 --reps 2)
else
  DEV=(--device cuda --dtype bfloat16); PRESET=llama-886m
  THR=(--workload throughput); LAT=(--workload latency); PRE=(--workload prefill)
  STRUCT=(--workload throughput)
  SERVE=(--num-prompts 64 --max-concurrency 32 --input-len 1024 --output-len 64)
  LOW=(--num-prompts 16 --max-concurrency 1 --input-len 1024 --output-len 16)  # low load
  OVERHEAD_N=300
  NODE=(--device cuda --dtype bfloat16 --max-num-seqs 64)
  PD_NODE=("${NODE[@]}" --gpu-memory-utilization 0.3 --num-blocks 8192)
  PROF=(--device cuda --batch 32 --context 512 --prefill-tokens 2048 --iters 20)
  XFER=(--device cuda --tokens 128 512 2048 8192 --tp 1 2)  # Llama-3-8B KV, VRAM, 3 GiB
  say "host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"
  say "$(ldd --version 2>&1 | head -1)"  # which manylinux wheels this host takes
fi
# The device tool's copy of the tree may carry an older .git: GPU_CHECK_COMMIT (set by the
# caller, e.g. GPU_CHECK_COMMIT=$(git rev-parse --short HEAD) spelled out in the command)
# names the tree that ran.
say "commit ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} (GPU_CHECK_COMMIT: ${GPU_CHECK_COMMIT:-unset}), budget ${BUDGET}s, only '${ONLY}'"
# What the steps import, from this host or the wheels: a missing one is named at once.
step "preflight imports" 60 5 $PY -c "import starlette, uvicorn, httptools, zmq, nixl._api, torch, triton; print('imports ok')"
# Optional: llguidance, for the structured step only (skipped with this reason without it).
STRUCTURED_SKIP=""
if LLG=$($PY -c "import importlib.metadata as m, llguidance; print(m.version('llguidance'))" 2>&1); then
  say "llguidance $LLG"
else
  STRUCTURED_SKIP="llguidance not importable ($(echo "$LLG" | tail -n 1 | cut -c1-200))"
  say "structured step: skipped, $STRUCTURED_SKIP"
fi
MODEL="$WORK/model-$PRESET"
need_model() {  # build the benchmark model once (steps that need it call this first)
  [ -f "$MODEL/config.json" ] || step "make-model $PRESET" 120 20 $PY -m engine.bench make-model --out "$MODEL" --preset "$PRESET"
}
B=($PY -m engine.bench offline --model "$MODEL" "${DEV[@]}")
S=($PY -m engine.bench serve --no-progress --slo-ttft-ms 150 --slo-itl-ms 25 "${SERVE[@]}")

# Steps, most valuable first (each stage below is skipped when the budget is spent).
# 1. The compiled Triton kernels and the device sampler against their references.
if [ "$SMOKE" != 1 ] && selected kernels; then
  step "pytest kernels" 150 40 $PY -m pytest -q -p no:cacheprovider --junitxml "$WORK/pytest_kernels.xml" tests/test_triton_attention.py tests/test_triton_ops.py tests/test_sampler.py
fi

# 2. Offline: the throughput workload (with transformers in the same run) and one stream.
selected model && need_model
if selected throughput; then
  need_model
  step "offline throughput (+transformers)" 180 60 "${B[@]}" "${THR[@]}" --compare-hf --json "$WORK/offline_throughput.json"
fi
if selected latency; then
  need_model
  step "offline latency" 90 30 "${B[@]}" "${LAT[@]}" --json "$WORK/offline_latency.json"
fi

# The same two with --no-async-scheduling (each step scheduled once the one before ended;
# async scheduling, step N+1 scheduled while N runs, is the default the rows above run).
if selected sync; then
  need_model
  step "offline throughput sync" 120 40 "${B[@]}" "${THR[@]}" --no-async-scheduling --json "$WORK/offline_throughput_sync.json"
  step "offline latency sync" 90 30 "${B[@]}" "${LAT[@]}" --no-async-scheduling --json "$WORK/offline_latency_sync.json"
fi

# 3. HTTP: colocated node.
if selected colocated && need_model && [ "$(left)" -ge 60 ]; then
  say "colocated node"
  $PY -m decode_node --model "$MODEL" "${NODE[@]}" --port 8300 >"$WORK/node.log" 2>&1 &
  PIDS+=($!)
  if wait_up http://127.0.0.1:8300 "${PIDS[-1]}"; then
    step "serve colocated" 150 40 "${S[@]}" --base-url http://127.0.0.1:8300 --json "$WORK/serve_colocated.json" --plot "$WORK/serve_colocated.png"
    step "low load colocated" 90 30 "${S[@]}" "${LOW[@]}" --seed 1 --base-url http://127.0.0.1:8300 --json "$WORK/low_colocated.json"
    # The proxy's own overhead on this (quiet, fast) host: 1-token requests straight to the
    # node and through a proxy in front of it (decode node alone: --prefill-fallback), in turn.
    $PY -m proxy serve --decode http://127.0.0.1:8300 --prefill-fallback --port 8301 >"$WORK/proxy_solo.log" 2>&1 &
    PIDS+=($!)
    if wait_up http://127.0.0.1:8301 "${PIDS[-1]}"; then
      step "proxy overhead" 60 20 $PY scripts/bench_proxy_ab.py --node http://127.0.0.1:8300 --proxy http://127.0.0.1:8301 -n "$OVERHEAD_N" --json "$WORK/proxy_overhead.json"
    else
      record "proxy overhead" start
    fi
  else
    say "colocated node did not start (see node.log)"; record "serve colocated" start
  fi
  cleanup
  publish
elif selected colocated; then
  record "serve colocated" budget
fi

# 4. HTTP: P/D through the proxy, P and D on the same GPU; a second prefill node with the
# pipelined push (--kv-layer-group-size 4) behind a second proxy, same decode node.
if selected pd && need_model && [ "$(left)" -ge 90 ]; then
  say "P/D"
  $PY -m prefill_node --model "$MODEL" "${PD_NODE[@]}" --port 8100 --kv-connector nixl >"$WORK/prefill.log" 2>&1 &
  PIDS+=($!); P_PID=$!
  $PY -m prefill_node --model "$MODEL" "${PD_NODE[@]}" --port 8101 --kv-connector nixl --kv-layer-group-size 4 >"$WORK/prefill_pipelined.log" 2>&1 &
  PIDS+=($!); P2_PID=$!
  $PY -m decode_node --model "$MODEL" "${PD_NODE[@]}" --port 8200 --kv-connector nixl >"$WORK/decode.log" 2>&1 &
  PIDS+=($!); D_PID=$!
  $PY -m proxy serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 >"$WORK/proxy.log" 2>&1 &
  PIDS+=($!); X_PID=$!
  $PY -m proxy serve --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8200 --port 8001 >"$WORK/proxy_pipelined.log" 2>&1 &
  PIDS+=($!); X2_PID=$!
  if wait_up http://127.0.0.1:8100 $P_PID && wait_up http://127.0.0.1:8200 $D_PID && wait_up http://127.0.0.1:8000 $X_PID; then
    step "serve P/D" 150 40 "${S[@]}" --base-url http://127.0.0.1:8000 --json "$WORK/serve_pd.json" --plot "$WORK/serve_pd.png"
    step "low load P/D" 90 30 "${S[@]}" "${LOW[@]}" --seed 2 --base-url http://127.0.0.1:8000 --json "$WORK/low_pd.json"
    curl -s http://127.0.0.1:8100/metrics >"$WORK/prefill_metrics.txt" 2>/dev/null
    if wait_up http://127.0.0.1:8101 $P2_PID && wait_up http://127.0.0.1:8001 $X2_PID; then
      step "low load P/D pipelined" 90 30 "${S[@]}" "${LOW[@]}" --seed 3 --base-url http://127.0.0.1:8001 --json "$WORK/low_pd_pipelined.json"
      curl -s http://127.0.0.1:8101/metrics >"$WORK/prefill_pipelined_metrics.txt" 2>/dev/null
    else
      record "low load P/D pipelined" start
    fi
    curl -s http://127.0.0.1:8200/metrics >"$WORK/decode_metrics.txt" 2>/dev/null
  else
    say "P/D did not start (see prefill.log, decode.log, proxy.log)"; record "serve P/D" start
  fi
  cleanup
  publish
elif selected pd; then
  record "serve P/D" budget
fi

# 5. Correctness of the engine on the GPU (transformers, graphs vs eager, the reference
# backend with chunks/prefix hits/preemption, P/D over NIXL in VRAM).
if [ "$SMOKE" != 1 ] && selected gpu-tests; then
  step "pytest gpu" 240 60 $PY -m pytest -q -p no:cacheprovider --junitxml "$WORK/pytest_gpu.xml" tests/test_gpu.py
fi

# 6. The remaining offline rows, the profile and the KV push.
if selected prefill; then
  need_model
  step "offline prefill" 120 30 "${B[@]}" "${PRE[@]}" --json "$WORK/offline_prefill.json"
fi
if selected eager; then
  need_model
  step "offline latency eager" 90 30 "${B[@]}" "${LAT[@]}" --enforce-eager --json "$WORK/offline_latency_eager.json"
fi
# The small per-layer ops (RMSNorm + residual, rotary, SiLU-and-multiply) as our Triton
# kernels (PDSERVE_MODEL_OPS=triton, opt-in until measured; engine/model/ops/) instead of
# torch ops: the offline rows again, and the engine's gpu tests on them, same run.
if selected triton-ops; then
  need_model
  step "offline latency triton ops" 90 30 env PDSERVE_MODEL_OPS=triton "${B[@]}" "${LAT[@]}" --json "$WORK/offline_latency_triton_ops.json"
  step "offline throughput triton ops" 120 40 env PDSERVE_MODEL_OPS=triton "${B[@]}" "${THR[@]}" --json "$WORK/offline_throughput_triton_ops.json"
  step "offline latency eager triton ops" 90 30 env PDSERVE_MODEL_OPS=triton "${B[@]}" "${LAT[@]}" --enforce-eager --json "$WORK/offline_latency_eager_triton_ops.json"
  if [ "$SMOKE" != 1 ]; then
    step "pytest gpu triton ops" 150 40 env PDSERVE_MODEL_OPS=triton $PY -m pytest -q -p no:cacheprovider --junitxml "$WORK/pytest_gpu_triton_ops.xml" tests/test_gpu.py -k "fp32_greedy or bf16_triton or cuda_graph_decode or chunks_prefix"
  fi
fi
if selected executor; then  # the offline default at TP 1 is in-process (uni): the pipes' cost
  need_model
  step "offline latency mp" 90 30 "${B[@]}" "${LAT[@]}" --distributed-executor-backend mp --json "$WORK/offline_latency_mp.json"
fi
if selected profile; then
  need_model
  step "profile" 120 30 $PY scripts/profile_step.py --model "$MODEL" "${PROF[@]}" --trace "$WORK/trace" --json "$WORK/profile.json"
fi
# KV push P->D: the connector path vs raw NIXL vs a device-to-device copy, same bytes.
selected transfer && step "transfer" 150 40 $PY -m engine.bench transfer "${XFER[@]}" --json "$WORK/transfer.json"

# Constrained decoding (each request its own JSON schema, llguidance): the same batch on
# an engine with --no-async-scheduling and one with async scheduling (the default: the
# masks sent while the forward runs).
# Late: no target of the issues rests on it, and it starts two engines.
if selected structured; then
  if [ -n "$STRUCTURED_SKIP" ]; then
    $PY -c 'import json, sys; json.dump({"skipped": sys.argv[1]}, open(sys.argv[2], "w"))' \
      "$STRUCTURED_SKIP" "$WORK/offline_structured.json"
    record "offline structured json" skipped
    publish
  else
    need_model
    step "offline structured json" 150 60 "${B[@]}" "${STRUCT[@]}" --structured json --json "$WORK/offline_structured.json"
  fi
fi

# 7. Last (longest, least needed): TP ranks sharing the GPU over gloo (P/D 2->2, 1->2, 2->1
# in VRAM) and, on a host with more GPUs, P and D on different ones; on CPU (SMOKE) only its
# placement tests run, the others skip with reasons.
selected multi-gpu && step "pytest multi-gpu" 420 30 $PY -m pytest -q -rs -p no:cacheprovider --junitxml "$WORK/pytest_multi_gpu.xml" tests/test_multi_gpu.py

# 8. Summary (also on stdout: the device tool's output tail).
publish
cat "$OUT/summary.md"
echo
echo "steps:"; cat "$OUT/steps.txt"
echo "(${SECONDS}s of ${BUDGET}s; files in $OUT: $(ls "$OUT" | tr '\n' ' '))"
