#!/usr/bin/env bash
# The chaos suite's long form (issue 9; docs/reliability.md, "Chaos suite").
#
# 2 prefill + 2 decode nodes (TP=2, NIXL over UCX, loopback, tiny model) behind pd-proxy,
# a colocated node for the reference answers, and a workload of greedy requests (mixed
# prompt lengths, completions and chat, streamed and not, concurrency 32, 20% client
# aborts, reused X-Request-Id values) while every fault is injected once per wave:
# SIGKILL of a prefill node and of a decode node mid-push (both restarted on their ports),
# SIGKILL and SIGSTOP/SIGCONT of a TP worker, SIGTERM drain under load (then a restart),
# bursts of malformed, forged and replayed side-channel messages. Asserts 0 hung, 0 broken,
# 0 wrong, 0 leaked, no valid request answered with a 4xx, survivors' resident memory flat across the last two rounds; prints the
# summary table; exits 1 if any of that failed.
#
# Usage: bash scripts/chaos.sh [extra flags of tests/stress/chaos_suite.py]
#
# Settings (environment; the flags of the same name win):
#   CHAOS_REQUESTS=300       requests per round, at least          (--requests)
#   CHAOS_ROUNDS=2           rounds                                (--rounds)
#   CHAOS_DURATION_S=1200    minimum seconds of workload, all rounds together (--duration)
#   CHAOS_WAVE=100           requests per wave; every fault once per wave (--wave)
#   CHAOS_CONCURRENCY=32     clients at once                       (--concurrency)
#   CHAOS_FAULTS=all         comma-separated subset of kill_prefill,kill_decode,kill_worker,
#                            stop_worker,drain,side_channel        (--faults); also
#                            kill_engine (opt-in: SIGKILL of an engine process alone, its
#                            workers must exit by themselves)
#   CHAOS_LAST_ROUND_FAULTS  faults of the last round, if not the same (--last-round-faults)
#   CHAOS_ABORT_RATE=0.2, CHAOS_REUSE_RATE=0.1, CHAOS_SEED=0, CHAOS_KV_TIMEOUT=3 (seconds,
#   every node's --kv-transfer-timeout), CHAOS_DEADLINE_S=180 (a request not ended by then
#   is hung), CHAOS_UNSIGNED=1 (nodes without --kv-secret; default: a random secret)
#   CHAOS_TP=2,2,2,2         TP of p1,p2,d1,d2 (unequal TP: the heterogeneous-TP connector)
#   CHAOS_ASYNC=1            every node (the reference too) with --async-scheduling (the
#                            nodes' default) and PDSERVE_DEFER_READBACK=1 (outputs read
#                            back late, as on CUDA)             (--async-scheduling)
#   CHAOS_NODE_ARGS="--f v"  extra flags of every node, the reference too (--node-arg=--f,
#                            repeatable; --node-env NAME=VALUE for the environment)
#   CHAOS_STRUCTURED_RATE=0  share of requests with a structured output (--structured-rate)
#   CHAOS_PLAIN_REFERENCE=1  the reference without those flags, with --no-async-scheduling
#                            (a synchronous reference)            (--plain-reference)
#   CHAOS_KILL_WORKER_RANK=-1, CHAOS_STOP_WORKER_RANK=0: the TP rank kill_worker and
#                            stop_worker hit (rank 0 waits for the grammar masks)
#   CHAOS_TENANTS=0          tenants (--tenants N): each request gets its tenant's cache_salt
#                            and its conversation's prompt_cache_key; nodes with
#                            --enable-prompt-tokens-details, the proxy with --routing prefix;
#                            no answer may report cached tokens only another tenant could
#                            have left (CHAOS_TENANTS_UNSALTED=1, --tenants-unsalted: no salt
#                            sent, a negative control that check must fail)
#   CHAOS_JSON=path          also write the summary as JSON there  (--json)
#   CHAOS_LOGS_DIR=dir       keep every process's log there (default: a temporary
#                            directory, removed at the end)        (--logs-dir)
#
# Examples:
#   bash scripts/chaos.sh                                   # >= 600 requests, >= 20 minutes
#   CHAOS_JSON=/tmp/chaos.json bash scripts/chaos.sh --duration 600
#   CHAOS_FAULTS=side_channel,stop_worker bash scripts/chaos.sh --requests 100 --duration 0
#   bash scripts/chaos.sh --async-scheduling --structured-rate 0.4 --kill-worker-rank 0 \
#       --plain-reference
#
# Everything it starts is stopped by PID when it ends, also on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${CHAOS_FAULTS:-all}" == "all" ]]; then
    unset CHAOS_FAULTS
fi
exec "${PYTHON:-python}" tests/stress/chaos_suite.py "$@"
