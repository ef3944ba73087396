"""Run-time node discovery in the proxy: nodes that register (and heartbeat, and
deregister), and DNS names resolved periodically (a Kubernetes headless service).

Unit tests (no processes): registration bodies and URLs, the pool's membership by source
(a node leaving drops what the prefix router knows of it), expiry and the cap, DNS
refreshes through an injected resolver, the proxy's and the node's flags.

Real processes (``slow``): one prefill node and proxies with no decode node; a decode node
started with ``--register-with`` joins, is routed to (token-identical to asking it
directly), and leaves on SIGTERM while a request on it still finishes; a registration that
stops heartbeating expires; bad or unauthenticated registrations get 4xx and change
nothing; a proxy given ``--decode-dns localhost:PORT`` finds the node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import httpx
import pytest
import yaml
from harness import (
    GREEDY,
    NIXL,
    REPO_ROOT,
    Proc,
    Procs,
    assert_completes_with,
    free_port,
    metric,
    spawn,
    sse_data,
    stream_ids,
    wait_for,
    wait_healthy,
    worker_pids,
)

from engine.server.request_fields import APIError
from kvconnector.nixl.peers import PeerAllowlist
from proxy.config import ProxyConfig, ProxyConfigError, add_proxy_args, config_from_sources
from proxy.discovery import Membership, RoleConflict
from proxy.dns import DnsDiscovery, NameNotFound, parse_dns_name
from proxy.nodes import NodePool
from proxy.prefix import PrefixIndex, PromptKey
from proxy.registration import Registry, normalize_node_url, parse_registration
from proxy.router import Router

P, D1, D2 = "http://10.0.0.1:8100", "http://10.0.0.2:8200", "http://10.0.0.3:8200"
KEY = "registration-secret"
LONG = "".join(f"word{i} " for i in range(40))


def _ready(node: Any) -> Any:
    node.model, node.side_channel = "tiny", "tcp://x:1"
    node.set_healthy(True)
    return node


# -- registration bodies and URLs ----------------------------------------------------------------


def test_registration_body_is_checked_field_by_field() -> None:
    ok = json.dumps({"role": "decode", "url": "http://Node-3.svc:8200/"}).encode()
    assert parse_registration(ok) == ("decode", "http://node-3.svc:8200")
    assert normalize_node_url("https://[fd00::1]:443") == "https://[fd00::1]:443"
    bad: list[tuple[Any, str | None]] = [
        (b"not json", None),
        (b"\xff\xfe", None),
        ([], None),
        ({"url": D1}, "role"),
        ({"role": "router", "url": D1}, "role"),
        ({"role": ["decode"], "url": D1}, "role"),
        ({"role": "decode"}, "url"),
        ({"role": "decode", "url": 8200}, "url"),
        ({"role": "decode", "url": "ftp://10.0.0.2:8200"}, "url"),
        ({"role": "decode", "url": "10.0.0.2:8200"}, "url"),
        ({"role": "decode", "url": "http://:8200"}, "url"),
        ({"role": "decode", "url": "http://10.0.0.2"}, "url"),  # the port is required
        ({"role": "decode", "url": "http://10.0.0.2:0"}, "url"),
        ({"role": "decode", "url": "http://10.0.0.2:70000"}, "url"),
        ({"role": "decode", "url": "http://10.0.0.2:port"}, "url"),
        ({"role": "decode", "url": "http://10.0.0.2:8200/v1"}, "url"),
        ({"role": "decode", "url": "http://10.0.0.2:8200?x=1"}, "url"),
        ({"role": "decode", "url": "http://user:pw@10.0.0.2:8200"}, "url"),
        ({"role": "decode", "url": "http://bad host:8200"}, "url"),
        ({"role": "decode", "url": "http://0.0.0.0:8200"}, "url"),  # not reachable
        ({"role": "decode", "url": "http://[::]:8200"}, "url"),
        ({"role": "decode", "url": "http://[::ffff:0.0.0.0]:8200"}, "url"),  # 0.0.0.0 as v6
        # the resolver reads these as addresses (0.0.0.0 and loopback in disguise)
        ({"role": "decode", "url": "http://0:8200"}, "url"),
        ({"role": "decode", "url": "http://0.0.0.0.:8200"}, "url"),
        ({"role": "decode", "url": "http://2130706433:8200"}, "url"),
        ({"role": "decode", "url": "http://127.1:8200"}, "url"),
        ({"role": "decode", "url": "http://0x7f.1:8200"}, "url"),
        ({"role": "decode", "url": "http://" + "a" * 300 + ":8200"}, "url"),
    ]
    for body, param in bad:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        with pytest.raises(APIError) as e:
            parse_registration(raw)
        assert e.value.status_code == 400, body
        assert e.value.param == param, (body, e.value.message)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 4000,  # deeper than the JSON parser goes: a RecursionError, a 500, before
        b'{"role": "decode", "url": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        b'{"role": "decode", "url": "http://h\\ud800:1", "x": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"role": "decode", "url": "http://a\\ud800b:8200"}',  # a lone surrogate
    ],
    ids=["4000 levels", "2000 levels in url", "100 levels", "lone surrogate"],
)
def test_a_registration_body_nested_past_the_parser_is_a_400(raw: bytes) -> None:
    """A registration body (at most 4 KiB) read as JSON with the API's own parser: nesting
    past 64 levels is a 400 ``invalid_json``, a lone surrogate a 400 (found by the fuzz
    round of tests/test_fuzz_http.py: ``json.loads`` raised ``RecursionError`` past ~1000
    levels, which no handler caught)."""
    with pytest.raises(APIError) as e:
        parse_registration(raw)
    assert e.value.status_code == 400, e.value.message


@pytest.mark.parametrize("url", ["http://[fe80::1%eth0]:8200", "http://[fe80::1%25eth0]:8200"])
def test_a_registered_ipv6_url_with_a_zone_id_is_refused_naming_the_fix(url: str) -> None:
    """An IPv6 zone id (``%eth0``) names an interface of the host that wrote the URL: the
    node's, which says nothing about the proxy's (RFC 6874's ``%25eth0`` form never even
    resolved: every health check failed). Refused, saying what to advertise instead."""
    raw = json.dumps({"role": "decode", "url": url}).encode()
    with pytest.raises(APIError) as e:
        parse_registration(raw)
    assert (e.value.status_code, e.value.param) == (400, "url")
    assert "zone id" in e.value.message and "--advertise-url" in e.value.message, e.value.message


# -- membership: nodes by source -------------------------------------------------------------------


def test_a_node_stays_while_any_source_lists_it_and_leaving_forgets_its_prefixes() -> None:
    pool = NodePool((P,), ())
    _ready(pool.prefill[0])
    router = Router(pool, index=PrefixIndex(1024))
    members = Membership(pool)
    d = _ready(members.add("decode", D1, "registered"))
    assert pool.ready("decode") == [d] and d.sources == {"registered"}
    assert members.add("decode", D1, "dns:svc:8200") is d  # the same node, a second source
    key = PromptKey.of("text", LONG)
    router.plan(key)  # routed: remembered under D1 (and P)
    assert router.index is not None and router.index.size(D1) > 0
    with d.lease():  # a request in flight on it when it leaves
        assert not members.drop(D1, "registered")  # still listed by DNS
        assert pool.ready("decode") == [d]
        assert members.drop(D1, "dns:svc:8200")
        assert d.removed and not d.ready and pool.decode == []
        assert router.index.size(D1) == 0  # what the prefix router knew is gone
    assert d.outstanding == 0
    # Back again: a fresh node, health unknown until checked.
    again = members.add("decode", D1, "registered")
    assert again is not d and not again.ready and again.on_reset is not None
    # A URL is one role; a static node never leaves through another source.
    with pytest.raises(RoleConflict):
        members.add("prefill", D1, "registered")
    members.add("prefill", P, "registered")
    assert not members.drop(P, "registered") and pool.prefill[0].url == P
    assert pool.prefill[0].sources == {"static"}
    assert members.events["added"] == 2 and members.events["removed"] == 1


def test_registrations_renew_expire_and_are_capped() -> None:
    now = [100.0]
    pool = NodePool((), ())
    members = Membership(pool)
    reg = Registry(members, key=KEY, ttl=10.0, max_nodes=2, clock=lambda: now[0])
    assert reg.register("decode", D1)["status"] == "registered"
    assert reg.register("prefill", P)["expires_in"] == 10.0
    now[0] = 108.0
    assert reg.register("decode", D1)["status"] == "renewed"  # heartbeat: deadline 118
    with pytest.raises(APIError) as e:
        reg.register("decode", D2)  # a third node: over --max-registered-nodes
    assert e.value.status_code == 429 and "--max-registered-nodes" in e.value.message
    assert [n.url for n in pool.all()] == [P, D1]
    with pytest.raises(APIError) as e:
        reg.register("prefill", D1)  # D1 is a decode node
    assert e.value.status_code == 409
    now[0] = 111.0
    assert reg.expire() == [P] and [n.url for n in pool.all()] == [D1]
    assert members.events["expired"] == 1
    assert reg.register("decode", D2)["status"] == "registered"  # room again
    assert reg.deregister("decode", D2)["status"] == "deregistered"
    assert reg.deregister("decode", D2)["status"] == "not_registered"
    with pytest.raises(APIError) as e:
        reg.deregister("prefill", D1)
    assert e.value.status_code == 409
    now[0] = 119.0
    assert reg.expire() == [D1] and pool.all() == []
    # Authentication: a bearer token equal to the key, compared in constant time.
    for header in (None, "", "Bearer", "Bearer wrong", "Basic " + KEY, KEY):
        with pytest.raises(APIError) as e:
            reg.authorize(header)
        assert e.value.status_code == 401
    reg.authorize("Bearer " + KEY)


@pytest.mark.parametrize(
    "allowed, url, ok",
    [
        ("10.0.0.0/8", "http://10.1.2.3:8200", True),
        ("10.0.0.0/8", "http://192.168.0.5:8200", False),
        ("10.0.0.0/8", "http://node-7.internal:8200", False),  # a name is not in a network
        ("loopback", "http://[::1]:8200", True),
        ("loopback", "http://127.0.0.1:8200", True),
        ("loopback", "http://169.254.169.254:80", False),  # cloud metadata
        ("node-7.internal", "http://node-7.internal:8200", True),
        ("10.0.0.3:8200", "http://10.0.0.3:8201", False),
        ("*", "http://169.254.169.254:80", True),  # the default: any (the key is trusted)
        ("::/0", "http://[::ffff:169.254.169.254]:80", False),  # IPv4, written as IPv6
        ("10.0.0.0/8", "http://[::ffff:10.0.0.1]:8200", True),
    ],
)
def test_registration_names_only_the_nodes_the_proxy_allows(allowed: str, url: str, ok: bool):
    pool = NodePool((), ())
    members = Membership(pool)
    reg = Registry(members, key=KEY, ttl=10.0, max_nodes=4, allowed=PeerAllowlist.parse(allowed))
    url = normalize_node_url(url)
    assert "::ffff:" not in url  # a mapped IPv4 address is written as the IPv4 address
    if ok:
        assert reg.register("decode", url)["status"] == "registered"
        assert [n.url for n in pool.all()] == [url]
        return
    with pytest.raises(APIError) as e:
        reg.register("decode", url)
    assert e.value.status_code == 403 and "--registration-allowed-nodes" in e.value.message
    assert pool.all() == [] and reg.deadlines == {}


# -- DNS ---------------------------------------------------------------------------------------------


def test_dns_names_add_new_addresses_and_remove_vanished_ones() -> None:
    answers: dict[str, Any] = {"svc": ["10.0.0.1", "10.0.0.2"], "pre": ["fd00::7"]}
    asked: list[str] = []

    def resolver(name: str) -> list[str]:
        asked.append(name)
        value = answers[name]
        if isinstance(value, Exception):
            raise value
        return value

    pool = NodePool((), ("http://10.0.0.9:8200",))
    members = Membership(pool)
    dns = DnsDiscovery(members, [("decode", "svc", 8200), ("prefill", "pre", 8100)], resolver)

    def urls(role: str) -> list[str]:
        return sorted(n.url for n in pool.nodes(role))  # type: ignore[arg-type]

    asyncio.run(dns.refresh())
    assert sorted(asked) == ["pre", "svc"]
    assert urls("decode") == [
        "http://10.0.0.1:8200",
        "http://10.0.0.2:8200",
        "http://10.0.0.9:8200",
    ]
    assert urls("prefill") == ["http://[fd00::7]:8100"]
    gone = next(n for n in pool.decode if n.url == "http://10.0.0.1:8200")
    answers["svc"] = ["10.0.0.2", "10.0.0.3", "10.0.0.3"]
    asyncio.run(dns.refresh())
    assert urls("decode") == [
        "http://10.0.0.2:8200",
        "http://10.0.0.3:8200",
        "http://10.0.0.9:8200",
    ]
    assert gone.removed
    # A lookup that fails for a reason other than "no such name" keeps what was known ...
    answers["svc"] = OSError("Temporary failure in name resolution")
    asyncio.run(dns.refresh())
    assert len(urls("decode")) == 3 and members.events["dns_error"] == 1
    # ... a name that no longer exists (a headless service with no pods) empties its set;
    # the static node stays.
    answers["svc"] = NameNotFound("svc")
    asyncio.run(dns.refresh())
    assert urls("decode") == ["http://10.0.0.9:8200"]


def test_one_dns_name_for_both_roles_lists_each_roles_nodes() -> None:
    """``--prefill-dns nodes:8100 --decode-dns nodes:8200`` (P and D on the same hosts, or
    ``localhost`` on one box): the second entry's lookup was refused as "the lookup of
    nodes from an earlier refresh still runs" -- the first entry's, of the same refresh --
    at every refresh, so the proxy never found a decode node (a walkthrough of
    --decode-dns). A name is looked up once per refresh and its answer serves each entry."""
    asked: list[str] = []

    def resolver(name: str) -> list[str]:
        asked.append(name)
        return ["10.0.0.1", "10.0.0.2"]

    pool = NodePool((), ())
    members = Membership(pool)
    names = [("prefill", "nodes", 8100), ("decode", "nodes", 8200)]
    dns = DnsDiscovery(members, names, resolver)  # type: ignore[arg-type]
    asyncio.run(dns.refresh())
    assert asked == ["nodes"] and members.events["dns_error"] == 0
    assert sorted(n.url for n in pool.prefill) == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    assert sorted(n.url for n in pool.decode) == ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]


def test_a_name_whose_lookup_raises_anything_fails_alone() -> None:
    """A fault round: ``--decode-dns localhost:PORT <64-letter label>.svc:80`` passed the
    flag check, ``getaddrinfo`` raised ``UnicodeError`` (IDNA: label too long) for it, and
    that error -- no ``OSError`` -- ended every refresh before any answer was applied, so
    not even ``localhost``'s node was ever found (a traceback each interval). A lookup
    that raises anything is that name's failed lookup; the flag refuses such a label."""

    def resolver(name: str) -> list[str]:
        if name == "bad":
            raise UnicodeError("encoding with 'idna' codec failed (label too long)")
        return ["10.0.0.1"]

    pool = NodePool((), ())
    members = Membership(pool)
    names = [("prefill", "good", 8100), ("decode", "bad", 8200), ("decode", "good", 8200)]
    dns = DnsDiscovery(members, names, resolver)  # type: ignore[arg-type]
    asyncio.run(dns.refresh())
    assert [n.url for n in pool.prefill] == ["http://10.0.0.1:8100"]
    assert [n.url for n in pool.decode] == ["http://10.0.0.1:8200"]
    assert members.events["dns_error"] == 1
    label = "a" * 64
    with pytest.raises(ValueError, match="label"):
        parse_dns_name(f"{label}.svc:8200")
    with pytest.raises(ProxyConfigError, match="^--decode-dns: "):
        _proxy_cfg("--prefill", P, "--decode-dns", f"{label}.svc:8200")
    assert parse_dns_name(f"{label[:63]}.svc:8200") == (f"{label[:63]}.svc", 8200)
    with pytest.raises(APIError, match="host"):
        parse_registration(json.dumps({"role": "decode", "url": f"http://{label}:8200"}).encode())


def test_a_dns_address_of_the_other_role_is_logged_once(caplog: pytest.LogCaptureFixture):
    """A fault round: a DNS answer listing an address that is a node of the other role
    (static, or registered) was refused at every refresh with a warning per address: 256
    addresses, 256 log lines every ``--discovery-interval``. It is logged once per address
    until that address stops conflicting."""
    addrs = [f"10.0.0.{i}" for i in range(1, 4)]
    pool = NodePool(tuple(f"http://{a}:8100" for a in addrs), ())
    members = Membership(pool)
    dns = DnsDiscovery(members, [("decode", "nodes", 8100)], lambda name: list(addrs))
    with caplog.at_level("WARNING", logger="proxy.dns"):
        for _ in range(3):
            asyncio.run(dns.refresh())
    assert len(pool.prefill) == 3 and pool.decode == []
    conflicts = [r for r in caplog.records if "not added" in r.getMessage()]
    assert len(conflicts) == 3, [r.getMessage() for r in conflicts]
    caplog.clear()
    addrs[:] = addrs[:1]  # two addresses leave the answer ...
    asyncio.run(dns.refresh())
    addrs[:] = [f"10.0.0.{i}" for i in range(1, 4)]  # ... and come back: said again
    with caplog.at_level("WARNING", logger="proxy.dns"):
        asyncio.run(dns.refresh())
    assert len([r for r in caplog.records if "not added" in r.getMessage()]) == 2


def test_one_name_and_port_for_both_roles_is_refused():
    """A fault round: ``--prefill-dns nodes:8100 --decode-dns nodes:8100`` started; both
    entries are the source ``dns:nodes:8100``, so the decode entry found its addresses
    already "listed" (as prefill nodes) and silently added none: the proxy answered 503
    "no healthy decode node" with no reason anywhere. A discovered URL is one role: the
    same NAME:PORT in both roles is refused at start-up."""
    with pytest.raises(ProxyConfigError, match="^--decode-dns: .*both"):
        _proxy_cfg("--prefill-dns", "nodes:8100", "--decode-dns", "Nodes:8100")
    cfg = _proxy_cfg("--prefill-dns", "nodes:8100", "--decode-dns", "nodes:8200")
    assert cfg.decode_dns == ("nodes:8200",)


def test_one_static_url_for_both_roles_is_refused_naming_the_fix() -> None:
    """``--prefill X --decode X`` was accepted while the same NAME:PORT for both roles, or
    registering X in the other role, is refused: X became two nodes at one address (each
    health-checked, each routed to; a P and a D that may be paired with themselves, the
    KV pushed from a node to itself). A URL is one role at start-up too."""
    for p, d in (("http://a:8100", "http://a:8100"), ("http://a:8100", "http://A:8100")):
        with pytest.raises(ProxyConfigError, match="^--decode: .*both roles.*--prefill-fallback"):
            _proxy_cfg("--prefill", p, "--decode", d)
    cfg = _proxy_cfg("--prefill", "http://a:8100", "--decode", "http://a:8200")
    assert (cfg.prefill, cfg.decode) == (("http://a:8100",), ("http://a:8200",))


def test_a_static_url_with_an_escaped_zone_id_is_refused_naming_the_written_form() -> None:
    """``%25eth0`` (RFC 6874's form) reaches the resolver as written and never resolves;
    the proxy's own interface written ``%eth0`` works (it is the proxy's to name)."""
    with pytest.raises(ProxyConfigError, match=r"^--decode: .*\[fe80::1%eth0\]:8200"):
        _proxy_cfg("--prefill", P, "--decode", "http://[fe80::1%25eth0]:8200")
    assert _proxy_cfg("--prefill", P, "--decode", "http://[fe80::1%eth0]:8200").decode == (
        "http://[fe80::1%eth0]:8200",
    )


# -- flags --------------------------------------------------------------------------------------------


def _proxy_cfg(*argv: str) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    return config_from_sources(parser.parse_args(list(argv)), {})


def test_proxy_flags_say_which_source_to_configure() -> None:
    with pytest.raises(ProxyConfigError, match=r"^--decode: .*--decode-dns.*--registration-key"):
        _proxy_cfg("--prefill", P)
    with pytest.raises(ProxyConfigError, match=r"^--prefill: .*--prefill-dns"):
        _proxy_cfg("--decode", D1)
    cfg = _proxy_cfg(
        "--prefill-dns", "pre.ns.svc:8100", "--decode-dns", "dec:8200", "--discovery-interval", "2"
    )
    assert cfg.prefill == () and cfg.decode_dns == ("dec:8200",) and cfg.discovery_interval == 2
    cfg = _proxy_cfg("--registration-key", KEY, "--registration-ttl", "5")
    assert (cfg.prefill, cfg.decode, cfg.registration_ttl) == ((), (), 5.0)
    assert KEY not in repr(cfg)
    assert parse_dns_name("pdserve-decode.default.svc.cluster.local:8200") == (
        "pdserve-decode.default.svc.cluster.local",
        8200,
    )
    with pytest.raises(
        ProxyConfigError, match="^--registration-allowed-nodes: .*--registration-key"
    ):
        _proxy_cfg("--prefill", P, "--decode", D1, "--registration-allowed-nodes", "10.0.0.0/8")
    for bad in ("svc", "svc:0", "svc:x", ":8200", "http://svc:8200", "a b:1"):
        with pytest.raises(ProxyConfigError, match="^--decode-dns: "):
            _proxy_cfg("--prefill", P, "--decode-dns", bad)
    for flags, name in (
        (("--discovery-interval", "0"), "--discovery-interval"),
        (("--registration-ttl", "0"), "--registration-ttl"),
        (("--max-registered-nodes", "0"), "--max-registered-nodes"),
        (("--registration-allowed-nodes", "10.0.0.0/33"), "--registration-allowed-nodes"),
        (("--registration-allowed-nodes", " , "), "--registration-allowed-nodes"),
    ):
        with pytest.raises(ProxyConfigError, match=f"^{name}: "):
            _proxy_cfg("--registration-key", KEY, *flags)
    env = {"PDPROXY_DECODE_DNS": "a:1,b:2", "PDPROXY_REGISTRATION_KEY": KEY}
    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    cfg = config_from_sources(parser.parse_args(["--prefill", P]), env)
    assert cfg.decode_dns == ("a:1", "b:2") and cfg.registration_key == KEY


def test_a_bad_serve_setting_prints_the_serve_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """An error found after parsing printed the top-level usage (``pd-proxy [-h] COMMAND``),
    not the usage of the command the user ran."""
    from proxy.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--prefill", P])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pd-proxy serve ") and "pd-proxy serve: error: --decode" in err


def test_node_registration_flags_are_checked_before_the_engine_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.server.node_main import run_node

    monkeypatch.delenv("PDSERVE_REGISTRATION_KEY", raising=False)
    proxy = "http://127.0.0.1:9"
    cases = [
        (["--register-with", proxy], "--registration-key"),
        (["--register-with", "proxy:8000", "--registration-key", KEY], "--register-with"),
        (["--register-with", proxy, "--registration-key", KEY, "--host", "0.0.0.0"], "--advertise-url"),
        (["--register-with", proxy, "--registration-key", KEY, "--advertise-url", "http://0.0.0.0:1"], "--advertise-url"),
        (["--register-with", proxy, "--registration-key", KEY, "--registration-interval", "0"], "--registration-interval"),
        (["--advertise-url", "http://10.0.0.2:8200"], "--register-with"),
        (["--register-with", proxy, "--registration-key", KEY, "--advertise-url", "http://[fe80::1%eth0]:1"], "--advertise-url"),
        # The listening address it would advertise without --advertise-url: a zone id names
        # the node's own interface (every registration got 400; the node kept serving).
        (["--register-with", proxy, "--registration-key", KEY, "--host", "fe80::1%eth0"], "--advertise-url"),
    ]  # fmt: skip
    for argv, flag in cases:
        with pytest.raises(SystemExit) as e:
            run_node("decode", ["--port", "0", *argv])
        assert e.value.code == 2, argv
        assert flag in capsys.readouterr().err, argv


def test_k8s_proxy_finds_the_nodes_through_their_headless_services() -> None:
    from proxy.cli import build_parser

    docs = [
        doc
        for path in sorted((REPO_ROOT / "scripts" / "deploy" / "k8s").glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    (proxy,) = [d for d in docs if d["kind"] == "Deployment"]
    (box,) = proxy["spec"]["template"]["spec"]["containers"]
    cfg = config_from_sources(build_parser().parse_args(box["args"]), {})
    assert cfg.prefill == cfg.decode == ()  # no static list to keep in step with replicas
    for role, names in (("prefill", cfg.prefill_dns), ("decode", cfg.decode_dns)):
        (name,) = names
        host, port = parse_dns_name(name)
        svc = services[host]
        assert svc["clusterIP"] == "None", f"{host}: one address per pod needs headless"
        assert svc["publishNotReadyAddresses"] is True, host
        assert svc["selector"]["app.kubernetes.io/component"] == role
        assert port in [p["port"] for p in svc["ports"] if p["name"] == "http"], name


# -- real processes -------------------------------------------------------------------------------

BODY = {"prompt": "The quick brown fox", "max_tokens": 8, **GREEDY}


def bare_proxy(procs: Procs, name: str, *args: str) -> Proc:
    """A proxy with only ``args`` (``harness.spawn_proxy`` always passes node lists)."""
    port = free_port()
    cmd = [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--health-interval", "0.5"]
    return procs.add(spawn(name, [*cmd, *args], f"http://127.0.0.1:{port}", procs.tmp))


def wait_up(*proxies: Proc) -> None:
    """Until each proxy answers (its /health may be 503: no decode node yet)."""
    for p in proxies:

        def up(p: Proc = p) -> bool:
            assert p.proc.poll() is None, p.logs()
            try:
                return httpx.get(p.url + "/metrics", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, f"{p.name} to listen")


def nodes(proxy: Proc, role: str = "decode") -> list[dict[str, Any]]:
    return httpx.get(proxy.url + "/health", timeout=5).json()[role]


def complete(url: str, body: dict[str, Any] = BODY) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# Proxy b's registrations expire after this: the node must join and serve a request
# within it on a loaded box (2 s was tight).
TTL_B = 8.0


class Setup:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.p = procs.node(
            *NIXL, "--num-blocks", "256", module="prefill_node", name="p", wait=False
        )
        # a: the node registers with it; b: registrations expire after TTL_B s.
        self.a = bare_proxy(
            procs, "proxy-a", "--prefill", self.p.url, "--registration-key", KEY,
            "--registration-allowed-nodes", "loopback",
        )  # fmt: skip
        self.b = bare_proxy(
            procs, "proxy-b", "--prefill", self.p.url, "--registration-key", KEY,
            "--registration-ttl", str(TTL_B),
        )  # fmt: skip
        wait_healthy(self.p)
        wait_up(self.a, self.b)
        for proxy in (self.a, self.b):  # each has checked p since it came up
            wait_for(lambda p=proxy: nodes(p, "prefill")[0]["healthy"], 30, "p in rotation")
        self.d: Proc | None = None

    def register_decode(self) -> Proc:
        """A decode node that registers (and heartbeats) with proxy a, once it is in a's
        rotation."""
        self.d = self.procs.node(
            *NIXL, "--num-blocks", "256", "--register-with", self.a.url,
            "--registration-key", KEY, "--registration-interval", "1",
            module="decode_node", name="d",
        )  # fmt: skip
        a = self.a.url
        wait_for(lambda: httpx.get(a + "/health").status_code == 200, 30, "the node to join")
        return self.d

    def decode(self) -> Proc:
        """The registered decode node: the first test's, or a new one when this test runs
        without it (under ``-n 2`` without ``--dist loadfile`` xdist hands a module's tests
        to both workers, each with its own ``setup``; or the test was picked alone)."""
        return self.d if self.d is not None else self.register_decode()


@pytest.fixture(scope="module")
def setup(module_procs: Procs) -> Setup:
    return Setup(module_procs)


@pytest.mark.slow
def test_a_node_registering_is_routed_to(setup: Setup) -> None:
    a = setup.a
    resp = complete(a.url)
    assert resp.status_code == 503, resp.text
    assert httpx.get(a.url + "/health").json()["reason"] == "no healthy decode node"
    assert nodes(a) == []
    d = setup.register_decode()
    (entry,) = nodes(a)
    assert (entry["url"], entry["healthy"], entry["sources"]) == (d.url, True, ["registered"])
    assert_completes_with(a.url, BODY, complete(d.url).json()["choices"][0]["token_ids"])
    assert metric(a.url, "pdproxy_node_requests_total", {"url": d.url}) == 2


@pytest.mark.slow
def test_bad_registrations_get_4xx_and_change_nothing(setup: Setup) -> None:
    a, d = setup.a, setup.decode()
    before = httpx.get(a.url + "/health").json()
    reg, dereg = a.url + "/v1/nodes/register", a.url + "/v1/nodes/deregister"
    good = {"role": "decode", "url": "http://127.0.0.1:1"}
    cases: list[tuple[str, Any, dict[str, str], int]] = [
        (reg, good, {}, 401),
        (reg, good, auth("wrong"), 401),
        (dereg, {"role": "decode", "url": d.url}, {}, 401),
        (dereg, {"role": "decode", "url": d.url}, auth("wrong"), 401),
        (reg, b"{not json", auth(), 400),
        (reg, {"role": "router", "url": "http://127.0.0.1:1"}, auth(), 400),
        (reg, {"role": "decode", "url": "http://127.0.0.1"}, auth(), 400),
        (reg, {"role": "decode", "url": "file:///etc/passwd"}, auth(), 400),
        (reg, {"role": "decode", "url": "x" * 20000}, auth(), 413),
        (reg, {"role": "prefill", "url": d.url}, auth(), 409),  # d is a decode node
        (reg, {"role": "decode", "url": setup.p.url}, auth(), 409),  # p is a prefill node
        (dereg, {"role": "prefill", "url": d.url}, auth(), 409),
        (dereg, {"role": "decode"}, auth(), 400),
        (reg, {"role": "decode", "url": "http://10.9.9.9:8200"}, auth(), 403),  # not loopback
    ]
    for url, body, headers, status in cases:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = httpx.post(url, content=raw, headers=headers, timeout=10)
        assert resp.status_code == status, (body, headers, resp.text)
        assert resp.json()["error"]["message"], resp.text
    assert httpx.get(reg, headers=auth()).status_code == 405
    time.sleep(1.0)  # a health round: nothing was added or taken out
    assert httpx.get(a.url + "/health").json() == before
    assert complete(a.url).status_code == 200
    assert metric(a.url, "pdproxy_discovery_events_total", {"event": "refused"}) == len(cases)


@pytest.mark.slow
def test_a_proxy_registered_as_a_node_is_never_routed_to(setup: Setup) -> None:
    """The registration key's holder names the proxy itself as a decode node: it is in the
    pool but never healthy (it answers as a proxy), and requests keep going to d."""
    a, d = setup.a, setup.decode()
    body = {"role": "decode", "url": a.url}
    resp = httpx.post(a.url + "/v1/nodes/register", json=body, headers=auth(), timeout=10)
    assert resp.status_code == 200, resp.text
    try:
        wait_for(lambda: len(nodes(a)) == 2, 10, "the registration in the pool")
        time.sleep(1.5)  # health rounds (0.5 s apart here)
        (itself,) = [n for n in nodes(a) if n["url"] == a.url]
        assert not itself["healthy"] and "a pd-proxy" in itself["error"], itself
        for _ in range(4):
            assert complete(a.url).status_code == 200
        assert metric(a.url, "pdproxy_node_requests_total", {"url": a.url}) == 0
    finally:
        httpx.post(a.url + "/v1/nodes/deregister", json=body, headers=auth(), timeout=10)
    assert [n["url"] for n in nodes(a)] == [d.url]


@pytest.mark.slow
def test_a_flood_of_refused_registrations_does_not_flood_the_log(setup: Setup) -> None:
    """Every refused post was logged at WARNING: anyone reaching the proxy could fill its
    log. All are still counted."""
    b = setup.b
    log = b.stderr_path.read_text()
    before = metric(b.url, "pdproxy_discovery_events_total", {"event": "refused"})
    start = time.monotonic()
    with httpx.Client(timeout=10) as client:
        for _ in range(40):
            resp = client.post(b.url + "/v1/nodes/register", json={"role": "decode"})
            assert resp.status_code == 401
    took = time.monotonic() - start
    new_lines = b.stderr_path.read_text()[len(log) :].count("/v1/nodes/register from")
    assert 1 <= new_lines <= 2 + took, (new_lines, took)  # one line a second at most
    after = metric(b.url, "pdproxy_discovery_events_total", {"event": "refused"})
    assert after == before + 40


@pytest.mark.slow
def test_a_dns_name_adds_its_addresses(setup: Setup) -> None:
    d = setup.decode()
    port = d.url.rsplit(":", 1)[1]
    assert "127.0.0.1" in {a[4][0] for a in socket.getaddrinfo("localhost", None)}
    c = bare_proxy(
        setup.procs, "proxy-dns", "--prefill", setup.p.url, "--decode-dns", f"localhost:{port}",
        "--discovery-interval", "0.5",
    )  # fmt: skip
    wait_healthy(c, timeout=60)
    (entry,) = [n for n in nodes(c) if n["url"] == d.url]
    assert entry["healthy"] and entry["sources"] == [f"dns:localhost:{port}"]
    direct = complete(d.url).json()["choices"][0]["token_ids"]
    assert complete(c.url).json()["choices"][0]["token_ids"] == direct
    # This proxy takes no registrations (no --registration-key): 403, not a silent 200.
    resp = httpx.post(c.url + "/v1/nodes/register", json={"role": "decode", "url": d.url}, headers=auth())  # fmt: skip
    assert resp.status_code == 403 and "--registration-key" in resp.json()["error"]["message"]


@pytest.mark.slow
def test_a_registration_that_stops_heartbeating_expires(setup: Setup) -> None:
    b, d = setup.b, setup.decode()
    registered = time.monotonic()  # before the proxy starts the registration's clock
    resp = httpx.post(
        b.url + "/v1/nodes/register", json={"role": "decode", "url": d.url}, headers=auth()
    )  # one registration, no heartbeat
    assert resp.status_code == 200 and resp.json()["expires_in"] == TTL_B, resp.text
    wait_for(lambda: httpx.get(b.url + "/health").status_code == 200, 10, "the node to join")
    assert complete(b.url).status_code == 200
    wait_for(lambda: nodes(b) == [], TTL_B + 10, "the registration to expire")
    assert time.monotonic() - registered >= TTL_B
    assert complete(b.url).status_code == 503
    assert metric(b.url, "pdproxy_discovery_events_total", {"event": "expired"}) == 1
    assert httpx.get(d.url + "/health").status_code == 200  # the node itself is fine


@pytest.mark.slow
def test_sigterm_deregisters_and_the_request_in_flight_finishes(setup: Setup) -> None:
    """The request cannot end before the test has seen the node leaving: D's TP worker is
    stopped (SIGSTOP) while D's server, which handles SIGTERM and deregisters, runs on,
    and goes on once the test has looked. (Not reading the stream holds nothing back: on
    loopback the sockets between D, the proxy and the client hold MBs; a 200-token stream
    read on could end before the first look, and the node was never seen leaving.)"""
    a, d = setup.a, setup.decode()
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, **GREEDY}
    direct = complete(d.url, {**body, "stream": False}).json()["choices"][0]["token_ids"]
    removed = metric(a.url, "pdproxy_discovery_events_total", {"event": "removed"})
    workers = worker_pids(d.proc.pid)
    assert workers, "the decode node's TP worker"
    with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = [next(lines) for _ in range(4)]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)  # no more tokens until SIGCONT
        try:
            d.proc.send_signal(signal.SIGTERM)  # drains: the request finishes; deregisters
            # Out of the pool at once (not a 30 s expiry), shown leaving while its request
            # runs.
            wait_for(lambda: [n["state"] for n in nodes(a)] == ["leaving"], 10, "deregistered")
            (entry,) = nodes(a)
            assert (entry["outstanding"], entry["healthy"], entry["sources"]) == (1, False, [])
            assert metric(a.url, "pdproxy_node_outstanding_requests", {"url": d.url}) == 1
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):  # a failed test: maybe gone
                    os.kill(pid, signal.SIGCONT)
        events = sse_data(first + list(lines))
    assert events[-1] == "DONE" and all("error" not in e for e in events[:-1]), events[-3:]
    wait_for(lambda: nodes(a) == [], 10, "the node that left to be gone")  # its request ended
    assert stream_ids(events[:-1]) == direct
    d.stop()
    setup.d = None
    assert complete(a.url).status_code == 503
    assert metric(a.url, "pdproxy_discovery_events_total", {"event": "removed"}) == removed + 1
    assert a.proc.poll() is None and "Traceback" not in a.logs(100_000)
