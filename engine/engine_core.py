"""The engine step, on one screen: schedule -> execute -> update.

``EngineCore`` owns the scheduler, the scheduler-side connector and the executor. It is
driven by one thread (``AsyncLLMEngine``'s loop, or ``LLM.generate`` offline).
"""

from __future__ import annotations

import logging
import os

from engine.config import EngineConfig
from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.executor.multiproc import MultiprocExecutor
from engine.kv_cache_layout import KVCacheSpec
from engine.model.loader import load_arch_config
from engine.outputs import RequestOutput
from engine.worker.model_runner import DTYPES
from kvconnector.factory import create_scheduler_connector

logger = logging.getLogger(__name__)


def decide_num_blocks(config: EngineConfig, spec: KVCacheSpec, max_model_len: int) -> int:
    """KV blocks per rank: ``--num-blocks``, else a fraction of memory (capped by need)."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    if config.parallel.device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        total //= config.parallel.tp  # all ranks share the host's memory
    by_memory = int(total * config.cache.kv_memory_fraction) // spec.block_bytes
    by_need = config.scheduler.max_num_seqs * cdiv(max_model_len, config.cache.block_size)
    return max(2, min(by_memory, by_need))


class EngineCore:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self.arch = load_arch_config(config.model.model)
        tp = config.parallel.tp
        self.arch.validate_tp(tp)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        spec = KVCacheSpec(
            num_blocks=1,
            num_layers=self.arch.num_hidden_layers,
            num_kv_heads=self.arch.num_key_value_heads // tp,
            block_size=config.cache.block_size,
            head_dim=self.arch.head_dim,
            dtype=DTYPES[config.model.dtype],
        )
        self.num_blocks = decide_num_blocks(config, spec, self.max_model_len)
        self.block_bytes = spec.block_bytes
        logger.info(
            "engine: model=%s tp=%d blocks=%d x %d B per rank, max_model_len=%d",
            config.model.model,
            tp,
            self.num_blocks,
            spec.block_bytes,
            self.max_model_len,
        )
        self.connector = create_scheduler_connector(config)
        self.executor = MultiprocExecutor(config, self.num_blocks, log_level)
        try:
            self.connector.set_worker_info(self.executor.worker_infos)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config, self.num_blocks, self.max_model_len, self.connector)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str, error: str | None = None) -> None:
        self.scheduler.abort_request(request_id, error)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> tuple[list[RequestOutput], int]:
        """One engine step; returns the outputs and the number of tokens computed."""
        sched = self.scheduler.schedule()
        if self._workers_idle(sched):
            result = ModelRunnerOutput()  # nothing for the workers to do or report
        else:
            result = self.executor.execute_model(sched)  # type: ignore[assignment]
        outputs = self.scheduler.update_from_output(sched, result)
        return outputs, sched.num_scheduled_tokens

    def _workers_idle(self, sched: SchedulerOutput) -> bool:
        md = sched.kv_connector_metadata
        return (
            sched.num_scheduled_tokens == 0
            and not sched.finished_request_ids
            and (md is None or md.is_empty())
            and not self.connector.needs_worker_poll()
        )

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """End every request with an error (the executor died)."""
        for rid in list(self.scheduler.requests):
            self.scheduler.abort_request(rid, reason)
        return self.scheduler.take_outputs()

    def stats(self) -> dict[str, float]:
        return {**self.scheduler.stats(), **self.connector.stats()}

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.executor.shutdown()
