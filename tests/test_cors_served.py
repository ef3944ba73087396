"""CORS on real servers (a prefill/decode pair and the proxy, real processes): what a
browser's web UI on another origin sees -- preflights answered without the API key,
``Access-Control-*`` headers on answers (streamed or not), the key still asked for on
every real call -- and bad CORS flags refused at start-up with a message naming the fix.
The unit-level rules (list syntax, each check) are tests/test_cors.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from harness import PD, Procs, sse_events

pytestmark = pytest.mark.slow

UI, EVIL, KEY = "https://ui.example", "https://evil.example", "cors-key-1"
ORIGINS = f'["{UI}", "http://localhost:3000"]'  # vLLM's JSON-array form
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
BODY = {"prompt": "hi", "max_tokens": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def pd_node_args() -> tuple[str, ...]:
    return ("--num-blocks", "64", "--api-key", KEY, "--allowed-origins", ORIGINS)


@pytest.fixture(scope="module")
def proxy_url(pd_pair: PD, module_procs: Procs) -> str:
    proxy = module_procs.proxy(
        [pd_pair.p.url], [pd_pair.d.url], "--api-key", KEY, "--node-api-key", KEY,
        "--allowed-origins", UI, "http://localhost:3000",
    )  # fmt: skip
    return proxy.url


@pytest.fixture(params=["decode node", "proxy"])
def url(request: pytest.FixtureRequest, pd_pair: PD) -> str:
    return pd_pair.d.url if request.param == "decode node" else request.getfixturevalue("proxy_url")


def _as_ui(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Origin": UI, "Authorization": f"Bearer {KEY}", **(extra or {})}


def test_a_preflight_needs_no_key_and_other_origins_are_refused(url: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
        pre = httpx.options(url + path, headers=PREFLIGHT, timeout=30)
        assert pre.status_code == 200, (path, pre.text)
        assert pre.headers["access-control-allow-origin"] == UI
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        refused = httpx.options(url + path, headers={**PREFLIGHT, "Origin": EVIL}, timeout=30)
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers


def test_answers_carry_the_headers_streamed_or_not_and_the_key_is_still_asked_for(url: str):
    plain = httpx.post(url + "/v1/completions", json=BODY, headers=_as_ui(), timeout=120)
    assert plain.status_code == 200, plain.text
    assert plain.headers["access-control-allow-origin"] == UI
    # A browser reads only headers listed as exposed: the request id (to abort or report
    # a request) and Retry-After (on a 429) are listed.
    exposed = plain.headers.get("access-control-expose-headers", "").lower()
    assert "x-request-id" in exposed and "retry-after" in exposed
    assert plain.headers["x-request-id"]
    with httpx.stream(
        "POST", url + "/v1/completions", json={**BODY, "stream": True}, headers=_as_ui(),
        timeout=120,
    ) as streamed:  # fmt: skip
        assert streamed.status_code == 200
        assert streamed.headers["access-control-allow-origin"] == UI
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed)
    assert events[-1] == "DONE" and len(events) > 1
    # No key: refused still, and the page may read why (the headers are on the 401).
    no_key = httpx.post(url + "/v1/completions", json=BODY, headers={"Origin": UI}, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert no_key.headers["access-control-allow-origin"] == UI
    # An origin not named gets its answer (a server cannot stop a non-browser client) but
    # no header that would let a browser page read it.
    other = httpx.post(url + "/v1/completions", json=BODY, headers=_as_ui({"Origin": EVIL}),
                       timeout=120)  # fmt: skip
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def _start(cmd: list[str]) -> tuple[int, str]:
    """The exit status and stderr of a start meant to fail; one that starts serving
    instead is stopped (its whole process group: a node has workers) and fails the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"started anyway: {cmd}\n{err[-2000:]}")
    return proc.returncode, err


NODE = [sys.executable, "-m", "decode_node", "--port", "0"]
PROXY = [sys.executable, "-m", "proxy", "serve", "--port", "0", "--prefill",
         "http://127.0.0.1:9", "--decode", "http://127.0.0.1:7"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--allowed-origins", "https://ui.example/"], "write it as 'https://ui.example'"),
        (["--allowed-origins", "https://UI.example:443"], "write it as 'https://ui.example'"),
        (["--allowed-origins", "ui.example"], "is not an origin"),
        (["--allowed-origins", '["https://ui.example"'], "not a JSON array"),
        (["--allowed-origins", "*", "--allow-credentials"], "--allow-credentials: not with"),
        (["--allowed-methods", "PO ST"], "--allowed-methods: 'PO ST' is not a name"),
        (
            ["--allowed-origins", UI, "--allowed-headers", "content-type", "--api-key", "k"],
            "--allowed-headers: add authorization",
        ),
    ],
)
@pytest.mark.parametrize("cmd", [NODE, PROXY], ids=["node", "proxy"])
def test_bad_cors_flags_stop_the_start_with_a_message_naming_the_fix(
    cmd: list[str], flags: list[str], says: str
) -> None:
    status, err = _start(cmd + flags)
    assert status == 2, err[-2000:]
    assert says in err and "Traceback" not in err, err[-2000:]
