"""Two hosts: a prefill node on one, a decode node on the other, the KV between them over
RDMA. Marked ``rdma`` (skipped where UCX sees no RDMA device) and driven by environment
variables (skipped, naming them, when they are not set).

Run it from a host on the RDMA fabric (the prefill host will do) that reaches both hosts
with non-interactive ssh, this checkout being at the same path on both (or at
``PDSERVE_TEST_REMOTE_DIR``) with pdserve installed::

    PDSERVE_TEST_PREFILL_HOST=gpu-a PDSERVE_TEST_DECODE_HOST=gpu-b \\
    PDSERVE_TEST_NIC=mlx5_0:1 python -m pytest -q -rs tests/test_two_hosts.py

The test starts each node on its host with ``scripts/launch_{prefill,decode}.sh`` over ssh
(the way docs/deploy.md deploys them: ``HOST``, ``GPUS``, ``UCX_NET_DEVICES``, a fresh
``PDSERVE_KV_SECRET``, ``--kv-allowed-peers`` the other host, ``UCX_PROTO_INFO=y``),
runs the proxy here in front of them, and checks:

* every answer through the proxy equals the prefill node's own answer to the same request
  sent to it alone (colocated, on the prefill host), streamed too;
* the decode node computed no prompt token, the prefill node pushed every prompt block
  (``pdserve_engine_kv_blocks_sent_total``) and no transfer failed;
* the prefill node's UCX protocol tables (``UCX_PROTO_INFO=y`` prints, per endpoint, the
  transport chosen for each operation) show that its remote writes to the decode host --
  what NIXL's WRITE is -- went over an RDMA transport (``rc_*``, ``dc_*``, ``ud_*``) on the
  NIC asked for, and never over ``tcp``;
* the pushes' bandwidth (bytes / push time, from the node's metrics) is reported.

Settings (environment):

=================================  ==========================================================
``PDSERVE_TEST_PREFILL_HOST``      ssh destination of the prefill host (``[user@]host``)
``PDSERVE_TEST_DECODE_HOST``       ssh destination of the decode host
``PDSERVE_TEST_PREFILL_ADDR``,     address the other host and this one reach each node at
``PDSERVE_TEST_DECODE_ADDR``       (HTTP and side channel); default: the host resolved here
``PDSERVE_TEST_NIC``               ``UCX_NET_DEVICES`` of both nodes (e.g. ``mlx5_0:1``);
                                   the RDMA device the writes must use. Default: the
                                   ``UCX_NET_DEVICES`` of this environment, else UCX's pick
``PDSERVE_TEST_SSH``               remote shell (default ``ssh -o BatchMode=yes``); ``local``
                                   runs the commands on this host (a one-box dry run)
``PDSERVE_TEST_REMOTE_DIR``        the checkout on the hosts (default: this checkout's path)
``PDSERVE_TEST_PYTHON``            python on the hosts (the launch scripts' ``PYTHON``)
``PDSERVE_TEST_MODEL``             model (default ``tiny``); ``PDSERVE_TEST_DTYPE`` (float32)
``PDSERVE_TEST_DEVICE``            ``cuda`` (default) or ``cpu``
``PDSERVE_TEST_PREFILL_TP``, ...   TP of each node (default 1; hetero TP allowed) and
``PDSERVE_TEST_PREFILL_GPUS``,...  its GPUs (default ``0..TP-1``); ``..._PORT`` (8100/8200)
``PDSERVE_TEST_SIDE_CHANNEL_PORT`` fixed side-channel port for firewalls (default random)
``PDSERVE_TEST_NODE_ARGS``         more node flags for both nodes
``PDSERVE_TEST_EXPECT_TRANSPORT``  ``rdma`` (default); a UCX transport name; ``any`` (report)
=================================  ==========================================================

Every ``UCX_*`` and ``NIXL_*`` variable of this environment is passed to both nodes
(``UCX_TLS``, ``UCX_IB_GID_INDEX`` on RoCE, ``NIXL_LOG_LEVEL``, ...). Logs stay on each host
under ``/tmp/pdserve-two-hosts-<id>/``; the nodes are stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from harness import (
    GREEDY,
    REPO_ROOT,
    parse_metric,
    spawn_proxy,
    sse_events,
    stream_ids,
    wait_healthy,
)
from hf_models import random_prompt

# -- UCX's protocol tables (UCX_PROTO_INFO=y) ---------------------------------------------------

# Each printed line: "[<time>] [<host>:<pid>:<thread>]  <text>" (the pid may be padded).
_UCX_LINE = re.compile(r"^\[[\d.]+\]\s+\[(?P<host>[^:\]\s]+):\s*(?P<pid>\d+)\s*:\s*(?P<tid>\d+)\]\s?(?P<text>.*)$")  # fmt: skip
_PEER = re.compile(r"\b(inter-node|intra-node|self|loopback) cfg#\d+")
_RANGE = re.compile(r"^\d+(\.\d+)?[KMGT]?(\.\.(\d+(\.\d+)?[KMGT]?|inf))?$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([^\s/|]+)")
_PUT = "remote memory write by ucp_put"
# UCX's RDMA transports: rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ud_mlx5 (InfiniBand, RoCE).
RDMA_TRANSPORT = re.compile(r"^(rc|dc|ud)(_|$)")


@dataclass
class PutProtocol:
    """One UCX protocol table of remote memory writes (``ucp_put*``: what a NIXL WRITE
    is): who printed it, to which kind of peer, between which memory types, and the
    transports (``(name, device)``) its size ranges use."""

    process: str  # "host:pid"
    peer: str  # inter-node, intra-node, self
    memory: str  # "host memory to host", "cuda/GPU0 to cuda/dev[0]", ...
    transports: list[tuple[str, str]] = field(default_factory=list)

    @property
    def names(self) -> set[str]:
        return {name for name, _ in self.transports}

    @property
    def source_memory(self) -> str:
        """``host`` or ``cuda`` (or another UCX memory type): where the data came from."""
        return self.memory.split(" to ")[0].split("/")[0].split()[0]

    def __str__(self) -> str:
        used = ", ".join(f"{n}/{d}" for n, d in self.transports) or "no rows"
        return f"{self.process} {self.peer} put from {self.memory}: {used}"


def ucx_put_protocols(log: str) -> list[PutProtocol]:
    """The remote-write tables in ``log`` (a node's output with ``UCX_PROTO_INFO=y``).

    UCX prints one table per (endpoint configuration, operation, memory types): a title
    naming the worker and the peer kind (``... inter-node cfg#2``), the operation
    (``remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[0]``; older UCX put
    both in one line), then rows ``| 0..inf | zero-copy | rc_mlx5/mlx5_0:1 |`` whose last
    cell names the transport/device. Lines are grouped per printing thread, so the tables
    of TP workers sharing one log may interleave."""
    current: dict[tuple[str, str, str], PutProtocol | None] = {}
    peers: dict[tuple[str, str, str], str] = {}
    tables: list[PutProtocol] = []
    for line in log.splitlines():
        m = _UCX_LINE.match(line.strip())
        if not m or not m["text"].strip().startswith("|"):
            continue
        key = (m["host"], m["pid"], m["tid"])
        cells = [c.strip() for c in m["text"].strip().strip("|").split("|")]
        if len(cells) >= 3 and _RANGE.match(cells[0]):
            table = current.get(key)
            if table is not None:
                table.transports += [
                    t for t in _TRANSPORT.findall(cells[-1]) if t not in table.transports
                ]
            continue
        for cell in cells:
            if peer := _PEER.search(cell):
                peers[key] = peer[1]
                current[key] = None
            if " by ucp_" in cell or cell.startswith("rendezvous"):
                current[key] = None
                if cell.startswith(_PUT) and key in peers:
                    memory = cell.split(" from ", 1)[1] if " from " in cell else ""
                    table = PutProtocol(f"{m['host']}:{m['pid']}", peers[key], memory)
                    current[key] = table
                    tables.append(table)
    return tables


def check_put_transport(
    tables: list[PutProtocol], peer: str, source_memory: str, expect: str, nics: list[str]
) -> list[PutProtocol]:
    """The tables of writes to ``peer`` peers from ``source_memory``; raises unless there
    is one and each used the expected transport: ``rdma`` (an rc/dc/ud transport), a
    transport name, or ``any``; never ``tcp`` unless asked for. With ``nics``, every RDMA
    device named must be one of them (``mlx5_0:1`` or ``mlx5_0``)."""
    found = [t for t in tables if t.peer == peer and t.source_memory == source_memory]
    shown = "\n  ".join(str(t) for t in tables) or "(no remote-write table at all)"
    assert found, (
        f"no UCX table for remote writes to an {peer} peer from {source_memory} memory "
        f"(is UCX_PROTO_INFO=y reaching the node?); tables found:\n  {shown}"
    )
    for t in found:
        if expect != "any":
            assert t.transports, f"a write table without rows: {t}"
        if expect not in ("any", "tcp"):
            assert "tcp" not in t.names, f"KV writes went over TCP: {t}"
        if expect == "rdma":
            assert any(RDMA_TRANSPORT.match(n) for n in t.names), f"not over RDMA: {t}"
            if nics:
                wanted = {n.split(":")[0] for n in nics} | set(nics)
                devs = {d for n, d in t.transports if RDMA_TRANSPORT.match(n)}
                assert devs <= wanted, f"RDMA on {sorted(devs)}, not on {nics}: {t}"
        elif expect != "any":
            assert expect in t.names, f"not over {expect}: {t}"
    return found


# -- the two-host test ------------------------------------------------------------------------

P_HOST, D_HOST = "PDSERVE_TEST_PREFILL_HOST", "PDSERVE_TEST_DECODE_HOST"
PROMPT_LENGTHS = (1, 17, 40, 300, 1000)
MAX_TOKENS = 16
BLOCK_SIZE = 16  # the nodes' default --block-size


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, "").strip() or default


@dataclass
class RemoteNode:
    role: str  # prefill | decode
    dest: str  # ssh destination
    addr: str
    port: int
    tp: int
    gpus: str
    run_dir: str
    pid: int | None = None
    launch_output: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"

    @property
    def log(self) -> str:
        return f"{self.run_dir}/{self.role}-{self.port}.log"

    @classmethod
    def from_env(cls, role: str, run_dir: str) -> RemoteNode:
        up = role.upper()
        dest = _env(P_HOST if role == "prefill" else D_HOST)
        name = dest.rsplit("@", 1)[-1]
        addr = _env(f"PDSERVE_TEST_{up}_ADDR") or socket.gethostbyname(name)
        tp = int(_env(f"PDSERVE_TEST_{up}_TP", "1"))
        gpus = _env(f"PDSERVE_TEST_{up}_GPUS", ",".join(map(str, range(tp))))
        port = int(_env(f"PDSERVE_TEST_{up}_PORT", "8100" if role == "prefill" else "8200"))
        return cls(role, dest, addr, port, tp, gpus, run_dir)


def remote_argv(dest: str, script: str) -> list[str]:
    """The command running bash ``script`` on ``dest`` (``PDSERVE_TEST_SSH``)."""
    ssh = _env("PDSERVE_TEST_SSH", "ssh -o BatchMode=yes")
    if ssh == "local":
        return ["bash", "-c", script]
    return [*shlex.split(ssh), dest, "bash -c " + shlex.quote(script)]


def run_remote(dest: str, script: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        remote_argv(dest, script), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"on {dest}: `{script[:300]}` exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def launch_script(node: RemoteNode, peer: RemoteNode, key: str, secret: str) -> str:
    """The bash line starting ``node`` with its launch script (run on its host)."""
    device = _env("PDSERVE_TEST_DEVICE", "cuda")
    env = {
        # Passed on first, so the settings below win.
        **{k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
        "HOST": node.addr,
        "PORT": str(node.port),
        "SIDE_CHANNEL_HOST": node.addr,
        "SIDE_CHANNEL_PORT": _env("PDSERVE_TEST_SIDE_CHANNEL_PORT", "0"),
        "MODEL": _env("PDSERVE_TEST_MODEL", "tiny"),
        "TP": str(node.tp),
        "DEVICE": device,
        "LOG_DIR": node.run_dir,
        "RUN_DIR": node.run_dir,
        "STARTUP_TIMEOUT": "900",
        "PDSERVE_API_KEY": key,
        "PDSERVE_KV_SECRET": secret,
        "UCX_PROTO_INFO": "y",
    }
    if device == "cuda":
        env["GPUS"] = node.gpus
    if nic := _env("PDSERVE_TEST_NIC"):
        env["UCX_NET_DEVICES"] = nic
    if python := _env("PDSERVE_TEST_PYTHON"):
        env["PYTHON"] = python
    flags = ["--kv-allowed-peers", peer.addr, "--dtype", _env("PDSERVE_TEST_DTYPE", "float32")]
    flags += ["--num-blocks", "2048", *shlex.split(_env("PDSERVE_TEST_NODE_ARGS"))]
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (
        f"cd {shlex.quote(_env('PDSERVE_TEST_REMOTE_DIR', str(REPO_ROOT)))} && "
        f"mkdir -p {shlex.quote(node.run_dir)} && env {assignments} "
        f"scripts/launch_{node.role}.sh -- {' '.join(map(shlex.quote, flags))}"
    )


def start_remote(node: RemoteNode, peer: RemoteNode, key: str, secret: str) -> None:
    node.launch_output = run_remote(node.dest, launch_script(node, peer, key, secret), 1000)
    m = re.search(r"listening on \S+ \(pid (\d+)", node.launch_output)
    assert m, f"{node.role} on {node.dest}: no pid in\n{node.launch_output}"
    node.pid = int(m[1])


def stop_remote(node: RemoteNode) -> None:
    """SIGTERM the node (it stops its TP workers), SIGKILL after 40 s."""
    if node.pid is None:
        return
    pid = node.pid
    run_remote(
        node.dest,
        f"kill {pid} 2>/dev/null || exit 0; for i in $(seq 80); do "
        f"kill -0 {pid} 2>/dev/null || exit 0; sleep 0.5; done; kill -9 {pid}",
        timeout=90,
    )
    node.pid = None


def _post(url: str, prompt: list[int], headers: dict[str, str], **kw: object) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, **GREEDY, **kw}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@pytest.mark.rdma
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(
    not (os.environ.get(P_HOST) and os.environ.get(D_HOST)),
    reason=f"set {P_HOST} and {D_HOST} (ssh destinations of two hosts on the RDMA fabric; "
    "optional PDSERVE_TEST_NIC=mlx5_0:1 and the others in tests/test_two_hosts.py; "
    "docs/deploy.md, 'Running the hardware tests')",
)
def test_prefill_and_decode_on_two_hosts_over_rdma_match_colocated(tmp_path):
    run_dir = f"/tmp/pdserve-two-hosts-{secrets.token_hex(4)}"
    p, d = RemoteNode.from_env("prefill", run_dir), RemoteNode.from_env("decode", run_dir)
    key, secret = secrets.token_hex(16), secrets.token_hex(32)
    auth = {"Authorization": f"Bearer {key}"}
    nics = [n for n in _env("PDSERVE_TEST_NIC", _env("UCX_NET_DEVICES")).split(",") if n]
    expect = _env("PDSERVE_TEST_EXPECT_TRANSPORT", "rdma")
    device = _env("PDSERVE_TEST_DEVICE", "cuda")
    proxy = None
    try:
        with ThreadPoolExecutor(2) as pool:  # both start-ups at once (minutes with a model)
            for fut in [pool.submit(start_remote, n, o, key, secret) for n, o in ((p, d), (d, p))]:  # fmt: skip
                fut.result()
        proxy = spawn_proxy(tmp_path, [p.url], [d.url], "--node-api-key", key)
        wait_healthy(proxy, timeout=60)
        for node in (p, d):
            info = httpx.get(node.url + "/v1/kv_transfer_info", headers=auth, timeout=10).json()
            assert info["transport"]["mem_type"] == ("VRAM" if device == "cuda" else "DRAM")
            assert info["compat"]["tp_size"] == node.tp, info

        def metrics(node: RemoteNode) -> str:
            return httpx.get(node.url + "/metrics", timeout=10).text

        p0, d0 = metrics(p), metrics(d)
        prompts = [random_prompt(n, 256, seed=1000 + n) for n in PROMPT_LENGTHS]
        through_proxy = [_post(proxy.url, x, {}) for x in prompts]
        p1, d1 = metrics(p), metrics(d)

        def delta(name: str, before: str, after: str) -> float:
            return parse_metric(after, name) - parse_metric(before, name)

        # D decoded from the pushed KV only; P pushed every block of every prompt to every
        # D rank that holds its heads, and no transfer failed.
        assert delta("pdserve_prompt_tokens_total", d0, d1) == 0
        blocks = sum(-(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS)
        assert delta("pdserve_engine_kv_blocks_sent_total", p0, p1) == blocks * max(p.tp, d.tp)
        assert delta("pdserve_engine_kv_transfer_failures_total", p0, p1) == 0
        assert delta("pdserve_engine_kv_loads_failed_total", d0, d1) == 0
        pushed = delta("pdserve_engine_kv_bytes_sent_total", p0, p1)
        seconds = delta("pdserve_kv_transfer_duration_seconds_sum", p0, p1)
        print(
            f"\n{len(prompts)} pushes {p.dest} -> {d.dest}: {pushed / 2**20:.2f} MiB in "
            f"{seconds * 1e3:.1f} ms of push time, {pushed / max(seconds, 1e-9) / 1e9:.2f} GB/s"
        )
        # The prefill node alone answers the same (colocated, after the P/D run: a node
        # that has seen a prompt serves its blocks from its prefix cache, and D's would
        # have cut what P pushes).
        colocated = [_post(p.url, x, auth) for x in prompts]
        assert through_proxy == colocated
        assert all(len(t) == MAX_TOKENS for t in colocated)
        # Streamed through the proxy: the same tokens.
        with httpx.stream(
            "POST",
            proxy.url + "/v1/completions",
            json={"prompt": prompts[3], "max_tokens": MAX_TOKENS, "stream": True, **GREEDY},
            timeout=300,
        ) as resp:
            assert resp.status_code == 200
            assert stream_ids(sse_events(resp)) == colocated[3]
    finally:
        errors = []
        if proxy is not None:
            proxy.stop()
        for node in (p, d):
            try:
                stop_remote(node)
            except Exception as e:  # stop the other one too, then report
                errors.append(repr(e))
        assert not errors, errors
    log = run_remote(p.dest, f"cat {shlex.quote(p.log)}")
    peer = "intra-node" if p.addr == d.addr else "inter-node"  # one-box dry run: intra
    memory = "cuda" if device == "cuda" else "host"
    used = check_put_transport(ucx_put_protocols(log), peer, memory, expect, nics)
    print("UCX remote writes of the prefill node:\n  " + "\n  ".join(map(str, used)))


# -- the parser, on what UCX prints (no hardware needed) --------------------------------------

# UCX 1.23 (the one in the nixl wheel), two TP workers of one node interleaved, then the
# one-line title of older UCX for an RDMA write of GPU memory (rows as UCX prints them).
SAMPLE = """\
[1796028865.064271] [vm:9872 :0]   +--------+-------------+-----------------------------------+
[1796028865.064271] [vm:9872 :0]   | 6e1f-tp0 intra-node cfg#1                                |
[1796028865.064280] [vm:9873 :0]   | 6e1f-tp1 inter-node cfg#2                                |
[1796028865.064271] [vm:9872 :0]   | remote memory write by ucp_put* from host memory to host |
[1796028865.064280] [vm:9873 :0]   | remote memory write by ucp_put*(multi) from cuda/GPU1 to cuda/dev[1] |
[1796028865.064271] [vm:9872 :0]   +--------+-------------+-----------------------------------+
[1796028865.064271] [vm:9872 :0]   | Range  | Description |              Config               |
[1796028865.064280] [vm:9873 :0]   |   1..inf | zero-copy | rc_mlx5/mlx5_1:1 50% on path0 and 50% on path1 |
[1796028865.064271] [vm:9872 :0]   | 0..inf | zero-copy   | cma/memory                        |
[1796028865.067702] [vm:9872 :0]   | 6e1f-tp0 intra-node cfg#1      |
[1796028865.067702] [vm:9872 :0]   | active message by ucp_am_send* from host memory |
[1796028865.067702] [vm:9872 :0]   |          0 | short              | tcp/lo        |
[1721319202.993450] [ps:143851:0]   | perftest inter-node cfg#1 | remote memory write by ucp_put* from host memory to cuda    |
[1721319202.993468] [ps:143851:0]   |                     0..2K | short                                    | rc_mlx5/mlx5_0:1/path0 |
[1721319202.993470] [ps:143851:0]   |                 2049..inf | zero-copy                                | rc_mlx5/mlx5_0:1 |
[1721319202.993470] [ps:143851:0]   | perftest inter-node cfg#1 | remote memory write by ucp_put* from cuda/GPU0 to cuda/dev[0] |
[1721319202.993470] [ps:143851:0]   |  0..inf | software emulation | tcp/eth2 |
"""


def test_ucx_put_tables_are_read_per_thread_with_their_transports():
    tables = ucx_put_protocols(SAMPLE)
    got = [(t.process, t.peer, t.source_memory, sorted(t.transports)) for t in tables]
    assert got == [
        ("vm:9872", "intra-node", "host", [("cma", "memory")]),
        ("vm:9873", "inter-node", "cuda", [("rc_mlx5", "mlx5_1:1")]),
        ("ps:143851", "inter-node", "host", [("rc_mlx5", "mlx5_0:1")]),
        ("ps:143851", "inter-node", "cuda", [("tcp", "eth2")]),
    ]  # the active-message table's tcp/lo row is not a write
    rdma = check_put_transport(tables[1:3], "inter-node", "host", "rdma", ["mlx5_0:1"])
    assert [t.process for t in rdma] == ["ps:143851"]
    assert check_put_transport(tables, "intra-node", "host", "cma", [])
    with pytest.raises(AssertionError, match="over TCP"):
        check_put_transport(tables, "inter-node", "cuda", "rdma", [])
    with pytest.raises(AssertionError, match="not on"):
        check_put_transport(tables[1:2], "inter-node", "cuda", "rdma", ["mlx5_0:1"])
    with pytest.raises(AssertionError, match="no UCX table"):
        check_put_transport(tables, "inter-node", "rocm", "any", [])


@pytest.mark.slow
def test_ucx_put_tables_of_a_live_prefill_node_are_found(procs):
    """The parser against what this UCX really prints: a loopback P/D pair on CPU with
    UCX_PROTO_INFO=y; P's writes into D are an intra-node table from host memory."""
    pytest.importorskip("nixl._api")
    env = {"UCX_PROTO_INFO": "y"}
    nodes = ("--kv-connector", "nixl", "--num-blocks", "64")
    p = procs.node(*nodes, module="prefill_node", name="p", env=env, wait=False)
    d = procs.node(*nodes, module="decode_node", name="d", env=env, wait=False)
    wait_healthy(p, d)
    proxy = procs.proxy([p.url], [d.url])
    prompt = random_prompt(40, 256, seed=7)
    assert _post(proxy.url, prompt, {}) == _post(d.url, prompt, {})
    deadline = time.monotonic() + 10
    tables: list[PutProtocol] = []
    while time.monotonic() < deadline and not tables:
        with contextlib.suppress(AssertionError):
            text = p.stdout_path.read_text(errors="replace")
            tables = check_put_transport(ucx_put_protocols(text), "intra-node", "host", "any", [])
        time.sleep(0.2)
    assert tables, p.logs()
    assert all(t.transports and "tcp" not in t.names for t in tables), tables
