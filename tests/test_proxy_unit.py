"""Proxy pieces without processes: configuration sources, routing policy, validation."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from engine.server.request_fields import APIError
from proxy.cli import build_parser
from proxy.client_stream import Skipper
from proxy.config import ProxyConfig, ProxyConfigError, add_proxy_args, config_from_sources
from proxy.nodes import NodePool
from proxy.router import LeastOutstanding, NoHealthyNode, Router
from proxy.validation import CHAT, COMPLETIONS, validate_request

P, D = "http://10.0.0.1:8100", "http://10.0.0.2:8200"


def _cfg(argv: list[str], env: dict[str, str] | None = None) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    return config_from_sources(parser.parse_args(argv), env or {})


def test_flags_env_and_file_precedence(tmp_path: Path) -> None:
    cfg = _cfg(["--prefill", P, "--decode", D, "http://10.0.0.3:8200", "--port", "9000"])
    assert cfg.prefill == (P,) and len(cfg.decode) == 2 and cfg.port == 9000
    env = {"PDPROXY_PREFILL": f"{P}, http://10.0.0.9:1", "PDPROXY_DECODE": D,
           "PDPROXY_MAX_INFLIGHT": "7", "PDPROXY_NODE_SKIP_FIRST_TOKEN": "true"}  # fmt: skip
    cfg = _cfg([], env)
    assert cfg.prefill == (P, "http://10.0.0.9:1") and cfg.max_inflight == 7
    assert cfg.node_skip_first_token is True
    toml = tmp_path / "proxy.toml"
    toml.write_text(f'prefill = ["{P}"]\ndecode = ["{D}"]\nmax-inflight = 3\nport = 1234\n')
    cfg = _cfg(["--config", str(toml), "--port", "4321"], {"PDPROXY_MAX_INFLIGHT": "5"})
    assert (cfg.port, cfg.max_inflight, cfg.decode) == (4321, 5, (D,))  # flag > env > file
    js = tmp_path / "proxy.json"
    js.write_text(json.dumps({"prefill": [P], "decode": [D], "max_model_len": 512}))
    assert _cfg(["--config", str(js)]).max_model_len == 512
    # A list of entries in a file is the comma-separated flag's value.
    toml.write_text(
        f'prefill = ["{P}"]\ndecode = ["{D}"]\n'
        'registration-key = "k"\nregistration-allowed-nodes = ["10.0.0.0/8", "loopback"]\n'
    )
    cfg = _cfg(["--config", str(toml)])
    assert cfg.registration_allowed_nodes == "10.0.0.0/8,loopback"
    # YAML, as the nodes' --config takes (a [proxy]-like top-level key is allowed too).
    yml = tmp_path / "proxy.yaml"
    yml.write_text(f"proxy:\n  prefill: [{P}]\n  decode:\n    - {D}\n  max_inflight: 9\n")
    cfg = _cfg(["--config", str(yml)])
    assert (cfg.prefill, cfg.decode, cfg.max_inflight) == ((P,), (D,), 9)
    yml.write_text("prefill: [unclosed\n")
    with pytest.raises(ProxyConfigError, match="not valid YAML"):
        _cfg(["--config", str(yml)])


@pytest.mark.parametrize(
    "argv, env, flag",
    [
        ([], {}, "--prefill"),
        (["--prefill", P], {}, "--decode"),
        (["--prefill", "10.0.0.1:8100", "--decode", D], {}, "--prefill"),
        (["--prefill", P, P, "--decode", D], {}, "--prefill"),
        (["--prefill", P, "--decode", D, "--max-inflight", "0"], {}, "--max-inflight"),
        (["--prefill", P, "--decode", D], {"PDPROXY_PORT": "http"}, "--port"),
        (["--prefill", P, "--decode", D, "--health-interval", "0"], {}, "--health-interval"),
    ],
)
def test_bad_settings_name_the_flag(argv: list[str], env: dict[str, str], flag: str) -> None:
    with pytest.raises(ProxyConfigError, match=flag):
        _cfg(argv, env)


def test_serve_exits_2_naming_the_flag(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill": [P], "decode": [D], "colour": "blue"}))
    for argv, flag in (([], "--prefill"), (["--config", str(bad)], "colour")):
        proc = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", *argv],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert proc.returncode == 2 and flag in proc.stderr, proc.stderr


def test_cli_subcommands() -> None:
    parser = build_parser()
    args = parser.parse_args(["complete", "hi", "--stream", "--max-tokens", "4"])
    assert (args.prompt, args.stream, args.max_tokens) == ("hi", True, 4)
    assert parser.parse_args(["chat", "--url", "http://h:1"]).url == "http://h:1"


def _pool(n_p: int, n_d: int) -> NodePool:
    pool = NodePool(
        tuple(f"http://p{i}:1" for i in range(n_p)), tuple(f"http://d{i}:1" for i in range(n_d))
    )
    for n in pool.all():
        n.model, n.side_channel = "tiny", "tcp://x:1"
        n.set_healthy(True)
    return pool


def test_least_outstanding_with_round_robin_ties() -> None:
    pool = _pool(3, 2)
    router = Router(pool, LeastOutstanding())
    picks = [router.pick("prefill").url for _ in range(6)]
    assert sorted(set(picks)) == [n.url for n in pool.prefill]  # ties rotate
    assert picks[:3] != [picks[0]] * 3
    pool.prefill[0].outstanding, pool.prefill[1].outstanding = 2, 1
    assert router.pick("prefill").url == pool.prefill[2].url
    pool.prefill[2].outstanding = 5
    assert router.pick("prefill").url == pool.prefill[1].url
    pool.decode[0].mark_failed("boom")
    assert {router.pick("decode").url for _ in range(4)} == {pool.decode[1].url}
    assert not pool.decode[0].ready and pool.decode[0].failures_total == 1
    pool.decode[1].set_healthy(False, "down")
    assert not pool.serving
    with pytest.raises(NoHealthyNode):
        router.pick_pair()


def test_prefill_fallback_routes_to_decode_alone_only_while_no_prefill_node_is_ready() -> None:
    pool = _pool(1, 2)
    pool.prefill[0].set_healthy(False, "down")
    with pytest.raises(NoHealthyNode):  # off by default: no pair, no route
        Router(pool).plan()
    assert not pool.serving
    pool.prefill_fallback = True
    router = Router(pool)
    route = router.plan()
    assert route.prefill is None and route.decode in pool.decode
    assert pool.serving and router.modes["prefill_fallback"] == 1
    with pytest.raises(NoHealthyNode):  # a retry that must check P's first token needs P
        router.plan(allow_decode_only=False)
    pool.prefill[0].set_healthy(True)
    assert router.plan().prefill is pool.prefill[0] and router.modes["disaggregated"] == 1


def test_a_proxy_without_prefill_nodes_needs_prefill_fallback() -> None:
    with pytest.raises(ProxyConfigError, match="--prefill-fallback"):
        _cfg(["--decode", D])
    cfg = _cfg(["--decode", D, "--prefill-fallback"])
    assert cfg.prefill == () and cfg.prefill_fallback


def test_validation_reuses_node_rules() -> None:
    ok = validate_request(COMPLETIONS, b'{"prompt": "x", "max_tokens": 5}', ["tiny"], 100)
    assert ok.parsed.max_tokens == 5 and not ok.stream
    chat = validate_request(CHAT, b'{"messages": [{"role": "user", "content": "x"}]}', [], None)
    assert chat.chat and chat.path == "/v1/chat/completions"
    for raw, param in (
        (b'{"prompt": "x", "max_tokens": 100}', "max_tokens"),
        (b'{"prompt": "x", "model": "other"}', "model"),
        (b'{"prompt": "x", "best_of": 3}', "best_of"),
    ):
        with pytest.raises(APIError) as info:
            validate_request(COMPLETIONS, raw, ["tiny"], 100)
        assert info.value.param == param and info.value.status_code == 400


def test_skipper_drops_what_was_already_sent() -> None:
    s = Skipper(1, "He")
    assert s.apply([7], "H") == ([], "")
    assert s.apply([8], "ello") == ([8], "llo")
    assert s.apply([9], "!") == ([9], "!")


def test_counters_alerts_read_are_exported_at_zero_from_the_start() -> None:
    """Retries, stream migrations and errors by kind are series from the first scrape (an
    alert on ``rate(...)`` saw "no data" until the first one happened)."""
    from prometheus_client.parser import text_string_to_metric_families

    from proxy.metrics import ProxyMetrics
    from proxy.nodes import NodePool

    text = ProxyMetrics(NodePool((P,), (D,))).render().decode()
    series = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    for name, label, values in [
        ("pdproxy_request_retries_total", "role", ("prefill", "decode")),
        ("pdproxy_stream_migrations_total", "outcome", ("resumed", "diverged", "failed")),
        ("pdproxy_request_errors_total", "kind", ("upstream", "stream_error")),
    ]:
        for value in values:
            assert series.get((name, ((label, value),))) == 0, (name, value)


def test_a_node_healthy_for_the_first_time_is_not_healthy_again(caplog) -> None:
    # A proxy started before its decode node logged "decode node ... is healthy again"
    # once the node came up: it had never been healthy (its first check was refused).
    from proxy.nodes import Node

    node = Node("http://127.0.0.1:1", "decode")
    with caplog.at_level(logging.INFO, logger="proxy.nodes"):
        node.set_healthy(False, "connection refused")  # the first check, node not up yet
        node.set_healthy(True)
        node.set_healthy(False, "connection refused")
        node.set_healthy(True)
    lines = [r.getMessage() for r in caplog.records if "is healthy" in r.getMessage()]
    assert lines == [
        "decode node http://127.0.0.1:1 is healthy",
        "decode node http://127.0.0.1:1 is healthy again",
    ], lines


def test_proxy_up_line_says_why_a_node_is_not_ready() -> None:
    # "proxy up: 1 prefill, 1 decode node(s); ready: False" and nothing else: which node
    # was missing, and why, a new user had to find in /health.
    from proxy.nodes import NodePool, not_ready_summary

    pool = NodePool(("http://127.0.0.1:1",), ("http://127.0.0.1:2",))
    pool.decode[0].set_healthy(False, "connection refused")
    text = not_ready_summary(pool)
    assert "decode node http://127.0.0.1:2: connection refused" in text, text
    assert "prefill node http://127.0.0.1:1: not checked yet" in text, text
