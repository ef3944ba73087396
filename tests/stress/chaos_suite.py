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
``--async-scheduling`` is ``--node-arg=--async-scheduling`` with
``--node-env PDSERVE_DEFER_READBACK=1`` (a worker holds a step's output until the next
step is launched, as on CUDA). ``--structured-rate R`` gives a share R of the requests a
structured output (``STRUCTURED``: two regexes, a ``guided_choice``, a JSON schema;
greedy, so the reference is deterministic; nodes need llguidance); under async
scheduling such a request's step goes to the workers with ``sampling_deferred`` and its
grammar masks follow on rank 0's task pipe, so a fault can meet rank 0 waiting for them
(``--kill-worker-rank 0`` makes ``kill_worker`` hit that rank; ``stop_worker`` stops
rank 0 by default). A completed structured answer must also keep to its grammar.
``--plain-reference`` starts the reference without those flags and variables, so async
nodes are checked against a synchronous reference (greedy answers are the same).

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

Run it with ``python tests/stress/chaos_suite.py --help`` (the long form is
``scripts/chaos.sh``); the short form is ``tests/stress/test_chaos.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq
from prometheus_client.parser import text_string_to_metric_families

_TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TESTS), str(_TESTS.parent)]  # harness, and the repository's packages

from harness import (  # noqa: E402
    GREEDY,
    MODEL,
    REPO_ROOT,
    Proc,
    descendants,
    free_port,
    spawn,
    wait_gone,
    wait_healthy,
    worker_pids,
)

from kvconnector.nixl.side_channel import _request_mac  # noqa: E402

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
    # The TP rank kill_worker and stop_worker hit (-1: the last). Rank 0 samples: under
    # async scheduling it is the one waiting for a step's grammar masks.
    kill_worker_rank: int = -1
    stop_worker_rank: int = 0
    # The reference without node_args and node_env (async nodes against a synchronous
    # reference, say); by default it gets them too.
    plain_reference: bool = False

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


# -- metrics and memory ---------------------------------------------------------------------


def scrape(url: str, timeout: float = 10) -> dict[str, float]:
    """Every sample of a ``/metrics`` page, summed over labels, by sample name."""
    text = httpx.get(url + "/metrics", timeout=timeout).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process (/proc/<pid>/status, VmRSS); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


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


# -- the cluster ----------------------------------------------------------------------------


class Node:
    """One node on fixed ports; every start is a new incarnation (``proc``)."""

    def __init__(
        self, name: str, module: str, args: list[str], tmp: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.module, self.args, self.tmp, self.env = name, module, args, tmp, env
        self.port = free_port()
        self.sc_port = free_port() if "--kv-connector" in args else 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.starts = 0
        self.lock = threading.Lock()  # one fault at a time on a node
        self.exits: list[dict[str, Any]] = []

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.sc_port:
            cmd += ["--side-channel-port", str(self.sc_port), "--engine-id", self.name]
        return cmd + self.args

    def spawn(self) -> Proc:
        self.starts += 1
        self.proc = spawn(
            f"{self.name}.{self.starts}", self.command(), self.url, self.tmp, self.env
        )
        return self.proc

    def start(self, timeout: float = 300) -> None:
        self.spawn()
        wait_healthy(self.proc, timeout=timeout)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill9()
        self.exits.append({"incarnation": self.starts, "how": "SIGKILL", "code": -9})

    def sigterm_and_wait(self, timeout: float, signal_sent: bool = False) -> dict[str, Any]:
        """SIGTERM (unless ``signal_sent``); waits up to ``timeout`` for the exit (then
        SIGKILLs the tree); what happened."""
        assert self.proc is not None
        kids = descendants(self.pid)
        start = time.monotonic()
        if not signal_sent:
            self.proc.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.proc.wait(timeout)
            took = time.monotonic() - start
            stuck = wait_gone(kids, 10)  # its workers end after it
        except subprocess.TimeoutExpired:
            code, took, stuck = None, time.monotonic() - start, []
        if code is None or stuck:
            self.proc.kill9()
            for k in stuck:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)
        rec = {
            "incarnation": self.starts,
            "how": "SIGTERM",
            "code": code,
            "took_s": round(took, 1),
            "workers_left_behind": len(stuck),
        }
        self.exits.append(rec)
        return rec

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def logs(self, n: int = 3000) -> str:
        return self.proc.logs(n) if self.proc else ""


class Cluster:
    """2 P + 2 D (NIXL, TP ``cfg.tp``) and a proxy; a colocated node for the references."""

    def __init__(self, cfg: ChaosConfig, tmp: Path) -> None:
        self.cfg, self.tmp = cfg, tmp
        common = [
            "--model",
            MODEL,
            "--num-blocks",
            str(cfg.num_blocks),
            "--shutdown-timeout",
            str(cfg.shutdown_timeout),
            "--max-num-seqs",
            "32",
        ]
        nixl = [
            "--kv-connector",
            "nixl",
            "--kv-transfer-timeout",
            str(cfg.kv_transfer_timeout),
            "--peer-ping-interval",
            "0.5",
        ]
        # The secret travels in the environment (the flag would show in ps).
        env = {"PDSERVE_KV_SECRET": cfg.kv_secret}
        tp = dict(zip(("p1", "p2", "d1", "d2"), cfg.tp, strict=True))

        def node(name: str, module: str, *extra: str, plain: bool = False) -> Node:
            own = () if plain else cfg.node_args
            args = [*common, *own, "--tp", str(tp.get(name, tp["d1"])), *extra]
            node_env = {**({} if plain else cfg.node_env), **(env if extra else {})}
            return Node(name, module, args, tmp, node_env or None)

        self.prefill = [node(f"p{i}", "prefill_node", *nixl) for i in (1, 2)]
        self.decode = [node(f"d{i}", "decode_node", *nixl) for i in (1, 2)]
        self.reference = node("colocated", "decode_node", plain=cfg.plain_reference)
        self.proxy: Proc | None = None
        self.retired: list[Proc] = []

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefill, *self.decode]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self) -> None:
        for n in [*self.nodes, self.reference]:
            n.spawn()
        wait_healthy(*[n.proc for n in [*self.nodes, self.reference]], timeout=400)
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--port",
            str(port),
            "--health-interval",
            "0.5",
            "--max-retries",
            "2",
            "--request-timeout",
            "60",
            "--connect-timeout",
            "3",
            "--prefill",
            *[n.url for n in self.prefill],
            "--decode",
            *[n.url for n in self.decode],
        ]
        self.proxy = spawn("proxy", cmd, f"http://127.0.0.1:{port}", self.tmp)
        wait_healthy(self.proxy, timeout=60)

    def stop_reference(self) -> None:
        self.reference.stop()

    def stop_all(self) -> None:
        """Stops every process it started, by PID, all at once (each SIGTERM, then SIGKILL)."""
        errors: list[str] = []
        procs = [self.proxy, *[n.proc for n in self.nodes], self.reference.proc, *self.retired]

        def stop(p: Proc) -> None:
            try:
                for w in worker_pids(p.pid):  # a SIGSTOPped worker would never exit
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w, signal.SIGCONT)
                p.stop()
            except Exception as e:  # stop the rest, then report
                errors.append(f"{p.name}: {e!r}")

        threads = [threading.Thread(target=stop, args=(p,)) for p in procs if p is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("could not stop: " + "; ".join(errors))


# -- the workload ---------------------------------------------------------------------------


_TEXT = """
the of and to in is was for on that with as by at from his it an were are which this be
river game home place state number best great old large line public last right city court
stone road hill lake forest sea wind rain snow sun moon star sky cloud fire earth metal
wood glass paper cloth bread milk fruit seed tree flower grass leaf root branch animal
"""
WORDS = _TEXT.split()


def make_prompts(
    n: int, rng: random.Random, long_bytes: tuple[int, int] = (300, 1400)
) -> list[str]:
    """``n`` prompts: a third short (~10-60 bytes), a third medium (~150-400), a third long
    (~900-2000, the long ones share a 600-byte prefix in pairs: prefix-cache hits on D)."""

    def text(nbytes: int) -> str:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < nbytes:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    prompts = []
    shared = [text(600) for _ in range(max(1, n // 6))]
    for i in range(n):
        kind = i % 3
        if kind == 0:
            prompts.append(text(rng.randint(10, 60)))
        elif kind == 1:
            prompts.append(text(rng.randint(150, 400)))
        else:
            prompts.append(shared[(i // 3) % len(shared)] + " " + text(rng.randint(*long_bytes)))
    return prompts


@dataclass
class Spec:
    """One client request of the workload."""

    index: int
    round: int
    prompt: int  # index into the prompt pool
    chat: bool
    stream: bool
    max_tokens: int
    label: str
    abort: tuple[str, float] | None  # ("events", k) or ("after_s", t): the client leaves
    burst: bool = False  # part of a fault's long-prompt burst
    structured: int = -1  # an index into STRUCTURED; -1: none

    @property
    def ref_key(self) -> RefKey:
        return (self.prompt, self.chat, self.max_tokens, self.structured)


@dataclass
class Result:
    index: int
    round: int
    label: str
    chat: bool
    stream: bool
    max_tokens: int
    prompt_len: int
    planned_abort: str | None
    outcome: str = "pending"  # completed | errored | aborted | hung | broken
    status: int | None = None
    error: str | None = None
    tokens: int = 0
    wrong: bool = False
    wrong_detail: str | None = None
    elapsed_s: float = 0.0
    burst: bool = False
    ref_key: RefKey = (0, False, 0, -1)
    finish: str | None = None  # a completed answer's finish reason
    ids: list[int] = field(default_factory=list, repr=False)  # what the client got
    text: str = field(default="", repr=False)

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["ids"], d["text"] = d["ids"][:16], d["text"][:80]
        return d


def make_specs(
    cfg: ChaosConfig,
    rng: random.Random,
    round_no: int,
    start: int,
    n: int,
    num_prompts: int,
    long_only: bool = False,
) -> list[Spec]:
    specs = []
    for i in range(start, start + n):
        prompt = rng.randrange(num_prompts)
        if long_only:
            prompt = rng.choice([k for k in range(num_prompts) if k % 3 == 2])
        stream = rng.random() < 0.5
        abort = None
        if rng.random() < cfg.abort_rate:
            if stream and rng.random() < 0.6:
                abort = ("events", float(rng.randint(0, 6)))
            else:
                abort = ("after_s", round(rng.uniform(0.02, 2.0), 3))
        if rng.random() < cfg.reuse_rate:
            label = f"dup-{rng.randrange(3)}"
        else:
            label = f"chaos-r{round_no}-{i}"
        structured = -1
        if cfg.structured_rate > 0 and rng.random() < cfg.structured_rate:  # draws only then:
            structured = rng.randrange(len(STRUCTURED))  # a seed's plain workload stays
        specs.append(
            Spec(
                i,
                round_no,
                prompt,
                rng.random() < 0.15,
                stream,
                rng.choice(cfg.max_tokens),
                label,
                abort,
                burst=long_only,
                structured=structured,
            )
        )
    return specs


def body_of(spec: Spec, prompts: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": spec.max_tokens, **GREEDY}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": prompts[spec.prompt]}]
    else:
        body["prompt"] = prompts[spec.prompt]
    if spec.stream:
        body["stream"] = True
    if spec.structured >= 0:
        body.update(STRUCTURED[spec.structured])
    return body


def path_of(spec: Spec) -> str:
    return "/v1/chat/completions" if spec.chat else "/v1/completions"


def choice_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") or ""


def compute_references(
    url: str,
    keys: set[RefKey],
    prompts: list[str],
    refs: dict[RefKey, tuple[list[int], str]],
    concurrency: int = 8,
) -> None:
    """The colocated node's answer (token ids, text) of every request shape in ``keys``
    not in ``refs`` yet. Greedy answers do not depend on when they are computed, so this
    runs after a round (the reference node idles during the chaos)."""
    keys = sorted(set(keys) - set(refs))

    def one(key: RefKey) -> None:
        spec = Spec(0, 0, key[0], key[1], False, key[2], "chaos-ref", None, structured=key[3])
        resp = httpx.post(url + path_of(spec), json=body_of(spec, prompts), timeout=300)
        resp.raise_for_status()
        (choice,) = resp.json()["choices"]
        # ignore_eos: only a grammar ends an answer before max_tokens.
        ends = ("length", "stop") if key[3] >= 0 else ("length",)
        assert choice["finish_reason"] in ends, choice
        refs[key] = (list(choice["token_ids"]), choice_text(choice, key[1]))

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one, k) for k in keys]:
            f.result()


def run_request(proxy_url: str, spec: Spec, prompts: list[str], deadline_s: float) -> Result:
    r = Result(
        spec.index,
        spec.round,
        spec.label,
        spec.chat,
        spec.stream,
        spec.max_tokens,
        len(prompts[spec.prompt]),
        f"{spec.abort[0]}={spec.abort[1]}" if spec.abort else None,
        burst=spec.burst,
        ref_key=spec.ref_key,
    )
    start = time.monotonic()
    ids: list[int] = []
    text = ""
    leave_after_s = spec.abort[1] if spec.abort and spec.abort[0] == "after_s" else None
    leave_after_events = int(spec.abort[1]) if spec.abort and spec.abort[0] == "events" else None
    read_timeout = leave_after_s if leave_after_s is not None else deadline_s
    timeout = httpx.Timeout(read_timeout, connect=10, write=10, pool=10)
    headers = {"X-Request-Id": spec.label}
    url = proxy_url + path_of(spec)
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream("POST", url, json=body_of(spec, prompts), headers=headers) as resp,
        ):
            r.status = resp.status_code
            if not spec.stream or resp.status_code != 200:
                raw = _read_within(resp, start, leave_after_s, deadline_s)
                _classify_body(r, resp.status_code, raw, spec.chat, ids_out=ids)
                if r.outcome == "completed":
                    text = _json_text(raw, spec.chat)
            else:
                events = 0
                finish = None
                ended = False
                for line in resp.iter_lines():
                    if time.monotonic() - start > deadline_s:
                        r.outcome, r.error = "hung", f"stream still open after {deadline_s}s"
                        break
                    if leave_after_s is not None and time.monotonic() - start > leave_after_s:
                        r.outcome = "aborted"
                        break
                    if not line:
                        continue
                    if not line.startswith("data: "):
                        r.outcome, r.error = "broken", f"not an SSE data line: {line[:80]!r}"
                        break
                    data = line[6:]
                    if data == "[DONE]":
                        ended = True
                        break
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        r.outcome, r.error = "broken", f"event not JSON: {data[:80]!r}"
                        break
                    if "error" in ev:
                        r.outcome = "errored"
                        err = ev["error"] or {}
                        r.error = f"event {err.get('code')}: {str(err.get('message'))[:160]}"
                        continue  # [DONE] must follow
                    for c in ev.get("choices", []):
                        ids.extend(c.get("token_ids") or [])
                        text += choice_text(c, spec.chat)
                        finish = c.get("finish_reason") or finish
                    events += 1
                    if leave_after_events is not None and events >= leave_after_events:
                        r.outcome = "aborted"
                        break
                if r.outcome == "pending":
                    if not ended:
                        r.outcome, r.error = "broken", "stream ended without [DONE]"
                    elif finish in ("length", "stop"):
                        r.outcome, r.finish = "completed", finish
                    else:
                        r.outcome, r.error = "errored", f"stream finished with {finish!r}"
                elif r.outcome == "errored" and not ended:
                    r.outcome = "broken"
                    r.error = (r.error or "") + " (no [DONE] after the error event)"
    except httpx.TimeoutException as e:
        if leave_after_s is not None and time.monotonic() - start < deadline_s:
            r.outcome = "aborted"
        else:
            r.outcome, r.error = "hung", f"{type(e).__name__} after {time.monotonic() - start:.0f}s"
    except httpx.HTTPError as e:
        r.outcome, r.error = "broken", f"{type(e).__name__}: {e}"[:200]
    r.elapsed_s = round(time.monotonic() - start, 2)
    r.tokens = len(ids)
    r.ids, r.text = ids, text
    return r


def _read_within(
    resp: httpx.Response, start: float, leave_after_s: float | None, deadline_s: float
) -> bytes:
    chunks = []
    for chunk in resp.iter_bytes():
        chunks.append(chunk)
        if time.monotonic() - start > deadline_s:
            raise httpx.ReadTimeout("deadline")
    return b"".join(chunks)


def _json_text(raw: bytes, chat: bool) -> str:
    return choice_text(json.loads(raw)["choices"][0], chat)


def _classify_body(r: Result, status: int, raw: bytes, chat: bool, ids_out: list[int]) -> None:
    try:
        body = json.loads(raw)
    except ValueError:
        r.outcome, r.error = "broken", f"{status} body not JSON: {raw[:120]!r}"
        return
    if status != 200:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            r.outcome, r.error = (
                "errored",
                f"{status} {err.get('code')}: {str(err['message'])[:160]}",
            )
        else:
            r.outcome, r.error = "broken", f"{status} without an error body: {raw[:120]!r}"
        return
    try:
        (choice,) = body["choices"]
    except (KeyError, TypeError, ValueError):
        r.outcome, r.error = "broken", f"200 without one choice: {raw[:120]!r}"
        return
    ids_out.extend(choice.get("token_ids") or [])
    if choice.get("finish_reason") in ("length", "stop"):
        r.outcome, r.finish = "completed", choice["finish_reason"]
    else:
        r.outcome, r.error = "errored", f"200 finished with {choice.get('finish_reason')!r}"


def check_answer(r: Result, ref: tuple[list[int], str]) -> None:
    """Marks ``r`` wrong when its answer is not the reference's (or, for a partial answer,
    not the start of it)."""
    ids, text = r.ids, r.text
    ref_ids, ref_text = ref
    if r.outcome == "completed":
        if ids != ref_ids:
            r.wrong = True
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b),
                min(len(ids), len(ref_ids)),
            )
            r.wrong_detail = (
                f"tokens differ at {at}: got {ids[at : at + 6]} want {ref_ids[at : at + 6]} "
                f"(got {len(ids)} tokens, want {len(ref_ids)})"
            )
        elif text != ref_text:
            r.wrong = True
            r.wrong_detail = f"text differs: got {text[:60]!r} want {ref_text[:60]!r}"
        elif r.ref_key[3] >= 0 and not STRUCTURED_CHECKS[r.ref_key[3]](text, r.finish == "stop"):
            # The reference broke the grammar too: both nodes' masks went wrong the same way.
            r.wrong = True
            r.wrong_detail = (
                f"answer (the reference's too) breaks its structured output "
                f"{STRUCTURED[r.ref_key[3]]} (finish {r.finish!r}): {text[:60]!r}"
            )
    elif ids and ids != ref_ids[: len(ids)]:
        # A partial answer (error event, client left) must still be the reference's start.
        r.wrong = True
        r.wrong_detail = (
            f"partial answer is not a prefix of the reference: {ids[:8]} vs {ref_ids[:8]}"
        )


# -- side-channel fuzzing ---------------------------------------------------------------------


def _pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def sign(secret: bytes, msg: Any, *, ts: float | None = None, nonce: bytes | None = None) -> bytes:
    """A request envelope as a peer with ``secret`` sends it (``side_channel``'s format)."""
    body = _pack(msg)
    ts = time.time() if ts is None else ts
    nonce = os.urandom(16) if nonce is None else nonce
    mac = _request_mac(secret, ts, nonce, body)
    return _pack({"ts": ts, "n": nonce, "body": body, "mac": mac})


def _dealer_call(addr: str, frames: list[bytes], timeout: float = 3.0) -> Any:
    """Send ``frames`` on a fresh DEALER; the decoded reply (a signed one opened), or a
    string saying what happened."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            return "no-reply"
        reply = [f for f in sock.recv_multipart() if f]
        if not reply:
            return "empty-reply"
        try:
            out = msgpack.unpackb(reply[-1], raw=False)
            if isinstance(out, dict) and isinstance(out.get("body"), bytes) and "mac" in out:
                out = msgpack.unpackb(out["body"], raw=False)
            return out
        except Exception as e:
            return f"undecodable-reply: {e}"
    finally:
        sock.close(linger=0)


def fuzz_messages(
    target: dict[str, Any],
    decode_infos: list[dict[str, Any]],
    rng: random.Random,
    tag: str,
    secret: bytes | None,
) -> list[tuple[str, list[bytes], str]]:
    """A burst for one node: (name, frames, expected) with ``expected`` one of 'refused'
    (``ok`` false, or no reply for frames the server cannot answer), 'ok' or 'any'.

    With ``secret`` (the nodes' ``--kv-secret``) the schema and state checks behind the
    signature are reached by signing the message as a confused peer would; unsigned,
    wrongly signed, tampered, stale and replayed envelopes must all be refused."""
    enc = (lambda m: sign(secret, m)) if secret else _pack  # noqa: E731
    compat = dict(target.get("compat") or {})
    tp = int(compat.get("tp_size") or 1)
    fake_engine = "chaos-fuzzer"
    incarnation = f"{tag}-{rng.getrandbits(32):08x}"
    fake_key = f"{fake_engine}:{incarnation}"
    # Nobody listens there: P's failure notices to it time out on that peer's own lane.
    dead_addr = f"tcp://127.0.0.1:{free_port()}"
    tid = f"chaos-forged-{tag}-{rng.getrandbits(32):08x}"
    nonce = f"forged-{rng.getrandbits(64):016x}"
    reserve = {
        "kind": "reserve",
        "transfer_id": tid,
        "nonce": nonce,
        "d_request_id": "chaos-x",
        "peer_key": fake_key,
        "address": dead_addr,
        "block_ids": [3, 4, 5],
        "skip_blocks": 0,
    }
    msgs: list[tuple[str, list[bytes], str]] = [
        ("garbage bytes", [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))], "any"),
        ("not msgpack", [b"\xc1\xc1\xc1 not msgpack"], "refused"),
        ("msgpack list", [_pack([1, 2, 3])], "refused"),
        ("msgpack string", [_pack("reserve")], "refused"),
        ("msgpack nil", [_pack(None)], "refused"),
        ("two frames", [enc({"kind": "ping"}), enc({"kind": "ping"})], "refused"),
        ("empty map", [enc({})], "refused"),
        ("unknown kind", [enc({"kind": "launch_missiles"})], "refused"),
        ("kind not a string", [enc({"kind": 7})], "refused"),
        ("reserve without fields", [enc({"kind": "reserve"})], "refused"),
        ("reserve negative block", [enc({**reserve, "block_ids": [1, -5]})], "refused"),
        ("reserve float block", [enc({**reserve, "block_ids": [1.5]})], "refused"),
        (
            "reserve huge block list",
            [enc({**reserve, "block_ids": list(range(100_000))})],
            "refused",
        ),
        ("reserve from an unknown peer", [enc({**reserve, "peer_key": "nobody:0"})], "refused"),
        (
            "handshake with wrong types",
            [
                enc(
                    {
                        "kind": "handshake",
                        "engine_id": 1,
                        "compat": [],
                        "ranks": "x",
                        "address": "http://x",
                    }
                )
            ],
            "refused",
        ),
        (
            "handshake with another block size",
            [
                enc(
                    {
                        "kind": "handshake",
                        "engine_id": fake_engine,
                        "incarnation": incarnation,
                        "peer_key": fake_key,
                        "compat": {**compat, "block_size": 2 * int(compat.get("block_size", 16))},
                        "ranks": [{"num_blocks": 64}] * tp,
                        "address": dead_addr,
                    }
                )
            ],
            "refused",
        ),
        (
            "handshake from a peer outside the allowlist",
            [
                enc(
                    {
                        "kind": "handshake",
                        "engine_id": fake_engine,
                        "incarnation": incarnation,
                        "peer_key": fake_key,
                        "compat": compat,
                        "ranks": [{"num_blocks": 64}] * tp,
                        "address": "tcp://203.0.113.7:5555",
                    }
                )
            ],
            "refused",
        ),
        (
            "cancel unknown nonce",
            [
                enc(
                    {
                        "kind": "cancel",
                        "transfer_id": tid,
                        "nonce": "never-issued",
                        "peer_key": fake_key,
                    }
                )
            ],
            "any",
        ),
        (
            "transfer_failed unknown nonce",
            [
                enc(
                    {
                        "kind": "transfer_failed",
                        "d_request_id": "chaos-nobody",
                        "transfer_id": tid,
                        "nonce": "never-issued",
                        "reason": "forged",
                        "safe": True,
                    }
                )
            ],
            "any",
        ),
        ("ping", [enc({"kind": "ping"})], "ok"),
    ]
    if secret:
        ping = sign(secret, {"kind": "ping"})
        body = _pack({"kind": "ping"})
        ts, n = time.time(), os.urandom(16)
        tampered = _pack(
            {
                "ts": ts,
                "n": n,
                "body": _pack({"kind": "cancel"}),
                "mac": _request_mac(secret, ts, n, body),
            }
        )
        msgs += [
            ("unsigned ping", [_pack({"kind": "ping"})], "refused"),
            ("unsigned reserve", [_pack(reserve)], "refused"),
            (
                "ping signed with another secret",
                [sign(b"not-the-secret", {"kind": "ping"})],
                "refused",
            ),
            ("tampered body", [tampered], "refused"),
            ("stale timestamp", [sign(secret, {"kind": "ping"}, ts=time.time() - 3600)], "refused"),
            ("signed ping", [ping], "ok"),
            ("signed ping replayed byte for byte", [ping], "refused"),
        ]
    else:
        msgs.append(("ping replayed", [_pack({"kind": "ping"})], "ok"))
    # Reservations naming a real decode node (its public engine id and incarnation) with
    # block ids past its pool: refused before any WRITE is posted.
    for info in decode_infos:
        real_key = f"{info.get('engine_id')}:{info.get('incarnation')}"
        msgs.append(
            (
                f"reserve out of range as {info.get('engine_id')}",
                [
                    enc(
                        {
                            **reserve,
                            "transfer_id": tid + "-oor",
                            "nonce": nonce + "-oor",
                            "peer_key": real_key,
                            "address": info.get("side_channel") or dead_addr,
                            "block_ids": [0, 10**6, 2**40],
                        }
                    )
                ],
                "refused",
            )
        )
    # A compatible peer of our own (an identity no real node uses), then an in-range
    # reservation of a transfer no prefill has, repeated, cancelled, repeated again.
    handshake = {
        "kind": "handshake",
        "engine_id": fake_engine,
        "incarnation": incarnation,
        "peer_key": fake_key,
        "compat": compat,
        "ranks": [{"num_blocks": 64} for _ in range(tp)],
        "address": dead_addr,
    }
    cancel = {"kind": "cancel", "transfer_id": tid, "nonce": nonce, "peer_key": fake_key}
    if target.get("role") == "producer":
        msgs += [
            ("handshake (own identity)", [enc(handshake)], "ok"),
            ("handshake again", [enc(handshake)], "ok"),
            ("reserve in range, unknown transfer", [enc(reserve)], "ok"),
            ("same reserve again (a retry)", [enc(reserve)], "ok"),
            (
                "reserve out of range for our own peer",
                [
                    enc(
                        {
                            **reserve,
                            "nonce": nonce + "-2",
                            "transfer_id": tid + "-2",
                            "block_ids": [63, 64],
                        }
                    )
                ],
                "refused",
            ),
            ("cancel", [enc(cancel)], "ok"),
            ("cancel again", [enc(cancel)], "ok"),
            ("reserve again after its cancel", [enc(reserve)], "refused"),
            # Held until the deadline: P then tells our dead address transfer_failed.
            (
                "early reservation left to expire",
                [enc({**reserve, "transfer_id": tid + "-e", "nonce": nonce + "-e"})],
                "ok",
            ),
        ]
        # Claims naming a real decode node: P takes them as claims its address must confirm
        # (that address answers as the real node, so they are dropped), never as that
        # node restarting; the real node's pushes go on (the run's token checks see it).
        for info in decode_infos:
            eid, inc = info.get("engine_id"), info.get("incarnation")
            msgs += [
                (
                    f"handshake claiming {eid}'s engine id and address",
                    [
                        enc(
                            {
                                **handshake,
                                "engine_id": eid,
                                "peer_key": f"{eid}:{incarnation}",
                                "address": info.get("side_channel") or dead_addr,
                            }
                        )
                    ],
                    "any",
                ),
                (
                    f"handshake under {eid}'s own key",
                    [
                        enc(
                            {
                                **handshake,
                                "engine_id": eid,
                                "incarnation": inc,
                                "peer_key": f"{eid}:{inc}",
                            }
                        )
                    ],  # fmt: skip
                    "any",
                ),
            ]
    else:  # a decode node pairs with no one and takes no reservation or cancel
        msgs += [
            ("handshake to a decode node", [enc(handshake)], "refused"),
            ("reserve to a decode node", [enc(reserve)], "refused"),
        ]
    return msgs


def side_channel_burst(cluster: Cluster, rng: random.Random, tag: str) -> dict[str, Any]:
    """One burst to every live node; returns what each answered that was unexpected."""
    infos = {}
    for n in cluster.nodes:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            infos[n.name] = httpx.get(n.url + "/v1/kv_transfer_info", timeout=5).json()
    decode_infos = [infos[n.name] for n in cluster.decode if n.name in infos]
    sent, unexpected = 0, []
    secret = cluster.cfg.kv_secret.encode() or None
    for name, info in infos.items():
        addr = info.get("side_channel")
        if not addr:
            continue
        for what, frames, expected in fuzz_messages(info, decode_infos, rng, tag, secret):
            reply = _dealer_call(addr, frames)
            sent += 1
            ok = isinstance(reply, dict) and reply.get("ok") is True
            if expected == "ok" and not ok:
                unexpected.append(f"{name}: {what}: expected success, got {reply!r:.160}")
            elif expected == "refused" and ok:
                unexpected.append(f"{name}: {what}: accepted: {reply!r:.160}")
            elif expected == "refused" and not isinstance(reply, dict) and reply != "no-reply":
                unexpected.append(f"{name}: {what}: {reply!r:.160}")
    healthy = {}
    for n in cluster.nodes:
        with contextlib.suppress(httpx.HTTPError):
            healthy[n.name] = httpx.get(n.url + "/health", timeout=5).status_code
    for n, code in healthy.items():
        if code != 200:
            unexpected.append(f"{n}: /health {code} right after the burst")
    return {"messages": sent, "unexpected": unexpected}


# -- faults ---------------------------------------------------------------------------------


class Injector:
    """Runs one wave's faults in order, each once the wave has issued its share of requests.

    Injecting is quick (a signal, a burst); what follows (waiting for the node to notice,
    the drain, the restart) runs in a background thread that holds the victim's lock, so
    the next fault waits only if it has the same victim. The wave keeps issuing requests
    until every fault has been injected, so every fault meets load."""

    def __init__(
        self, run: ChaosRun, wave_faults: list[tuple[int, str]], round_no: int, wave_no: int
    ) -> None:
        self.run, self.faults, self.round_no, self.wave_no = run, wave_faults, round_no, wave_no
        self.cond = threading.Condition()
        self.issued = 0
        self.injected = 0
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._loop, name="chaos-injector", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def issuing(self, i: int) -> None:
        with self.cond:
            self.issued = i
            self.cond.notify_all()

    def all_injected(self) -> bool:
        with self.cond:
            return self.injected == len(self.faults)

    def _loop(self) -> None:
        for at, name in self.faults:
            with self.cond:
                while self.issued < at:
                    self.cond.wait(1.0)
            try:
                t = self.run.inject(name, self.round_no, self.wave_no)
            except Exception as e:  # a failed injection is reported, never silently lost
                self.run.record_fault(
                    name, self.round_no, "", error=f"{e!r}\n{traceback.format_exc()}"
                )
                t = None
            if t is not None:
                self.threads.append(t)
            with self.cond:
                self.injected += 1
                self.cond.notify_all()

    def join(self, timeout: float = 900) -> None:
        self.thread.join(timeout)
        for t in self.threads:
            t.join(timeout)


@dataclass
class RoundReport:
    round: int
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    leaked: int = 0
    leaks: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    rss_detail_mib: dict[str, list[float]] = field(default_factory=dict)  # engine, workers...
    pids_at_start: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    idle_after_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    counters: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # per node, this incarnation


COUNTERS = {
    "pdserve_engine_kv_transfers_started_total": "pushes",
    "pdserve_engine_kv_transfer_failures_total": "push_failures",
    "pdserve_engine_kv_loads_failed_total": "loads_failed",
    "pdserve_engine_kv_notifs_received_total": "notifs",
    "pdserve_engine_kv_handshakes_total": "handshakes",
    "pdserve_engine_kv_prefill_peers_lost_total": "peers_lost",
    "pdserve_prompt_tokens_total": "prompt_tokens",
    "pdserve_generation_tokens_total": "generated_tokens",
}


def _pids(cluster: Cluster) -> dict[str, int]:
    out = {n.name: n.pid for n in cluster.nodes if n.alive()}
    if cluster.proxy is not None:
        out["proxy"] = cluster.proxy.pid
    return out


def rss_detail(pid: int) -> list[float]:
    """MiB of ``pid`` itself, then of each process under it."""
    return [round(rss_bytes(p) / MIB, 1) for p in [pid, *descendants(pid)]]


class ChaosRun:
    def __init__(self, cfg: ChaosConfig, tmp: Path) -> None:
        self.cfg, self.tmp = cfg, tmp
        self.rng = random.Random(cfg.seed)
        self.cluster = Cluster(cfg, tmp)
        self.prompts = make_prompts(cfg.num_prompts, self.rng, cfg.long_bytes)
        self.refs: dict[RefKey, tuple[list[int], str]] = {}
        self.results: list[Result] = []
        self.faults: list[dict[str, Any]] = []
        self.rounds: list[RoundReport] = []
        self.lock = threading.Lock()
        self.next_index = 0
        self.pool: ThreadPoolExecutor | None = None
        self.sem = threading.Semaphore(cfg.concurrency)
        self.futures: list[Future] = []
        self.fault_rng = random.Random(cfg.seed + 1)
        self.started = time.monotonic()

    # -- bookkeeping --------------------------------------------------------------------------
    def record_fault(self, name: str, round_no: int, target: str, **info: Any) -> dict[str, Any]:
        rec = {
            "fault": name,
            "round": round_no,
            "target": target,
            "t": round(time.monotonic() - self.started, 1),
            **info,
        }
        with self.lock:
            self.faults.append(rec)
        log(f"fault {name} on {target or '-'}: {json.dumps(info)[:300]}")
        return rec

    # -- requests -----------------------------------------------------------------------------
    def submit(self, spec: Spec) -> None:
        self.sem.acquire()
        assert self.pool is not None and self.cluster.proxy is not None
        fut = self.pool.submit(self._one, spec)
        fut.add_done_callback(lambda _f: self.sem.release())
        with self.lock:
            self.futures.append(fut)

    def _one(self, spec: Spec) -> Result:
        assert self.cluster.proxy is not None
        try:
            r = run_request(self.cluster.proxy.url, spec, self.prompts, self.cfg.deadline_s)
        except Exception as e:  # the client itself failed: report it, do not lose the request
            r = Result(
                spec.index,
                spec.round,
                spec.label,
                spec.chat,
                spec.stream,
                spec.max_tokens,
                0,
                None,
                outcome="broken",
                error=f"client error {e!r}",
                ref_key=spec.ref_key,
            )
        with self.lock:
            self.results.append(r)
        return r

    def new_specs(
        self, round_no: int, n: int, long_only: bool = False, rng: random.Random | None = None
    ) -> list[Spec]:
        with self.lock:
            start, self.next_index = self.next_index, self.next_index + n
        return make_specs(
            self.cfg, rng or self.rng, round_no, start, n, len(self.prompts), long_only
        )

    # -- faults -------------------------------------------------------------------------------
    def _background(self, node: Node, work: Any, name: str) -> threading.Thread:
        """Runs ``work()`` in a thread that releases ``node``'s lock when it ends."""

        def go() -> None:
            try:
                work()
            except Exception as e:
                self.record_fault(name, 0, node.name, error=f"{e!r}\n{traceback.format_exc()}")
            finally:
                node.lock.release()

        t = threading.Thread(target=go, name=f"{name}-{node.name}", daemon=True)
        t.start()
        return t

    def _restart(self, node: Node, fault: dict[str, Any]) -> None:
        if node.proc is not None:
            self.cluster.retired.append(node.proc)
        t0 = time.monotonic()
        try:
            node.start(timeout=400)
            fault["restart_s"] = round(time.monotonic() - t0, 1)
            fault["incarnation"] = node.starts
        except Exception as e:
            fault["restart_error"] = f"{e!r}"[:2000]
            log(f"restart of {node.name} FAILED: {e!r}"[:2000])

    @staticmethod
    def _wait_loaded(node: Node, n: int = 1, timeout: float = 30) -> dict[str, Any]:
        """Waits until ``node`` holds at least ``n`` requests (the fault is to meet load):
        how long it waited (None: it never did; the fault goes ahead anyway) and how many
        requests it held at that moment."""
        t0 = time.monotonic()
        seen = [0.0]

        def loaded() -> bool:
            seen[0] = _safe_scrape(node.url, 2).get("pdserve_num_requests_admitted", 0.0)
            return seen[0] >= n

        ok = _wait(loaded, timeout)
        waited = round(time.monotonic() - t0, 1) if ok else None
        return {"waited_for_load_s": waited, "admitted": seen[0]}

    @staticmethod
    def _before_kill(node: Node) -> dict[str, Any]:
        """What a node had done and held just before it is killed (its counters die with it)."""
        m = _safe_scrape(node.url, 2)
        return {
            "admitted_at_kill": m.get("pdserve_num_requests_admitted"),
            "counters_before": {v: m[k] for k, v in COUNTERS.items() if k in m},
        }

    def inject(self, name: str, round_no: int, wave_no: int) -> threading.Thread | None:
        c = self.cluster

        def victim() -> Node:
            node = c.node(self.cfg.victim(name, round_no, wave_no))
            # Never both nodes of a role at once: a fault waits while the other is still
            # down from an earlier one (the load goes on meanwhile).
            role = c.prefill if node in c.prefill else c.decode
            others = [n for n in role if n is not node]
            _wait(lambda: not any(n.lock.locked() for n in others), 600)
            return node

        if name == "kill_prefill":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node)
            before = self._before_kill(node)
            node.kill9()
            rec = self.record_fault(name, round_no, node.name, **loaded, **before)
            return self._background(node, lambda: self._restart(node, rec), name)
        if name == "kill_decode":
            return self._kill_decode_mid_write(victim(), round_no)
        if name == "kill_worker":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node)
            worker = _rank_pid(node, self.cfg.kill_worker_rank)
            os.kill(worker, signal.SIGKILL)
            rec = self.record_fault(name, round_no, node.name, worker=worker, **loaded)

            def recover() -> None:
                t0 = time.monotonic()
                # The node turns unhealthy once its engine meets the dead worker (the load
                # keeps coming, so it does); then it is stopped and restarted.
                seen = _wait(lambda: _health(node.url) != 200, 60)
                rec["unhealthy_after_s"] = round(time.monotonic() - t0, 1) if seen else None
                rec["shutdown"] = node.sigterm_and_wait(60)
                self._restart(node, rec)

            return self._background(node, recover, name)
        if name == "kill_engine":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node)
            kids = descendants(node.pid)
            os.kill(node.pid, signal.SIGKILL)  # the engine process only, not its tree
            node.proc.proc.wait(10)  # type: ignore[union-attr]
            node.exits.append({"incarnation": node.starts, "how": "SIGKILL engine", "code": -9})
            rec = self.record_fault(name, round_no, node.name, processes_under=len(kids), **loaded)

            def reap_and_restart() -> None:
                t0 = time.monotonic()
                left = wait_gone(kids, ORPHAN_GRACE_S)
                rec["orphans_gone_after_s"] = round(time.monotonic() - t0, 1)
                rec["orphans_left"] = len(left)
                for k in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(k, signal.SIGKILL)
                self._restart(node, rec)

            return self._background(node, reap_and_restart, name)
        if name == "stop_worker":
            node = victim()
            node.lock.acquire()
            worker = _rank_pid(node, self.cfg.stop_worker_rank)
            length = self.cfg.stop_s or self.cfg.kv_transfer_timeout + 2
            os.kill(worker, signal.SIGSTOP)
            rec = self.record_fault(name, round_no, node.name, worker=worker, stopped_s=length)

            def resume() -> None:
                try:
                    time.sleep(length)
                finally:
                    os.kill(worker, signal.SIGCONT)
                rec["healthy_after"] = _health(node.url)

            return self._background(node, resume, name)
        if name == "drain":
            node = victim()
            node.lock.acquire()
            loaded = self._wait_loaded(node, 2)
            node.proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            rec = self.record_fault(name, round_no, node.name, **loaded)

            def drain_and_restart() -> None:
                rec["shutdown"] = node.sigterm_and_wait(
                    self.cfg.shutdown_timeout + 60, signal_sent=True
                )
                self._restart(node, rec)

            return self._background(node, drain_and_restart, name)
        if name == "side_channel":
            out = side_channel_burst(c, self.fault_rng, f"r{round_no}w{wave_no}")
            self.record_fault(name, round_no, "all", **out)
            return None
        raise ValueError(f"unknown fault {name!r}")

    def _kill_decode_mid_write(self, node: Node, round_no: int) -> threading.Thread:
        """A burst of long prompts; ``node`` is SIGKILLed as soon as a prefill node reports
        a push in flight (or once the burst's pushes have started, if none is caught)."""
        c = self.cluster
        node.lock.acquire()
        ps = [p for p in c.prefill if p.alive()]
        key = "pdserve_engine_kv_transfers_started_total"
        before = sum(_safe_scrape(p.url, 2).get(key, 0) for p in ps)
        for spec in self.new_specs(round_no, 8, long_only=True, rng=self.fault_rng):
            self.submit(spec)  # before the wave ends: the round waits for every request
        seen_in_flight = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = [_safe_scrape(p.url, 2) for p in ps]
            if any(v.get("pdserve_engine_kv_transfers_in_flight", 0) > 0 for v in m):
                seen_in_flight = True
                break
            if sum(v.get(key, 0) for v in m) - before >= 4:
                break
            time.sleep(0.01)
        before = self._before_kill(node)
        node.kill9()
        rec = self.record_fault(
            "kill_decode", round_no, node.name, push_in_flight_seen=seen_in_flight, **before
        )
        return self._background(node, lambda: self._restart(node, rec), "kill_decode")

    # -- rounds -------------------------------------------------------------------------------
    def run_wave(self, round_no: int, wave_no: int, n: int, faults: tuple[str, ...]) -> int:
        """Issues at least ``n`` requests with every fault in ``faults`` injected once;
        returns how many it issued."""
        # Spread over 10%..70% of the wave, in an order that alternates the victims.
        order = [
            f
            for f in (
                "side_channel",
                "kill_prefill",
                "kill_decode",
                "stop_worker",
                "side_channel",
                "kill_worker",
                "kill_engine",
                "drain",
            )
            if f in faults
        ]
        points = [int(n * (0.1 + 0.6 * k / max(1, len(order) - 1))) for k in range(len(order))]
        inj = Injector(self, list(zip(points, order, strict=True)), round_no, wave_no)
        inj.start()
        i = 0
        try:
            while i < n or not inj.all_injected():
                (spec,) = self.new_specs(round_no, 1)
                inj.issuing(i)
                self.submit(spec)
                i += 1
        finally:
            inj.issuing(1 << 30)
            inj.join()
        return i

    def run_round(self, round_no: int) -> RoundReport:
        cfg = self.cfg
        faults = cfg.faults_for(round_no)
        log(
            f"round {round_no}: {cfg.requests} requests (waves of {cfg.wave or cfg.requests}), faults {list(faults)}"
        )
        report = RoundReport(round_no, pids_at_start=_pids(self.cluster))
        t0 = time.monotonic()
        wave_n = cfg.wave or cfg.requests
        issued, wave_no = 0, 0
        faults_before = len(self.faults)
        last_log = time.monotonic()
        while issued < cfg.requests or time.monotonic() - t0 < cfg.min_round_s:
            wave_no += 1
            issued += self.run_wave(round_no, wave_no, wave_n, faults)
            if time.monotonic() - last_log > cfg.log_every_s:
                last_log = time.monotonic()
                self._log_progress(round_no)
        # Every request of the round ends (each has its own deadline on the client side).
        with self.lock:
            futs = list(self.futures)
        for f in futs:
            f.result()
        with self.lock:
            results = [r for r in self.results if r.round == round_no]
        report.requests = len(results)
        report.outcomes = dict(Counter(r.outcome for r in results))
        report.errors = dict(
            Counter(_error_kind(r.error) for r in results if r.outcome == "errored")
        )
        report.faults = dict(Counter(f["fault"] for f in self.faults[faults_before:]))
        report.seconds = round(time.monotonic() - t0, 1)
        # Once the deadlines passed: nothing left anywhere.
        t1 = time.monotonic()
        report.leaks = self.wait_idle()
        report.idle_after_s = round(time.monotonic() - t1, 1)
        report.leaked = len(report.leaks)
        report.pids = _pids(self.cluster)
        for name, pid in report.pids.items():
            detail = rss_detail(pid)
            report.rss_detail_mib[name] = detail
            report.rss_mib[name] = round(sum(detail), 1)
        for n in self.cluster.nodes:
            m = _safe_scrape(n.url)
            report.counters[n.name] = {v: m[k] for k, v in COUNTERS.items() if k in m}
        # Then the answers: every one against the colocated node's.
        t2 = time.monotonic()
        keys = {r.ref_key for r in results}
        compute_references(self.cluster.reference.url, keys, self.prompts, self.refs)
        for r in results:
            check_answer(r, self.refs[r.ref_key])
        report.wrong = sum(r.wrong for r in results)
        log(
            f"round {round_no}: {len(keys)} reference answers checked in {time.monotonic() - t2:.0f}s"
        )
        log(f"round {round_no} done: {json.dumps(asdict(report))}")
        return report

    def _log_progress(self, round_no: int) -> None:
        with self.lock:
            c = Counter(r.outcome for r in self.results if r.round == round_no)
        log(f"round {round_no}: {dict(c)} faults={len(self.faults)}")

    def wait_idle(self) -> dict[str, dict[str, float]]:
        """Waits until every live node and the proxy are idle with full pools, for at most
        every deadline of the connector (4 x the transfer timeout: P's tombstones) plus a
        margin; returns what is still left, by process."""
        limit = 4 * self.cfg.kv_transfer_timeout + 60
        deadline = time.monotonic() + limit
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def leftovers(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for n in self.cluster.nodes:
            if not n.alive():
                out[n.name] = {"not_running": 1.0}
                continue
            m = _safe_scrape(n.url)
            if not m:
                out[n.name] = {"metrics_unreadable": 1.0}
                continue
            bad = {g: m.get(g, float("nan")) for g in IDLE_GAUGES if m.get(g, float("nan")) != 0}
            free, total = m.get("pdserve_kv_blocks_free"), m.get("pdserve_kv_blocks_capacity")
            if free != total:
                bad["pdserve_kv_blocks_free"] = free if free is not None else float("nan")
            if m.get("pdserve_engine_healthy") != 1:
                bad["pdserve_engine_healthy"] = m.get("pdserve_engine_healthy", float("nan"))
            if bad:
                out[n.name] = bad
        if self.cluster.proxy is not None:
            m = _safe_scrape(self.cluster.proxy.url)
            bad = {
                g: m.get(g, float("nan")) for g in PROXY_IDLE_GAUGES if m.get(g, float("nan")) != 0
            }
            if bad:
                out["proxy"] = bad
        return out

    def execute(self) -> dict[str, Any]:
        cfg = self.cfg
        log(
            f"starting 2 prefill + 2 decode nodes (TP p1,p2,d1,d2 = {cfg.tp}), a colocated reference node and a proxy in {self.tmp}"
        )
        t0 = time.monotonic()
        self.cluster.start()
        log(f"cluster up in {time.monotonic() - t0:.0f}s")
        self.pool = ThreadPoolExecutor(cfg.concurrency + 16, thread_name_prefix="chaos-client")
        try:
            for round_no in range(1, cfg.rounds + 1):
                self.rounds.append(self.run_round(round_no))
        finally:
            self.pool.shutdown(wait=True, cancel_futures=False)
        return self.summary()

    # -- the summary ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        cfg = self.cfg
        totals = Counter(r.outcome for r in self.results)
        return {
            "commit": git_commit(),
            "config": public_config(cfg),
            "signed_side_channel": bool(cfg.kv_secret),
            "requests": len(self.results),
            "completed": totals.get("completed", 0),
            "errored": totals.get("errored", 0),
            "aborted": totals.get("aborted", 0),
            "hung": totals.get("hung", 0),
            "broken": totals.get("broken", 0),
            "wrong": sum(r.wrong for r in self.results),
            "leaked": sum(rep.leaked for rep in self.rounds),
            "rss_growth": self.rss_check(),
            "faults": dict(Counter(f["fault"] for f in self.faults if not f.get("error"))),
            "fault_failures": [f for f in self.faults if _fault_failed(f)],
            "side_channel_unexpected": [u for f in self.faults for u in f.get("unexpected", [])],
            "rounds": [asdict(r) for r in self.rounds],
            "fault_log": self.faults,
            "node_exits": {n.name: n.exits for n in self.cluster.nodes},
            "problems": [
                r.public() for r in self.results if r.wrong or r.outcome in ("hung", "broken")
            ],
            "errors": dict(
                Counter(_error_kind(r.error) for r in self.results if r.outcome == "errored")
            ),
            "duration_s": round(time.monotonic() - self.started, 1),
            "client_abort_planned": sum(r.planned_abort is not None for r in self.results),
            "reused_ids": sum(r.label.startswith("dup-") for r in self.results),
            "streamed": sum(r.stream for r in self.results),
            "chat": sum(r.chat for r in self.results),
            "structured": sum(r.ref_key[3] >= 0 for r in self.results),
            # Every request of the workload is valid: a 4xx other than 429 blames the client
            # for something it did not do.
            "client_blamed": [
                f"{r.label} #{r.index}: {r.error}"
                for r in self.results
                if r.outcome == "errored" and _blames_client(r)
            ],
            "log_tracebacks": _tracebacks(self.tmp),
        }

    def rss_check(self) -> dict[str, dict[str, float]]:
        """Resident memory of the survivors: the processes that ran through all of the
        second-to-last round and the last one (same pid at its start and at both ends).
        MiB after each of the two rounds, the growth and what is allowed."""
        if len(self.rounds) < 2:
            return {}
        a, b = self.rounds[-2], self.rounds[-1]
        out = {}
        for name, pid in b.pids.items():
            if not (a.pids_at_start.get(name) == a.pids.get(name) == pid):
                continue
            before, after = a.rss_mib[name], b.rss_mib[name]
            allowed = max(self.cfg.rss_slack_mib, before * self.cfg.rss_slack_ratio)
            out[name] = {
                "before_mib": before,
                "after_mib": after,
                "growth_mib": round(after - before, 1),
                "allowed_mib": round(allowed, 1),
            }
        return out


def _tracebacks(tmp: Path) -> dict[str, int]:
    """Tracebacks in each process's log (expected from the faults; listed, not asserted)."""
    out = {}
    for path in sorted(tmp.glob("*.err")):
        with contextlib.suppress(OSError):
            n = path.read_text(errors="replace").count("Traceback (most recent call last)")
            if n:
                out[path.name] = n
    return out


def _blames_client(r: Result) -> bool:
    return r.status is not None and 400 <= r.status < 500 and r.status != 429


def _fault_failed(f: dict[str, Any]) -> bool:
    if f.get("error") or f.get("restart_error") or f.get("orphans_left"):
        return True
    sd = f.get("shutdown")
    return bool(sd and (sd.get("code") != 0 or sd.get("workers_left_behind")))


def _rank_pid(node: Node, rank: int) -> int:
    """The pid of TP worker ``rank`` of ``node`` (-1: the last; past the node's TP: the
    last)."""
    pids = worker_pids(node.pid)
    return pids[min(rank, len(pids) - 1)] if rank >= 0 else pids[rank]


def _error_kind(error: str | None) -> str:
    if not error:
        return "?"
    return error.split(":", 1)[0][:60]


def _safe_scrape(url: str, timeout: float = 10) -> dict[str, float]:
    try:
        return scrape(url, timeout)
    except (httpx.HTTPError, ValueError):
        return {}


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=3).status_code
    except httpx.HTTPError:
        return 0


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


# -- the report -----------------------------------------------------------------------------


def format_table(s: dict[str, Any]) -> str:
    lines = [
        f"chaos suite @ {s['commit']}: {s['requests']} requests in {s['duration_s']:.0f}s "
        f"({s['streamed']} streamed, {s['chat']} chat, {s.get('structured', 0)} with a structured "
        f"output, {s['client_abort_planned']} planned client aborts, {s['reused_ids']} with a "
        f"reused X-Request-Id)",
        "",
        "| round | requests | completed | errored | aborted | hung | broken | wrong | leaked | seconds |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rounds"]:
        o = r["outcomes"]
        lines.append(
            f"| {r['round']} | {r['requests']} | {o.get('completed', 0)} | {o.get('errored', 0)} | "
            f"{o.get('aborted', 0)} | {o.get('hung', 0)} | {o.get('broken', 0)} | {r['wrong']} | "
            f"{r['leaked']} | {r['seconds']:.0f} |"
        )
    lines.append(
        f"| all | {s['requests']} | {s['completed']} | {s['errored']} | {s['aborted']} | "
        f"{s['hung']} | {s['broken']} | {s['wrong']} | {s['leaked']} | {s['duration_s']:.0f} |"
    )
    names = sorted({n for r in s["rounds"] for n in r["rss_mib"]})
    if names:
        lines += [
            "",
            "| RSS MiB (process tree) | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for r in s["rounds"]:
            cells = [f"{r['rss_mib'][n]:.0f}" if n in r["rss_mib"] else "-" for n in names]
            lines.append(f"| after round {r['round']} | " + " | ".join(cells) + " |")
        if s["rss_growth"]:
            cells = []
            for n in names:
                g = s["rss_growth"].get(n)
                cells.append(
                    f"{g['growth_mib']:+.1f} (≤ {g['allowed_mib']:.0f})" if g else "restarted"
                )
            lines.append("| growth, last two rounds | " + " | ".join(cells) + " |")
    lines += [
        "",
        "faults injected: " + ", ".join(f"{k} × {v}" for k, v in sorted(s["faults"].items())),
    ]
    if s["config"].get("node_args") or s["config"].get("node_env"):
        env = " ".join(f"{k}={v}" for k, v in sorted(s["config"].get("node_env", {}).items()))
        who = "every node but the reference" if s["config"].get("plain_reference") else "every node"
        lines.append(f"{who}: {' '.join(s['config'].get('node_args', ()))} {env}".rstrip())
    if s["errors"]:
        lines.append(
            "errors (clear): " + ", ".join(f"{k} × {v}" for k, v in sorted(s["errors"].items()))
        )
    if s["client_blamed"]:
        lines.append(f"valid requests answered with a 4xx: {len(s['client_blamed'])}")
    if s["fault_failures"]:
        lines.append(f"fault injections that went wrong: {len(s['fault_failures'])}")
    if s["side_channel_unexpected"]:
        lines.append(f"unexpected side-channel answers: {len(s['side_channel_unexpected'])}")
    return "\n".join(lines)


def failures(s: dict[str, Any]) -> list[str]:
    """What the suite asserts, as messages (empty: passed). Every request of the workload
    is valid, so a 4xx other than 429 is a failure too (the drain-deadline 499 the suite
    once found, fixed in d1a1453, was its last known case)."""
    out = []
    if s.get("client_blamed"):
        out.append(
            f"{len(s['client_blamed'])} valid request(s) answered with a 4xx: {s['client_blamed'][:5]}"
        )
    if s["hung"]:
        out.append(f"{s['hung']} hung request(s)")
    if s["broken"]:
        out.append(f"{s['broken']} broken answer(s) (neither completed nor a clear error)")
    if s["wrong"]:
        out.append(f"{s['wrong']} wrong answer(s)")
    for r in s["rounds"]:
        if r["leaks"]:
            out.append(f"round {r['round']}: left over after the deadlines: {r['leaks']}")
    for name, g in s["rss_growth"].items():
        if g["growth_mib"] > g["allowed_mib"]:
            out.append(f"{name}: RSS grew {g['growth_mib']} MiB (allowed {g['allowed_mib']})")
    for f in s["fault_failures"]:
        out.append(
            f"fault {f['fault']} on {f['target']}: {json.dumps({k: v for k, v in f.items() if k not in ('fault', 'target')})[:600]}"
        )  # noqa: E501
    for u in s["side_channel_unexpected"]:
        out.append(f"side channel: {u}")
    return out


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
        help="every node (the reference too) with --async-scheduling, and "
        f"{DEFER_READBACK_ENV}=1: workers hold a step's output until the next step is "
        "launched, as on CUDA (env CHAOS_ASYNC=1)",
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
        "--async-scheduling (e.g. async nodes checked against a synchronous reference; "
        "greedy answers are the same) (env CHAOS_PLAIN_REFERENCE=1)",
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
    if not 0 <= a.structured_rate <= 1:
        ap.error(f"--structured-rate: a share in [0, 1], got {a.structured_rate}")
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
        kill_worker_rank=a.kill_worker_rank,
        plain_reference=a.plain_reference,
        stop_worker_rank=a.stop_worker_rank,
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
