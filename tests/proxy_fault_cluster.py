"""The stand-in cluster of the proxy's fault property test
(``tests/test_property_proxy_faults.py``): what a node may do with a request (``Act``),
an example's whole script (``Case``), and the stand-in nodes that play it (``Cluster``:
each node's handler, and what it said to whom)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvconnector.base import KV_NOT_RESERVED
from tests.proxy_fault_membership import HealthScript, Member
from tests.standin_http import SeenRequest, answer, node_facts

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 1.0  # --request-timeout: a node's next bytes (a loaded box: not less)
HANG_S = REQUEST_TIMEOUT_S + 0.4  # a hung node: past it
KV_WAIT_S = 0.2  # a decode node waits this long at most for P's answer (its KV)
DEADLINE_S = 20.0  # every request ends by then
DIVERGED = 99_999  # the token id a diverging replay puts in

# -- scripts ---------------------------------------------------------------------------------

PREFILL_ACTS = ("ok", "refuse", "load429", "load503", "fail500", "close", "hang", "no_room")
# A decode node's; those whose outcome does not depend on streaming first (``BEFORE``).
BEFORE_ACTS = ("ok", "refuse", "load429", "load503", "fail500", "close", "hang", "event")
EVENTS = ("server", "untyped", "client", "status400", "gateway", "load", "overloaded",
          "status400str", "openai_rate")  # fmt: skip
LOAD_EVENTS = {"load", "overloaded", "openai_rate"}
FAILING = {"fail500", "close", "hang", "break"}  # fail as a node (events: by kind)
FAILING_EVENTS = {"server", "untyped", "gateway"}


@dataclass(frozen=True)
class Act:
    """What a node does with one request: ``kind``; ``k`` tokens first (``break``,
    ``event``, ``hang`` of a stream) or the position a diverging replay changes
    (``diverge``); ``event``: the error event's kind."""

    kind: str
    k: int = 0
    event: str = ""

    @property
    def fails_node(self) -> bool:
        return self.kind in FAILING or (self.kind == "event" and self.event in FAILING_EVENTS)

    def __repr__(self) -> str:
        extra = f"{self.event}@{self.k}" if self.kind == "event" else f"@{self.k}"
        return self.kind + (extra if self.kind in ("event", "break", "hang", "diverge") else "")


@dataclass(frozen=True)
class Leave:
    """A client that leaves: ``how`` "disconnect" (its connection closes: the server's
    ``receive`` says ``http.disconnect``) or "cancel" (its request's task is cancelled, as
    an in-process client's); ``when``: after ``delay`` seconds (0: as soon as its body is
    in) or, a stream, once ``tokens`` tokens reached it."""

    how: str
    delay: float = 0.0
    tokens: int | None = None

    def __repr__(self) -> str:
        at = f"{self.tokens} tokens" if self.tokens is not None else f"{self.delay}s"
        return f"Leave({self.how} after {at})"


@dataclass(frozen=True)
class Case:
    n_requests: int
    waves: tuple[int, ...]  # requests per wave, concurrent within one
    length: int  # tokens per answer
    mode: str  # "stream", "json", "both" (the same script each way, compared)
    shape: str  # "prestream", "stop" (D's stream is the whole answer), "alone" (D alone)
    max_retries: int
    migration_limit: int
    routing: str
    skip_first: bool  # --node-skip-first-token: D omits the token P streamed
    kv_wait: bool  # a decode node answers once P answered (else at once: legs race)
    fallback: bool  # --prefill-fallback: D alone once no prefill node is left
    prefill: tuple[tuple[Act, ...], ...]  # [node][request]
    decode: tuple[tuple[Act, ...], ...]
    leave: tuple[Leave | None, ...] = ()  # [request]: its client leaves (None: stays)
    chat: bool = False  # chat completions (else completions)
    n: int = 1  # choices per request (``n``; with a seed: choice j's is ``seed + j``)
    responses: bool = False  # /v1/responses (chat-shaped legs: ``chat`` too)
    batch: int = 1  # completions: prompts per request (choice ``b * n + j``: prompt b's j-th)
    # Per node (P's, then D's; none: each static, and its /health passing at once).
    members: tuple[Member, ...] = ()  # static, or registered and leaving, or joining
    health: tuple[HealthScript, ...] = ()  # its /health once the waves are over

    @property
    def choices(self) -> int:
        return self.n * self.batch


# -- stand-in nodes --------------------------------------------------------------------------

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def expected(r: int, length: int, j: int = 0) -> list[int]:
    """Request ``r``'s answer (its choice ``j``'s): its own token ids (no other request's,
    no other choice's)."""
    return [1000 + 100 * r + 10 * j + i for i in range(length)]


def seed_of(r: int) -> int:
    """The seed a request with several choices is sent with (choice j's: ``+ j``)."""
    return 7000 + 100 * r


def choice_of(r: int, body: dict[str, Any]) -> int:
    """The choice a leg is of (0 unless the request has several: its seed tells)."""
    seed = body.get("seed")
    return seed - seed_of(r) if seed is not None and 0 <= seed - seed_of(r) < 10 else 0


def prompt_of(r: int, b: int) -> str:
    """Request ``r``'s prompt ``b`` (of a batch; 0: its only one)."""
    return f"request-{r}" + (f"/{b}" if b else "")


def request_of(prompt: str) -> tuple[int, int]:
    """The request and the batch's prompt a leg is of (``prompt_of``'s inverse)."""
    r, _, b = prompt.removeprefix("request-").partition("/")
    return int(r), int(b or 0)


def piece(token: int) -> str:
    return f"<{token}>"


def _sse_chunk(event: Any) -> bytes:
    data = b"data: [DONE]\n\n" if event is None else f"data: {json.dumps(event)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _token_event(token: int, last: bool, chat: bool) -> dict[str, Any]:
    choice = {"index": 0, "text": piece(token), "token_ids": [token],
              "finish_reason": "length" if last else None}  # fmt: skip
    if chat:
        choice["delta"] = {"content": choice.pop("text")}
    return {"choices": [choice], "model": "tiny"}


def _role_event() -> dict[str, Any]:
    """A chat stream's first event: the role alone."""
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
              "finish_reason": None}  # fmt: skip
    return {"choices": [choice], "model": "tiny"}


def _whole(ids: list[int], chat: bool) -> dict[str, Any]:
    """A whole answer's choice (P's: its first token)."""
    text = "".join(map(piece, ids))
    choice: dict[str, Any] = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": choice.pop("text")}
    return choice


def _error(name: str, r: int, kind: str) -> tuple[dict[str, Any], int]:
    """An error event (or body) of ``kind`` from node ``name`` for request ``r``, and the
    status it stands for."""
    msg = f"{name} says {kind} to request {r}"
    err: dict[str, Any] = {
        "server": {"message": msg, "type": "server_error", "param": None, "code": None},
        "untyped": {"message": msg},
        "client": {"message": msg, "type": "invalid_request_error", "param": "prompt",
                   "code": None},
        "status400": {"message": msg, "type": "BadRequestError", "param": None, "code": 400},
        "gateway": {"message": msg, "type": "GatewayTimeout", "param": None, "code": 504},
        "load": {"message": msg, "type": "rate_limit_error", "param": None,
                 "code": "overloaded"},
        "overloaded": {"message": msg, "type": "server_error", "param": None,
                       "code": "overloaded"},
        # A status as a string; OpenAI's rate limit (its type "requests", its code a string).
        "status400str": {"message": msg, "type": "BadRequestError", "param": None,
                         "code": "400"},
        "openai_rate": {"message": msg, "type": "requests", "param": None,
                        "code": "rate_limit_exceeded"},
    }[kind]  # fmt: skip
    status = {"client": 400, "status400": 400, "gateway": 504, "load": 429, "overloaded": 503,
              "status400str": 400, "openai_rate": 429}  # fmt: skip
    return {"error": err}, status.get(kind, 500)


@dataclass
class Cluster:
    """The stand-in nodes' scripts and what they said to whom."""

    case: Case
    refusals: dict[int, list[Any]] = field(default_factory=lambda: defaultdict(list))
    loads: dict[int, list[Any]] = field(default_factory=lambda: defaultdict(list))
    diverged: set[int] = field(default_factory=set)  # requests a replay diverged for
    kv: dict[str, asyncio.Event] = field(default_factory=dict)  # P answered, by transfer
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # hung nodes end now
    # The legs a node is still answering: (node, transfer id) -> request.
    active: dict[tuple[str, str], int] = field(default_factory=dict)
    served: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))  # by node
    # The health round by hand under way (the waves are over): /health answers by
    # ``case.health``; None: 200.
    health_round: int | None = None

    def health_of(self, name: str) -> HealthScript:
        i = int(name[1:]) + (0 if name[0] == "P" else len(self.case.prefill))
        return self.case.health[i] if self.case.health else HealthScript()

    async def hang(self) -> None:
        """Past the proxy's timeout (or until the cluster closes)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.closing.wait(), HANG_S)

    async def close(self) -> None:
        """End the hung nodes' answers, so that their servers close cleanly."""
        self.closing.set()
        await asyncio.sleep(0.01)

    def node(self, role: str, i: int) -> Any:
        script = (self.case.prefill if role == "prefill" else self.case.decode)[i]
        name = f"{role[0].upper()}{i}"

        async def handler(req: SeenRequest) -> Any:
            if req.path == "/health" and self.health_round is not None:
                fails = self.health_of(name)
                if self.health_round < fails.fails:
                    return answer(503, {"status": "unhealthy"}) if fails.how == "503" else None
            facts = node_facts(req, "producer" if role == "prefill" else "consumer")
            if facts is not None:
                return facts
            body = req.json()
            prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
            r, b = request_of(prompt)
            body["choice"] = b * self.case.n + choice_of(r, body)
            tid = (body.get("kv_transfer_params") or {}).get("transfer_id")
            leg = (name, tid or f"no transfer {len(self.active)}")
            self.active[leg] = r
            self.served[name].add(r)
            act = script[r] if r < len(script) else Act("ok")  # after the waves: answers
            ended = True
            try:
                if role == "prefill":
                    reply = await self._prefill(name, r, act, body)
                else:
                    reply = await self._decode(name, r, act, body)
                if hasattr(reply, "__aiter__"):  # still answering while its pieces go out
                    ended = False
                    return self._until_end(reply, leg)
                return reply
            finally:
                if ended:
                    self.active.pop(leg, None)

        return handler

    async def _until_end(self, pieces: AsyncIterator[bytes], leg: tuple[str, str]) -> Any:
        try:
            async for p in pieces:
                yield p
        finally:
            self.active.pop(leg, None)

    def _refusal(self, name: str, r: int) -> bytes:
        body, status = _error(name, r, "client")
        self.refusals[r].append(body)
        return answer(status, body)

    def _load(self, name: str, r: int, kind: str) -> bytes:
        body, status = _error(name, r, kind)
        self.loads[r].append(body)
        return answer(status, body, {"Retry-After": "2"} if status == 429 else None)

    async def _common(self, name: str, r: int, act: Act) -> Any:
        """The reply of an act that is not an answer (None: answer)."""
        if act.kind == "refuse":
            return self._refusal(name, r)
        if act.kind in ("load429", "load503"):
            return self._load(name, r, "load" if act.kind == "load429" else "overloaded")
        if act.kind == "no_room":  # P's leg: no decode node reserved its KV in time
            body = {"error": {"message": f"{name}: not reserved", "type": "server_error",
                              "param": None, "code": KV_NOT_RESERVED}}  # fmt: skip
            return answer(409, body)
        if act.kind == "fail500":
            body, _ = _error(name, r, "server")
            return answer(500, body)
        if act.kind == "close":
            return b""  # closes without answering
        if act.kind == "hang" and act.k == 0:
            await self.hang()
            return b""
        return None

    async def _prefill(self, name: str, r: int, act: Act, body: dict[str, Any]) -> Any:
        tid = body["kv_transfer_params"]["transfer_id"]
        done = self.kv.setdefault(tid, asyncio.Event())
        try:
            reply = await self._common(name, r, act)
            if reply is not None:
                return reply or None
            first = expected(r, self.case.length, body["choice"])[0]
            choice = _whole([first], self.case.chat)
            return answer(200, {"choices": [choice], "kv_transfer_params": {"first_token": first},
                                "model": "tiny"})  # fmt: skip
        finally:  # D's KV comes once P's answer is out
            asyncio.get_running_loop().call_later(0.005, done.set)

    async def _decode(self, name: str, r: int, act: Act, body: dict[str, Any]) -> Any:
        kv = body.get("kv_transfer_params") or {}
        if self.case.kv_wait and kv.get(
            "remote_side_channel"
        ):  # wait for P's KV (a D prefills when it never comes)
            done = self.kv.setdefault(kv["transfer_id"], asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), KV_WAIT_S)
        stream = bool(body.get("stream"))
        if act.kind == "event":
            err, status = _error(name, r, act.event)
            if act.event in LOAD_EVENTS:
                self.loads[r].append(err)
            elif status < 500:
                self.refusals[r].append(err)
            if not stream:
                return answer(status, err)
        else:
            reply = await self._common(name, r, act)
            if reply is not None:
                return reply or None
        ids = expected(r, self.case.length, body["choice"])
        # A replay diverges where the proxy seeded it (several choices: each has a seed).
        if act.kind == "diverge" and "seed" in body and self.case.n == 1:
            ids[act.k] = DIVERGED
            self.diverged.add(r)
        if not stream:
            choice = _whole(ids, self.case.chat)
            full = answer(200, {"choices": [choice], "model": "tiny"})
            if act.kind == "break":  # the headers and half the body, then the connection closes
                return full[: len(full) - len(full.split(b"\r\n\r\n", 1)[1]) // 2], True
            return full
        k = act.k if act.kind in ("break", "event", "hang") else len(ids)
        chat = self.case.chat
        chunks = [_sse_chunk(_token_event(t, j == len(ids) - 1, chat))
                  for j, t in enumerate(ids[:k])]  # fmt: skip
        if kv.get("skip_first_token"):  # the client has it from P
            chunks = chunks[1:]
        if chat:
            chunks.insert(0, _sse_chunk(_role_event()))
        if act.kind == "break":
            return STREAM_HEAD + b"".join(chunks), True
        if act.kind == "hang":

            async def pieces() -> AsyncIterator[bytes]:
                yield STREAM_HEAD + b"".join(chunks)
                await self.hang()

            return pieces()
        if act.kind == "event":
            err, _ = _error(name, r, act.event)
            chunks.append(_sse_chunk(err))
        return STREAM_HEAD + b"".join(chunks) + _sse_chunk(None) + b"0\r\n\r\n"
