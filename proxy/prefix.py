"""What the proxy remembers of the prompts it sent to each node, for prefix-aware routing.

The proxy has no tokenizer, so it keys prompts by their text (SGLang's router does the
same with a character radix tree): a completion's prompt text, a chat's messages
serialized role by role (appending a turn extends the key, as it extends the rendered
prompt; an assistant message's tool calls after its content, as templates render them;
the request's tools and template variables first, where templates render them),
or a prompt of token ids as ids. Asking a node's ``/tokenize`` would give the
engine's own block hashes, but costs a round trip and a node's CPU on every request
before it can be routed; the text is free and a shared text prefix is a shared token
prefix up to the last token of the shared part.

A key is cut into blocks of ``CHAR_BLOCK`` characters (``ID_BLOCK`` ids) and each full
block gets a hash chained with its predecessor's, as the engine's prefix cache hashes
full KV blocks (``engine/core/kv_cache_manager.py``): block *i*'s hash stands for the
whole prefix up to it, and a partial last block is never matched. ``PrefixIndex`` keeps,
per node, the hashes of what the node served in LRU order with a cap (a prompt routed
there counts as on its way until its request ends: kept when the node served it,
forgotten when it did not -- a refused pair, a refused request, a client that left); a prompt's
blocks are touched last block first, so a prefix is always more recent than its
extensions and eviction trims prompts from their ends, never leaves a hole in a chain.
A node that goes out of rotation or restarts loses its entries (``drop``).

A request's ``cache_salt`` (vLLM's prefix-cache isolation) roots its chain: the engine
mixes it into the first KV block's hash, so a salted prompt hits only its own salt's
blocks, and its key here shares no hash with another salt's or an unsalted one -- tenants'
identical prompts are routed independently, never after another tenant's cache.

``TokenEstimator`` turns characters into prompt tokens for ``--disagg-min-prompt-tokens``:
``--chars-per-token`` at first, then learned (a moving average) from the
``usage.prompt_tokens`` the nodes answer with.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.server.chat_protocol import parse_messages
from engine.server.protocol import BaseRequest, ChatCompletionRequest, CompletionRequest
from engine.server.request_fields import APIError
from proxy.cache_keys import affinity

CHAR_BLOCK = 64  # characters per block of a text key (about 16 tokens of English)
ID_BLOCK = 16  # token ids per block of an ids key (the engine's default --block-size)
KINDS = ("text", "chat", "ids")


def _chat_text(messages: Sequence[dict[str, Any]]) -> str:
    """Messages (validated: ``parse_messages``) as one string; a conversation with one
    more turn extends it. An assistant message's tool calls follow its content, as chat
    templates render them: each its name and its arguments (compact JSON of the object
    the request's text was parsed into; text that is no JSON object as it is)."""
    out = []
    for m in messages:
        out.append(f"\x1e{m.get('role', '')}\x1f{m.get('content', '')}")
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
            out.append(f"\x1d{fn.get('name', '')}\x1d{args}")
    return "".join(out)


def _chat_head(req: ChatCompletionRequest) -> str:
    """What a chat template renders before the messages besides them: the request's
    tools (most templates put them in the system part) and its ``chat_template_kwargs``
    (e.g. ``enable_thinking``); empty without either, so such keys are the messages'."""
    tools = req.tools.template_tools() if req.tools is not None else None
    extra = req.chat_template_kwargs or None
    if tools is None and extra is None:
        return ""
    return "\x1c" + json.dumps([tools, extra], ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the index sees it: its kind, length and the chained block hashes."""

    kind: str  # "text" (a completion prompt), "chat" (messages) or "ids" (token ids)
    length: int  # characters ("ids": token ids)
    hashes: tuple[int, ...]  # one per full block
    tail: str | tuple[int, ...]  # what follows the last full block (for ``extend``)
    salt: str | None = field(default=None, repr=False)  # ``cache_salt``: the chain's root
    # ``prompt_cache_key`` (with the salt) as ``proxy/cache_keys.py`` remembers it; None:
    # the request has none. Routes with ``--routing prefix``, never a block of the chain.
    affinity: bytes | None = field(default=None, repr=False)

    @property
    def block(self) -> int:
        return ID_BLOCK if self.kind == "ids" else CHAR_BLOCK

    @classmethod
    def of(cls, kind: str, seq: str | Sequence[int], salt: str | None = None) -> PromptKey:
        if kind == "ids":
            seq = tuple(seq)
        return _chain(kind, salt, _root(kind, salt), (), seq, 0)

    def extend(self, more: str | Sequence[int]) -> PromptKey:
        """The key of this prompt followed by ``more`` (e.g. the answer, which the
        decode node caches too)."""
        if self.kind == "ids":
            more = tuple(more)
        elif not isinstance(more, str):
            raise TypeError("a text key extends with text")
        parent = self.hashes[-1] if self.hashes else _root(self.kind, self.salt)
        seq = self.tail + more  # type: ignore[operator]
        done = self.length - len(self.tail)
        key = _chain(self.kind, self.salt, parent, self.hashes, seq, done)
        return key if self.affinity is None else dataclasses.replace(key, affinity=self.affinity)


def _root(kind: str, salt: str | None) -> int:
    """The parent of a key's first block: its kind's, or its kind's and salt's."""
    return hash(kind) if salt is None else hash((kind, "cache_salt", salt))


def _chain(
    kind: str, salt: str | None, parent: int, hashes: tuple[int, ...], seq: Any, done: int
) -> PromptKey:
    b = ID_BLOCK if kind == "ids" else CHAR_BLOCK
    full = len(seq) // b
    out = list(hashes)
    for i in range(full):
        parent = hash((parent, seq[i * b : (i + 1) * b]))
        out.append(parent)
    return PromptKey(kind, done + len(seq), tuple(out), seq[full * b :], salt)


def prompt_key(parsed: BaseRequest) -> PromptKey:
    """The key of a validated completion or chat request (its ``cache_salt`` the root,
    its ``prompt_cache_key`` the affinity)."""
    salt = parsed.cache_salt
    if isinstance(parsed, ChatCompletionRequest):
        key = PromptKey.of("chat", _chat_head(parsed) + _chat_text(parsed.messages), salt)
    else:
        assert isinstance(parsed, CompletionRequest)
        if parsed.prompt_token_ids is not None:
            key = PromptKey.of("ids", parsed.prompt_token_ids, salt)
        else:
            key = PromptKey.of("text", parsed.prompt_text or "", salt)
    near = affinity(parsed.prompt_cache_key, salt)
    return key if near is None else dataclasses.replace(key, affinity=near)


def answer_suffix(
    key: PromptKey,
    text: str,
    token_ids: Sequence[int],
    calls: list[dict[str, Any]] | None = None,
    reasoned: bool = False,
) -> str | Sequence[int]:
    """What an answer appends to ``key`` in the next request of the same conversation
    (empty: nothing). A chat answer: its content and tool ``calls`` (the message's
    ``tool_calls``, as the client got them and sends them back). One with reasoning
    (``reasoned``) adds nothing: the decode node cached the reasoning right after the
    prompt, and the next turn's prompt leaves it out (``reasoning_content`` is not sent
    to the template), so that prompt parts from the cache where the answer begins."""
    if key.kind == "ids":
        return token_ids
    if key.kind != "chat":
        return text
    if reasoned:
        return ""
    message = {"role": "assistant", "content": text, "tool_calls": calls or None}
    try:
        return _chat_text(parse_messages({"messages": [message]}))  # as the next turn's
    except APIError:
        return ""  # calls in a shape no client could send back


class PrefixIndex:
    """Per node, the block hashes of the prompts it served: LRU, at most ``max_blocks``
    per node; and those of the prompts on their way to it (``begin``: routed there, not
    yet served), matched as held until their request ends (``end``), so that requests
    sharing a prefix follow each other to a node before the first one is done."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._nodes: dict[str, OrderedDict[int, None]] = {}
        # url -> block hash -> requests on their way with it; ``_epoch``: the ticket of
        # each url's ``_pending`` entry, new (never seen before) each time one is made, so
        # a ``begin`` from before a drop ends without touching what came after it. Both
        # hold only urls with requests on their way (nothing of nodes long gone).
        self._pending: dict[str, Counter[int]] = {}
        self._epoch: dict[str, int] = {}
        self._tickets = itertools.count(1)
        self.evicted_total = 0

    def match(self, url: str, key: PromptKey) -> int:
        """How many leading blocks of ``key`` ``url`` holds (or is being sent), as far as
        the proxy knows."""
        blocks = self._nodes.get(url) or {}
        pending = self._pending.get(url) or {}
        n = 0
        for h in key.hashes:
            if h not in blocks and h not in pending:
                break
            n += 1
        return n

    def begin(self, url: str, key: PromptKey) -> int:
        """A request with ``key`` was routed to ``url``: matched from now on, until
        ``end``; returns the ticket ``end`` takes."""
        if not key.hashes:
            return 0  # nothing on its way: ``end`` has nothing to take back
        if url not in self._pending:
            self._pending[url], self._epoch[url] = Counter(), next(self._tickets)
        self._pending[url].update(key.hashes)
        return self._epoch[url]

    def end(self, url: str, key: PromptKey, ticket: int, served: bool) -> None:
        """The request ``begin`` gave ``ticket`` for ended; ``served``: ``url`` computed (or
        received) its prompt, which it now holds (``insert``)."""
        pending = self._pending.get(url)
        if pending is not None and ticket == self._epoch.get(url) and key.hashes:
            pending.subtract(key.hashes)
            for h in key.hashes:
                if pending.get(h, 1) <= 0:
                    del pending[h]
            if not pending:  # every request of this ticket ended
                del self._pending[url], self._epoch[url]
        if served:
            self.insert(url, key)

    def insert(self, url: str, key: PromptKey) -> None:
        """Record that ``url`` computed (or received) ``key``'s blocks."""
        if not key.hashes:
            return
        blocks = self._nodes.get(url)
        if blocks is None:
            blocks = self._nodes[url] = OrderedDict()
        # Last block first: the prefix ends up most recent, so it is evicted last.
        for h in reversed(key.hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        over = len(blocks) - self.max_blocks
        for _ in range(over):
            blocks.popitem(last=False)
        if over > 0:
            self.evicted_total += over

    def drop(self, url: str) -> None:
        """Forget everything about ``url`` (it restarted, or its cache is unknown), the
        prompts on their way to it too."""
        self._nodes.pop(url, None)
        self._pending.pop(url, None)
        self._epoch.pop(url, None)  # its tickets end nothing now (the next begin: a new one)

    def size(self, url: str) -> int:
        """Blocks remembered for ``url``, those of prompts on their way to it included."""
        blocks = self._nodes.get(url) or {}
        pending = self._pending.get(url) or {}
        return len(blocks) + sum(1 for h in pending if h not in blocks)

    def total(self) -> int:
        return sum(len(b) for b in self._nodes.values())


class TokenEstimator:
    """Prompt tokens of a key: exact for ids, else characters / characters-per-token,
    the ratio learned per kind from the prompt token counts nodes report."""

    ALPHA = 0.2  # weight of a new observation in the moving average

    def __init__(self, chars_per_token: float) -> None:
        self.ratio = {"text": chars_per_token, "chat": chars_per_token}
        self.observed = {"text": 0, "chat": 0}

    def tokens(self, key: PromptKey, units: int | None = None) -> float:
        """Tokens of ``units`` characters of ``key`` (default: all of it)."""
        n = key.length if units is None else units
        return float(n) if key.kind == "ids" else n / self.ratio[key.kind]

    def observe(self, key: PromptKey, prompt_tokens: Any) -> None:
        """A node reported ``prompt_tokens`` for the prompt of ``key``."""
        if key.kind == "ids" or not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
            return
        r = min(max(key.length / prompt_tokens, 0.05), 100.0)
        kind = key.kind
        if self.observed[kind] == 0:
            self.ratio[kind] = r
        else:
            self.ratio[kind] += self.ALPHA * (r - self.ratio[kind])
        self.observed[kind] += 1
