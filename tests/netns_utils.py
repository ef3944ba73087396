"""Two "hosts" on one box: a pair of network namespaces joined by a veth pair.

Used by ``tests/test_netns.py``. Everything here only touches namespaces and links it
created itself (names carry the creating process's PID), and only ever sends traffic to
loopback or to the addresses inside those namespaces.

The module is also the in-namespace driver: the test process lives in the root
namespace and cannot reach the namespace addresses, so it runs
``ip netns exec <ns> python tests/netns_utils.py <command> ...`` and reads one JSON
document from stdout:

* ``health URL... --timeout S`` -- waits until every URL's ``/health`` answers 200;
  ``{"ok": bool, "status": {url: code-or-error}}``.
* ``disagg --prefill URL --decode URL --prompts JSON --max-tokens N`` -- sends each
  prompt (a token-id list) as one disaggregated request, both legs at once with one
  transfer id, as ``scripts/pd_request.py`` does (D's leg non-streamed), then scrapes
  both nodes' ``/metrics``; ``{"tokens": [[...], ...], "p_metrics": text, "d_metrics":
  text}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_NS_RE = re.compile(r"^pds-(\d+)-[ab]$")


class NetnsUnavailable(RuntimeError):
    """Namespaces or the veth pair cannot be made here (no ``ip``, no privileges...)."""


@dataclass
class NetnsPair:
    """Namespaces ``a`` and ``b``, veth ``dev_a`` in a (``addr_a``) <-> ``dev_b`` in b."""

    a: str
    b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str

    def prefix(self, ns: str) -> list[str]:
        """Command prefix that runs a program inside ``ns`` (``ip netns exec`` execs it,
        so the PID of the spawned process is the program's)."""
        return ["ip", "netns", "exec", ns]

    def link_stats(self, ns: str, dev: str) -> dict[str, int]:
        """``rx_bytes``/``tx_bytes`` of ``dev`` inside ``ns`` (from ``ip -s -j link``)."""
        out = _ip("-n", ns, "-s", "-j", "link", "show", "dev", dev)
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"]}


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(
            f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> None:
    """Delete ``pds-<pid>-[ab]`` namespaces left by test runs whose process is gone
    (e.g. a SIGKILLed pytest that never reached its teardown)."""
    with contextlib.suppress(Exception):
        for line in _ip("netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            m = _NS_RE.match(name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                _ip("netns", "delete", name, check=False)


def create_pair(subnet: str = "10.213.77") -> NetnsPair:
    """Create namespaces ``pds-<pid>-a``/``-b`` joined by a veth pair with
    ``<subnet>.1/30`` and ``<subnet>.2/30``; lo and both veth ends up.

    The addresses exist only inside the two namespaces, so they cannot clash with
    anything on the host (or with a concurrent run, which has its own namespaces).
    Raises ``NetnsUnavailable`` (with ``ip``'s stderr) when this can't be done; on a
    partial failure whatever was created is deleted again.
    """
    if shutil.which("ip") is None:
        raise NetnsUnavailable(
            "`ip` (iproute2) not found; on Debian/Ubuntu: apt-get install iproute2"
        )
    pid = os.getpid()
    pair = NetnsPair(
        a=f"pds-{pid}-a",
        b=f"pds-{pid}-b",
        dev_a=f"pdsv{pid}a",  # <= 15 chars for any pid up to 2**22
        dev_b=f"pdsv{pid}b",
        addr_a=f"{subnet}.1",
        addr_b=f"{subnet}.2",
    )
    created: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            _ip("netns", "add", ns)
            created.append(ns)
        # Create both ends directly inside their namespaces: the names never exist in
        # the root namespace.
        _ip(
            "link", "add", pair.dev_a, "netns", pair.a, "type", "veth",
            "peer", "name", pair.dev_b, "netns", pair.b,
        )  # fmt: skip
        for ns, dev, addr in ((pair.a, pair.dev_a, pair.addr_a), (pair.b, pair.dev_b, pair.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
    except BaseException:
        for ns in created:
            _ip("netns", "delete", ns, check=False)
        raise
    return pair


def delete_pair(pair: NetnsPair) -> list[str]:
    """Delete both namespaces (which deletes the veth pair); returns errors, if any."""
    errors = []
    for ns in (pair.a, pair.b):
        proc = subprocess.run(
            ["ip", "netns", "delete", ns], capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    return errors


def ns_run(
    pair: NetnsPair, ns: str, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
) -> dict:
    """Run this module's driver inside ``ns``; returns its JSON answer."""
    cmd = [*pair.prefix(ns), sys.executable, str(Path(__file__).resolve()), *args]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"driver {args[:1]} in {ns} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout)


# --------------------------------------------------------------- in-namespace driver


async def _health(urls: list[str], timeout: float) -> dict:
    import httpx

    status: dict[str, object] = {u: None for u in urls}
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            for u in urls:
                if status[u] == 200:
                    continue
                try:
                    status[u] = (await client.get(u + "/health")).status_code
                except httpx.HTTPError as e:
                    status[u] = f"{type(e).__name__}: {e}"
            ok = all(s == 200 for s in status.values())
            if ok or time.monotonic() > deadline:
                return {"ok": ok, "status": status}
            await asyncio.sleep(0.2)


async def _disagg(prefill: str, decode: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        info = (await client.get(f"{prefill}/v1/kv_transfer_info")).json()
        if not info.get("side_channel"):
            raise SystemExit(f"prefill node has no side channel: {info}")
        tokens = []
        for i, prompt in enumerate(prompts):
            rid = f"netns-{i}-{uuid.uuid4().hex[:8]}"
            body = {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            headers = {"X-Request-Id": rid}
            p_body = {**body, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": rid}}
            d_body = {
                **body,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "transfer_id": rid,
                    "remote_side_channel": info["side_channel"],
                },
            }
            p_resp, d_resp = await asyncio.gather(
                client.post(f"{prefill}/v1/completions", json=p_body, headers=headers),
                client.post(f"{decode}/v1/completions", json=d_body, headers=headers),
            )
            for leg, resp in (("prefill", p_resp), ("decode", d_resp)):
                if resp.status_code != 200:
                    raise SystemExit(f"{leg} leg of {rid} answered {resp.status_code}: {resp.text}")
            tokens.append(d_resp.json()["choices"][0]["token_ids"])
        return {
            "side_channel": info["side_channel"],
            "tokens": tokens,
            "p_metrics": (await client.get(f"{prefill}/metrics")).text,
            "d_metrics": (await client.get(f"{decode}/metrics")).text,
        }


def _main() -> int:
    ap = argparse.ArgumentParser(description="in-namespace driver for tests/test_netns.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("health")
    h.add_argument("urls", nargs="+")
    h.add_argument("--timeout", type=float, default=2.0)
    d = sub.add_parser("disagg")
    d.add_argument("--prefill", required=True)
    d.add_argument("--decode", required=True)
    d.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    d.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    if args.cmd == "health":
        result = asyncio.run(_health(args.urls, args.timeout))
    else:
        result = asyncio.run(
            _disagg(args.prefill, args.decode, json.loads(args.prompts), args.max_tokens)
        )
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
