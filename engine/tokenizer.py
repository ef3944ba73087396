"""Tokenizers: a byte-level one for the 'tiny' model and HF ``tokenizer.json`` checkpoints.

``load_tokenizer(model, chat_template)`` picks one; ``chat_template`` (``--chat-template``)
renders chats instead of the checkpoint's template (or the built-in simple one), and a
request may bring its own (``apply_chat_template(chat_template=...)``). ``IncrementalDetokenizer`` turns a growing list of
generated ids into printable text deltas, holding back incomplete UTF-8 sequences.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
from abc import ABC, abstractmethod
from datetime import datetime
from typing import Any

logger = logging.getLogger(__name__)

TINY_MODEL = "tiny"
REPLACEMENT_CHAR = "\ufffd"


def _message_text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; keep the text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def simple_chat_template(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """``<|role|>\\ncontent\\n`` per message, then the assistant prompt ``<|assistant|>\\n``.
    With ``tools``, a first ``<|tools|>`` block lists them (one JSON line each); an
    assistant message's ``tool_calls`` follow its content as hermes-style
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` lines; a tool message is
    ``<|tool|>`` with its content."""
    parts = []
    if tools:
        lines = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools)
        parts.append(f"<|tools|>\n{lines}")
    for m in messages:
        text = _message_text(m.get("content"))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            one = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            text += f"\n<tool_call>{json.dumps(one, ensure_ascii=False)}</tool_call>"
        parts.append(f"<|{m.get('role', 'user')}|>\n{text}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def continue_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """The rendered chat cut right after the final message's text (its end-of-turn markers
    dropped), so the model continues that message (transformers' and vLLM's
    ``continue_final_message``; a template that strips messages is matched stripped)."""
    final = _message_text(messages[-1].get("content")) if messages else ""
    for text in (final, final.strip()):
        at = rendered.rfind(text)
        if at >= 0:
            return rendered[: at + len(text)]
    raise ValueError("the chat template does not render the final message's text")


class Tokenizer(ABC):
    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. For an already rendered chat prompt pass
        ``add_special_tokens=False`` (the template carries BOS itself)."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; never raises on invalid UTF-8 or unknown ids."""

    # The server's --chat-template (its Jinja source): renders chats instead of the
    # tokenizer's own template.
    chat_template_override: str | None = None

    def set_chat_template(self, source: str) -> None:
        """Render chats with ``source`` (a Jinja chat template: ``--chat-template``);
        ``ValueError`` when it does not compile or jinja2 is missing."""
        try:
            compile_chat_template(source)
        except ImportError as e:
            raise ValueError("a chat template needs jinja2: pip install jinja2") from e
        self.chat_template_override = source

    def chat_template_digest(self) -> str:
        """Which template chats use without a request's, as a short digest ("builtin": the
        simple one): a proxy compares its P and D nodes' (``/v1/kv_transfer_info``)."""
        source = self._template_source()
        if source is None:
            return "builtin"
        return hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def _template_source(self) -> str | None:
        return self.chat_template_override

    def _own_template(self) -> Any:
        """The compiled template chats use without a request's (None: the simple one)."""
        if self.chat_template_override is not None:
            return compile_chat_template(self.chat_template_override)
        return None

    def _special_strings(self) -> dict[str, str]:
        """Template variables naming special tokens (``bos_token``, ``eos_token``, ...)."""
        return {"bos_token": "", "eos_token": ""}

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The rendered prompt string, ending with the assistant generation prompt (unless
        ``add_generation_prompt`` is false). ``template_kwargs`` (a request's
        ``chat_template_kwargs``) are extra variables of a Jinja chat template; only
        ``supports_template_kwargs`` tokenizers take them. ``tools`` (a request's, as
        OpenAI shapes them): the template's ``tools`` variable (transformers'
        ``apply_chat_template(tools=...)``). ``chat_template``: a request's own Jinja
        template, used instead of the tokenizer's."""
        template = (
            compile_chat_template(chat_template)
            if chat_template is not None
            else self._own_template()
        )
        if template is None:
            _refuse_template_kwargs(template_kwargs)
            return simple_chat_template(messages, add_generation_prompt, tools)
        variables: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
            **self._special_strings(),
            **(template_kwargs or {}),  # e.g. enable_thinking; may not replace the messages
        }
        variables["messages"] = messages
        if tools is not None:  # the request's tools, over a chat_template_kwargs "tools"
            variables["tools"] = tools
        return str(template.render(**variables))

    @property
    def supports_template_kwargs(self) -> bool:
        """Whether ``apply_chat_template`` renders a Jinja template that can use
        ``template_kwargs`` (the built-in simple template has no variables)."""
        return self._own_template() is not None

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens included), as logprobs name tokens."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (a part of a UTF-8 character stays itself, not U+FFFD)."""
        return self.token_text(token_id).encode("utf-8")

    @property
    @abstractmethod
    def eos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end generation (Llama 3 instruct has several)."""
        return [] if self.eos_token_id is None else [self.eos_token_id]


class ByteTokenizer(Tokenizer):
    """ids 0..255 are bytes; BOS=256, EOS=257. It adds no special tokens when encoding."""

    BOS = 256
    EOS = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special_tokens and i in (self.BOS, self.EOS):
                out.extend(b"<|bos|>" if i == self.BOS else b"<|eos|>")
        return out.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self.token_text(token_id).encode("utf-8")

    @property
    def eos_token_id(self) -> int | None:
        return self.EOS

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def vocab_size(self) -> int:
        return 258


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    """tokenizer_config special tokens are a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _select_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A checkpoint's ``tokenizer.json`` via the ``tokenizers`` library."""

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            from engine.model.config import ModelConfigError

            raise ModelConfigError(f"{model_dir!r} has no tokenizer.json")
        self._tok = RustTokenizer.from_file(path)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        tok_cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(model_dir, "config.json"))
        gen_cfg = _read_json(os.path.join(model_dir, "generation_config.json"))

        self.bos_token = _token_str(tok_cfg.get("bos_token"))
        self.eos_token = _token_str(tok_cfg.get("eos_token"))
        self._specials = {
            key: s for key in ("pad_token", "unk_token") if (s := _token_str(tok_cfg.get(key)))
        }
        self._bos_id = self._lookup(self.bos_token)
        if self._bos_id is None and _ids(model_cfg.get("bos_token_id")):
            self._bos_id = _ids(model_cfg.get("bos_token_id"))[0]
        eos_ids: list[int] = []
        for candidate in (
            [self._lookup(self.eos_token)],
            _ids(gen_cfg.get("eos_token_id")),
            _ids(model_cfg.get("eos_token_id")),
        ):
            eos_ids.extend(i for i in candidate if i is not None and i not in eos_ids)
        self._eos_ids = eos_ids
        self._chat_template = self._find_template(model_dir, tok_cfg)
        self._compiled: Any = None
        self._is_byte_level: bool | None = None

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @staticmethod
    def _find_template(model_dir: str, tok_cfg: dict[str, Any]) -> str | None:
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        template = _select_template(tok_cfg.get("chat_template"))
        if template is None:
            template = _select_template(
                _read_json(os.path.join(model_dir, "chat_template.json")).get("chat_template")
            )
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (structured outputs build their
        ``llguidance`` tokenizer from it)."""
        return str(self._tok.to_str())

    def token_bytes(self, token_id: int) -> bytes:
        """Byte-level BPE (GPT-2 style) tokens map back to their bytes; SentencePiece byte
        fallback tokens (``<0xE2>``) are their byte; else the token's text."""
        token = self._tok.id_to_token(token_id)
        if token is not None:
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in token):
                return bytes(_BYTE_OF_CHAR[c] for c in token)
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    return bytes([int(token[3:5], 16)])
                except ValueError:
                    pass
        return super().token_bytes(token_id)

    @property
    def _byte_level(self) -> bool:
        if self._is_byte_level is None:
            self._is_byte_level = "ByteLevel" in repr(self._tok.decoder)
        return self._is_byte_level

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        valid = [i for i in ids if 0 <= i < self._vocab_size]  # model vocab may be padded
        return self._tok.decode(valid, skip_special_tokens=skip_special_tokens)

    def _template_source(self) -> str | None:
        return self.chat_template_override or self._chat_template

    def _own_template(self) -> Any:
        if self.chat_template_override is not None:
            return compile_chat_template(self.chat_template_override)
        if self._chat_template is None:
            logger.warning("checkpoint has no chat_template; using the simple built-in one")
            return None
        if self._compiled is None:
            self._compiled = _compile_template(self._chat_template)
        return self._compiled

    def _special_strings(self) -> dict[str, str]:
        return {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **self._specials,
        }

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character its tokens use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _refuse_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    if template_kwargs:
        raise ValueError(
            "chat_template_kwargs need a Jinja chat template; this model uses the simple "
            "built-in one"
        )


def _compile_template(source: str) -> Any:
    """A checkpoint's chat template compiled; None if jinja2 is missing (the simple one is
    used then)."""
    try:
        return _compile_jinja(source)
    except ImportError:
        logger.warning("jinja2 is not installed; using the simple built-in chat template")
        return None


def _compile_jinja(source: str) -> Any:
    """Compile a chat template the way transformers does (a sandboxed Jinja environment):
    ``ImportError`` without jinja2, ``ValueError`` (jinja2's ``TemplateSyntaxError``) for a
    template that does not compile."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    from jinja2 import TemplateSyntaxError

    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e} (line {e.lineno})") from e


# --chat-template's and requests' templates (a repeated one is compiled once).
compile_chat_template = functools.lru_cache(maxsize=32)(_compile_jinja)


def load_tokenizer(model: str, chat_template: str | None = None) -> Tokenizer:
    """'tiny' -> ``ByteTokenizer``; a checkpoint directory -> ``HFTokenizer``.
    ``chat_template``: ``--chat-template`` (a file or the template itself:
    ``load_chat_template``), rendering chats instead of the model's template."""
    tok: Tokenizer = ByteTokenizer() if model == TINY_MODEL else HFTokenizer(model)
    if chat_template is not None:
        source = load_chat_template(chat_template)
        tok.set_chat_template(source)
        logger.info("chats are rendered with --chat-template (%d characters)", len(source))
    return tok


def load_chat_template(value: str) -> str:
    """``--chat-template`` as vLLM reads it: the file at ``value``, else -- when ``value``
    has Jinja's characters (braces, a line break) -- the template itself, its backslash
    escapes (``\\n``) decoded. ``ValueError`` for a path that cannot be read."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"{value!r} looks like a file path, but cannot be read ({e.strerror or e}); "
                "give a template file or the Jinja template itself"
            ) from e
    try:  # '\n' typed on a command line is a line break (vLLM's reading)
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError:
        return value


class IncrementalDetokenizer:
    """Streams text for generated ids. ``add`` returns only new, complete text: output that
    ends in an incomplete UTF-8 sequence (a trailing U+FFFD) is held back until a later
    token completes it, or until ``flush`` at the end of the stream.

    Decoding restarts from a few tokens before the new ones (``prompt_ids`` seeds that
    context), so tokenizers that drop a leading space at the start of a decode still
    produce the right spacing.

    A prompt (given as token ids) that ends inside a multi-byte character: its text counts
    as ending before that character, so the generated tokens that complete it print the
    whole character (vLLM's ``DecodeStream`` primed with the prompt's last tokens), and
    tokens that do not complete it print U+FFFD for the prompt's broken bytes first (vLLM
    too). An answer with no generated text prints nothing of the prompt's. A prompt ending
    with a real U+FFFD reads like a broken tail: the answer reprints it (vLLM's too).
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = self._context(tokenizer, prompt_ids or [])
        self._prefix_offset = 0  # start of the decode window
        # ids before this are already emitted: the prompt's, less an incomplete UTF-8 tail
        self._read_offset = len(self._ids)
        while self._read_offset and self._decode(self._ids[: self._read_offset]).endswith(
            REPLACEMENT_CHAR
        ):
            self._read_offset -= 1
        self._prompt_end = len(self._ids)  # the generated ids follow
        self.text = ""  # everything emitted so far

    @classmethod
    def _context(cls, tokenizer: Tokenizer, prompt_ids: list[int]) -> list[int]:
        """The prompt's last ``CONTEXT_TOKENS`` ids, widened back to a character's start
        (at most 3 ids more): a window opening on UTF-8 continuation bytes would decode
        them to U+FFFD, and backing off a broken tail could reach that U+FFFD and print it
        as the answer's (vLLM primes its stream with a suffix that decodes cleanly)."""
        start = max(0, len(prompt_ids) - cls.CONTEXT_TOKENS)
        lowest = max(0, start - 3)  # a UTF-8 character has at most 3 continuation bytes
        while (
            start > lowest
            and 0x80 <= (tokenizer.token_bytes(prompt_ids[start])[:1] or b"\0")[0] < 0xC0
        ):
            start -= 1
        return list(prompt_ids[start:])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, force: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if not force and full_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += new_text
        return new_text

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the newly printable text (may be empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """At the end of a stream: return held-back text (with U+FFFD for broken bytes).
        Nothing when the generated ids held back have no text (a special token after the
        prompt's incomplete tail: that tail is the prompt's)."""
        generated = self._ids[max(self._read_offset, self._prompt_end) :]
        if not generated or not self._decode(generated):
            return ""
        return self._emit(force=True)
