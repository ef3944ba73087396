"""The default connector: nothing comes from or goes to a peer (colocated serving).

Colocated requests run through the same hooks as disaggregated ones, so the metadata
lifecycle and the aggregation path are exercised on every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from engine.core.request import Request
    from engine.core.scheduler_output import SchedulerOutput
    from engine.kv_cache_layout import KVCacheSpec
    from kvconnector.params import KVTransferParams


class NoopConnectorMetadata(KVConnectorMetadata):
    def is_empty(self) -> bool:
        return True


class NoopConnectorScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_ids: Callable[[str], list[int]]
    ) -> KVConnectorMetadata:
        return NoopConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        return False, None


class NoopConnectorWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()
