"""Stop strings in streamed text (``StopStringMatcher``)."""

from __future__ import annotations


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that may begin one.

    ``feed`` returns the text that is safe to emit and whether a stop string was hit; on a
    hit the returned text ends right before the stop string (after it with ``include``),
    and ``matched`` is that stop string.

    vLLM's rule (its v1 detokenizer, ``check_stop_strings``): a stop string must end in the
    text just fed; it may start up to ``len(stop) - 1`` characters before it, in text fed
    earlier -- with ``min_tokens``, text fed with ``check=False``, in which no stop string
    is looked for. So one that starts within ``min_tokens`` and ends after it matches; one
    that ends within it does not. When several end in the text fed, the stop strings are
    tried in the request's order and the first found is the one (vLLM's loop), wherever
    another starts; so feed one token's text at a time, as vLLM's steps add it.

    ``skip``: text the client already has (a decode leg's first token, which the proxy got
    from the prefill node): a stop string may begin in it, and it is never returned.
    """

    def __init__(self, stops: list[str], include: bool = False) -> None:
        """``include`` (``include_stop_str_in_output``): the text ends after the stop string."""
        self._stops = [s for s in stops if s]
        self._include = include
        self._held = ""
        self._sent = 0  # the first characters of ``_held`` the client already has (``skip``)
        self.matched: str | None = None  # the stop string that was hit (``stop_reason``)

    def skip(self, text: str) -> None:
        """``text`` is the answer's start, already with the client: kept (the part that
        may begin a stop string) as context for later text, never returned."""
        if not self._stops:
            return
        buf = self._held + text
        hold = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - hold :]
        self._sent = min(len(self._held), self._sent + len(text))

    def feed(self, new_text: str, final: bool = False, check: bool = True) -> tuple[str, bool]:
        """``check=False``: within ``min_tokens``: no stop string may end in ``new_text``,
        but what may begin one is held back as usual (one may end in later text)."""
        if not self._stops:
            return new_text, False
        old = len(self._held)
        buf = self._held + new_text
        if check:
            # Only a stop that ends in ``new_text``: the held text has none that may match
            # (looked for before, or within min_tokens). The first listed that is found.
            for stop in self._stops:
                at = buf.find(stop, max(0, old - len(stop) + 1))
                if at >= 0:
                    self._held = ""
                    self.matched = stop
                    return self._emit(buf, at + len(stop) if self._include else at), True
        if final:
            self._held = ""
            return self._emit(buf, len(buf)), False
        hold = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - hold :]
        return self._emit(buf, len(buf) - hold), False

    def _emit(self, buf: str, cut: int) -> str:
        """``buf[:cut]`` without what the client already has (``skip``); a stop string
        that began there leaves nothing to send (the client keeps that part of it)."""
        sent, self._sent = self._sent, max(0, self._sent - cut)
        return buf[sent:cut] if cut > sent else ""

    def _partial_suffix_len(self, buf: str) -> int:
        """The longest suffix of ``buf`` shorter than a stop string that begins it.

        Only suffixes starting with a stop's first character are tried, longest first:
        one ``startswith`` per candidate (it was one slice and a pass over every stop per
        suffix length, quadratic in a long held text, on the node's event loop)."""
        n, best = len(buf), 0
        for stop in self._stops:
            # buf[i:] longer than ``best`` and shorter than ``stop``: i from the left.
            i = buf.find(stop[0], max(0, n - len(stop) + 1), n - best)
            while i >= 0:
                if stop.startswith(buf[i:]):
                    best = n - i
                    break
                i = buf.find(stop[0], i + 1, n - best)
        return best
