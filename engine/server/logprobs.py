"""Log probabilities in the OpenAI shapes (vLLM's), and the proxy's splice of a prefill
node's entries into a decode node's answer. Torch-free: the proxy imports it.

Completions (``logprobs: k``)::

    {"tokens": [str], "token_logprobs": [float|null], "top_logprobs": [{str: float}|null],
     "text_offset": [int]}

``top_logprobs[i]`` holds the ``k`` most likely tokens and the chosen one (so ``k + 1``
entries when it is not among them; ``logprobs: 0`` gives the chosen one alone);
``text_offset[i]`` is where token ``i``'s text starts in the choice's text (in a stream: in
all the text streamed so far). With ``echo`` the prompt's tokens come first; the first
prompt token has no log probability (null).

Chat (``logprobs: true``, ``top_logprobs: k``)::

    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token": str, "logprob": float, "bytes": [int]}] * k}]}

Values are clamped at -9999.0 (JSON has no -inf), as OpenAI and vLLM do.

**P/D.** A decode node does not compute what the prefill node did: the first output token
(it arrives with the KV) and, with ``echo``, the prompt's entries. It answers them with a
null log probability (and no alternatives); the proxy fills them from the prefill node's
answer, whose entries are the same tokens at the same indices (``fill_missing``).
"""

from __future__ import annotations

import functools
from typing import Any

from engine.outputs import TokenLogprob

MIN_LOGPROB = -9999.0


def _clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


class TokenStrings:
    """A tokenizer's per-token text and bytes, cached (alternatives repeat a lot).
    ``name`` is how log probabilities name a token: its text."""

    def __init__(self, tokenizer: Any, cache_size: int = 1 << 16) -> None:
        self.text = functools.lru_cache(maxsize=cache_size)(tokenizer.token_text)
        self.name = self.text
        self._bytes = functools.lru_cache(maxsize=cache_size)(tokenizer.token_bytes)

    def bytes(self, token_id: int) -> list[int]:
        return list(self._bytes(token_id))


class TokenIdStrings(TokenStrings):
    """vLLM's ``return_tokens_as_token_ids``: tokens named ``token_id:<id>`` (a token that
    is not text of its own, e.g. a byte of a character, stays identifiable), ``bytes``
    those of the name (as vLLM); ``text`` -- and so ``text_offset`` -- stays the text."""

    def __init__(self, tokenizer: Any, cache_size: int = 1 << 16) -> None:
        super().__init__(tokenizer, cache_size)
        self.name = _token_id_name

    def bytes(self, token_id: int) -> list[int]:
        return list(_token_id_name(token_id).encode())


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def completion_logprobs(
    ids: list[int],
    entries: list[TokenLogprob | None],
    strings: TokenStrings,
    text_offset: int = 0,
) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object of ``ids`` (one entry each), their text starting
    at ``text_offset``; returns it and the offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    by_text = strings.name is strings.text  # one cache lookup per token, not two
    for tid, e in zip(ids, entries, strict=True):
        name = strings.name(tid)
        tokens.append(name)
        offsets.append(text_offset)
        text_offset += len(name if by_text else strings.text(tid))
        if e is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_clamp(e.logprob))
        alternatives = {
            strings.name(t): _clamp(lp) for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)
        }
        alternatives.setdefault(name, _clamp(e.logprob))
        top.append(alternatives)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top}
    body["text_offset"] = offsets
    return body, text_offset


def chat_logprobs(
    ids: list[int], entries: list[TokenLogprob | None], strings: TokenStrings
) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``ids`` (one entry each)."""
    content = []
    for tid, e in zip(ids, entries, strict=True):
        item: dict[str, Any] = {
            "token": strings.name(tid),
            "logprob": None if e is None else _clamp(e.logprob),
            "bytes": strings.bytes(tid),
            "top_logprobs": [],
        }
        if e is not None:
            item["top_logprobs"] = [
                {"token": strings.name(t), "logprob": _clamp(lp), "bytes": strings.bytes(t)}
                for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)
            ]
        content.append(item)
    return {"content": content}


def prompt_logprobs_entries(
    ids: list[int], entries: list[TokenLogprob | None], strings: TokenStrings, k: int
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null (the first token, which nothing
    predicts) or ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for the token itself
    (first) and the ``k`` most likely ones (ranks 1..k)."""
    out: list[dict[str, Any] | None] = []
    for tid, e in zip(ids, entries, strict=True):
        if e is None:
            out.append(None)
            continue
        item = {str(tid): {"logprob": _clamp(e.logprob), "rank": e.rank,
                           "decoded_token": strings.name(tid)}}  # fmt: skip
        for rank, (t, lp) in enumerate(zip(e.top_ids[:k], e.top_logprobs[:k], strict=True), 1):
            item.setdefault(
                str(t), {"logprob": _clamp(lp), "rank": rank, "decoded_token": strings.name(t)}
            )
        out.append(item)
    return out


def trim(entries: list[TokenLogprob | None], k: int) -> list[TokenLogprob | None]:
    """``entries`` with at most ``k`` alternatives each (computed for a larger ``k``)."""
    return [
        e
        if e is None or len(e.top_ids) <= k
        else TokenLogprob(e.token_id, e.logprob, e.top_ids[:k], e.top_logprobs[:k], e.rank)
        for e in entries
    ]


# -- the proxy's side ---------------------------------------------------------------------------


def num_entries(logprobs: Any, chat: bool) -> int:
    """How many tokens a ``logprobs`` object covers (0 for null or a malformed one)."""
    if not isinstance(logprobs, dict):
        return 0
    items = logprobs.get("content") if chat else logprobs.get("token_logprobs")
    return len(items) if isinstance(items, list) else 0


def has_missing(logprobs: Any, chat: bool, start: int = 0, echo: bool = False) -> bool:
    """Whether a decode node left entries for the prefill node's (a null log probability).
    ``start``: the answer's index of the first entry; with ``echo`` the answer's entry 0
    (the prompt's first token, which nothing predicts) is null everywhere, not missing."""
    if not isinstance(logprobs, dict):
        return False
    if chat:
        items = logprobs.get("content")
        return isinstance(items, list) and any(
            isinstance(i, dict) and i.get("logprob") is None for i in items
        )
    values = logprobs.get("token_logprobs")
    if not isinstance(values, list):
        return False
    first = 1 if echo and start == 0 else 0
    return any(v is None for v in values[first:])


def fill_missing(target: Any, source: Any, chat: bool, start: int = 0) -> int:
    """Fill ``target``'s null entries (a decode node's answer or stream chunk, whose first
    entry is the answer's ``start``-th) from ``source`` (the prefill node's answer: the same
    tokens from index 0). Returns how many were filled."""
    if not isinstance(target, dict) or not isinstance(source, dict):
        return 0
    filled = 0
    if chat:
        items, src = target.get("content"), source.get("content")
        if not isinstance(items, list) or not isinstance(src, list):
            return 0
        for i, item in enumerate(items):
            j = start + i
            if not isinstance(item, dict) or item.get("logprob") is not None or j >= len(src):
                continue
            given = src[j]
            if isinstance(given, dict) and given.get("logprob") is not None:
                item["logprob"] = given["logprob"]
                item["top_logprobs"] = given.get("top_logprobs") or []
                filled += 1
        return filled
    values, tops = target.get("token_logprobs"), target.get("top_logprobs")
    src_values, src_tops = source.get("token_logprobs"), source.get("top_logprobs")
    if not all(isinstance(x, list) for x in (values, tops, src_values, src_tops)):
        return 0
    for i, value in enumerate(values):  # type: ignore[arg-type]
        j = start + i
        if value is not None or j >= len(src_values) or src_values[j] is None:  # type: ignore[arg-type,index]
            continue
        values[i] = src_values[j]  # type: ignore[index]
        if i < len(tops) and j < len(src_tops):  # type: ignore[arg-type]
            tops[i] = src_tops[j]  # type: ignore[index]
        filled += 1
    return filled


def drop_first(logprobs: Any, chat: bool, n: int) -> None:
    """Remove the first ``n`` entries (tokens the client already got from the prefill
    node's answer)."""
    if n <= 0 or not isinstance(logprobs, dict):
        return
    keys = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for key in keys:
        items = logprobs.get(key)
        if isinstance(items, list):
            del items[:n]
