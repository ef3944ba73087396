"""``ScriptedEngine``: an engine for the HTTP layer's in-process tests whose every request
answers a scripted text (a few bytes per output, each token with a log probability),
over the byte tokenizer with a chat template that takes variables (``TemplateBytes``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from engine.outputs import RequestOutput, TokenLogprob
from engine.tokenizer import ByteTokenizer, simple_chat_template


class TemplateBytes(ByteTokenizer):
    """The byte tokenizer with a chat template that takes variables (``enable_thinking``)."""

    @property
    def supports_template_kwargs(self) -> bool:
        return True

    def apply_chat_template(self, messages: Any, template_kwargs: Any = None,
                            add_generation_prompt: bool = True, tools: Any = None) -> str:  # fmt: skip
        return simple_chat_template(messages, add_generation_prompt, tools)


class StubEngine:
    """What the HTTP layer needs of an engine besides ``generate``: a healthy model "m"
    of a 4096-token context over the byte tokenizer, grammars not run, nothing to abort."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_name, self.max_model_len, self.vocab_size = "m", 4096, 512
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.healthy, self.dead_reason = True, None
        self.grammars = SimpleNamespace(compile=lambda so: None)  # grammars are not run

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        return None

    async def settle(self, request_id: str, stop_string: bool) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def kv_info(self) -> dict[str, Any]:
        return {"engine_id": "e"}


class ScriptedEngine(StubEngine):
    """An engine whose every request answers ``text``, a few bytes per output (the last
    output "length"), each token with a log probability."""

    def __init__(self, text: str, per_output: int = 3) -> None:
        super().__init__(TemplateBytes())
        self.text, self.per_output = text, per_output
        self.params: list[Any] = []  # each request's SamplingParams

    async def generate(self, request_id: str, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        self.params.append(args[1])
        ids = list(self.text.encode())
        for i in range(0, len(ids), self.per_output):
            chunk = ids[i : i + self.per_output]
            last = i + self.per_output >= len(ids)
            lps = [TokenLogprob(t, -1.0) for t in chunk]
            yield RequestOutput(request_id, chunk, last, "length" if last else None,
                                new_logprobs=lps)  # fmt: skip


def chat(client: Any, messages: list[Any], /, status: int = 200, **body: Any) -> dict[str, Any]:
    """A chat completion's body from ``client`` (a test client of a node app); ``body``
    may give other ``messages``."""
    body = {"messages": messages, "max_tokens": 64, **body}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def chat_chunks(client: Any, messages: list[Any], /, **body: Any) -> list[dict[str, Any]]:
    """A streamed chat completion's chunks (it must end with ``[DONE]``)."""
    body = {"messages": messages, "max_tokens": 64, **body, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]
