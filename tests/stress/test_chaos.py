"""The chaos suite's short form (issue 9), run by CI: ``tests/stress/chaos_suite.py`` with
fewer requests on 2 prefill + 2 decode nodes (TP=2) behind the proxy, in two rounds.

Round 1 injects every fault once (client aborts and reused request ids throughout, SIGKILL
of p1 and of d1 mid-push, both restarted on their ports, SIGKILL of a TP worker of d1 and
SIGTERM drain of p1 under load, each followed by a restart, SIGSTOP/SIGCONT of a TP worker
of p2 and d2, side-channel bursts). Round 2 injects only what leaves every node running
(aborts, reused ids, SIGSTOP, side-channel bursts). The resident memory of p2, d2 and the
proxy, which run through both rounds, is compared between them.

``CHAOS_SHORT_ASYNC=1`` runs it with every node (the reference too) started with
``--async-scheduling`` (and ``PDSERVE_DEFER_READBACK=1``, outputs held as on CUDA) and a
quarter of the requests with a structured output (their grammar masks follow each step on
rank 0's pipe): opt-in, CI runs the nodes' default (async scheduling, a step's output
sent at once on CPU), a tenth of its requests structured. ``CHAOS_SHORT_SYNC=1`` (opt-in)
starts every node with ``--no-async-scheduling``.
Either way some requests are asked as `POST /v1/responses` (`--responses-rate`).
``CHAOS_SHORT_TENANTS=N`` (opt-in) adds N tenants (``--tenants``: salts, cache keys,
``--routing prefix`` and the tenant isolation check).

Asserts 0 hung, 0 broken, 0 wrong, 0 leaked, no valid request answered with a 4xx, flat memory, and that every fault was
injected as planned. The summary table is printed; ``CHAOS_JSON=path`` also writes it as
JSON. The long form is ``scripts/chaos.sh``.
"""

from __future__ import annotations

import os

import pytest
from chaos_config import DEFER_READBACK_ENV, FAULTS, ChaosConfig
from chaos_report import failures, format_table
from chaos_suite import run_chaos

pytest.importorskip("nixl._api")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RESTARTS = ("kill_prefill", "kill_decode", "kill_worker", "drain")


def test_chaos_short_form(tmp_path):
    # A tenth of the requests with a structured output: the grammar path under the faults.
    extra: dict = {"structured_rate": 0.1, "responses_rate": 0.15}
    if os.environ.get("CHAOS_SHORT_ASYNC") == "1":
        pytest.importorskip("llguidance")
        extra = {
            "node_args": ("--async-scheduling",),
            "node_env": {DEFER_READBACK_ENV: "1"},
            "structured_rate": 0.25,
            "responses_rate": 0.15,
        }
    elif os.environ.get("CHAOS_SHORT_SYNC") == "1":
        extra["node_args"] = ("--no-async-scheduling",)
    # Opt-in: tenants (cache_salt, prompt_cache_key, --routing prefix, the isolation
    # check). Off in CI: on this short form's 12 prompts key affinity keeps every key on
    # the node that never restarts, so kill_worker and drain met no load on d1 and p1.
    extra["tenants"] = int(os.environ.get("CHAOS_SHORT_TENANTS", "0"))
    cfg = ChaosConfig(
        requests=int(os.environ.get("CHAOS_SHORT_REQUESTS", "32")),  # ~110 s on 2 cores
        rounds=2,
        faults=FAULTS,
        later_round_faults=tuple(f for f in FAULTS if f not in RESTARTS),
        num_prompts=12,
        max_tokens=(4, 16),
        long_bytes=(200, 700),
        json_path=os.environ.get("CHAOS_JSON") or str(tmp_path / "chaos.json"),
        **extra,
    )
    summary = run_chaos(cfg, tmp_path)
    print(format_table(summary))
    want = {f: 1 for f in RESTARTS} | {"side_channel": 4, "stop_worker": 2}
    assert summary["faults"] == want, summary["fault_log"]
    assert summary["client_abort_planned"] and summary["reused_ids"], summary
    assert summary["structured"] and summary["responses"], summary
    if cfg.tenants:
        assert summary["tenants"]["checked"], summary["tenants"]
    assert {"p2", "d2", "proxy"} <= set(summary["rss_growth"]), summary["rounds"]
    assert not failures(summary), "\n".join(failures(summary))
