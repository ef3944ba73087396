"""The engine step, on one screen: schedule -> execute -> update.

``EngineCore`` owns the scheduler, the scheduler-side connector and the executor. It is
driven by one thread (``AsyncLLMEngine``'s loop, or ``LLM.generate`` offline).

With async scheduling (the default; ``--no-async-scheduling`` turns it off) one step
stays in flight: a step schedules and sends step N+1, then waits for step N and updates
from it, so the workers start N+1 as soon as N is done while the engine turns N's
results into outputs (``core/scheduler.py`` says how the tokens N samples are scheduled
before they are known).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future

from engine.config import TINY_MODEL, ConfigError, EngineConfig
from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import DeferredSampling, ModelRunnerOutput, SchedulerOutput
from engine.core.step_stats import StepStats
from engine.executor import make_executor
from engine.kv_cache_layout import KVCacheSpec
from engine.model.config import checkpoint_files, load_arch_config, resolve_dtype
from engine.model.hub import resolve_model_config
from engine.outputs import RequestOutput
from engine.sampling_params import InvalidRequestError
from engine.stats import StatsGroup
from engine.structured.compiler import GrammarCompiler
from engine.tokenizer import Tokenizer, load_tokenizer
from kvconnector.factory import create_scheduler_connector

# While the workers only wait on transfers, a step goes to them when one wakes the engine
# (a transfer completed) or, as a safety net, this long after the last one.
WORKER_POLL_FALLBACK_S = 0.05

logger = logging.getLogger(__name__)


def decide_num_blocks(
    config: EngineConfig, spec: KVCacheSpec, max_model_len: int, kv_bytes: list[int | None]
) -> int:
    """KV blocks per rank: ``--num-blocks``; on CUDA what the smallest profiled rank can hold
    (``--gpu-memory-utilization``); on CPU ``--kv-memory-fraction`` of host memory, capped
    by what ``--max-num-seqs`` full-length requests need."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    profiled = [b for b in kv_bytes if b is not None]
    if profiled:
        blocks = min(profiled) // spec.block_bytes
        if blocks < 2:
            raise RuntimeError(
                f"no GPU memory left for the KV cache ({min(profiled) / 2**30:.2f} GiB after "
                "the weights and activations): raise --gpu-memory-utilization, lower "
                "--max-num-batched-tokens, or free the GPU"
            )
        return blocks
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    total //= config.parallel.tp  # all ranks share the host's memory
    by_memory = int(total * config.cache.kv_memory_fraction) // spec.block_bytes
    by_need = config.scheduler.max_num_seqs * cdiv(max_model_len, config.cache.block_size)
    return max(2, min(by_memory, by_need))


# vLLM's switch for a --max-model-len past the model's positions (same name, same meaning).
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def check_long_max_model_len(explicit: int | None, max_positions: int) -> None:
    """A ``--max-model-len`` past ``max_position_embeddings`` is a ``ConfigError`` unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (as vLLM): positions the model never saw in training
    give wrong tokens without any error."""
    if explicit is None or explicit <= max_positions:
        return
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV) == "1":
        logger.warning(
            "--max-model-len %d is more than the model's max_position_embeddings %d "
            "(%s=1): answers past it may be wrong",
            explicit, max_positions, ALLOW_LONG_MAX_MODEL_LEN_ENV,
        )  # fmt: skip
        return
    raise ConfigError(
        f"--max-model-len {explicit} is more than the model's max_position_embeddings "
        f"{max_positions}: positions it was never trained at give wrong tokens, without an "
        f"error; lower it, or set {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to serve it anyway (vLLM's "
        "variable)"
    )


def fit_max_model_len(
    explicit: int | None, derived: int, num_blocks: int, config: EngineConfig
) -> int:
    """The context length this node serves: one request of it must fit the KV cache.

    A length the model's config gave is lowered to what the cache holds, with a warning
    (a node that advertised more refused every chat request without ``max_tokens``); a
    ``--max-model-len`` the cache cannot hold is a ``ConfigError`` (the node exits 2
    naming the flag; vLLM refuses to start too)."""
    capacity = num_blocks * config.cache.block_size
    if derived <= capacity:
        return derived
    fix = (
        "raise --num-blocks"
        if config.cache.num_blocks is not None
        else "raise --gpu-memory-utilization"
        if config.parallel.device == "cuda"
        else "raise --kv-memory-fraction"
    )
    if explicit is not None:
        raise ConfigError(
            f"--max-model-len {explicit} does not fit the KV cache: {num_blocks} blocks x "
            f"{config.cache.block_size} tokens hold {capacity} tokens; lower --max-model-len "
            f"to at most {capacity} or {fix}"
        )
    logger.warning(
        "max_model_len lowered from %d (the model's) to %d: the KV cache holds %d blocks x "
        "%d tokens; %s, or set --max-model-len",
        derived, capacity, num_blocks, config.cache.block_size, fix,
    )  # fmt: skip
    return capacity


class EngineCore:
    def __init__(
        self, config: EngineConfig, log_level: str = "INFO", tokenizer: Tokenizer | None = None
    ) -> None:
        # A repo-id --model becomes its local snapshot (a no-op when run_node already did).
        config = resolve_model_config(config)
        self.arch = load_arch_config(config.model.model)
        if config.model.model != TINY_MODEL:  # before the workers: one line, not theirs
            checkpoint_files(config.model.model)
        # Resolve --dtype auto once, so workers and the connector's compat check agree.
        dtype = resolve_dtype(config.model.dtype, config.parallel.device, self.arch)
        config = config.replace(model=dataclasses.replace(config.model, dtype=dtype))
        self.config = config
        tp = config.parallel.tp
        self.arch.validate_tp(tp)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        check_long_max_model_len(config.model.max_model_len, self.arch.max_position_embeddings)
        # This engine's KV layout per rank, built once; the connector's compatibility check
        # is made from it (the workers allocate the same layout).
        spec = KVCacheSpec.for_model(self.arch, config)
        self.kv_spec = spec
        self.block_bytes = spec.block_bytes
        self.connector = create_scheduler_connector(config, spec)
        self.executor = make_executor(
            config,
            lambda kv_bytes: decide_num_blocks(config, spec, self.max_model_len, kv_bytes),
            log_level,
        )
        self.num_blocks = self.executor.num_blocks
        try:
            self.max_model_len = fit_max_model_len(
                config.model.max_model_len, self.max_model_len, self.num_blocks, config
            )
        except BaseException:
            self.executor.shutdown()
            raise
        logger.info(
            "engine: model=%s dtype=%s tp=%d blocks=%d x %d B per rank (%.2f GiB), "
            "max_model_len=%d",
            config.model.model,
            dtype,
            tp,
            self.num_blocks,
            spec.block_bytes,
            self.num_blocks * spec.block_bytes / 2**30,
            self.max_model_len,
        )
        if config.scheduler.async_scheduling:
            logger.info(
                "async scheduling: on (the default, as vLLM's: step N+1 is scheduled while "
                "step N runs; --no-async-scheduling turns it off)"
            )
        else:
            logger.info(
                "async scheduling: off (--no-async-scheduling: each step is scheduled once "
                "the one before it ended)"
            )
        try:
            self.connector.set_worker_info(self.executor.worker_infos)
        except BaseException:
            self.executor.shutdown()
            raise
        # Structured outputs' grammars, for this model's tokenizer (loaded, and the
        # llguidance tokenizer built, on the first structured request only).
        self.grammars = GrammarCompiler(
            (lambda: tokenizer)
            if tokenizer is not None
            else (lambda: load_tokenizer(config.model.model)),
            self.arch.vocab_size,
        )
        self.scheduler = Scheduler(
            config,
            self.num_blocks,
            self.max_model_len,
            self.connector,
            self.grammars,
            vocab_size=self.arch.vocab_size,
        )
        self._last_dispatch = 0.0
        self.step_stats = StepStats()
        # Async scheduling: the step sent and not updated from yet.
        # (The step, its result, when it was sent.)
        self._in_flight: tuple[SchedulerOutput, Future[ModelRunnerOutput], float] | None = None
        self._last_result_at = 0.0
        self._room_made = False  # async: the last step sent nothing but updated one

    @property
    def max_logprobs(self) -> int:
        """--max-logprobs, -1 resolved to the vocabulary size."""
        limit = self.config.model.max_logprobs
        return self.arch.vocab_size if limit < 0 else limit

    def add_request(self, request: Request) -> None:
        sp = request.sampling_params
        for name in ("logprobs", "prompt_logprobs"):  # HTTP requests were checked already
            k = getattr(sp, name)
            if k is not None and k > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name} {k} is more than this engine allows (--max-logprobs "
                    f"{self.max_logprobs})",
                    name,
                )
        self.scheduler.add_request(request)

    def abort_request(
        self, request_id: str, error: str | None = None, reason: str = "abort"
    ) -> None:
        """``reason``: "abort", or "stop" for a request its caller ended at a stop string
        (the request metrics' finish reason; ``Scheduler.abort_request``)."""
        self.scheduler.abort_request(request_id, error, reason)

    def settle_request(self, request_id: str, stop_string: bool) -> None:
        """The caller has the answer of ``request_id`` (which ended by itself): at a stop
        string or not -- its finish reason in the request metrics (``Scheduler.settle``)."""
        self.scheduler.settle(request_id, stop_string)

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Whoever runs the step loop (``AsyncLLMEngine``) is woken by the workers (a
        transfer completed between steps) and by the connector (a peer's message)."""
        self.executor.set_wake_callback(wake)
        self.connector.set_wake(wake)

    def has_running(self) -> bool:
        """Requests the next step will compute tokens for (e.g. one whose KV just landed,
        in a step that computed nothing), or a step in flight (async scheduling), or an
        async step that sent nothing but updated the step before (room for waiting
        requests, which a synchronous step would have scheduled at once)."""
        return self._in_flight is not None or self._room_made or bool(self.scheduler.running)

    def idle_wait(self, longest: float) -> float:
        """How long an idle loop may wait for a wake-up after a step that computed
        nothing: ``longest``, or less when a delayed admission ends sooner."""
        at = self.connector.admission_retry_at()
        return longest if at is None else max(0.0, min(longest, at - time.monotonic()))

    def step(self) -> tuple[list[RequestOutput], int]:
        """One engine step; returns the outputs and the number of tokens computed."""
        if self.scheduler.async_scheduling:
            return self._step_async()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        idle = self._workers_idle(sched)
        if idle:
            result = ModelRunnerOutput()  # nothing for the workers to do or report
        else:
            self._last_dispatch = time.monotonic()
            result = self.executor.execute_model(sched)  # type: ignore[assignment]
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(sched, result)
        if not idle:  # where the step's time went (core/step_stats.py)
            st = self.step_stats
            st.steps_total += 1
            st.step_schedule_seconds_total += t1 - t0
            st.step_execute_seconds_total += t2 - t1
            st.step_worker_seconds_total += result.worker_busy_s
            st.step_update_seconds_total += time.perf_counter() - t2
        return outputs, sched.num_scheduled_tokens

    def _step_async(self) -> tuple[list[RequestOutput], int]:
        """Send step N+1, then wait for step N and update from it: the outputs are step
        N's, the token count step N+1's."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        prev, self._in_flight = self._in_flight, None
        idle = self._workers_idle(sched)
        if not idle:
            self.step_stats.step_schedule_seconds_total += t1 - t0
            self._last_dispatch = time.monotonic()
            sent = time.perf_counter()  # before: in process, the call may run the step
            fut = self.executor.execute_model(sched, non_block=True)
            self._in_flight = (sched, fut, sent)  # type: ignore[assignment]
        try:
            outputs = self._wait_and_update(prev) if prev is not None else []
        except BaseException as e:
            if not idle and sched.sampling_deferred:
                # Its masks follow the step that failed: none will come. The workers end
                # its wait now (the step fails), not at its deadline.
                why = f"no sampling masks: step {prev[0].step_id} before it failed ({e!r:.200})"  # type: ignore[index]
                self.executor.sample_tokens(DeferredSampling(sched.step_id, failed=why))
            raise
        if not idle and sched.sampling_deferred:
            # Its grammar masks and bad words' bans follow tokens known only now: they go
            # while its forward runs (the workers sample once they arrive).
            self.executor.sample_tokens(self.scheduler.deferred_sampling(sched))
            outputs += self.scheduler.take_outputs()  # requests their grammar ended
        # Nothing sent, but the update of the step before may have made room (requests
        # it ended, blocks back): the next schedule may find work, so do not idle yet.
        self._room_made = idle and prev is not None
        if idle:
            outputs += self.scheduler.update_from_output(sched, ModelRunnerOutput())
        return outputs, sched.num_scheduled_tokens

    def finish_in_flight(self) -> list[RequestOutput]:
        """Async scheduling: wait for the step in flight, if any, and update from it (an
        offline run's end, so its blocks come back)."""
        step, self._in_flight = self._in_flight, None
        return [] if step is None else self._wait_and_update(step)

    def _wait_and_update(
        self, step: tuple[SchedulerOutput, Future[ModelRunnerOutput], float]
    ) -> list[RequestOutput]:
        """Wait for a step sent earlier and update from it."""
        sched, fut, sent = step
        result = self.executor.wait(fut)
        t = time.perf_counter()
        outputs = self.scheduler.update_from_output(sched, result)
        # Execute: from when the workers could start the step (sent, and the step before it
        # done) to its result, as in sync mode; the engine's scheduling and updating
        # overlapped it (the phases add up to more than the wall time). "Done" is when the
        # result was there, not when this thread got to it: that is later by the engine's
        # own work -- in process (``uni`` on CPU), by the whole next step, which ran in
        # the call that sent it.
        done = result.done_at or t
        st = self.step_stats
        st.steps_total += 1
        st.step_execute_seconds_total += done - max(sent, self._last_result_at)
        self._last_result_at = done
        st.step_worker_seconds_total += result.worker_busy_s
        st.step_update_seconds_total += time.perf_counter() - t
        return outputs

    def _workers_idle(self, sched: SchedulerOutput) -> bool:
        md = sched.kv_connector_metadata
        if (
            sched.num_scheduled_tokens
            or sched.finished_request_ids
            or sched.preempted_request_ids
            or (md is not None and not md.is_empty())
        ):
            return False
        if not self.connector.needs_worker_poll():
            return True
        # The workers watch their transfers between steps and wake the engine when one
        # completes; a step goes to them then, and otherwise every WORKER_POLL_FALLBACK_S
        # (a lost wake costs that much latency, never a hang).
        if self.executor.take_wake():
            return False
        return time.monotonic() - self._last_dispatch < WORKER_POLL_FALLBACK_S

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """End every request with an error (the executor died)."""
        self._in_flight = None
        self.scheduler.forget_steps_in_flight()
        for rid in list(self.scheduler.requests):
            self.scheduler.abort_request(rid, reason)
        return self.scheduler.take_outputs()

    def stats(self) -> StatsGroup:
        """The scheduler's, the step timings' and the connector's typed stats, read as one."""
        return StatsGroup(
            self.scheduler.stats(), dataclasses.replace(self.step_stats), self.connector.stats()
        )

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.executor.shutdown()
