"""Offline, synchronous use of the engine (tests, benchmarks, scripts)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

from engine.config import EngineConfig
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.generation_config import default_sampling_params
from engine.sampling_params import SamplingParams
from engine.stats import StatsGroup


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
    def __init__(self, config: EngineConfig, log_level: str = "WARNING") -> None:
        self.core = EngineCore(offline_config(config), log_level)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the checkpoint's ``generation_config.json`` sampling values (as
        ``--generation-config``, the config's ``model.generation_config``, says), vLLM's
        defaults for the rest."""
        model = self.core.config.model
        return default_sampling_params(model.model, model.generation_config)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
    ) -> list[list[int]]:
        """Run the prompts (token ids) to completion together; returns output token ids.
        ``params``: one for all or one per prompt (None: ``get_default_sampling_params()``,
        as vLLM's ``LLM.generate``). ``priority``: one per prompt
        (``--scheduling-policy priority``; vLLM's argument). A request that ends with an
        error raises ``RuntimeError`` (saying why); the call's other requests are aborted
        first, so the engine is idle, its blocks free, for the next call."""
        if params is None:
            params = self.get_default_sampling_params()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        prios = priority if priority is not None else [0] * len(prompts)
        ids = []
        for prompt, sp, prio in zip(prompts, plist, prios, strict=True):
            rid = f"llm-{next(self._ids)}"
            self.core.add_request(Request(rid, prompt, sp, priority=prio))
            ids.append(rid)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            try:
                outputs, _ = self.core.step()
            except Exception:
                self._after_failed_step()
                raise
            failed = None
            for out in outputs:
                results[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done.add(out.request_id)
                    if out.finish_reason == "error" and failed is None:
                        failed = out
            if failed is not None:
                self._abandon([rid for rid in ids if rid not in done])
                raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
        # Async scheduling: a step may still be in flight (one token too many for a request
        # that stopped); its update gives its blocks back. It has nothing for the caller.
        self.core.finish_in_flight()
        return [results[rid] for rid in ids]

    def _abandon(self, ids: list[str]) -> None:
        """A request of the call failed and ``generate`` raises: the call's unfinished
        requests (``ids``) are aborted and the step in flight (async scheduling) is
        updated, so their blocks are free and the next call starts from an idle engine
        (their outputs would otherwise come to it). Finished ones are left alone (one
        held for a KV push keeps its hold)."""
        for rid in ids:
            self.core.abort_request(rid)
        self.core.finish_in_flight()
        self.core.scheduler.take_outputs()  # the aborts' outputs: nobody reads them

    def _after_failed_step(self) -> None:
        """A step failed (``generate`` raises its error): the step still in flight (async
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
