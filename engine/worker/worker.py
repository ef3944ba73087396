"""One TP rank's step: connector hooks around the model runner (seed rule 2 lives here)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput, WorkerOutput
from kvconnector.base import KVConnectorWorker
from kvconnector.factory import create_worker_connector

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        world_size: int,
        device: str,
        connector: KVConnectorWorker | None = None,
        model_runner: Any = None,
    ) -> None:
        self.rank = rank
        if model_runner is None:
            from engine.worker.model_runner import ModelRunner

            model_runner = ModelRunner(config, rank, world_size, device)
        self.model_runner = model_runner
        self.connector = connector or create_worker_connector(config, rank, world_size)

    def profile_kv_bytes(self) -> int | None:
        """Bytes this rank's KV cache may take (CUDA), or None (the engine decides)."""
        return self.model_runner.profile_kv_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and register it with the connector (before any step)."""
        self.model_runner.init_kv_cache(num_blocks)
        self.connector.register_kv_caches(self.model_runner.kv_cache, self.model_runner.kv_spec)

    def handshake_info(self) -> dict[str, Any]:
        return self.connector.handshake_info()

    def execute_model(
        self, sched: SchedulerOutput, deferred_source: Callable[[int], Any] | None = None
    ) -> WorkerOutput:
        """Run one step. Clearing the connector metadata is the step's last connector call,
        on every path: normal, nothing scheduled, and a forward that raises.

        The step's sends are posted on every path too: they push prefills that finished in
        earlier steps (their KV is complete), and the scheduler-side connector already
        counts them in flight -- a forward that raises must not leave them unposted."""
        connector = self.connector
        try:
            connector.bind_connector_metadata(sched.kv_connector_metadata)
            connector.start_load_kv()
            sampled = WorkerOutput(rank=self.rank)
            try:
                # Every step, tokens or not: the block tables' changes (finished requests).
                self.model_runner.update_states(sched)
                if sched.num_scheduled_tokens > 0:
                    kwargs: dict[str, Any] = {}
                    if connector.wants_layer_hook():  # a pipelined push: pieces per layer
                        kwargs["after_layer"] = connector.save_kv_layer
                    if sched.sampling_deferred:  # its masks come after the forward
                        kwargs["deferred_source"] = deferred_source
                    sampled = self.model_runner.execute(sched, **kwargs)
            except BaseException:
                self._post_sends_of_failed_step()
                raise
            if sampled.pending_sampled is not None and connector.needs_sampled_ids():
                sampled.resolve_sampled()  # async scheduling: the ids, now
            connector.wait_for_save(sampled.sampled_token_ids)
            sending, recving = connector.get_finished(sched.finished_request_ids)
            return WorkerOutput(
                rank=self.rank,
                sampled_token_ids=sampled.sampled_token_ids,
                pending_sampled=sampled.pending_sampled,  # async scheduling: ids on their way
                logprobs=sampled.logprobs,
                prompt_logprobs=sampled.prompt_logprobs,
                finished_sending=sending,
                finished_recving=recving,
                kv_recv_info=connector.take_recv_info(),
                kv_failed=connector.take_failures(),
                kv_stats=connector.stats(),
            )
        finally:
            connector.clear_connector_metadata()

    def _post_sends_of_failed_step(self) -> None:
        try:
            self.connector.wait_for_save(None)
        except Exception:  # the forward's error is the one the step reports
            logger.exception("tp%d: posting the sends of a failed step failed", self.rank)

    def shutdown(self) -> None:
        self.connector.shutdown()
