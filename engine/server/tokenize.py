"""vLLM's utility endpoints on a node: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Shapes follow vLLM: ``/tokenize`` takes ``{"prompt": str}`` (``add_special_tokens``
default true) or a chat ``{"messages": [...]}`` (rendered with the model's chat template,
``add_special_tokens`` default false, optional ``chat_template_kwargs``, ``tools``,
``add_generation_prompt`` and ``continue_final_message`` as on chat) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (each token's text with
``return_token_strs: true``, else null); ``/detokenize`` takes
``{"tokens": [ids]}`` and answers ``{"prompt": str}``; ``/version`` answers
``{"version": <pdserve version>}``. Errors are OpenAI-shaped 400s naming the field.
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.httpkit.body import read_body
from engine.httpkit.listen import DEFAULT_MAX_REQUEST_BYTES
from engine.server.chat_protocol import (
    check_request_template,
    parse_chat_template,
    parse_chat_template_kwargs,
    parse_generation_prompt,
    parse_messages,
    parse_tools,
)
from engine.server.engine_client import EngineClient
from engine.server.json_body import parse_json_body
from engine.server.request_checks import check_model, check_token_ids
from engine.server.request_fields import APIError
from engine.tokenizer import compile_chat_template, continue_final_message

# Token ids rendered per piece of a /tokenize answer (~2 ms of json.dumps here).
IDS_PER_PIECE = 1 << 15


def render_with_ids(fields: dict[str, Any], name: str, ids: list[int]) -> bytes:
    """``json.dumps({**fields, name: ids})`` with the ids rendered in pieces: one
    ``json.dumps`` of millions of ids is one C call that holds the GIL for most of a
    second (the event loop, and every stream on it, would wait); between pieces the
    thread doing it lets the loop run."""
    head = json.dumps({**fields, name: None})[:-1].removesuffix("null")  # '{..., "name": '
    pieces = (
        json.dumps(ids[i : i + IDS_PER_PIECE])[1:-1] for i in range(0, len(ids), IDS_PER_PIECE)
    )
    return (head + "[" + ",".join(pieces) + "]}").encode()


def pdserve_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "0.0.0+unknown"


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be a boolean", param=name, code="invalid_type")
    return value


def _object(raw: bytes) -> dict[str, Any]:
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", code="invalid_body")
    return body


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
    continue_final: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> str:
    """The chat prompt; ``chat_template_kwargs`` the template cannot take are a 400.
    ``continue_final``: cut after the final message's text (``continue_final_message``);
    ``tools``: the request's tools, the template's ``tools`` variable; ``chat_template``:
    the request's own template (checked by the caller: ``check_request_template``)."""
    if kwargs and chat_template is None and not tokenizer.supports_template_kwargs:
        raise APIError(
            "'chat_template_kwargs' is not supported: this model has no Jinja chat template "
            "(a node's --chat-template gives it one)",
            param="chat_template_kwargs",
            code="unsupported_parameter",
        )
    own: dict[str, Any] = {}
    if chat_template is not None:
        try:
            compile_chat_template(chat_template)
        except (ValueError, ImportError) as e:
            raise APIError(f"'chat_template': {e}", param="chat_template") from e
        own["chat_template"] = chat_template
    try:
        text = str(
            tokenizer.apply_chat_template(
                messages, kwargs or None, add_generation_prompt, tools, **own
            )
        )
        return continue_final_message(text, messages) if continue_final else text
    except Exception as e:  # a template's raise_exception, a kwarg it cannot render
        raise APIError(f"the chat template failed: {e}", param="messages") from e


class TokenizeServing:
    def __init__(
        self,
        engine: EngineClient,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        trust_request_chat_template: bool = False,
        served_names: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.served_names = served_names or [engine.model_name]
        self.max_request_bytes = max_request_bytes
        self.trust_request_chat_template = trust_request_chat_template

    async def tokenize(self, request: Request) -> JSONResponse:
        raw = await read_body(request, self.max_request_bytes)

        # Parsing, tokenizing and rendering the answer (millions of ids) off the event loop.
        def answer() -> Response:
            fields = self._tokenize(raw)
            tokens = fields.pop("tokens")
            body = render_with_ids(fields, "tokens", tokens)
            return Response(body, media_type="application/json")

        return await anyio.to_thread.run_sync(answer)

    async def detokenize(self, request: Request) -> JSONResponse:
        raw = await read_body(request, self.max_request_bytes)
        return await anyio.to_thread.run_sync(lambda: JSONResponse(self._detokenize(raw)))

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": pdserve_version()})

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError("'model' must be a string", param="model", code="invalid_type")
        check_model(model, self.served_names)

    def _tokenize(self, raw: bytes) -> dict[str, Any]:
        body = _object(raw)
        self._check_model(body)
        tok = self.engine.tokenizer
        if body.get("messages") is not None:
            if body.get("prompt") is not None:
                raise APIError("give either 'prompt' or 'messages', not both", param="prompt")
            add, cont = parse_generation_prompt(body)
            tools = parse_tools(body)
            kwargs = parse_chat_template_kwargs(body)
            template = parse_chat_template(body, kwargs)
            check_request_template(template, self.trust_request_chat_template)
            text = render_chat(
                tok, parse_messages(body), kwargs, add, cont,
                tools.template_tools() if tools is not None else None, template,
            )  # fmt: skip
            special = _bool(body, "add_special_tokens", False)
        else:
            text = body.get("prompt")
            if text is None:
                raise APIError(
                    "'prompt' or 'messages' is required",
                    param="prompt",
                    code="missing_required_parameter",
                )
            if not isinstance(text, str):
                raise APIError("'prompt' must be a string", param="prompt", code="invalid_type")
            special = _bool(body, "add_special_tokens", True)
        tokens = list(tok.encode(text, add_special_tokens=special))
        strs = (
            [tok.token_text(t) for t in tokens] if _bool(body, "return_token_strs", False) else None
        )
        return {
            "count": len(tokens),
            "max_model_len": self.engine.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    def _detokenize(self, raw: bytes) -> dict[str, Any]:
        body = _object(raw)
        self._check_model(body)
        tokens = body.get("tokens")
        if tokens is None:
            raise APIError(
                "'tokens' is required", param="tokens", code="missing_required_parameter"
            )
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise APIError(
                "'tokens' must be an array of token ids", param="tokens", code="invalid_type"
            )
        check_token_ids(tokens, self.engine.vocab_size, "tokens")
        return {"prompt": self.engine.tokenizer.decode(tokens, skip_special_tokens=False)}
