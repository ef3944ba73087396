"""``truncate_messages_to`` (the Responses API's ``truncation: "auto"``): a chat prompt too
long for the context, cut by dropping whole messages from the start of the conversation.

What may go: the messages after the leading system and developer ones (the instructions,
and the rules a conversation opens with, stay), oldest first, an assistant message's tool
calls together with the tool messages that follow it (a template never sees a tool result
without its call); what is kept begins with a user turn where there is one to begin with. What must fit is what ``resolve_max_tokens`` refuses otherwise: the
prompt and ``max_tokens`` (without one, the prompt and one token). The fewest messages are
dropped that make it fit; when even the last of them alone does not, nothing is dropped
(the request is refused as it would be without the cut, with the same numbers).

Pure: the caller renders (``render``: messages to the prompt's token ids). Fewer
messages never render a longer prompt (a template's text per message), so the fewest
drops are found by bisection: a few renders for a conversation of any length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

# Roles a conversation's leading messages keep when it is cut.
KEPT_ROLES = ("system", "developer")

Render = Callable[[list[dict[str, Any]]], list[int]]


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A chat prompt after the cut: its token ids and how many messages were dropped
    (0: the prompt as the request gave it)."""

    ids: list[int]
    dropped: int


def fits(prompt_len: int, max_tokens: int | None, context: int) -> bool:
    """Whether ``resolve_max_tokens`` takes a prompt of ``prompt_len`` tokens: with
    ``max_tokens`` the two fit the context; without, one token of answer does."""
    room = 1 if max_tokens is None else max_tokens
    return prompt_len + room <= context


def cut_points(messages: Sequence[dict[str, Any]]) -> list[int]:
    """The indices a cut conversation may resume at, in order: after the leading system and
    developer messages (the first of the others is never a cut: at least one goes), at a
    user message -- templates that want turns to alternate (Mistral's, Llama 2's) refuse
    a conversation resuming at an assistant's -- or, in a conversation with no user message
    to resume at, at any message but a tool result (it stays with the call before it).
    The last message is always kept."""
    head = _head_len(messages)
    points = [i for i in range(head + 1, len(messages)) if messages[i].get("role") != "tool"]
    users = [i for i in points if messages[i].get("role") == "user"]
    return users or points


def fit_messages(
    messages: list[dict[str, Any]],
    render: Render,
    context: int,
    max_tokens: int | None,
) -> Fitted:
    """``messages`` rendered, with the fewest leading messages dropped (``cut_points``) that
    let the prompt and the answer's room fit ``context`` tokens; none dropped when the
    whole fits or when even the last cut does not."""
    ids = render(messages)
    if fits(len(ids), max_tokens, context):
        return Fitted(ids, 0)
    points = cut_points(messages)
    if not points:
        return Fitted(ids, 0)
    head = messages[: _head_len(messages)]

    def at(i: int) -> list[int]:
        return render(head + messages[i:])

    last = at(points[-1])
    if not fits(len(last), max_tokens, context):
        return Fitted(ids, 0)  # refused with the whole prompt's numbers, as without the cut
    lo, hi, best = 0, len(points) - 1, last  # points[hi] fits; find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        got = at(points[mid])
        if fits(len(got), max_tokens, context):
            hi, best = mid, got
        else:
            lo = mid + 1
    return Fitted(best, points[hi] - len(head))


def _head_len(messages: Sequence[dict[str, Any]]) -> int:
    """How many leading messages are system or developer messages (kept by a cut)."""
    head = 0
    while head < len(messages) and messages[head].get("role") in KEPT_ROLES:
        head += 1
    return head
