"""The outcome of one request of the proxy's fault property test
(``tests/test_property_proxy_faults.py``), its invariants asserted: a completions or chat
answer (JSON or stream, every choice), a ``/v1/responses`` one (its ``response`` object or
events), or an error the rules allow."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import httpx
from harness import sse_chunk_events

from tests.proxy_fault_cluster import DIVERGED, Case, Cluster, expected, piece

logger = logging.getLogger(__name__)

RESPONSE_ENDS = {"response.completed", "response.incomplete", "response.failed"}


@dataclass
class Outcome:
    status: int
    kind: str  # "full", "refused", "load", "failed"
    detail: Any = None  # the refusal's body; the error's code
    stream_error: bool = False  # a 200 stream that ended with an error event
    error_code: str | None = None


def check_answer(
    case: Case, cluster: Cluster, r: int, stream: bool, resp: httpx.Response
) -> Outcome:
    """The request's outcome, its invariants asserted."""
    status, ctype = resp.status_code, resp.headers.get("content-type", "")
    assert status != 500 and status in (200, 400, 429, 502, 503), (status, resp.text)
    if status != 200:
        err = resp.json()["error"]
        if status == 400:
            assert _refused(cluster, r, resp.json()), (resp.json(), cluster.refusals[r])
            return Outcome(status, "refused", resp.json())
        if status == 429:
            assert resp.headers.get("retry-after"), resp.headers
            assert resp.json() in cluster.loads[r], (resp.json(), cluster.loads[r])
            return Outcome(status, "load")
        if status == 503 and err.get("code") == "overloaded":
            assert resp.headers.get("retry-after"), resp.headers
            return Outcome(status, "load")
        code = err.get("code")
        assert (status, code) in ((502, "upstream_error"), (503, "no_healthy_nodes")), resp.text
        return Outcome(status, "failed", code)
    if case.responses:
        return check_response(case, cluster, r, stream, resp)
    wants = [expected(r, case.length, j) for j in range(case.choices)]
    if not stream:
        assert ctype.startswith("application/json"), ctype
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == list(range(case.choices)), choices
        for choice, want in zip(choices, wants, strict=True):
            assert choice["token_ids"] == want, (choice, want)
            text = choice["message"]["content"] if case.chat else choice["text"]
            assert text == "".join(map(piece, want)) and choice["finish_reason"] == "length"
        return Outcome(status, "full")
    assert ctype.startswith("text/event-stream"), ctype
    assert resp.text.endswith("data: [DONE]\n\n"), resp.text[-200:]
    events = sse_chunk_events([resp.text])
    errors = [i for i, e in enumerate(events) if "error" in e]
    assert errors in ([], [len(events) - 1]), events  # one error at most, the last event
    every = [c for e in events for c in e.get("choices", [])]
    assert {c["index"] for c in every} <= set(range(case.choices)), every
    for j, want in enumerate(wants):
        chunks = [c for c in every if c["index"] == j]
        ids = [t for c in chunks for t in c.get("token_ids") or []]
        if case.chat:
            text = "".join(c.get("delta", {}).get("content") or "" for c in chunks)
        else:
            text = "".join(c.get("text") or "" for c in chunks)
        assert len(ids) <= len(want), (j, ids, want)
        for got, token in zip(ids, want, strict=False):
            assert got == token or (got == DIVERGED and r in cluster.diverged), (j, ids, want)
        assert text == "".join(map(piece, ids)), (j, text, ids)
        if not errors:
            assert len(ids) == len(want), (j, ids, want)  # never a silently truncated answer
            assert chunks[-1]["finish_reason"] == "length", chunks[-1]
    if not errors:
        return Outcome(status, "full")
    last = events[-1]
    err = last["error"]
    if _refused(cluster, r, last):
        return Outcome(status, "refused", last, True)
    if last in cluster.loads[r] or err.get("code") == "overloaded":
        return Outcome(status, "load", None, True, err.get("code"))
    code = err.get("code")
    assert code in ("upstream_error", "retry_diverged", "no_healthy_nodes"), last
    return Outcome(status, "failed", code, True, code)


def _refused(cluster: Cluster, r: int, body: dict[str, Any]) -> bool:
    """``body`` is a node's refusal of request ``r`` (a batch's: naming its prompt, as
    ``prompt[i]``, as the proxy names it)."""
    if body in cluster.refusals[r]:
        return True
    err = body.get("error") or {}
    where = err.get("param")
    if not (isinstance(where, str) and where.startswith("prompt[")):
        return False
    message = str(err.get("message")).removeprefix(f"{where}: ")
    return {**body, "error": {**err, "param": "prompt", "message": message}} in cluster.refusals[r]


def check_response(
    case: Case, cluster: Cluster, r: int, stream: bool, resp: httpx.Response
) -> Outcome:
    """A /v1/responses request's 200: its ``response`` object, or its events (one
    ``response.completed``/``incomplete``/``failed`` last, the text the request's own)."""
    ids = expected(r, case.length)
    want = "".join(map(piece, ids))

    def agrees(text: str, whole: bool) -> bool:  # a wrong token only from a replay
        got = [int(t) for t in re.findall(r"<(-?\d+)>", text)]
        if text != "".join(map(piece, got)) or len(got) > len(ids):
            return False
        if whole and len(got) != len(ids):
            return False
        return all(g == w or (g == DIVERGED and r in cluster.diverged)
                   for g, w in zip(got, ids, strict=False))  # fmt: skip

    ctype = resp.headers.get("content-type", "")
    if not stream:
        assert ctype.startswith("application/json"), ctype
        body = resp.json()
        assert body["status"] == "incomplete", body  # cut by max_output_tokens
        (item,) = body["output"]
        assert agrees(item["content"][0]["text"], True), (item, want)
        return Outcome(200, "full")
    assert ctype.startswith("text/event-stream"), ctype
    events = sse_chunk_events([resp.text])
    ends = [i for i, e in enumerate(events) if e["type"] in RESPONSE_ENDS]
    assert ends == [len(events) - 1], [e["type"] for e in events]  # one end, the last
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    last = events[-1]
    if last["type"] != "response.failed":
        assert last["type"] == "response.incomplete", last
        assert agrees(text, True), (text, want)
        assert last["response"]["output"][0]["content"][0]["text"] == text, last
        return Outcome(200, "full")
    assert agrees(text, False), (text, want)
    err = last["response"]["error"]  # OpenAI's code; the node's or proxy's after the message
    code = err["message"].rsplit("(", 1)[-1].rstrip(")")
    if err["code"] == "rate_limit_exceeded":
        return Outcome(200, "load", None, True, code)
    # A node's refusal: the node's body it stands for (as a chat stream's last event).
    refusals = [e for e in cluster.refusals[r] if err["message"].startswith(e["error"]["message"])]
    if refusals:  # the client's error stays the client's (OpenAI's code for it)
        too_long = refusals[0]["error"].get("code") == "context_length_exceeded"
        assert err["code"] == ("context_length_exceeded" if too_long else "invalid_prompt"), err
        return Outcome(200, "refused", refusals[0], True)
    assert err["code"] == "server_error", err
    return Outcome(200, "failed", code, True, code)


def tokens_in(text: str) -> int:
    """The tokens a stream so far holds (a /v1/responses stream: a delta is one)."""
    events = sse_chunk_events([text])
    deltas = sum(e.get("type") == "response.output_text.delta" for e in events)
    return deltas + sum(len(c.get("token_ids") or []) for e in events
                        for c in e.get("choices", []))  # fmt: skip
