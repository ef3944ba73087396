"""A chat completion stream translated into the Responses API's events.

``ResponsesStream`` is fed the chat stream's chunks in order (``feed``), then its end
(``finish``: the ``[DONE]``) or its failure (an error event: ``fail``), and answers the
events each one makes. The events follow OpenAI's order: ``response.created`` and
``response.in_progress`` first; each output item is opened (``output_item.added``, a
content part), grows by deltas (reasoning text, output text, function-call arguments)
and is closed (the ``.done`` events) before the next one opens; last comes
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it,
``response.failed``, after an ``error`` event, when it failed: the open item closed
``incomplete`` first) with the whole ``response`` object. ``sse`` frames an event
(``event:`` + ``data:``; no ``[DONE]`` follows, as OpenAI's).

A body (``response_object``) is built by the same ``ResponsesStream``: its parts fed as
the chunks of a stream, so that it is the final ``response`` a stream of the same answer
ends with -- its items in the text's order (a node's ``before_reasoning``: the content
and tool calls written before the reasoning; ``before_tool_calls``: the content written
before each call, and the tokens before it), their ids, statuses and log probabilities.
"""

from __future__ import annotations

import json
from typing import Any

from engine.responses_api import output as out
from engine.responses_api.request import ResponseEcho

Event = dict[str, Any]


def sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class _Item:
    """One output item being streamed: its kind, index in ``output`` and what it holds."""

    def __init__(self, kind: str, index: int, rid: str, call: int = -1) -> None:
        self.kind, self.index, self.call = kind, index, call
        self.rid = rid  # its id's tail: the response's, or with its index for a second one
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.call_id: Any = None
        self.name: Any = None
        self.body: dict[str, Any] = {}


class ResponsesStream:
    def __init__(self, echo: ResponseEcho) -> None:
        self.echo = echo
        self.seq = 0
        self.rid = "0"
        self.model: Any = None
        self.created: Any = None
        self.started = False
        self.ended = False
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.finish_reason: Any = None
        self.usage: Any = None
        self.pending_logprobs: list[dict[str, Any]] = []  # tokens whose text is not out yet

    # -- framing ------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(self, status: str) -> dict[str, Any]:
        return out.envelope(self.echo, self.rid, self.model, self.created, status)

    # -- the chat stream ----------------------------------------------------------------------
    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events of one chat chunk (an error event: ``fail``)."""
        if self.ended:
            return []
        if "error" in chunk:
            return self.fail(chunk.get("error"))
        events = self._start(chunk) if not self.started else []
        for choice in chunk.get("choices") or []:
            events += self._choice(choice)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return events

    def _start(self, chunk: dict[str, Any]) -> list[Event]:
        self.started = True
        self.rid = str(chunk.get("id") or "").removeprefix("chatcmpl-") or "0"
        self.model, self.created = chunk.get("model"), chunk.get("created")
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def _choice(self, choice: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        delta = choice.get("delta") or {}
        self.pending_logprobs += out.text_logprobs(choice.get("logprobs"))
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            item, events = self._item("reasoning", events)
            item.text += reasoning
            events.append(
                self._event("response.reasoning_text.delta", item_id=item.body["id"],
                            output_index=item.index, content_index=0, delta=reasoning)
            )  # fmt: skip
        content = delta.get("content")
        if content:
            item, events = self._item("message", events)
            lp, self.pending_logprobs = self.pending_logprobs, []
            item.text += content
            item.logprobs += lp
            events.append(
                self._event("response.output_text.delta", item_id=item.body["id"],
                            output_index=item.index, content_index=0, delta=content, logprobs=lp)
            )  # fmt: skip
        for call in delta.get("tool_calls") or []:
            events += self._tool_call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = next((i for i in self.items if i.kind == "call" and i.call == index), None)
        events: list[Event] = []
        if item is None:
            events += self._close()
            item = self._add("call", index)
            item.call_id, item.name = call.get("id"), fn.get("name")
            item.body = out.function_call_item(
                self.rid, index, item.call_id, item.name, "", "in_progress"
            )
            events.append(
                self._event("response.output_item.added", output_index=item.index,
                            item=dict(item.body))
            )  # fmt: skip
        args = fn.get("arguments") or ""
        if args:
            item.text += args
            events.append(
                self._event("response.function_call_arguments.delta", item_id=item.body["id"],
                            output_index=item.index, delta=args)
            )  # fmt: skip
        return events

    def _add(self, kind: str, call: int = -1) -> _Item:
        index = len(self.items)
        # A second item of a kind (a message after the reasoning that followed content
        # before <think>) has an id of its own: msg_<id>_<index>.
        again = kind != "call" and any(i.kind == kind for i in self.items)
        item = _Item(kind, index, f"{self.rid}_{index}" if again else self.rid, call)
        self.items.append(item)
        self.open = item
        return item

    def _item(self, kind: str, events: list[Event]) -> tuple[_Item, list[Event]]:
        """The open item of ``kind``, opened now (the open one closed first) if need be."""
        if self.open is not None and self.open.kind == kind:
            return self.open, events
        events = events + self._close()
        item = self._add(kind)
        if kind == "reasoning":
            item.body = out.reasoning_item(item.rid, "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            item.body = out.message_item(item.rid, "", "in_progress", [])
            part = out.output_text("", [])
        item_id = item.body["id"]
        events.append(
            self._event("response.output_item.added", output_index=item.index,
                        item=dict(item.body))
        )  # fmt: skip
        events.append(
            self._event("response.content_part.added", item_id=item_id,
                        output_index=item.index, content_index=0, part=part)
        )  # fmt: skip
        return item, events

    def _close(self, failed: bool = False) -> list[Event]:
        """The ``.done`` events of the open item (none open: none); ``incomplete`` when
        the length cut it or the response failed while it was open."""
        item, self.open = self.open, None
        if item is None:
            return []
        cut = failed or self.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        at = {"item_id": item.body["id"], "output_index": item.index}
        if item.kind == "call":
            item.body = out.function_call_item(
                self.rid, item.call, item.call_id, item.name, item.text, status
            )
            return [
                self._event("response.function_call_arguments.done", **at,
                            arguments=item.text, name=item.name),
                self._event("response.output_item.done", output_index=item.index,
                            item=item.body),
            ]  # fmt: skip
        if item.kind == "reasoning":
            item.body = out.reasoning_item(item.rid, item.text, status)
            part: dict[str, Any] = {"type": "reasoning_text", "text": item.text}
            done = self._event("response.reasoning_text.done", **at, content_index=0,
                               text=item.text)  # fmt: skip
        else:
            item.logprobs += self.pending_logprobs
            self.pending_logprobs = []
            item.body = out.message_item(item.rid, item.text, status, item.logprobs)
            part = out.output_text(item.text, item.logprobs)
            done = self._event("response.output_text.done", **at, content_index=0,
                               text=item.text, logprobs=item.logprobs)  # fmt: skip
        return [
            done,
            self._event("response.content_part.done", **at, content_index=0, part=part),
            self._event("response.output_item.done", output_index=item.index, item=item.body),
        ]

    # -- the end --------------------------------------------------------------------------------
    def finish(self) -> list[Event]:
        """The chat stream's ``[DONE]``: the open item closed, then the final event."""
        if self.ended:
            return []
        events = [] if self.started else self._start({})
        if not self.items:  # nothing was said: an empty message, as a body has
            _, events = self._item("message", events)
        events += self._close()
        self.ended = True
        status, incomplete = out.status_of(self.finish_reason)
        response = self._response(status)
        response.update(
            output=[i.body for i in self.items],
            incomplete_details=incomplete,
            usage=out.usage(self.usage),
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def fail(self, error: Any) -> list[Event]:
        """An error in the chat stream: the open item closed ``incomplete`` (its text so
        far in its ``.done`` events), an ``error`` event saying it (its own code), then
        ``response.failed`` carrying it (OpenAI's code for it), as OpenAI's streams end."""
        if self.ended:
            return []
        events = [] if self.started else self._start({})
        events += self._close(failed=True)
        self.ended = True
        response = self._response("failed")
        response.update(
            output=[i.body for i in self.items],
            error=out.error_of(error),
            usage=out.usage(self.usage),
        )
        said = self._event("error", **out.error_event(error))
        return events + [said, self._event("response.failed", response=response)]


def _before(
    message: dict[str, Any], text: str, calls: list[Any], n_lp: int
) -> tuple[str, int, int]:
    """What a body's message says came before its reasoning (a node's ``before_reasoning``:
    content, tool calls, tokens), checked against the message (it came over the network):
    ``("", 0, 0)`` when it says nothing, or nothing that fits."""
    b = message.get("before_reasoning")
    if not isinstance(b, dict) or not message.get("reasoning_content"):
        return "", 0, 0
    content, n_calls, tokens = b.get("content"), b.get("tool_calls"), b.get("tokens")
    counts = (n_calls, tokens)
    if not isinstance(content, str) or not text.startswith(content):
        return "", 0, 0
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
        return "", 0, 0
    return content, min(n_calls, len(calls)), min(tokens, n_lp)


def _call_delta(index: int, call: Any) -> dict[str, Any]:
    call = call if isinstance(call, dict) else {}
    fn = call.get("function") or {}
    return {"index": index, "id": call.get("id"), "type": "function",
            "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""}}  # fmt: skip


def _call_marks(
    message: dict[str, Any], text: str, n_calls: int, n_lp: int, before: tuple[int, int, int]
) -> list[tuple[int, int]]:
    """Where each tool call sits: the content's characters and the tokens before it, from a
    node's ``before_tool_calls``, checked against the message (it came over the network);
    when it says nothing, or nothing that fits: the calls said before the reasoning after
    its content, the others after all of it (``before``: ``_before``'s, and its content's
    length)."""
    pre, calls_before, lp_before = before
    default = [(pre, lp_before) if i < calls_before else (len(text), n_lp) for i in range(n_calls)]
    marks = message.get("before_tool_calls")
    if not isinstance(marks, list) or len(marks) != n_calls:
        return default
    out: list[tuple[int, int]] = []
    said = 0  # the tokens the last mark said
    for i, m in enumerate(marks):
        chars = m.get("chars") if isinstance(m, dict) else None
        tokens = m.get("tokens") if isinstance(m, dict) else None
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in (chars, tokens)):
            return default
        if out and (chars < out[-1][0] or tokens < said):
            return default
        said = tokens
        if chars > len(text) or (chars > pre if i < calls_before else chars < pre):
            return default
        tokens = min(tokens, n_lp)
        if tokens > lp_before if i < calls_before else tokens < lp_before:
            return default
        out.append((chars, tokens))
    return out


def response_object(echo: ResponseEcho, chat: dict[str, Any]) -> dict[str, Any]:
    """The ``response`` object of chat completion body ``chat`` (one choice): what a
    stream of the same answer ends with. Its parts are fed in the text's order -- the
    content, tool calls and reasoning, each where the node says it was written
    (``before_reasoning``, ``before_tool_calls``; by default the reasoning first, then
    the content, then the tool calls) -- each piece of content with the log
    probabilities of the tokens up to the next part (a stream's go with the content
    they come before)."""
    (choice,) = chat.get("choices") or [{}]
    message = choice.get("message") or {}
    head = {k: chat.get(k) for k in ("id", "model", "created")}
    lp = choice.get("logprobs")
    entries = list(lp.get("content") or []) if isinstance(lp, dict) else []
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    pre, n_calls, n_lp = _before(message, text, calls, len(entries))
    marks = _call_marks(message, text, len(calls), len(entries), (len(pre), n_calls, n_lp))
    # The parts that cut the content, in the text's order: (chars, tokens, delta).
    cuts = [(c, t, {"tool_calls": [_call_delta(i, calls[i])]}) for i, (c, t) in enumerate(marks)]
    if message.get("reasoning_content"):
        cuts.insert(n_calls, (len(pre), n_lp, {"reasoning_content": message["reasoning_content"]}))
    parts: list[tuple[dict[str, Any], list[Any]]] = []
    at, lp_at = 0, 0
    for chars, tokens, delta in cuts:
        if text[at:chars]:
            parts += [({"content": text[at:chars]}, entries[lp_at:tokens]), (delta, [])]
        else:  # nothing said between: the tokens wait for the next content, as streamed
            parts.append((delta, entries[lp_at:tokens]))
        at, lp_at = chars, tokens
    if text[at:]:
        parts.append(({"content": text[at:]}, entries[lp_at:]))
        lp_at = len(entries)
    parts.append(({}, entries[lp_at:]))  # the end: what is left waits for the content
    stream = ResponsesStream(echo)
    stream.feed({**head, "choices": []})
    for i, (delta, lps) in enumerate(parts):
        last = i == len(parts) - 1
        c = {"index": 0, "delta": delta, "logprobs": {"content": lps} if lps else None,
             "finish_reason": choice.get("finish_reason") if last else None}  # fmt: skip
        stream.feed({**head, "choices": [c]})
    stream.feed({**head, "choices": [], "usage": chat.get("usage")})
    return stream.finish()[-1]["response"]
