"""OpenAI-compatible requests: the typed request objects, the fields every request shares
(sampling, stops, logprobs, structured outputs, ``n``: ``parse_common``) and
``/v1/completions`` bodies.

Its neighbours: ``request_fields`` (``APIError`` and the typed field getters),
``field_parsers`` (the parsers of single fields, their bounds, and which fields each
endpoint knows or refuses unless neutral), ``request_checks`` (the checks after the parse
that need engine facts: served name, context length, vocabulary), ``chat_protocol``
(``/v1/chat/completions`` bodies), ``json_body`` (a body as JSON, before any parser),
``stop_strings`` (stop strings in streamed text). Everything here is pure (no engine, no
I/O) so it can be unit-tested directly. Errors are raised as ``APIError`` carrying the HTTP
status and an OpenAI error body whose ``param`` names the offending field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import (
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    InvalidRequestError,
    SamplingParams,
)
from engine.server.field_parsers import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_CHOICES,
    logprobs_count,
    parse_allowed_token_ids,
    parse_bad_words,
    parse_cache_salt,
    parse_chat_logprobs,
    parse_logit_bias,
    parse_max_tokens,
    parse_n,
    parse_prompt_cache_key,
    parse_stop,
    parse_stop_token_ids,
    reject_unsupported,
)
from engine.server.request_fields import (
    APIError,
    bad_type,
    get_bool,
    get_float,
    get_int,
    is_int,
    require_object,
)
from engine.structured.reasoning import ReasoningTags
from engine.structured.spec import (
    StructuredOutput,
    UnsupportedStructuredKey,
    parse_structured_output,
)
from engine.tools.spec import ToolCalling
from kvconnector.params import KVTransferParams

DEFAULT_COMPLETION_MAX_TOKENS = 16


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


@dataclass
class BaseRequest:
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field it came from (chat: or max_completion_tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's)
    kv_transfer_params: KVTransferParams | None = None
    min_tokens: int = 0
    # Alternatives per token whose log probabilities to return (None: no logprobs):
    # completions' ``logprobs``, chat's ``top_logprobs`` (0 with ``logprobs: true`` alone).
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt comes first in the answer
    # vLLM's: the text of what stopped the answer (a stop string, a stop token) is kept.
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    n: int = 1  # choices per prompt (each its own engine request: ``children``)
    # vLLM's: keep only the prompt's last k tokens (-1: the model's context length).
    truncate_prompt_tokens: int | None = None
    # vLLM's: log probabilities name tokens ``token_id:<id>`` instead of their text.
    return_tokens_as_token_ids: bool = False
    # vLLM's: the answer carries the prompt's token ids (``prompt_token_ids``: on the
    # choice of a completion, on a chat response); ``token_ids`` are always there.
    return_token_ids: bool = False
    # vLLM's: special tokens (BOS, EOS, a chat template's markers) left out of the text.
    skip_special_tokens: bool = True
    # vLLM's: each prompt token's log probability, rank and ``k`` alternatives (None: off).
    prompt_logprobs: int | None = None
    # vLLM's: lower starts first (a node with --scheduling-policy priority; else only 0).
    priority: int = 0
    # vLLM's: words the answer must not contain (``engine.bad_words``; the node tokenizes).
    bad_words: tuple[str, ...] = ()
    # vLLM's: prefix-cache isolation -- hashed into the first KV block's hash (every later
    # block's chains from it), so requests with other salts (or none) share no cached block.
    cache_salt: str | None = field(default=None, repr=False)  # a tenant's secret: not logged
    # OpenAI's: which cache the request should go to (the proxy's routing affinity; a node
    # has one cache, so it changes nothing there). None: no key (or an empty one).
    prompt_cache_key: str | None = field(default=None, repr=False)
    # A structured output (response_format, structured_outputs, guided_*): one constraint.
    structured_output: StructuredOutput | None = None
    # Its grammar compiled by the node's HTTP layer (the matcher's start state, copied for
    # each choice's engine request): the engine thread never compiles one.
    grammar_template: Any = field(default=None, repr=False, compare=False)
    # ``bad_words`` as the node's tokenizer makes them (set by its HTTP layer, once).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # A structured chat answer that reasons first: the node's reasoning parser's tags as
    # token ids (set by its HTTP layer): the grammar waits for the reasoning's end.
    reasoning_tags: ReasoningTags | None = field(default=None, repr=False, compare=False)
    # Top-level fields this server does not know: accepted and ignored, with a warning
    # naming them in the node's log (vLLM's behaviour).
    ignored_fields: tuple[str, ...] = ()

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Build engine SamplingParams; ``max_tokens`` is the resolved completion budget."""
        if self.min_tokens > max_tokens:
            raise APIError(
                f"'min_tokens' ({self.min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens",
            )
        # An echo without generation ends by its "length" whatever its one sampled token,
        # which the answer leaves out: nothing may stop it in the engine either, so the
        # engine counts the finish the answer shows.
        left_out = self.echo_without_generation
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
                stop_token_ids=[] if left_out else list(self.stop_token_ids),
                stop=[] if left_out else list(self.stop),  # checked here; counted there
                ignore_eos=self.ignore_eos or left_out,
                min_tokens=self.min_tokens,
                logprobs=self.logprobs,
                prompt_logprobs=self._prompt_logprobs(),
                logit_bias=dict(self.logit_bias),
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                allowed_token_ids=None
                if self.allowed_token_ids is None
                else list(self.allowed_token_ids),
                structured_output=self.structured_output,
                bad_words_token_ids=self.bad_words_token_ids,
                reasoning_tags=self.reasoning_tags,
            )
        except InvalidRequestError as e:
            raise APIError(str(e), param=e.param) from e

    @property
    def echo_without_generation(self) -> bool:
        """vLLM's ``echo`` with ``max_tokens`` 0 (completions): the answer is the prompt
        alone -- its text and log probabilities, nothing generated."""
        return self.echo and self.max_tokens == 0

    def _prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes: for ``prompt_logprobs`` and
        for ``echo`` with ``logprobs`` (each trims to its own count)."""
        echo = self.logprobs if self.echo else None
        wanted = [k for k in (self.prompt_logprobs, echo) if k is not None]
        return max(wanted) if wanted else None

    @property
    def num_choices(self) -> int:
        return self.n

    def children(self) -> list[BaseRequest]:
        """One request per choice, each with ``n`` = 1, in the answer's order (``index``).
        Choice ``j`` of a prompt samples with ``seed + j`` (vLLM's parallel sampling), so
        each is what a single request with that seed answers."""
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
            for j in range(self.n)
        ]


@dataclass
class CompletionRequest(BaseRequest):
    # Either a text prompt or pre-tokenized ids (exactly one is set)...
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    # ...or, for a batch of more than one prompt, neither: each a string or token ids.
    batch: list[str | list[int]] | None = None

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.batch) if self.batch else 1)

    def children(self) -> list[BaseRequest]:
        """Prompt-major: choice ``i * n + j`` is prompt ``i``'s ``j``-th (vLLM's order)."""
        if not self.batch:
            return super().children()
        out: list[BaseRequest] = []
        for prompt in self.batch:
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            one = dataclasses.replace(self, batch=None, prompt_text=text, prompt_token_ids=ids)
            out.extend(one.children())
        return out


@dataclass
class ChatCompletionRequest(BaseRequest):
    # Normalized to [{"role": str, "content": str}], plus an assistant message's
    # "tool_calls" and a tool message's "tool_call_id" (and "name").
    messages: list[dict[str, Any]] = field(default_factory=list)
    # Extra variables of the model's Jinja chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # vLLM's: the request's own Jinja chat template (a node with
    # --trust-request-chat-template only: ``check_request_template``).
    chat_template: str | None = None
    # vLLM's: the template's assistant header after the messages; or (continue) the final
    # message left open for the model to go on with (a "prefilled" answer).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # tools / tool_choice / parallel_tool_calls (None: no tools): engine/tools/spec.py.
    tools: ToolCalling | None = None
    # vLLM's chat ``echo``: the final message's text, put before the answer, when that
    # message is in the answer's role ("" otherwise, or without echo).
    chat_echo: str = ""
    # vLLM's ``reasoning_effort``: a Jinja chat template's ``reasoning_effort`` variable
    # (over a ``chat_template_kwargs`` one); None: not set.
    reasoning_effort: str | None = None
    # pdserve's (``/v1/responses``' ``truncation: "auto"``): leading messages dropped until
    # the prompt and its answer fit this many tokens (-1: the model's context length;
    # ``engine/server/chat_truncation.py``); None: never cut.
    truncate_messages_to: int | None = None


def parse_common(body: dict[str, Any], req: BaseRequest, *, chat: bool) -> None:
    """Fill the shared fields of ``req`` from ``body`` and reject unsupported features."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_type("model", "a string", model)
    req.model = model

    req.temperature = get_float(body, "temperature", 1.0)
    if req.temperature < 0:
        raise APIError(f"'temperature' must be >= 0, got {req.temperature}", param="temperature")
    if req.temperature > MAX_TEMPERATURE:  # infinite in the sampler's float32 (NaN draws)
        raise APIError(
            f"'temperature' must be at most {MAX_TEMPERATURE:g} (float32's largest value), "
            f"got {req.temperature:g}",
            param="temperature",
        )
    req.top_p = get_float(body, "top_p", 1.0)
    if not 0.0 < req.top_p <= 1.0:
        raise APIError(f"'top_p' must be in (0, 1], got {req.top_p}", param="top_p")
    top_k = get_int(body, "top_k", -1)
    if top_k == 0:  # common client convention for "disabled"
        top_k = -1
    if top_k < -1:
        raise APIError(f"'top_k' must be -1 (disabled) or >= 1, got {top_k}", param="top_k")
    req.top_k = top_k
    req.seed = get_int(body, "seed", None)
    parse_n(body, req)
    req.truncate_prompt_tokens = get_int(body, "truncate_prompt_tokens", None)
    req.return_tokens_as_token_ids = get_bool(body, "return_tokens_as_token_ids", False)
    req.return_token_ids = get_bool(body, "return_token_ids", False)
    req.skip_special_tokens = get_bool(body, "skip_special_tokens", True)
    # vLLM's; no effect: the detokenizers never put spaces between special tokens (vLLM's
    # fast-tokenizer detokenizer ignores it too). Its type is still checked.
    get_bool(body, "spaces_between_special_tokens", True)
    req.prompt_logprobs = logprobs_count(body, "prompt_logprobs")
    req.priority = get_int(body, "priority", 0)
    req.bad_words = parse_bad_words(body.get("bad_words"))
    req.cache_salt = parse_cache_salt(body.get("cache_salt"))
    req.prompt_cache_key = parse_prompt_cache_key(body.get("prompt_cache_key"))
    keep = req.truncate_prompt_tokens
    if keep is not None and keep < 1 and keep != -1:
        raise APIError(
            f"'truncate_prompt_tokens' must be -1 (the model's context length) or at least 1, "
            f"got {keep}",
            param="truncate_prompt_tokens",
        )

    req.stop = parse_stop(body)
    req.stop_token_ids = parse_stop_token_ids(body)
    req.ignore_eos = get_bool(body, "ignore_eos", False)
    req.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output", False)

    req.stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_type("stream_options", "an object", opts)
        if not req.stream:
            raise APIError(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        usage = opts.get("include_usage")
        if usage is not None and not isinstance(usage, bool):  # named 'include_usage' before
            raise bad_type("stream_options.include_usage", "a boolean", usage)
        req.include_usage = bool(usage)
        every = opts.get("continuous_usage_stats")
        if every is not None and not isinstance(every, bool):
            raise bad_type("stream_options.continuous_usage_stats", "a boolean", every)
        # vLLM's: with include_usage, every chunk carries the usage so far.
        req.continuous_usage = req.include_usage and bool(every)

    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise bad_type("kv_transfer_params", "an object", kv)
    try:
        req.kv_transfer_params = None if kv is None else KVTransferParams.from_dict(kv)
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.param) from e
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise bad_type("user", "a string", body["user"])

    req.logit_bias = parse_logit_bias(body.get("logit_bias"))
    req.allowed_token_ids = parse_allowed_token_ids(body.get("allowed_token_ids"))
    req.min_p = get_float(body, "min_p", 0.0)
    if not 0.0 <= req.min_p <= 1.0:
        raise APIError(f"'min_p' must be in [0, 1], got {req.min_p}", param="min_p")
    for name, (lo, hi), neutral in (
        ("presence_penalty", PENALTY_RANGE, 0.0),
        ("frequency_penalty", PENALTY_RANGE, 0.0),
        ("repetition_penalty", REPETITION_PENALTY_RANGE, 1.0),
    ):
        value = get_float(body, name, neutral)
        if not lo <= value <= hi:
            raise APIError(f"'{name}' must be in [{lo:g}, {hi:g}], got {value}", param=name)
        setattr(req, name, value)

    req.min_tokens = get_int(body, "min_tokens", 0)
    if req.min_tokens < 0:
        raise APIError(f"'min_tokens' must be >= 0, got {req.min_tokens}", param="min_tokens")
    if chat:
        req.logprobs = parse_chat_logprobs(body)
    else:
        req.logprobs = logprobs_count(body, "logprobs")
        req.echo = get_bool(body, "echo", False)
    if req.echo_without_generation:
        # vLLM's: the engine runs it with max_tokens 1 (its SamplingParams check min_tokens
        # against that), so 1 is taken -- it bans EOS and the stop ids from the token the
        # answer leaves out.
        if req.min_tokens > 1:
            raise APIError(
                f"'min_tokens' ({req.min_tokens}) must be at most 1 with 'echo' and "
                "'max_tokens' 0 (the engine samples one token, which the answer leaves out)",
                param="min_tokens",
            )
    elif req.max_tokens is not None and req.min_tokens > req.max_tokens:
        name = req.max_tokens_param
        raise APIError(
            f"'min_tokens' ({req.min_tokens}) must be at most {name} ({req.max_tokens})",
            param="min_tokens",
        )

    reject_unsupported(body, chat=chat)
    try:
        req.structured_output = parse_structured_output(body)
    except UnsupportedStructuredKey as e:
        raise APIError(str(e), param=e.param, code="unsupported_parameter") from e
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.param) from e
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(  # as vLLM answers
            "'prompt_logprobs' is not available with 'stream': true", param="prompt_logprobs"
        )
    if req.kv_transfer_params is not None and req.num_choices > 1:
        raise APIError(
            "a request with 'kv_transfer_params' (a P/D leg) has one choice: n = 1 and one prompt",
            param="kv_transfer_params",
        )
    req.ignored_fields = tuple(
        k for k in body if k not in (CHAT_FIELDS if chat else COMPLETION_FIELDS)
    )


def _parse_prompt(body: dict[str, Any], req: CompletionRequest) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("'prompt' is required", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    # A batch: an array of strings or of token-id arrays (each its own choices).
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_CHOICES:  # before each is checked (n is checked later)
            raise APIError(
                f"a request may ask for at most {MAX_CHOICES} choices, got a batch of "
                f"{len(prompt)} prompts",
                param="prompt",
            )
        if len(prompt) > 1:
            req.batch = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            return
        prompt = prompt[0]
    one = _one_prompt(prompt, "prompt")
    if isinstance(one, str):
        req.prompt_text = one
    else:
        req.prompt_token_ids = one


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    """A prompt: a non-empty string or a non-empty array of token ids."""
    if isinstance(prompt, str | list) and not prompt:
        raise APIError(f"'{where}' must not be empty", param=where)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(is_int(t) for t in prompt):
        return list(prompt)
    raise bad_type(where, "a string or an array of token ids", prompt)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a ``/v1/completions`` JSON body."""
    body = require_object(body)
    req = CompletionRequest()
    _parse_prompt(body, req)
    if get_int(body, "max_tokens") == 0:  # vLLM's echo without generation, with echo
        if not get_bool(body, "echo", False):
            raise APIError(
                "'max_tokens' must be at least 1, got 0 (0 is for 'echo': true, which "
                "answers the prompt alone: its text and, with 'logprobs', its log "
                "probabilities)",
                param="max_tokens",
            )
        req.max_tokens = 0
    else:
        req.max_tokens = parse_max_tokens(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    parse_common(body, req, chat=False)
    kv = req.kv_transfer_params
    if (
        req.echo_without_generation
        and kv is not None
        and (kv.do_remote_decode or kv.do_remote_prefill)
    ):
        raise APIError(
            "'echo' with 'max_tokens' 0 decodes nothing: it is no prefill/decode leg "
            "(a node serves it alone, without do_remote_decode or do_remote_prefill)",
            param="kv_transfer_params",
        )
    return req
