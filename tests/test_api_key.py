"""--api-key on nodes and the proxy: a bearer token on every path but /health and /metrics,
and the proxy passes the nodes' key on every call to them (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from harness import PD, Procs

pytestmark = pytest.mark.slow

KEY, NODE_KEY = "client-secret-1", "node-secret-2"
BODY = {"prompt": "hi", "max_tokens": 3, "temperature": 0.0}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def pd(module_procs: Procs) -> PD:
    """A prefill and a decode node, both with ``--api-key NODE_KEY`` (one pair for the
    module: each test started its own nodes, a colocated one and then this pair)."""
    return module_procs.pd(1, 1, "--num-blocks", "64", "--api-key", NODE_KEY)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_with_an_api_key_refuses_requests_without_it(pd: PD, role: str):
    node = pd.p if role == "prefill" else pd.d
    for path, method in (("/v1/completions", "POST"), ("/v1/abort", "POST"),
                         ("/v1/models", "GET"), ("/v1/kv_transfer_info", "GET")):  # fmt: skip
        for headers in ({}, _bearer("wrong"), {"Authorization": NODE_KEY}):
            r = httpx.request(method, node.url + path, json=BODY, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(node.url + "/health").status_code == 200
    assert httpx.get(node.url + "/metrics").status_code == 200
    ok = httpx.post(node.url + "/v1/completions", json=BODY, headers=_bearer(NODE_KEY), timeout=60)
    assert ok.status_code == 200, ok.text


def test_the_proxy_checks_its_key_and_passes_the_nodes_key(pd: PD, module_procs: Procs):
    proxy = module_procs.proxy([pd.p.url], [pd.d.url], "--api-key", KEY, "--node-api-key", NODE_KEY)
    assert httpx.get(proxy.url + "/health").status_code == 200  # both nodes in rotation
    r = httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(proxy.url + "/v1/completions", json=BODY, headers=_bearer(KEY), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3
    # The CLI client sends the key too.
    cli = [sys.executable, "-m", "proxy", "complete", "hi", "--url", proxy.url, "--max-tokens", "2"]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=_env(None))
    assert refused.returncode != 0 and "API key" in refused.stderr + refused.stdout
    done = subprocess.run(cli + ["--api-key", KEY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _env(key: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PDPROXY_API_KEY", "OPENAI_API_KEY")}
    if key:
        env["PDPROXY_API_KEY"] = key
    return env
