"""A ``grammar`` in Lark's own dialect made one llguidance takes, where its language is clear.

llguidance reads a ``grammar`` as Lark only when a line begins with ``start:`` (its
``grammar_from("grammar")``; anything else went to its GBNF converter: ``?start: ...``
was a 400, "Expected name"), and its Lark parser refuses priorities and ``?_rule:``. Here:

* ``is_gbnf``: a GBNF grammar is told by its rule definitions (``name ::=`` at a line's
  start); it goes to llguidance's converter as before. Anything else is Lark.
* ``llguidance_lark``: one pass over the text that knows its literals, regexes, comments
  and brackets, and rewrites rule definitions only (a name at a line's start, outside any
  bracket, followed by ``:``): the ``?`` (inline) and ``!`` (keep tokens) prefixes and
  ``.N`` priorities are dropped. None of them changes which texts the grammar takes (they
  shape Lark's parse tree, or choose among the parses of an ambiguous text), and a
  constrained decoder needs only that set. A ``?`` anywhere else (``"?"``, ``/a?/``,
  ``x?``, a comment) is left as it is.
* What llguidance cannot run is a ``LarkDialectError`` (a ``ValueError``: the request's
  400) naming the construct, its line and what to write instead: templates, ``%declare``,
  ``%override``, ``%extend``, and ``%import`` from anything but Lark's ``common``.
  ``%import common.X`` (and ``common (X, Y)``) and ``%ignore`` llguidance takes itself.
"""

from __future__ import annotations

import re

# A GBNF rule definition: llama.cpp's names take '-', and '::=' is no Lark.
_GBNF_RULE = re.compile(r"(?m)^[ \t]*[A-Za-z0-9_-]+[ \t]*::=")
# A Lark definition's head: modifiers, a name, a priority, and what follows (':' or a
# template's '{'). Lark writes the modifiers next to the name ('? x:' is no definition).
_HEAD = re.compile(
    r"(?P<mods>[?!]{1,2})?(?P<name>[_A-Za-z][_A-Za-z0-9]*)(?P<prio>\.-?[0-9]+)?"
    r"(?P<space>[ \t]*)(?P<end>:(?!:)|\{)?"
)
_DIRECTIVE = re.compile(r"%(?P<word>[A-Za-z_]+)[ \t]*(?P<arg>[A-Za-z0-9_.]*)")
_REGEX_FLAGS = "imslux"
_UNSUPPORTED = {
    "declare": (
        "a declared terminal is made by a custom lexer (a postlexer such as Lark's "
        "Indenter), which constrained decoding does not run: define the terminal with a "
        "string or a regex instead"
    ),
    "override": "edit the definition it overrides in place instead",
    "extend": "add its alternatives to the definition it extends instead",
}


class LarkDialectError(ValueError):
    """A Lark construct llguidance cannot take (the message says what to write)."""


def is_gbnf(text: str) -> bool:
    """Whether ``text`` is a GBNF grammar (a ``name ::=`` rule at a line's start)."""
    return _GBNF_RULE.search(text) is not None


def llguidance_lark(text: str) -> str:
    """``text`` (Lark) with its definitions' ``?``/``!`` prefixes and priorities dropped;
    raises ``LarkDialectError`` on a construct llguidance cannot take."""
    out: list[str] = []
    i, n, depth, line_start = 0, len(text), 0, True
    while i < n:
        c = text[i]
        if c == "\n":
            line_start = True
            out.append(c)
            i += 1
            continue
        if c in " \t\r\f":
            out.append(c)
            i += 1
            continue
        if line_start and depth == 0:
            i = _definition(text, i, out)
        line_start = False
        c = text[i] if i < n else ""
        if c == '"':
            j = _string_end(text, i)
        elif c == "#" or text.startswith("//", i):
            j = _line_end(text, i)
        elif c == "/":
            j = _regex_end(text, i)
        else:
            depth = depth + 1 if c in "([{" else max(0, depth - 1) if c in ")]}" else depth
            j = i + 1
        out.append(text[i:j])
        i = j
    return "".join(out)


def _definition(text: str, i: int, out: list[str]) -> int:
    """At a line's first non-blank character (outside brackets): a definition's head is
    written to ``out`` without its modifiers and priority, and the index after it (its
    ``:``) returned; anything else is left where it is (``i``)."""
    if text[i] == "%":
        _check_directive(text, i)
        return i
    head = _HEAD.match(text, i)
    if head is None or head["end"] is None:
        return i
    if head["end"] == "{":
        raise LarkDialectError(
            f"Lark templates are not supported (`{head['name']}{{...}}` at line "
            f"{_line(text, i)}): write each use of the template out as a rule of its own"
        )
    out.append(head["name"] + head["space"])
    return head.start("end")


def _check_directive(text: str, i: int) -> None:
    d = _DIRECTIVE.match(text, i)
    if d is None:
        return
    word, line = d["word"], _line(text, i)
    if word in _UNSUPPORTED:
        raise LarkDialectError(f"`%{word}` (line {line}) is not supported: {_UNSUPPORTED[word]}")
    if word == "import" and d["arg"].split(".")[0] != "common":
        raise LarkDialectError(
            f"`%import {d['arg']}` (line {line}) is not supported: only the terminals of "
            "Lark's `common` can be imported (`%import common.NUMBER`); copy the definition "
            "into the grammar instead"
        )


def _line(text: str, i: int) -> int:
    return text.count("\n", 0, i) + 1


def _line_end(text: str, i: int) -> int:
    j = text.find("\n", i)
    return len(text) if j < 0 else j


def _string_end(text: str, i: int) -> int:
    """The index after the literal opening at ``i`` (Lark's literals end with their line;
    an unterminated one is llguidance's error to report)."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        elif c == "\n":
            return j
        else:
            j += 1
    return n


def _regex_end(text: str, i: int) -> int:
    """The index after the regex opening at ``i`` and its flags (as Lark's, it may span
    lines: it ends at the next ``/`` not escaped)."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == "/":
            j += 1
            while j < n and text[j] in _REGEX_FLAGS:
                j += 1
            return j
        else:
            j += 1
    return n
