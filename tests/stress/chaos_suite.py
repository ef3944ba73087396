"""The chaos suite (issue 9): a bounded greedy workload through ``pd-proxy serve`` against
two prefill and two decode nodes (TP=2, NIXL over UCX, loopback) while faults are injected.

Every request of the workload has a reference answer from a colocated node with the same
model and TP (greedy, ``ignore_eos``; computed after each round, while that node idled
through the chaos), so every answer is checked token for token and by its text. The workload mixes prompt lengths (short, medium, long; long ones
share prefixes, so decode nodes hit their prefix cache and ask P for the rest only),
completions and chat, streamed and not, at a fixed concurrency; 20% of the clients leave
at a random point, and some requests reuse one ``X-Request-Id`` at the same time.

Faults (``FAULTS``; each is injected once per wave, when the wave has issued a fixed share
of its requests -- counted in requests, never in seconds; a wave keeps issuing until every
fault is in, so each one meets load however slow the machine):

* ``kill_prefill``   SIGKILL of a prefill node (engine and workers), restarted on the
                     same HTTP and side-channel ports (a new incarnation).
* ``kill_decode``    the same for a decode node, right when a burst of long prompts is
                     being pushed to it (the interrupted transfer: peer killed mid-WRITE).
* ``kill_worker``    SIGKILL of one TP worker; the node turns unhealthy, is stopped with
                     SIGTERM and restarted.
* ``stop_worker``    SIGSTOP of one TP worker for longer than ``--kv-transfer-timeout``,
                     then SIGCONT.
* ``drain``          SIGTERM of a node under load (it drains, must exit 0), restarted.
* ``side_channel``   a burst of malformed, forged and replayed side-channel messages to
                     every node (``fuzz_messages``).
* ``kill_engine``    (opt-in: only when ``--faults`` names it) SIGKILL of a node's engine
                     process alone, as an OOM kill would: its TP workers and fork server
                     must exit by themselves within ``ORPHAN_GRACE_S`` (under async
                     scheduling rank 0 may be waiting for a step's grammar masks); then
                     it is restarted.

Client aborts and reused request ids are part of every request mix (``--abort-rate``,
``--reuse-rate``).

Other node set-ups: ``--node-arg=--FLAG`` (repeatable) and ``--node-env NAME=VALUE`` give
every node, the colocated reference included, an extra flag or environment variable;
``--async-scheduling`` is ``--node-arg=--async-scheduling`` (the nodes' default) with
``--node-env PDSERVE_DEFER_READBACK=1`` (a worker holds a step's output until the next
step is launched, as on CUDA); ``--node-arg=--no-async-scheduling`` runs every node
synchronously. ``--structured-rate R`` gives a share R of the requests a
structured output (``STRUCTURED``: two regexes, a ``guided_choice``, a JSON schema;
greedy, so the reference is deterministic; nodes need llguidance); under async
scheduling such a request's step goes to the workers with ``sampling_deferred`` and its
grammar masks follow on rank 0's task pipe, so a fault can meet rank 0 waiting for them
(``--kill-worker-rank 0`` makes ``kill_worker`` hit that rank; ``stop_worker`` stops
rank 0 by default). A completed structured answer must also keep to its grammar.
``--plain-reference`` starts the reference without those flags and variables and with
``--no-async-scheduling``, so the nodes (async scheduling is the default) are checked
against a synchronous reference (greedy answers are the same).
``--responses-rate R`` asks a share R of the requests as ``POST /v1/responses`` (a chat
conversation, its JSON schema as ``text.format``; ``chaos_responses.py``): checked
against the chat reference by text (the Responses API gives no token ids), a stream's
deltas against its final response object.

By default (``ChaosConfig.victims``) the faults that restart a node hit ``p1`` and ``d1``;
``p2`` and ``d2`` get the SIGSTOPs, so they (and the proxy) survive every round. Resident
memory (VmRSS of each process tree, after the round, once idle) is compared between the
last two rounds for every process that lived through both.

The nodes sign their side channel with a random ``--kv-secret`` (``--unsigned``: none);
the bursts sign most messages as a confused peer holding the secret would, so the schema
and state checks behind the signature are reached, and add unsigned, wrongly signed,
tampered, stale and byte-for-byte replayed envelopes, which must all be refused.

After each round, once every deadline has passed, the suite checks every node: KV pool
full, no request running or waiting, no transfer in flight, no held blocks, no early
reservation, no load waiting, no quarantine, no admitted request; and the proxy: nothing
in flight, nothing outstanding. It then measures each process tree's resident memory.

Outcomes of a request: ``completed`` (200 and a finish reason, or a stream that ended with
one and ``[DONE]``), ``errored`` (a clear error: an OpenAI error body with a non-200
status, or a stream that ended with an error event and ``[DONE]``), ``aborted`` (the client
left as planned), ``hung`` (no end within the request's deadline) and ``broken`` (an end
that is neither: a stream cut without ``[DONE]``, a 200 that is not JSON, a non-200
without an error body). ``wrong`` counts completed answers that differ from the reference
and partial answers (errored or aborted streams) whose tokens are not a prefix of it.

``--tenants N`` makes the workload multi-tenant: every request is one of N tenants', with
its tenant's ``cache_salt`` (the tenants send the same prompts, so without the salts they
would share prefix-cache blocks) and its conversation's ``prompt_cache_key`` (a tenant's
long prompts after one shared prefix are one conversation; every other prompt its own);
nodes run with ``--enable-prompt-tokens-details`` and the proxy with ``--routing prefix``
(key affinity and salted routing keys under the faults). Besides the usual checks (a salt
never changes an answer), no answer's ``usage`` may report more cached prompt tokens than
its own tenant's requests sent before it ended share with it in whole blocks
(``check_isolation``); ``--tenants-unsalted`` leaves the salts out, a negative control the
isolation check should fail.

Run it with ``python tests/stress/chaos_suite.py --help`` (the long form is
``scripts/chaos.sh``); the short form is ``tests/stress/test_chaos.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TESTS), str(_TESTS.parent)]  # harness, and the repository's packages

from chaos_config import DEFER_READBACK_ENV, FAULTS, KNOWN_FAULTS, OPT_IN_FAULTS, ChaosConfig
from chaos_report import failures, format_table
from chaos_run import ChaosRun


def run_chaos(cfg: ChaosConfig, tmp: Path) -> dict[str, Any]:
    """Runs the suite in ``tmp`` (node logs land there); always stops what it started."""
    run = ChaosRun(cfg, tmp)
    summary: dict[str, Any] | None = None
    try:
        summary = run.execute()
    finally:
        try:
            run.cluster.stop_all()
        finally:
            if summary is None and run.rounds:  # a crash mid-way: keep what was measured
                with contextlib.suppress(Exception):
                    summary = run.summary()
            if summary is not None:
                summary["logs"] = str(tmp)
                summary["failures"] = failures(summary)
                if cfg.json_path:
                    Path(cfg.json_path).write_text(json.dumps(summary, indent=1, default=str))
    assert summary is not None
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    env = os.environ.get
    ap.add_argument(
        "--requests",
        type=int,
        default=int(env("CHAOS_REQUESTS", "300")),
        help="requests per round, at least (env CHAOS_REQUESTS; default 300)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=int(env("CHAOS_ROUNDS", "2")),
        help="rounds; resident memory is compared between the last two (env CHAOS_ROUNDS)",
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=float(env("CHAOS_DURATION_S", "1200")),
        help="minimum seconds of workload, split over the rounds: a round keeps "
        "issuing waves until its share passed (env CHAOS_DURATION_S; default 1200)",
    )
    ap.add_argument(
        "--wave",
        type=int,
        default=int(env("CHAOS_WAVE", "100")),
        help="requests per wave; every fault is injected once per wave (env CHAOS_WAVE)",
    )
    ap.add_argument(
        "--tp",
        default=env("CHAOS_TP", "2,2,2,2"),
        help="TP of p1,p2,d1,d2 (env CHAOS_TP; default 2,2,2,2; the reference node "
        "takes d1's; unequal TP pairs through the connector's heterogeneous TP)",
    )
    ap.add_argument("--concurrency", type=int, default=int(env("CHAOS_CONCURRENCY", "32")))
    ap.add_argument(
        "--faults",
        default=env("CHAOS_FAULTS", ",".join(FAULTS)),
        help=f"comma-separated subset of {','.join(KNOWN_FAULTS)} (default: all but "
        f"{','.join(OPT_IN_FAULTS)}) (env CHAOS_FAULTS)",
    )
    ap.add_argument(
        "--last-round-faults",
        default=env("CHAOS_LAST_ROUND_FAULTS"),
        help="faults of the last round, if not --faults (env CHAOS_LAST_ROUND_FAULTS)",
    )
    ap.add_argument("--abort-rate", type=float, default=float(env("CHAOS_ABORT_RATE", "0.2")))
    ap.add_argument("--reuse-rate", type=float, default=float(env("CHAOS_REUSE_RATE", "0.1")))
    ap.add_argument("--seed", type=int, default=int(env("CHAOS_SEED", "0")))
    ap.add_argument(
        "--kv-transfer-timeout", type=float, default=float(env("CHAOS_KV_TIMEOUT", "3"))
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=float(env("CHAOS_DEADLINE_S", "180")),
        help="seconds after which a request that has not ended counts as hung",
    )
    ap.add_argument(
        "--unsigned",
        action="store_true",
        default=env("CHAOS_UNSIGNED") == "1",
        help="nodes without --kv-secret (default: a random secret for the run)",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        default=env("CHAOS_ASYNC") == "1",
        help="every node (the reference too) with --async-scheduling (the nodes' "
        f"default), and {DEFER_READBACK_ENV}=1: workers hold a step's output until the "
        "next step is launched, as on CUDA (env CHAOS_ASYNC=1)",
    )
    ap.add_argument(
        "--node-arg",
        action="append",
        default=env("CHAOS_NODE_ARGS", "").split(),
        metavar="FLAG",
        help="an extra flag of every node, the reference too; repeatable; write it "
        "--node-arg=--flag (env CHAOS_NODE_ARGS, space-separated)",
    )
    ap.add_argument(
        "--node-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of every node, the reference too; repeatable",
    )
    ap.add_argument(
        "--plain-reference",
        action="store_true",
        default=env("CHAOS_PLAIN_REFERENCE") == "1",
        help="the colocated reference without --node-arg, --node-env and "
        "--async-scheduling, with --no-async-scheduling (the nodes checked against a "
        "synchronous reference; greedy answers are the same) (env CHAOS_PLAIN_REFERENCE=1)",
    )
    ap.add_argument(
        "--kill-worker-rank",
        type=int,
        default=int(env("CHAOS_KILL_WORKER_RANK", "-1")),
        help="the TP rank kill_worker SIGKILLs (default -1: the last; rank 0 samples and "
        "waits for the grammar masks under async scheduling) (env CHAOS_KILL_WORKER_RANK)",
    )
    ap.add_argument(
        "--stop-worker-rank",
        type=int,
        default=int(env("CHAOS_STOP_WORKER_RANK", "0")),
        help="the TP rank stop_worker SIGSTOPs (default 0; -1: the last) "
        "(env CHAOS_STOP_WORKER_RANK)",
    )
    ap.add_argument(
        "--structured-rate",
        type=float,
        default=float(env("CHAOS_STRUCTURED_RATE", "0")),
        help="share of requests with a structured output (a regex, a choice or a JSON "
        "schema; nodes need llguidance) (env CHAOS_STRUCTURED_RATE; default 0)",
    )
    ap.add_argument(
        "--responses-rate",
        type=float,
        default=float(env("CHAOS_RESPONSES_RATE", "0")),
        help="share of requests asked as POST /v1/responses (a chat conversation; checked "
        "against the chat reference by its text) (env CHAOS_RESPONSES_RATE; default 0)",
    )
    ap.add_argument(
        "--tenants",
        type=int,
        default=int(env("CHAOS_TENANTS", "0")),
        help="tenants sharing the prompt pool (0: none): each request gets its tenant's "
        "cache_salt and its conversation's prompt_cache_key; nodes run with "
        "--enable-prompt-tokens-details, the proxy with --routing prefix, and no answer's "
        "cached_tokens may exceed what its own tenant could have cached (env CHAOS_TENANTS)",
    )
    ap.add_argument(
        "--tenants-unsalted",
        action="store_true",
        default=env("CHAOS_TENANTS_UNSALTED") == "1",
        help="the isolation check's negative control: --tenants without sending the salts "
        "(tenants share the cache; the check should fail) (env CHAOS_TENANTS_UNSALTED=1)",
    )
    ap.add_argument(
        "--json", default=env("CHAOS_JSON"), help="write the summary here (env CHAOS_JSON)"
    )
    ap.add_argument(
        "--logs-dir",
        default=env("CHAOS_LOGS_DIR"),
        help="keep the node logs here (default: a temporary directory, removed)",
    )
    a = ap.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f)
    last = tuple(f for f in a.last_round_faults.split(",") if f) if a.last_round_faults else None
    try:
        tp = tuple(int(x) for x in a.tp.split(","))
        assert len(tp) == 4 and all(t >= 1 for t in tp)
    except (ValueError, AssertionError):
        ap.error(f"--tp: four sizes >= 1 (p1,p2,d1,d2), got {a.tp!r}")
    unknown = (set(faults) | set(last or ())) - set(KNOWN_FAULTS)
    if unknown:
        ap.error(f"--faults: unknown {sorted(unknown)}; known: {','.join(KNOWN_FAULTS)}")
    node_args = list(a.node_arg)
    node_env = {}
    for kv in a.node_env:
        name, eq, value = kv.partition("=")
        if not eq or not name:
            ap.error(f"--node-env: NAME=VALUE, got {kv!r}")
        node_env[name] = value
    if a.async_scheduling:
        node_args += [] if "--async-scheduling" in node_args else ["--async-scheduling"]
        node_env.setdefault(DEFER_READBACK_ENV, "1")
    for name, share in (("structured", a.structured_rate), ("responses", a.responses_rate)):
        if not 0 <= share <= 1:
            ap.error(f"--{name}-rate: a share in [0, 1], got {share}")
    if a.tenants < 0 or (a.tenants_unsalted and a.tenants < 2):
        ap.error("--tenants: 0 (none) or more; --tenants-unsalted needs 2 or more")
    cfg = ChaosConfig(
        requests=a.requests,
        rounds=a.rounds,
        wave=a.wave,
        min_round_s=a.duration / max(1, a.rounds),
        concurrency=a.concurrency,
        faults=faults,
        last_round_faults=last,
        abort_rate=a.abort_rate,
        reuse_rate=a.reuse_rate,
        seed=a.seed,
        kv_transfer_timeout=a.kv_transfer_timeout,
        deadline_s=a.deadline,
        json_path=a.json,
        tp=tp,
        node_args=tuple(node_args),
        node_env=node_env,
        structured_rate=a.structured_rate,
        responses_rate=a.responses_rate,
        kill_worker_rank=a.kill_worker_rank,
        plain_reference=a.plain_reference,
        stop_worker_rank=a.stop_worker_rank,
        tenants=a.tenants,
        tenant_unsalted=a.tenants_unsalted,
    )
    if a.unsigned:
        cfg.kv_secret = ""
    if a.logs_dir:
        Path(a.logs_dir).mkdir(parents=True, exist_ok=True)
        summary = run_chaos(cfg, Path(a.logs_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
            summary = run_chaos(cfg, Path(tmp))
    print(format_table(summary))
    for f in summary["failures"]:
        print("FAIL:", f)
    if a.json:
        print(f"summary written to {a.json}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
