"""What a streamed client answer is made of: P's first chunk, then D's events rewritten.

``ClientStream`` is the formatting part of a streamed ``Session`` (``proxy/session.py``
runs the pairs, waits and retries, ``proxy/stream_body.py`` the stream's reruns and
migrations; ``proxy/decode_relay.py`` reads D's stream and hands its events here): the proxy's id and ``created`` on every event, the assistant role once
(chat), D's repeat of P's first token dropped (``Skipper``: unless D dropped it itself,
``--node-skip-first-token``) with its log-probability entry, and what the client has (for
replays, and for the router when it remembers what nodes cache). A stream moved
to another pair after its decode node failed mid-answer (``--migration-limit``) replays
the answer: what the client already has is checked token by token and dropped
(``Skipper`` with ``expect``); a replay that differs ends the stream (``Diverged``).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.httpkit import openai
from engine.httpkit.sse import sse_event
from engine.server.logprobs import drop_first
from engine.server.request_fields import APIError
from proxy.validation import ProxyRequest

logger = logging.getLogger(__name__)


class Diverged(APIError):
    """A rerun's tokens differ from those the client already has."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the retried request produced different tokens than those already streamed ({detail})",
            status_code=502,
            err_type="server_error",
            code="retry_diverged",
        )


class Skipper:
    """Drops what the client already got (P's first token; after a migration, the whole
    answer so far) from the start of D's stream. With ``expect`` (the ids to drop) the
    dropped ids must be those (``Diverged`` otherwise)."""

    def __init__(self, ids: int = 0, text: str = "", expect: list[int] | None = None) -> None:
        self.ids = ids
        self.text = text
        self.expect = expect
        self._checked = 0  # of ``expect``

    def apply(self, ids: list[int], text: str) -> tuple[list[int], str]:
        if self.ids:
            n = min(self.ids, len(ids))
            if self.expect is not None:
                want = self.expect[self._checked : self._checked + n]
                if ids[:n] != want:
                    raise Diverged(f"token {self._checked}: {ids[:n]!r:.60} for {want!r:.60}")
                self._checked += n
            ids, self.ids = ids[n:], self.ids - n
        if self.text and text:
            if text.startswith(self.text):
                text, self.text = text[len(self.text) :], ""
            elif self.text.startswith(text):
                text, self.text = "", self.text[len(text) :]
            elif self.expect is not None:
                raise Diverged(f"text {text!r:.40} for {self.text!r:.40}")
            else:
                logger.warning("decode text does not continue the first token's text")
                self.text = ""
        return ids, text

    @property
    def pending(self) -> bool:
        """Ids still to drop (a replay that ends here is shorter than the first answer)."""
        return self.ids > 0


def first_tokens(p_body: dict[str, Any], chat: bool) -> tuple[list[int], str]:
    """The token ids and text of P's answer (its first token)."""
    choice = p_body["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        first = (p_body.get("kv_transfer_params") or {}).get("first_token")
        ids = [] if first is None else [first]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    return list(ids), text or ""


class ClientStream:
    def __init__(
        self,
        req: ProxyRequest,
        request_id: str,
        created: int,
        node_skips_first: bool,
        index: int = 0,
    ) -> None:
        """``node_skips_first``: D leaves P's first token out of its stream itself;
        ``index``: the choice this stream is (``n`` > 1, a batch of prompts)."""
        self.req, self.request_id, self.created = req, request_id, created
        self.index = index
        self.node_skips_first = node_skips_first
        self.model: str | None = req.parsed.model
        self.role_sent = False
        self.prompt_ids_sent = False  # return_token_ids: the prompt's ids, sent once
        self.sent_ids: list[int] | None = None  # P's first token, once sent to the client
        self._first_skip = (0, "")  # what D's stream repeats of P's first token, to drop
        self._skip = Skipper()
        # What the client got from D's streams (after the first chunk), and the most any
        # one D stream sent (its raw ids and text, before ``_skip``): a migrated stream's
        # replay repeats that, and all of it is dropped.
        self.decode_tokens = 0  # of D's, sent to the client
        self._raw_ids: list[int] = []  # the current D stream's
        self._raw_text: list[str] = []
        self._replay: tuple[list[int], str] = ([], "")
        self.finished = False  # a finish_reason reached the client
        # All the client has (ids and text, the first chunk's included: ``answer``), and
        # whether the next decode stream repeats all of it (``whole_answer_next``).
        self._client_ids: list[int] = []
        self._client_text: list[str] = []
        self._whole_next = False
        # A chat answer's tool calls as the client put them together (the message's
        # ``tool_calls``), and whether it had reasoning: what the prefix index learns.
        self.answer_calls: list[dict[str, Any]] = []
        self.reasoned = False

    @property
    def response_id(self) -> str:
        return openai.response_id(self.request_id, self.req.chat)

    def first_chunk(self, p_body: dict[str, Any]) -> str:
        """The client's first events, from P's answer (a chat answer's role alone first, as
        a node streams it); D's stream then repeats P's token (dropped)."""
        ids, text = first_tokens(p_body, self.req.chat)
        self.model = p_body.get("model") or self.model
        if "\ufffd" in text:
            # An incomplete UTF-8 sequence: D's text carries the character -- all of this
            # text when D repeats the token, else (D took the token as context) its end.
            text = text.rstrip("\ufffd") if self.node_skips_first else ""
        self.sent_ids = ids
        self._first_skip = (0, "") if self.node_skips_first else (len(ids), text)
        self._skip = Skipper(*self._first_skip)
        self._client_ids.extend(ids)
        self._client_text.append(text)
        chat = self.req.chat
        choice: dict[str, Any] = {"index": self.index}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        logprobs = p_body["choices"][0].get("logprobs")  # P sampled the first token
        choice.update(logprobs=logprobs, finish_reason=None, stop_reason=None, token_ids=ids)
        body = self.envelope([choice], usage=True)
        # A chat stream opens with the role alone (a node's, vLLM's and OpenAI's shape).
        first = self.envelope([self._role_choice()], usage=True) if chat else body
        self.role_sent = chat
        # return_token_ids: P's prompt ids (a chat response's, a completion choice's).
        prompt_ids = (p_body if chat else p_body["choices"][0]).get("prompt_token_ids")
        if prompt_ids is not None:
            (first if chat else choice)["prompt_token_ids"] = prompt_ids
            self.prompt_ids_sent = True
        if self.req.parsed.continuous_usage:  # the usage so far: the prompt (and this token)
            prompt = (p_body.get("usage") or {}).get("prompt_tokens") or 0
            for event, n in ((first, 0), (body, len(ids))) if chat else ((body, len(ids)),):
                event["usage"] = {"prompt_tokens": prompt, "completion_tokens": n,
                                  "total_tokens": prompt + n}  # fmt: skip
        return (sse_event(first) if chat else "") + sse_event(body)

    def _role_choice(self) -> dict[str, Any]:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None, "stop_reason": None,
                "token_ids": []}  # fmt: skip

    def decode_starts(self) -> None:
        """A decode stream (the first, or a rerun's) starts: drop what it repeats of what
        the client has (P's first token, if it was sent, and what earlier decode streams
        sent: those ids must come again)."""
        if len(self._raw_ids) > len(self._replay[0]):
            self._replay = (self._raw_ids, "".join(self._raw_text))
        self._raw_ids, self._raw_text = [], []
        if self._whole_next:  # a decode node alone: it repeats everything, P's token too
            self._whole_next = False
            ids = list(self._client_ids)
            self._skip = Skipper(len(ids), "".join(self._client_text), expect=ids)
            return
        replay_ids, replay_text = self._replay
        if not replay_ids:
            self._skip = Skipper(*self._first_skip)
            return
        # D's streams are replays of one another: the next repeats what the longest sent.
        self._skip = Skipper(len(replay_ids), replay_text, expect=replay_ids)

    def whole_answer_next(self) -> None:
        """The next decode stream is a decode node's alone after P's token was streamed:
        it repeats all the client has (checked, ``Diverged`` if it differs, and dropped)."""
        self._whole_next = True

    @property
    def has_decode_part(self) -> bool:
        """Some of D's tokens reached the client (a rerun is then a migration)."""
        return self.decode_tokens > 0

    def envelope(self, choices: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
        body = openai.envelope(
            self.request_id, self.req.chat, True, self.created, self.model, choices
        )
        if usage and self.req.parsed.include_usage:
            body["usage"] = None
        return body

    def rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """D's event for the client (None: nothing left of it to send)."""
        obj.pop("kv_transfer_params", None)
        obj["id"] = self.response_id
        obj["created"] = self.created
        choices = obj.get("choices") or []
        if not choices:
            return obj  # the usage chunk
        c = choices[0]
        c["index"] = self.index
        if "prompt_token_ids" in (obj if self.req.chat else c):  # return_token_ids
            if self.prompt_ids_sent:  # P's answer gave them, or an earlier D stream
                (obj if self.req.chat else c).pop("prompt_token_ids")
            self.prompt_ids_sent = True
        ids = list(c.get("token_ids") or [])
        if self.req.chat:
            delta = c.setdefault("delta", {})
            text = delta.get("content") or ""
        else:
            text = c.get("text") or ""
        n = len(ids)
        self._raw_ids.extend(ids)
        if text:
            self._raw_text.append(text)
        ids, text = self._skip.apply(ids, text)
        if c.get("finish_reason") is not None:
            if self._skip.pending:
                raise Diverged("the rerun's answer ended before the one already streamed")
            self.finished = True
        if n > len(ids) and self.req.parsed.logprobs is not None:
            drop_first(c.get("logprobs"), self.req.chat, n - len(ids))  # with their tokens
        c["token_ids"] = ids
        self.decode_tokens += len(ids)
        self._client_ids.extend(ids)
        if text:
            self._client_text.append(text)
        role_added = False
        if self.req.chat:
            if self.role_sent:
                delta.pop("role", None)
            else:
                delta["role"] = "assistant"
                self.role_sent = role_added = True
            if text or "content" in delta:  # a tool-call or reasoning delta may have none
                delta["content"] = text
        else:
            c["text"] = text
        # A tool-call or reasoning delta carries no content.
        parts = self.req.chat and bool(delta.get("tool_calls") or delta.get("reasoning_content"))
        if parts:
            self.reasoned = self.reasoned or bool(delta.get("reasoning_content"))
            for call in delta.get("tool_calls") or ():
                self._add_call(call)
        if not ids and not text and c.get("finish_reason") is None and not role_added and not parts:
            return None
        return obj

    def _add_call(self, piece: Any) -> None:
        """A ``delta.tool_calls`` entry: a call's first piece (with its ``id``) or more of
        its arguments (OpenAI's stream shape, merged by ``index`` as clients do)."""
        if not isinstance(piece, dict) or not isinstance(piece.get("function"), dict):
            return
        fn, at = piece["function"], piece.get("index")
        if "id" in piece:
            self.answer_calls.append({"id": piece["id"], "type": piece.get("type", "function"),
                                      "function": {"name": fn.get("name"),
                                                   "arguments": fn.get("arguments") or ""}})  # fmt: skip
        elif isinstance(at, int) and 0 <= at < len(self.answer_calls):
            self.answer_calls[at]["function"]["arguments"] += fn.get("arguments") or ""

    def answer(self) -> tuple[str, list[int]]:
        """The answer sent so far: its text and ids."""
        return "".join(self._client_text), self._client_ids
