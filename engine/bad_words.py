"""vLLM's ``bad_words``: words an answer must not contain.

A word becomes token id sequences (``tokenize_bad_words``, at the HTTP entry, which has
the tokenizer): the word as it is, and the word after a space when that tokenizes to a
sequence of the same length starting with another id (a new word token: vLLM's rule).
Each step that samples for the request bans, for each sequence whose first ``k - 1`` ids
end the output so far, its last id (``banned_by_bad_words``; a one-id sequence is always
banned). The output only: a sequence straddling the prompt's end is not matched (vLLM's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# A request's words: at most this many, this many characters in all (vLLM sets no bound;
# every step that samples for the request checks each of its sequences).
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 4096


def tokenize_bad_words(tokenizer: Any, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's id sequences: alone, and after a space when that is a new word token."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def banned_by_bad_words(
    sequences: Sequence[Sequence[int]], tokens: Sequence[int], start: int = 0
) -> set[int]:
    """The ids the next token may not be: each sequence's last id where the output
    (``tokens[start:]``, read in place: a step copies nothing) ends with the rest of it."""
    banned: set[int] = set()
    n = len(tokens)
    for seq in sequences:
        k = len(seq) - 1
        if k == 0:
            banned.add(seq[0])
        elif k <= n - start and all(tokens[n - k + i] == seq[i] for i in range(k)):
            banned.add(seq[k])
    return banned
