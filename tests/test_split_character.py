"""A prompt given as token ids that ends inside a multi-byte UTF-8 character: the answer's
tokens that complete it print the whole character (vLLM's detokenizer, a ``tokenizers``
``DecodeStream`` primed with the prompt's last tokens), in the detokenizer and in a node's
completions (plain, streamed, echoed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from harness import sse_data

from engine.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer

TEXT = "héllo 世界 🎉 wörld, ünïcödé ✓"
EMOJI = list("🎉".encode())


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """A byte-level BPE whose merges never cover the multi-byte characters of ``TEXT``, so
    their bytes are separate tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the lazy dog"] * 5, trainer)
    path = tmp_path_factory.mktemp("split_char_tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return HFTokenizer(str(path))


def vllm_pieces(tok: HFTokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """vLLM's ``FastIncrementalDetokenizer``: a ``DecodeStream`` primed with the shortest
    prompt suffix of 4..23 tokens that decodes without U+FFFD (else the whole prompt), then
    stepped with each output token."""
    from tokenizers.decoders import DecodeStream

    rust = tok._tok
    suffix = prompt
    for i in range(4, min(len(prompt) + 1, 24)) if len(prompt) > 4 else ():
        if "\ufffd" not in rust.decode(prompt[-i:]):
            suffix = prompt[-i:]
            break
    stream = DecodeStream(skip_special_tokens=True)
    for token in suffix:
        stream.step(rust, token)
    return [stream.step(rust, token) or "" for token in output]


def _mid_character_cuts(tok: Any, ids: list[int]) -> list[int]:
    return [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]


def test_a_prompt_cut_inside_a_character_streams_as_vllm_does(hf_tok: HFTokenizer) -> None:
    ids = hf_tok.encode(TEXT, add_special_tokens=False)
    cuts = _mid_character_cuts(hf_tok, ids)
    assert len(cuts) >= 4  # the 2-, 3- and 4-byte characters are cut
    for k in cuts:
        prompt, output = ids[:k], ids[k:]
        detok = IncrementalDetokenizer(hf_tok, prompt)
        pieces = [detok.add([t]) for t in output]
        assert pieces == vllm_pieces(hf_tok, prompt, output), k
        assert detok.flush() == ""
        # The completed character is the answer's: no U+FFFD anywhere.
        assert "\ufffd" not in detok.text, k


# Prompts whose last few tokens begin inside a character (the detokenizer's context window
# opens mid-character) or that end with a real U+FFFD (complete bytes EF BF BD).
AWKWARD = ["世🎉!", "ab世🎉!", "x世界🎉!", "a\ufffd🎉!", "abc\ufffd\ufffdx!", "é🎉!"]


@pytest.mark.parametrize("text", AWKWARD)
def test_a_context_opening_inside_a_character_streams_as_vllm_does(
    hf_tok: HFTokenizer, text: str
) -> None:
    ids = hf_tok.encode(text, add_special_tokens=False)
    for k in range(1, len(ids)):
        prompt, output = ids[:k], ids[k:]
        detok = IncrementalDetokenizer(hf_tok, prompt)
        pieces = [detok.add([t]) for t in output]
        assert pieces == vllm_pieces(hf_tok, prompt, output), (text, k)


@pytest.mark.parametrize("text", AWKWARD)
def test_byte_tokens_after_a_context_opening_inside_a_character(text: str) -> None:
    """The answer's text is the prompt's text up to its last complete character removed
    from the whole text: no U+FFFD for the prompt's earlier characters."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    for k in range(1, len(ids)):
        done = k
        while done and tok.decode(ids[:done]).endswith("\ufffd"):
            done -= 1
        detok = IncrementalDetokenizer(tok, ids[:k])
        answer = "".join(detok.add([t]) for t in ids[k:]) + detok.flush()
        assert answer == tok.decode(ids[done:]), (text, k)


def test_a_prompt_ending_with_a_real_replacement_character() -> None:
    """A prompt whose text ends with U+FFFD itself (the complete character EF BF BD): by
    text it cannot be told from a broken tail, and vLLM's ``DecodeStream`` prints it again
    with the answer's first text; so does pdserve (one U+FFFD, not more). (Behind a
    broken tail, vLLM reprints every U+FFFD of a run of them; pdserve only those among
    the prompt's last few tokens.)"""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("abc\ufffd"))
    assert [detok.add([t]) for t in b"x!"] == ["\ufffdx", "!"]
    detok = IncrementalDetokenizer(tok, tok.encode("abc\ufffd\ufffd"))
    assert [detok.add([t]) for t in b"x!"] == ["\ufffd\ufffdx", "!"]


def test_an_answer_that_does_not_complete_the_prompts_character(hf_tok: HFTokenizer) -> None:
    """vLLM's rule: the prompt's broken tail is printed (U+FFFD) with the next token."""
    ids = hf_tok.encode(TEXT, add_special_tokens=False)
    other = hf_tok.encode("x", add_special_tokens=False)
    for k in _mid_character_cuts(hf_tok, ids):
        detok = IncrementalDetokenizer(hf_tok, ids[:k])
        assert [detok.add(other)] == vllm_pieces(hf_tok, ids[:k], other), k


def test_byte_tokens_completing_the_prompts_character() -> None:
    tok = ByteTokenizer()
    for cut in range(1, len(EMOJI)):
        prompt = [*b"abc", *EMOJI[:cut]]
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = [detok.add([t]) for t in [*EMOJI[cut:], ord("!")]]
        assert pieces[-2:] == ["🎉", "!"], cut
        assert detok.text == "🎉!"


def test_no_answer_text_from_the_prompts_broken_tail_alone() -> None:
    """An answer with no printable token (its EOS is left out) adds no text: the prompt's
    incomplete bytes are not the answer's."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [*b"abc", *EMOJI[:2]])
    assert detok.flush() == ""
    assert detok.add([]) == ""
    assert detok.add([tok.EOS]) == "" and detok.flush() == ""
    assert detok.text == ""


# ---- a node's completions ----------------------------------------------------------------


@pytest.fixture(scope="module")
def node() -> Iterator[Any]:
    """A node's app on the tiny (byte) model, in this process (``uni`` executor)."""
    from inproc_node import app_on_loop, uni_config

    with app_on_loop(uni_config(max_model_len=256, num_blocks=64)) as node:
        yield node


def _post(node: Any, body: dict[str, Any]) -> httpx.Response:
    app, loop = node

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
            return await client.post("/v1/completions", json={"model": "tiny", **body})

    resp = loop.run_until_complete(main())
    assert resp.status_code == 200, resp.text[:300]
    return resp


def test_a_nodes_completion_of_a_prompt_cut_inside_a_character(node: Any) -> None:
    """The prompt's ids end with the emoji's first three bytes; a logit bias makes the
    answer's one token its last byte."""
    prompt = [*b"abc", *EMOJI[:3]]
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {str(EMOJI[3]): 100},
        "logprobs": 0,
    }
    whole = _post(node, body).json()["choices"][0]
    assert whole["text"] == "🎉"
    assert len(whole["logprobs"]["tokens"]) == 1
    events = sse_data(_post(node, {**body, "stream": True}).text.splitlines())
    streamed = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
    assert streamed == whole["text"]
    # echo: the prompt's text as decoded (vLLM's), then the answer's.
    echoed = _post(node, {**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == ByteTokenizer().decode(prompt) + whole["text"]
    assert len(echoed["logprobs"]["tokens"]) == len(prompt) + 1


@pytest.mark.slow
def test_through_the_proxy_the_character_is_the_colocated_nodes(module_procs: Any) -> None:
    """P/D: P's first token completes the prompt's character (its text is the whole
    character, the proxy's first chunk), or does not (D's text carries it): the proxy's
    answers, whole and streamed, are a colocated node's."""
    from harness import MODEL

    pair = module_procs.pd(1, 1, "--num-blocks", "64", colocated=True)
    proxy = module_procs.proxy([pair.p.url], [pair.d.url])
    for cut, bias in ((3, EMOJI[3:]), (2, EMOJI[2:])):
        body = {
            "model": MODEL,
            "prompt": [*b"abc", *EMOJI[:cut]],
            "max_tokens": 3,
            "temperature": 0,
            "logit_bias": {str(t): 100 for t in bias},
        }
        answers = []
        for url in (pair.colocated.url, proxy.url):
            whole = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert whole.status_code == 200, whole.text
            text = whole.json()["choices"][0]["text"]
            streamed = httpx.post(
                url + "/v1/completions", json={**body, "stream": True}, timeout=60
            )
            events = sse_data(streamed.text.splitlines())
            assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == text
            answers.append(text)
        assert answers[0] == answers[1], cut
        if cut == 3:  # the one biased byte completes it first
            assert answers[0].startswith("🎉"), answers
