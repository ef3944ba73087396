"""``POST /v1/responses`` live, through the ``openai`` SDK: on a colocated node and
through the proxy on a P/D pair (NIXL over UCX), answers equal to the chat completions
answer of the same conversation, streamed and not; refusals as 400s naming the Responses
field on both; a client leaving a stream aborts its request."""

from __future__ import annotations

import httpx
import pytest
from harness import MODEL, PD, Proc, Procs, metric, node_idle, wait_for

openai = pytest.importorskip("openai")
pytest.importorskip("nixl._api")
pytestmark = pytest.mark.slow

INSTRUCTIONS = "answer briefly"
PROMPT = "the river runs by the old stone road to the lake"


@pytest.fixture(scope="module")
def pd(module_procs: Procs) -> PD:
    return module_procs.pd(1, 1, "--num-blocks", "256", colocated=True)


@pytest.fixture(scope="module")
def proxy(module_procs: Procs, pd: PD) -> Proc:
    return module_procs.proxy([pd.p.url], [pd.d.url])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat_text(url: str, max_tokens: int) -> str:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": PROMPT},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


ASK = {
    "model": MODEL,
    "input": PROMPT,
    "instructions": INSTRUCTIONS,
    "max_output_tokens": 12,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


@pytest.mark.parametrize("where", ["node", "proxy"])
def test_a_response_is_the_chat_answer_streamed_or_not(pd: PD, proxy: Proc, where: str):
    url = pd.colocated.url if where == "node" else proxy.url
    want = _chat_text(pd.colocated.url, 12)
    client = _client(url)
    r = client.responses.create(**ASK)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == want
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == 12 and r.store is False
    events = list(client.responses.create(stream=True, **ASK))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == 12


@pytest.mark.parametrize("where", ["node", "proxy"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0].type"),
        ({"temperature": -1}, "temperature"),  # the chat request's own check, named as asked
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_refusals_are_400s_naming_the_responses_field(pd: PD, proxy: Proc, where, fields, param):
    url = pd.colocated.url if where == "node" else proxy.url
    body = {"model": MODEL, "input": "hi", **fields}
    resp = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert "function." not in err["message"] and "messages" not in err["param"]


def _aborted(url: str) -> float:
    label = {"model_name": MODEL, "finished_reason": "abort"}
    return metric(url, "vllm:request_success_total", label)


def test_a_client_leaving_a_stream_aborts_its_request(pd: PD, proxy: Proc):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 3000, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    before = _aborted(pd.d.url)
    with httpx.stream("POST", proxy.url + "/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("event: response.output_text.delta")
            if seen >= 3:
                break
    wait_for(lambda: _aborted(pd.d.url) > before, 30, "the decode leg aborted")
    for node in (pd.d, pd.p):
        wait_for(lambda n=node: node_idle(n.url), 30, f"{node.name} idle after the client left")
    served = metric(pd.colocated.url, "pdserve_http_requests_total", {"path": "/v1/responses"})
    assert served > 0  # the node's own route is counted under its path


def _respond(url: str, items: list[dict[str, str]], truncation: str) -> httpx.Response:
    body = {"model": MODEL, "input": items, "truncation": truncation, "instructions": INSTRUCTIONS,
            "max_output_tokens": 12, "temperature": 0, "ignore_eos": True}  # fmt: skip
    return httpx.post(url + "/v1/responses", json=body, timeout=120)


def test_truncation_auto_through_the_proxy_answers_as_the_kept_items_alone(pd: PD, proxy: Proc):
    """A conversation longer than the context (4096 tokens): refused with ``disabled``;
    with ``auto`` the P/D pair answers what the colocated node answers the fewest newest
    items alone that fit and begin with a user turn (both legs cut alike: D's answer continues P's token)."""
    items = [
        {"role": ("user", "assistant")[i % 2], "content": f"{i}: " + PROMPT * 10} for i in range(11)
    ]
    refused = _respond(proxy.url, items, "disabled")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    got = _respond(proxy.url, items, "auto")
    assert got.status_code == 200, got.text
    for k in range(2, len(items), 2):  # a cut resumes at a user turn
        want = _respond(pd.colocated.url, items[k:], "disabled")
        if want.status_code == 200:
            break
    assert want.status_code == 200, want.text
    text = [r.json()["output"][0]["content"][0]["text"] for r in (got, want)]
    assert text[0] == text[1]
    assert got.json()["usage"] == want.json()["usage"]
