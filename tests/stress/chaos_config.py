"""The chaos suite's configuration: the faults it knows, the gauges that must read 0
once idle, the structured outputs of its workload, ``ChaosConfig`` and how a summary
shows it (``public_config``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from harness import (
    REPO_ROOT,
)

# engine.worker.model_runner's switch (not imported here: that would load torch).
DEFER_READBACK_ENV = "PDSERVE_DEFER_READBACK"
FAULTS = ("kill_prefill", "kill_decode", "kill_worker", "stop_worker", "drain", "side_channel")
# Injected only when named (``--faults``): not part of the default set (nor of CI's).
OPT_IN_FAULTS = ("kill_engine",)
KNOWN_FAULTS = FAULTS + OPT_IN_FAULTS
# How long a node's TP workers (and fork server) may outlive its SIGKILLed engine process.
ORPHAN_GRACE_S = 30.0
MIB = 1 << 20

# Gauges that must read 0 on every node once the deadlines passed (besides a full pool).
IDLE_GAUGES = (
    "pdserve_num_requests_running",
    "pdserve_num_requests_waiting",
    "pdserve_num_requests_admitted",
    "pdserve_engine_num_waiting_for_remote_kv",
    "pdserve_engine_num_held",
    "pdserve_engine_num_quarantined_blocks",
    "pdserve_engine_kv_transfers_in_flight",
    "pdserve_engine_kv_loads_waiting",
    "pdserve_engine_kv_quarantined_requests",
    "pdserve_engine_kv_held_for_send",
    "pdserve_engine_kv_reservations_waiting",
    "pdserve_kv_blocks_used",
    "vllm:kv_cache_usage_perc",
)
PROXY_IDLE_GAUGES = ("pdproxy_requests_inflight", "pdproxy_node_outstanding_requests")

# Structured outputs of the workload (``--structured-rate``), spelled as vLLM clients do.
# Greedy over ``tiny``'s byte tokens, so every answer is deterministic; some end by their
# grammar (finish "stop") before ``max_tokens``, some are cut by it. ``STRUCTURED_CHECKS``:
# whether an answer's text keeps to its grammar (``done``: the grammar ended it).
STRUCTURED: tuple[dict[str, Any], ...] = (
    {"structured_outputs": {"regex": "[a-z ]{6}"}},
    {"structured_outputs": {"regex": "[a-z ]{40}"}},
    {"guided_choice": ["red river", "blue sky over the lake", "green forest"]},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "chaos",
                "schema": {
                    "type": "object",
                    "properties": {"c": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
                    "required": ["c", "ok"],
                    "additionalProperties": False,
                },
            },
        }
    },
)


def _json_ok(text: str, done: bool) -> bool:
    if not done:
        return text.lstrip().startswith("{") or not text.strip()
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(v, dict)
        and set(v) == {"c", "ok"}
        and v["c"] in ("red", "blue")
        and isinstance(v["ok"], bool)
    )


STRUCTURED_CHECKS: tuple[Any, ...] = (
    lambda t, done: re.fullmatch("[a-z ]{6}" if done else "[a-z ]{0,6}", t) is not None,
    lambda t, done: re.fullmatch("[a-z ]{40}" if done else "[a-z ]{0,40}", t) is not None,
    lambda t, done: any(
        c == t if done else c.startswith(t) for c in STRUCTURED[2]["guided_choice"]
    ),
    _json_ok,
)

# A request shape, the key of its reference answer: (prompt, chat, max_tokens, structured:
# an index into STRUCTURED, -1 for none).
RefKey = tuple[int, bool, int, int]

# -- configuration --------------------------------------------------------------------------


@dataclass
class ChaosConfig:
    requests: int = 100  # per round (at least; a round also runs for min_round_s)
    rounds: int = 2
    wave: int = 0  # requests per wave (one injection of every fault); 0: the whole round
    min_round_s: float = 0.0  # a round keeps issuing waves until this much time passed
    concurrency: int = 32
    faults: tuple[str, ...] = FAULTS
    last_round_faults: tuple[str, ...] | None = None  # None: same as ``faults``
    later_round_faults: tuple[str, ...] | None = None  # rounds 2.. (None: same as ``faults``)
    # Who each fault hits: "a|b" alternates between waves (a in odd ones). The defaults
    # leave p2 and d2 running through every round (their memory is compared).
    victims: dict[str, str] = field(
        default_factory=lambda: {
            "kill_prefill": "p1",
            "kill_decode": "d1",
            "kill_worker": "d1|p1",
            "kill_engine": "d1|p1",
            "drain": "p1|d1",
            "stop_worker": "p2|d2",
        }
    )
    abort_rate: float = 0.2
    reuse_rate: float = 0.1
    seed: int = 0
    tp: tuple[int, int, int, int] = (2, 2, 2, 2)  # p1, p2, d1, d2 (the reference: d1's)
    kv_transfer_timeout: float = 3.0
    shutdown_timeout: float = 10.0
    num_blocks: int = 1024
    max_tokens: tuple[int, ...] = (4, 12, 24)
    num_prompts: int = 24
    long_bytes: tuple[int, int] = (300, 1400)  # long prompts: a 600-byte shared prefix + this
    deadline_s: float = 180.0  # a request not ended after this long is hung
    stop_s: float = 0.0  # SIGSTOP length; 0: kv_transfer_timeout + 2
    rss_slack_mib: float = 128.0
    rss_slack_ratio: float = 0.2
    kv_secret: str = field(default_factory=lambda: os.urandom(16).hex(), repr=False)  # "": unsigned
    json_path: str | None = None
    log_every_s: float = 30.0
    # Every node, the colocated reference included: extra flags (e.g. "--async-scheduling")
    # and environment (e.g. PDSERVE_DEFER_READBACK=1).
    node_args: tuple[str, ...] = ()
    node_env: dict[str, str] = field(default_factory=dict)
    structured_rate: float = 0.0  # share of requests with a structured output (STRUCTURED)
    # Share of requests asked as POST /v1/responses (chat's conversation; checked against
    # the chat's reference by text).
    responses_rate: float = 0.0
    # The TP rank kill_worker and stop_worker hit (-1: the last). Rank 0 samples: under
    # async scheduling it is the one waiting for a step's grammar masks.
    kill_worker_rank: int = -1
    stop_worker_rank: int = 0
    # The reference without node_args and node_env, with --no-async-scheduling (the
    # nodes against a synchronous reference); by default it gets them too.
    plain_reference: bool = False
    # Tenants (``--tenants``; 0: none): each request gets its tenant's ``cache_salt`` and
    # its conversation's ``prompt_cache_key``; every node runs with
    # --enable-prompt-tokens-details and the proxy with --routing prefix, and no answer's
    # ``cached_tokens`` may exceed what its own tenant's requests could have cached.
    tenants: int = 0
    # The isolation check's negative control: tenants and their keys, but no salt sent
    # (tenants then share prefix-cache blocks: the check must fail).
    tenant_unsalted: bool = False
    block_size: int = 16  # the nodes' --block-size (the default): cached_tokens' unit

    def faults_for(self, round_no: int) -> tuple[str, ...]:
        if round_no == self.rounds and self.last_round_faults is not None:
            return self.last_round_faults
        if round_no > 1 and self.later_round_faults is not None:
            return self.later_round_faults
        return self.faults

    def victim(self, fault: str, round_no: int, wave_no: int) -> str:
        names = self.victims[fault].split("|")
        return names[(round_no + wave_no) % len(names)]


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Flags and environment variables whose values are credentials: hidden in the summary.
_SECRET_FLAGS = ("--api-key", "--kv-secret", "--hf-token")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)


def public_config(cfg: ChaosConfig) -> dict[str, Any]:
    """The run's configuration as the summary shows it (a summary is meant to be shared):
    no side-channel secret, and the values of credential flags and environment variables
    given with ``--node-arg`` / ``--node-env`` hidden."""
    shown = {k: v for k, v in asdict(cfg).items() if k not in ("json_path", "kv_secret")}
    args: list[str] = []
    for i, arg in enumerate(cfg.node_args):
        flag, eq, _ = arg.partition("=")
        if eq and flag in _SECRET_FLAGS:
            arg = f"{flag}=<hidden>"
        elif i and cfg.node_args[i - 1] in _SECRET_FLAGS:
            arg = "<hidden>"
        args.append(arg)
    shown["node_args"] = args
    shown["node_env"] = {
        k: "<hidden>" if _SECRET_NAME.search(k) else v for k, v in cfg.node_env.items()
    }
    return shown


def git_commit() -> str:
    if os.environ.get("CHAOS_COMMIT"):  # a run from an exported tree (no .git)
        return os.environ["CHAOS_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out
