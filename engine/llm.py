"""Offline, synchronous use of the engine: vLLM's ``LLM`` (``generate``, ``chat``), and
``generate_token_ids`` for tests, benchmarks and scripts.

``LLM(model=..., **kwargs)`` takes vLLM's keyword names of the options pdserve has, the
node's flags by their names (``engine/llm_args.py``); ``LLM(config)`` an ``EngineConfig``.
Text comes out as a node's does: its incremental detokenizer and stop strings
(``engine/server/answer_text.py``), its chat rendering (``render_chat``); the outputs are
vLLM's shapes (``engine/llm_outputs.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.generation_config import default_sampling_params
from engine.llm_args import engine_config
from engine.llm_outputs import Answer, RequestOutput, position_logprobs
from engine.outputs import RequestOutput as EngineOutput
from engine.sampling_params import SamplingParams
from engine.stats import StatsGroup
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A prompt of ``generate``: text, vLLM's ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``
# (either with vLLM's ``"cache_salt"``), or token ids.
PromptType = str | dict[str, Any] | list[int]
# A prompt as ``_generate_text`` runs it: its text (None: ids given), ids and cache salt.
PromptItem = tuple[str | None, list[int], str | None]
Params = SamplingParams | Sequence[SamplingParams] | None


def offline_config(config: EngineConfig) -> EngineConfig:
    """``--distributed-executor-backend auto`` for offline use: the rank runs in this
    process at TP 1 (vLLM's ``uni``), worker processes otherwise."""
    parallel = config.parallel
    if parallel.distributed_executor_backend != "auto":
        return config
    backend = "uni" if parallel.tp == 1 else "mp"
    return config.replace(
        parallel=dataclasses.replace(parallel, distributed_executor_backend=backend)
    )


class LLM:
    def __init__(
        self,
        model: str | EngineConfig | None = None,
        *,
        config: EngineConfig | None = None,
        log_level: str = "WARNING",
        **engine_kwargs: Any,
    ) -> None:
        """``LLM(model="tiny", tensor_parallel_size=1, max_model_len=2048, ...)`` (vLLM's),
        or ``LLM(config)`` / ``LLM(config=config)`` with an ``EngineConfig``. Unknown
        keywords are a ``TypeError`` naming them; bad values a ``ConfigError``."""
        if isinstance(model, EngineConfig):
            if config is not None:
                raise TypeError("LLM() got two configs")
            config, model = model, None
        if config is None:
            config = engine_config(model, **engine_kwargs)
        elif model is not None or engine_kwargs:
            raise TypeError("LLM() takes a config or a model and keywords, not both")
        self.core = EngineCore(offline_config(config), log_level)
        self._ids = itertools.count()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The node's tokenizer of the model (``--chat-template`` applied); loaded on first
        use, so token-id callers never load it."""
        from engine.tokenizer import load_tokenizer

        model = self.core.config.model
        return load_tokenizer(model.model, model.chat_template)

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's name; pdserve's ``Tokenizer`` (``encode``, ``decode``, the chat template)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's ``generation_config.json`` sampling values (as
        ``--generation-config``, the config's ``model.generation_config``, says), vLLM's
        defaults for the rest."""
        model = self.core.config.model
        return default_sampling_params(model.model, model.generation_config)

    # -- vLLM's API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Params = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: run the prompts (one or a list: text, ``{"prompt": text}``,
        ``{"prompt_token_ids": ids}`` -- either with vLLM's ``"cache_salt"``, a node's
        rule: a non-empty string, at most 1 KiB, else ``ValueError`` -- or ids) to
        completion together; one
        ``RequestOutput`` per prompt, in order. ``sampling_params``: one for all or one per
        prompt (None: ``get_default_sampling_params()``); ``priority`` one per prompt.
        A text prompt is tokenized as a node's completion prompt is; the answer's text is
        a node's (its detokenizer, ``stop`` strings, ``include_stop_str_in_output``,
        ``skip_special_tokens``); EOS ends an answer unless ``ignore_eos``. ``use_tqdm``
        is accepted and ignored (no progress bar). A request ending with an error raises
        ``RuntimeError``."""
        del use_tqdm
        one = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        items = [self._prompt(p) for p in ([prompts] if one else prompts)]  # type: ignore[list-item]
        return self._generate_text(items, sampling_params, priority)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: Params = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: one conversation (a list of messages) or a list of them, each rendered
        as a node renders a chat request (``render_chat``: the model's template, or
        ``chat_template``; messages, ``tools`` and ``chat_template_kwargs`` checked by the
        node's parsers; a problem is a ``ValueError``), then ``generate``."""
        from engine.server.chat_protocol import (
            parse_chat_template,
            parse_chat_template_kwargs,
            parse_messages,
            parse_tools,
        )
        from engine.server.request_fields import APIError
        from engine.server.tokenize import render_chat

        del use_tqdm
        convs = [messages] if not messages or isinstance(messages[0], dict) else messages
        tok, items = self.tokenizer, []
        for c, conv in enumerate(convs):
            body = {"messages": conv, "chat_template_kwargs": chat_template_kwargs,
                    "chat_template": chat_template, "tools": tools}  # fmt: skip
            try:
                kwargs = parse_chat_template_kwargs(body)
                template = parse_chat_template(body, kwargs)
                calling = parse_tools(body)
                text = render_chat(
                    tok, parse_messages(body), kwargs, add_generation_prompt,
                    continue_final_message,
                    calling.template_tools() if calling is not None else None, template,
                )  # fmt: skip
            except APIError as e:
                where = f"conversation {c}: " if len(convs) > 1 else ""
                raise ValueError(where + str(e)) from None
            items.append((text, list(tok.encode(text, add_special_tokens=False)), None))
        return self._generate_text(items, sampling_params, None)

    # -- token ids (tests, benchmarks) --------------------------------------------------------
    def generate_token_ids(
        self,
        prompts: list[list[int]],
        params: Params = None,
        priority: list[int] | None = None,
    ) -> list[list[int]]:
        """Run the prompts (token ids) to completion together; returns output token ids.
        No text, and no EOS: an answer ends at ``max_tokens``, a stop token id or the
        context (engine-level runs: tests, benchmarks). ``params``: one for all or one per
        prompt (None: ``get_default_sampling_params()``); ``priority``: one per prompt
        (``--scheduling-policy priority``; vLLM's argument). A request that ends with an
        error raises ``RuntimeError`` (saying why); the call's other requests are aborted
        first, so the engine is idle, its blocks free, for the next call."""
        plist = self._params(params, len(prompts))
        prios = self._priorities(priority, len(prompts))
        reqs = [
            Request(f"llm-{next(self._ids)}", prompt, sp, priority=prio)
            for prompt, sp, prio in zip(prompts, plist, prios, strict=True)
        ]
        results: dict[str, list[int]] = {r.request_id: [] for r in reqs}

        def take(out: EngineOutput) -> bool:
            results[out.request_id].extend(out.new_token_ids)
            return False

        self._run(reqs, take)
        return [results[r.request_id] for r in reqs]

    # -- the one engine path ------------------------------------------------------------------
    def _prompt(self, prompt: PromptType) -> PromptItem:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt)), None
        if isinstance(prompt, dict):
            salt = _cache_salt(prompt.get("cache_salt"))
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
            if isinstance(prompt.get("prompt"), str):
                text, ids, _ = self._prompt(prompt["prompt"])
                return text, ids, salt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), None
        raise TypeError(
            f"a prompt is a string, {{'prompt': str}}, {{'prompt_token_ids': [int]}} or a "
            f"list of token ids, got {prompt!r:.80}"
        )

    def _params(self, params: Params, count: int) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * count
        plist = list(params)
        if len(plist) != count:
            raise ValueError(f"{len(plist)} sampling params for {count} prompts")
        return plist

    @staticmethod
    def _priorities(priority: list[int] | None, count: int) -> list[int]:
        if priority is None:
            return [0] * count
        if len(priority) != count:
            raise ValueError(f"{len(priority)} priorities for {count} prompts (priority)")
        return list(priority)

    def _generate_text(
        self,
        items: list[PromptItem],
        params: Params,
        priority: list[int] | None,
    ) -> list[RequestOutput]:
        from engine.server.answer_text import AnswerText
        from engine.server.logprobs import TokenStrings
        from engine.tokenizer import IncrementalDetokenizer

        plist = self._params(params, len(items))
        prios = self._priorities(priority, len(items))
        tok = self.tokenizer
        reqs: list[Request] = []
        answers: dict[str, Answer] = {}
        parents: list[tuple[str, list[Answer]]] = []
        for (_, ids, salt), sp, prio in zip(items, plist, prios, strict=True):
            parent, mine = str(next(self._ids)), []
            for j in range(sp.n):  # answer j seeded seed + j (a node's n)
                child = sp if sp.n == 1 else dataclasses.replace(
                    sp, n=1, seed=None if sp.seed is None else sp.seed + j
                )  # fmt: skip
                rid = parent if sp.n == 1 else f"{j}_{parent}"  # vLLM's child ids
                detok = IncrementalDetokenizer(tok, ids, child.skip_special_tokens)
                stop = list(child.stop or [])
                text = AnswerText(detok, child, stop, child.include_stop_str_in_output)
                answers[rid] = Answer(j, text)
                mine.append(answers[rid])
                reqs.append(
                    Request(rid, ids, child, tok.eos_token_ids, priority=prio, cache_salt=salt)
                )
            parents.append((parent, mine))
        self._run(reqs, lambda out: answers[out.request_id].add(out))
        name = TokenStrings(tok).text
        results = []
        for (prompt, ids, _), sp, (parent, mine) in zip(items, plist, parents, strict=True):
            prompt_lps = None
            if sp.prompt_logprobs is not None:
                entries = mine[0].prompt_entries or [None] * len(ids)
                prompt_lps = [position_logprobs(e, sp.prompt_logprobs, name) for e in entries]
            outs = [a.output(name) for a in mine]
            cached = mine[0].num_cached_tokens
            results.append(RequestOutput(parent, prompt, ids, prompt_lps, outs, True, cached))
        return results

    def _run(self, reqs: list[Request], take: Callable[[EngineOutput], bool]) -> None:
        """Add ``reqs`` and step until each ended: the engine finished it, or ``take`` (fed
        each of its outputs) said it ended (a stop string: the request is aborted)."""
        added: list[str] = []
        try:
            for req in reqs:
                self.core.add_request(req)
                added.append(req.request_id)
        except Exception:
            self._abandon(added)
            raise
        pending = set(added)
        cut = False
        while pending:
            try:
                outputs, _ = self.core.step()
            except Exception:
                self._after_failed_step()
                raise
            failed = None
            for out in outputs:
                if out.request_id not in pending:  # ended already (a stop string)
                    continue
                ended = take(out)
                if out.finished:  # stop strings checked: its finish reason (a stop string's)
                    self.core.settle_request(out.request_id, ended)
                if out.finished or ended:
                    pending.discard(out.request_id)
                if out.finished and out.finish_reason == "error" and failed is None:
                    failed = out
                elif ended and not out.finished:  # a stop string: counted as "stop"
                    self.core.abort_request(out.request_id, reason="stop")
                    cut = True
            if failed is not None:
                self._abandon(list(pending))
                raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
        # Async scheduling: a step may still be in flight (one token too many for a request
        # that stopped); its update gives its blocks back. It has nothing for the caller,
        # nor have the outputs of requests a stop string ended.
        self.core.finish_in_flight()
        if cut:
            self.core.scheduler.take_outputs()

    def _abandon(self, ids: list[str]) -> None:
        """A request of the call failed and the call raises: the call's unfinished
        requests (``ids``) are aborted and the step in flight (async scheduling) is
        updated, so their blocks are free and the next call starts from an idle engine
        (their outputs would otherwise come to it). Finished ones are left alone (one
        held for a KV push keeps its hold)."""
        for rid in ids:
            self.core.abort_request(rid)
        self.core.finish_in_flight()
        self.core.scheduler.take_outputs()  # the aborts' outputs: nobody reads them

    def _after_failed_step(self) -> None:
        """A step failed (the call raises its error): the step still in flight (async
        scheduling; it fails too when it waited for masks the failed step's update would
        have made) is waited for, and every request ends, so every block is free and the
        next call starts from an idle engine, not from steps whose KV was never written."""
        with contextlib.suppress(Exception):
            self.core.finish_in_flight()
        self.core.fail_all("a step failed")

    def stats(self) -> StatsGroup:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _cache_salt(salt: Any) -> str | None:
    """A prompt dict's ``cache_salt``, checked as a node checks it (a ``ValueError``)."""
    from engine.server.field_parsers import parse_cache_salt
    from engine.server.request_fields import APIError

    try:
        return parse_cache_salt(salt)
    except APIError as e:
        raise ValueError(str(e)) from None
