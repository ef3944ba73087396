"""Grammars in Lark's own dialect (``structured_outputs.grammar``, ``guided_grammar``):
what llguidance's Lark refuses or misreads, taken where the language is unchanged
(``engine/structured/lark_grammar.py``), and a 400 naming the construct and its fix
where it is not.

llguidance's ``grammar_from("grammar", ...)`` took a text for Lark only when a line began
with ``start:`` (or ``%llguidance``): ``?start: ...`` went to its GBNF converter and was a
400 ("Expected name"). Its Lark parser refuses priorities (``rule.2:``, ``TERM.2:``) and
``?_rule:``.
"""

from __future__ import annotations

import pytest

from engine.server.request_checks import check_structured
from engine.server.request_fields import APIError
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredOutput
from engine.tokenizer import ByteTokenizer

pytest.importorskip("llguidance")

# vLLM's docs' example for guided_grammar, as written there.
SQL = (
    "?start: select_statement\n"
    '?select_statement: "SELECT " column_list " FROM " table_name\n'
    '?column_list: column_name ("," column_name)*\n'
    "?table_name: identifier\n"
    "?column_name: identifier\n"
    "?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/"
)
TINY_VOCAB = 512


def _compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer, TINY_VOCAB)


def _accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes ``text`` whole (the byte tokenizer: one id a byte)."""
    matcher = compiler.new_matcher(StructuredOutput.grammar(grammar, "guided_grammar"))
    ids = list(text.encode())
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_vllms_sql_example_is_a_grammar_and_takes_its_language() -> None:
    check_structured(StructuredOutput.grammar(SQL, "guided_grammar"))
    compiler = _compiler()
    assert _accepts(compiler, SQL, "SELECT a,b_1 FROM t")
    assert not _accepts(compiler, SQL, "SELECT a, b FROM t")  # no space after ','
    assert not _accepts(compiler, SQL, "SELECT 1 FROM t")


@pytest.mark.parametrize(
    "grammar, yes, no",
    [
        ('!start: "a" x\n?x: "b"', ["ab"], ["a", "b"]),
        ('?!start: x\n!?x: "b"', ["b"], ["a"]),
        ("start: _x\n?_x: \"c\"", ["c"], ["cc"]),
        ('start: x\nx.2: "a" | y\ny.-1: Y\nY.3: "b"', ["a", "b"], ["ab"]),
        ('start.1: "q"', ["q"], [""]),
        # '?' inside literals, regexes and comments is the grammar's, not a prefix.
        ('?start: "?" x // ?x: "no"\n?x: /a?/ "?"', ["?a?", "??"], ["?a", "a?"]),
        ('start: Q\nQ: "?x: " /[?!]x?/ # ?start: "b"', ["?x: ?", "?x: !x"], ["b"]),
        ('start: "a"\n    | "\\"?" "b"\n?c: "z"', ["a", '"?b'], ["z"]),
        ('start: W ("," W)*\n%import common.WORD -> W\n%ignore " "', ["ab, c ,d"], [","]),
    ],
)  # fmt: skip
def test_standard_lark_takes_its_language(grammar: str, yes: list[str], no: list[str]) -> None:
    compiler = _compiler()
    for text in yes:
        assert _accepts(compiler, grammar, text), (grammar, text)
    for text in no:
        assert not _accepts(compiler, grammar, text), (grammar, text)


def test_gbnf_is_still_converted_and_its_question_marks_kept() -> None:
    gbnf = 'root ::= "a" x?\nx ::= "?"'
    compiler = _compiler()
    assert _accepts(compiler, gbnf, "a") and _accepts(compiler, gbnf, "a?")
    assert not _accepts(compiler, gbnf, "a??")


@pytest.mark.parametrize(
    "grammar, names",
    [
        ('start: sep{"a", ","}\nsep{x, s}: x (s x)*', ["template", "sep{", "line 2"]),
        ('start: "a" INDENT\n%declare INDENT', ["%declare", "line 2", "define"]),
        ('start: X\nX: "a"\n%override X: "b"', ["%override", "line 3"]),
        ('start: X\nX: "a"\n%extend X: "b"', ["%extend", "line 3"]),
        ("start: NAME\n%import python.NAME", ["%import python.NAME", "common"]),
    ],
)  # fmt: skip
def test_what_cannot_be_taken_is_a_400_naming_the_construct_and_the_fix(
    grammar: str, names: list[str]
) -> None:
    with pytest.raises(APIError) as e:
        check_structured(StructuredOutput.grammar(grammar, "guided_grammar"))
    assert e.value.status_code == 400 and e.value.param == "guided_grammar"
    for name in names:
        assert name in e.value.message, e.value.message


@pytest.mark.parametrize(
    "grammar, want",
    [
        ('?start: "?"', 'start: "?"'),
        ('  !?rule . 2: x', '  !?rule . 2: x'),  # not Lark: left to llguidance's error
        ('rule.2 : "a?"\nTERM.-1: /b?/i', 'rule : "a?"\nTERM: /b?/i'),
        ('start: "a"\n?x: "b" // ?y: "c"\n# ?z: "d"', 'start: "a"\nx: "b" // ?y: "c"\n# ?z: "d"'),
        ('start: ("a"\n?x: "b")', 'start: ("a"\n?x: "b")'),  # inside a group: not a rule
        ('start: "\\"?x: " x\n?x: "a"', 'start: "\\"?x: " x\nx: "a"'),  # escaped quote
        ('start: /\\/\n?x: /', 'start: /\\/\n?x: /'),  # a regex (escaped /) over 2 lines
        ("?start: x\r\n?x: \"a\"", "start: x\r\nx: \"a\""),
        ('%llguidance {}\n?start: "a"', '%llguidance {}\nstart: "a"'),
    ],
)  # fmt: skip
def test_the_rewrite_touches_rule_heads_at_a_lines_start_only(grammar: str, want: str) -> None:
    from engine.structured.lark_grammar import llguidance_lark

    assert llguidance_lark(grammar) == want


@pytest.mark.parametrize(
    "text, gbnf",
    [
        ('root ::= "a"', True),
        ("# c\n  root-rule   ::= x\n", True),
        ('?start: "a"', False),
        ('start: "::="', False),
        ("start: x\nx: /a::=/", False),
    ],
)
def test_gbnf_is_told_by_its_rule_definitions(text: str, gbnf: bool) -> None:
    from engine.structured.lark_grammar import is_gbnf

    assert is_gbnf(text) is gbnf
