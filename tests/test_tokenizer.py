"""Byte tokenizer, HF tokenizer.json checkpoints, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from engine.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    continue_final_message,
    load_tokenizer,
)

UNICODE_TEXT = "héllo wörld, 世界 🎉!"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([i]) for i in ids]


# ---- byte tokenizer -------------------------------------------------------------------


def test_byte_tokenizer_roundtrip_and_ids() -> None:
    tok = load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(UNICODE_TEXT)
    assert ids == list(UNICODE_TEXT.encode("utf-8"))
    assert tok.decode(ids) == UNICODE_TEXT
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (256, 257, [257])
    assert tok.vocab_size == 258
    # Specials and ids the model may emit beyond the byte range decode to nothing.
    assert tok.decode([256, 72, 105, 257, 400]) == "Hi"
    assert tok.decode([72, 257], skip_special_tokens=False) == "H<|eos|>"


def test_byte_tokenizer_decode_invalid_utf8_never_raises() -> None:
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"


def test_byte_chat_template() -> None:
    tok = ByteTokenizer()
    prompt = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]
    )
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_incremental_detokenizer_holds_back_split_multibyte() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("prompt"))
    euro = list("€".encode())  # 3 bytes
    assert _stream(detok, [ord("a"), *euro, ord("b")]) == ["a", "", "", "€", "b"]
    emoji = list("🎉".encode())  # 4 bytes, fed as two chunks of two
    assert detok.add(emoji[:2]) == ""
    assert detok.add(emoji[2:]) == "🎉"
    assert detok.text == "a€b🎉"
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_broken_tail_and_skips_garbage() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add([0xFF]) == ""  # held: it may still look incomplete
    assert detok.add([0x41]) == "\ufffdA"
    assert detok.add([0xE2, 0x82]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.add([257]) == ""  # EOS is skipped, nothing printable
    assert detok.text == "\ufffdA\ufffd"


# ---- checkpoint (tokenizer.json) --------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld"] * 5
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
                "chat_template": TEMPLATE,
            }
        )
    )
    im_end = tok.token_to_id("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, im_end]}))
    return path


def test_hf_tokenizer_roundtrip(hf_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.eos_token_ids == [1, 2]
    ids = tok.encode(UNICODE_TEXT)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(UNICODE_TEXT, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.decode([*ids, tok.vocab_size + 5]) == UNICODE_TEXT  # padded-vocab id ignored
    assert len(tok.encode("hello world", add_special_tokens=False)) < len("hello world")


def test_hf_chat_template(hf_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(hf_tokenizer_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<s><|user|>hello</s><|assistant|>"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.eos_token_id in ids


def test_a_chat_without_the_generation_prompt_or_continuing_its_final_message(
    hf_tokenizer_dir: Path,
) -> None:
    """vLLM's ``add_generation_prompt: false`` and ``continue_final_message``, on a Jinja
    template and the built-in one."""
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": " Hi th"}]
    tok = load_tokenizer(str(hf_tokenizer_dir))
    closed = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert closed == "<s><|user|>hello</s><|assistant|> Hi th</s>"
    assert continue_final_message(closed, chat) == "<s><|user|>hello</s><|assistant|> Hi th"
    byte = ByteTokenizer()
    closed = byte.apply_chat_template(chat, add_generation_prompt=False)
    assert closed == "<|user|>\nhello\n<|assistant|>\n Hi th\n"
    assert continue_final_message(closed, chat) == "<|user|>\nhello\n<|assistant|>\n Hi th"
    # A template that strips the messages: matched stripped.
    assert continue_final_message("<a>Hi th</a>", chat) == "<a>Hi th"
    with pytest.raises(ValueError):
        continue_final_message("<a>nothing</a>", chat)


def test_hf_chat_template_without_jinja2_falls_back(
    hf_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    monkeypatch.setitem(sys.modules, "jinja2.ext", None)
    tok = load_tokenizer(str(hf_tokenizer_dir))
    with caplog.at_level(logging.WARNING, logger="engine.tokenizer"):
        prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|user|>\nhello\n<|assistant|>\n"
    assert "jinja2" in caplog.text


def test_hf_incremental_detokenizer_matches_full_decode(hf_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(hf_tokenizer_dir))
    ids = tok.encode(UNICODE_TEXT, add_special_tokens=False)
    assert len(ids) > len(UNICODE_TEXT) // 2
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hello"))
    pieces = _stream(detok, ids)
    assert "".join(pieces) + detok.flush() == UNICODE_TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some multibyte chars were split across tokens
