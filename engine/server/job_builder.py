"""A request's body to its jobs: parsed with the node's defaults, checked against the
node (served names, ``--max-logprobs``, the vocabulary, a structured output compiled for
its tokenizer), tokenized (chat: rendered with the request's tools), and one ``Job`` per
choice. ``OpenAIServing`` runs it in a worker thread (``prepare_*``), then runs the jobs."""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

from starlette.requests import Request

from engine.bad_words import tokenize_bad_words
from engine.config import DEFAULT_MAX_LOGPROB_ENTRIES
from engine.generation_config import apply_defaults
from engine.reasoning import PARSERS as REASONING_PARSERS
from engine.reasoning import parser_class as reasoning_parser_class
from engine.reasoning.output import ReasoningOutput
from engine.reasoning.tokens import ReasoningTokens, TagIds
from engine.sampling_params import MAX_LOGPROBS, InvalidRequestError
from engine.server.chat_protocol import (
    check_request_template,
    parse_chat_request,
    template_kwargs,
    thinking_kwargs,
)
from engine.server.chat_truncation import Render, fit_messages
from engine.server.engine_client import EngineClient
from engine.server.jobs import Job, engine_error
from engine.server.json_body import parse_json_body
from engine.server.logprobs import TokenIdStrings, TokenStrings
from engine.server.protocol import (
    BaseRequest,
    ChatCompletionRequest,
    CompletionRequest,
    parse_completion_request,
)
from engine.server.request_checks import (
    check_logprob_entries,
    check_logprobs,
    check_model,
    check_structured,
    check_token_ids,
    logprob_entries,
    resolve_max_tokens,
    truncate_prompt,
)
from engine.server.request_fields import APIError
from engine.server.tokenize import render_chat
from engine.structured.matcher import start_allows_any
from engine.structured.reasoning import ReasoningTags
from engine.tools.output import ToolOutput, new_parser
from engine.tools.parsers import PARSERS

logger = logging.getLogger(__name__)


def engine_request_id(label: str) -> str:
    """A fresh engine id for a request the client labelled ``label`` (its ``X-Request-Id``):
    unique per request, so a client reusing a label never touches another's request."""
    return f"{label}-{uuid.uuid4().hex[:12]}"


# A request's ``n`` and its choices: one (request, prompt ids) each, prompt-major
# (``BaseRequest.children``); a prompt is tokenized once for its ``n`` choices.
Choices = tuple[int, list[tuple[BaseRequest, list[int]]]]


class JobBuilder:
    """A request's choices and their jobs, with the node's options for them."""

    def __init__(
        self,
        engine: EngineClient,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        trust_request_chat_template: bool = False,
        sampling_defaults: dict[str, Any] | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        served_names: list[str] | None = None,
        max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
        prompt_tokens_details: bool = False,
    ) -> None:
        """``tool_call_parser``: the parser of "auto" tool choice (``--enable-auto-tool-choice
        --tool-call-parser NAME``); None: such requests are refused (vLLM's rule).
        ``reasoning_parser``: splits chat answers into reasoning and content
        (``--reasoning-parser NAME``); None: chat answers are content.
        ``trust_request_chat_template``: a request may bring its own chat template
        (``--trust-request-chat-template``); else such requests are a 400.
        ``sampling_defaults``: the sampling fields of requests that do not set them, and
        ``max_tokens`` a cap on every answer (``--generation-config``). ``max_logprobs``:
        ``--max-logprobs``. ``served_names``: every name a request's ``model`` may give
        (default: the engine's ``model_name``). ``max_logprob_entries``: the most
        log-probability entries the answer of a request with several choices may hold
        (``--max-logprob-entries``). ``prompt_tokens_details``: answers' usage tells the
        prompt tokens the prefix cache held (``--enable-prompt-tokens-details``)."""
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r} "
                f"(choose from {', '.join(sorted(REASONING_PARSERS))})"
            )
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_logprobs = max_logprobs
        self.max_logprob_entries = max_logprob_entries
        self.prompt_tokens_details = prompt_tokens_details
        self.served_names = served_names or [engine.model_name]
        self.engine = engine
        self._strings: TokenStrings | None = None  # token names for logprobs, made once
        self._id_strings: TokenStrings | None = None  # ... with return_tokens_as_token_ids

    @functools.cached_property
    def reasoning_tags(self) -> ReasoningTags:
        """The reasoning parser's tags in this node's token ids (tokenized once)."""
        assert self.reasoning_parser is not None
        parser = reasoning_parser_class(self.reasoning_parser)
        return ReasoningTags.of(parser, self.engine.tokenizer)

    @functools.cached_property
    def reasoning_tag_ids(self) -> TagIds:
        """The reasoning tags in this node's token ids, both of them (tokenized once): an
        answer's reasoning tokens are counted between them."""
        return TagIds.of(self.engine.tokenizer)

    @property
    def strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.engine.tokenizer)
        return self._strings

    def _strings_for(self, req: BaseRequest) -> TokenStrings | None:
        if req.logprobs is None and req.prompt_logprobs is None:
            return None
        if not req.return_tokens_as_token_ids:
            return self.strings
        if self._id_strings is None:
            self._id_strings = TokenIdStrings(self.engine.tokenizer)
        return self._id_strings

    def prepare_completion(self, raw: bytes) -> Choices:
        req = parse_completion_request(apply_defaults(parse_json_body(raw), self.sampling_defaults))
        self._check_serving(req)
        children = req.children()
        out: list[tuple[BaseRequest, list[int]]] = []
        for k in range(0, len(children), req.n):
            one: Any = children[k]
            text, given = one.prompt_text, one.prompt_token_ids
            if given is not None:
                where = "prompt" if len(children) == req.n else f"prompt[{k // req.n}]"
                check_token_ids(given, self.engine.vocab_size, where)
                full = given
            else:
                full = list(self.engine.tokenizer.encode(text or ""))
            ids = truncate_prompt(full, req.truncate_prompt_tokens, self.engine.max_model_len)
            if req.echo and (given is not None or len(ids) < len(full)):
                # The text echoed before the answer: the prompt the model saw.
                text = self.engine.tokenizer.decode(ids, req.skip_special_tokens)
            for child in children[k : k + req.n]:
                child.prompt_text = text  # type: ignore[attr-defined]
                out.append((child, ids))
        return req.n, out

    def prepare_chat(self, raw: bytes) -> Choices:
        req = parse_chat_request(apply_defaults(parse_json_body(raw), self.sampling_defaults))
        check_request_template(req.chat_template, self.trust_request_chat_template)
        if req.structured_output is not None and self._reasons(req):
            # The grammar constrains the content, after the reasoning (vLLM's rule).
            req.reasoning_tags = self.reasoning_tags
        self._check_serving(req)
        if req.tools is not None and req.tools.choice == "auto" and self.tool_call_parser is None:
            raise APIError(  # vLLM's answer
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (the default tool choice of a request with tools is "auto")',
                param="tool_choice",
            )
        tok = self.engine.tokenizer
        kwargs = template_kwargs(req, req.chat_template is not None or tok.supports_template_kwargs)
        tools = req.tools.template_tools() if req.tools is not None else None

        def render(messages: list[dict[str, Any]]) -> list[int]:
            text = render_chat(
                tok, messages, kwargs, req.add_generation_prompt, req.continue_final_message,
                tools, req.chat_template,
            )  # fmt: skip
            return list(tok.encode(text, add_special_tokens=False))

        if req.truncate_messages_to is None:
            ids = render(req.messages)
        else:
            ids = self._fit(req, render)
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, self.engine.max_model_len)
        return req.n, [(child, ids) for child in req.children()]

    def _fit(self, req: ChatCompletionRequest, render: Render) -> list[int]:
        """``truncate_messages_to``: the prompt with the fewest leading messages dropped
        that lets it and the answer fit (the context the proxy named, so that both legs of
        a P/D pair cut alike; -1: this node's); the whole prompt when nothing fits."""
        context = req.truncate_messages_to
        if context is None or context == -1:
            context = self.engine.max_model_len
        fitted = fit_messages(req.messages, render, context, req.max_tokens)
        if fitted.dropped:
            logger.info(
                "truncation: dropped the first %d of %d messages (after the leading system "
                "and developer ones) to fit a prompt of %d tokens in a context of %d",
                fitted.dropped, len(req.messages), len(fitted.ids), context,
            )  # fmt: skip
        return fitted.ids

    def _check_serving(self, req: BaseRequest) -> None:
        check_model(req.model, self.served_names)
        check_logprobs(req, self.max_logprobs, chat=not isinstance(req, CompletionRequest))
        check_token_ids(list(req.logit_bias), self.engine.vocab_size, "logit_bias")
        if req.allowed_token_ids:
            check_token_ids(req.allowed_token_ids, self.engine.vocab_size, "allowed_token_ids")
        so = req.structured_output
        if so is not None:
            check_structured(so)  # 400s: llguidance missing, the grammar invalid
            try:  # compiled for this node's tokenizer here (cached), never on the engine loop:
                # each choice's request gets a copy (``generate_steps``)
                req.grammar_template = self.engine.grammars.compile(so)
            except InvalidRequestError as e:
                raise APIError(str(e), param=e.param, code="invalid_structured_output") from e
            ids = req.allowed_token_ids
            if (
                ids
                and req.reasoning_tags is None  # else the first token need not be the grammar's
                and not start_allows_any(req.grammar_template, ids, self.engine.vocab_size)
            ):
                raise APIError(
                    f"none of 'allowed_token_ids' may begin the structured output "
                    f"('{so.param}'): the answer could not have a first token",
                    param="allowed_token_ids",
                )
        if req.bad_words:  # once per request, off the event loop; its choices share them
            words = tokenize_bad_words(self.engine.tokenizer, req.bad_words)
            # A sequence with an id past the model's vocabulary can never be sampled whole.
            vocab = self.engine.vocab_size
            req.bad_words_token_ids = tuple(seq for seq in words if max(seq) < vocab)
        if not self.engine.healthy:
            raise engine_error(self.engine, None)

    def _reasons(self, req: BaseRequest) -> bool:
        """Whether a chat request's answer is split into reasoning and content."""
        if self.reasoning_parser is None:
            return False
        return reasoning_parser_class(self.reasoning_parser).applies(thinking_kwargs(req))

    def jobs(
        self,
        request: Request,
        chat: bool,
        choices: list[tuple[BaseRequest, list[int]]],
        n: int = 1,
    ) -> list[Job]:
        """Every choice's job, all checked before any starts (one too long: a 400, no work;
        all together answering more log probabilities than ``--max-logprob-entries``: a 400)."""
        jobs = [
            self._job(request, chat, req, ids, index) for index, (req, ids) in enumerate(choices)
        ]
        first = jobs[0].req
        if len(jobs) > 1 and (first.logprobs is not None or first.prompt_logprobs is not None):
            entries = sum(
                logprob_entries(j.req, len(j.prompt_ids), j.params.max_tokens) for j in jobs
            )
            check_logprob_entries(first, n, len(jobs), entries, self.max_logprob_entries, chat)
        return jobs

    def _job(
        self, request: Request, chat: bool, req: BaseRequest, ids: list[int], index: int = 0
    ) -> Job:
        param = "messages" if chat else "prompt"
        kv = req.kv_transfer_params
        if req.echo_without_generation:
            # vLLM's: the engine samples one token (it cannot stop before one), which the
            # answer leaves out (``prompt_only``). As vLLM's, the check counts the 0 tokens
            # asked for: a prompt may fill the context (the engine takes one that long;
            # its sampled token is never computed, so it needs no room).
            resolve_max_tokens(0, len(ids), self.engine.max_model_len, param)
            max_tokens = 1
        elif kv is not None and kv.do_remote_decode:
            # A prefill leg computes the prompt and one token: this node's context bounds
            # the prompt; the answer's budget is the decode node's to check. A prompt that
            # does not fit is refused with the client's numbers, as D would refuse it (a
            # client behind a proxy may get either leg's 400).
            try:
                resolve_max_tokens(1, len(ids), self.engine.max_model_len, param)
            except APIError:
                resolve_max_tokens(
                    req.max_tokens, len(ids), self.engine.max_model_len, param,
                    req.max_tokens_param,
                )  # fmt: skip
                raise
            # Its one token ends it whatever the budget; without max_tokens the answer's is
            # D's (the rest of D's context), so any min_tokens is left to D to check.
            max_tokens = req.max_tokens or max(1, req.min_tokens)
        else:
            max_tokens = resolve_max_tokens(
                req.max_tokens, len(ids), self.engine.max_model_len, param, req.max_tokens_param
            )
            cap = self.sampling_defaults.get("max_tokens")  # generation config's max_new_tokens
            max_tokens = min(max_tokens, cap) if cap else max_tokens
        label = request.state.request_id
        echo = req.echo and isinstance(req, CompletionRequest)
        tools = getattr(req, "tools", None)
        calls = None
        if (
            tools is not None
            and tools.parses_calls
            and not (kv is not None and kv.do_remote_decode)
        ):
            # A prefill leg's answer (one token, for the proxy) stays plain content.
            calls = ToolOutput(tools, new_parser(tools, self.tool_call_parser))
        reasoning, counted = None, None
        if (
            chat
            and self.reasoning_parser is not None
            and not (kv is not None and kv.do_remote_decode)
        ):
            # A prefill leg's answer (one token, for the proxy) is neither split nor counted.
            parser = reasoning_parser_class(self.reasoning_parser)
            if self._reasons(req):
                reasoning = ReasoningOutput(parser(), calls)
            counted = ReasoningTokens(
                self.reasoning_tag_ids, parser.initial if reasoning else "after"
            )
        return Job(
            chat=chat,
            request_id=engine_request_id(label),
            label=label,
            model=self.engine.model_name,
            prompt_ids=ids,
            params=req.sampling_params(max_tokens),
            req=req,
            strings=self._strings_for(req),
            echo_text=(req.prompt_text or "") if echo else None,  # type: ignore[attr-defined]
            index=index,
            tools=calls,
            reasoning=reasoning,
            reasoning_tokens=counted,
            prompt_tokens_details=self.prompt_tokens_details,
        )
