"""Pick the connector classes named by ``KVTransferConfig.kv_connector``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector.base import KVConnectorScheduler, KVConnectorWorker

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv_cache_layout import KVCacheSpec


def create_scheduler_connector(config: EngineConfig, kv_spec: KVCacheSpec) -> KVConnectorScheduler:
    """``kv_spec``: one rank's KV layout, as the engine computed it (dtype resolved)."""
    name = config.kv_transfer.kv_connector
    if name == "none":
        from kvconnector.noop import NoopConnectorScheduler

        return NoopConnectorScheduler(config, kv_spec)
    if name == "nixl":
        from kvconnector.nixl.scheduler import NixlConnectorScheduler

        return NixlConnectorScheduler(config, kv_spec)
    raise ValueError(f"--kv-connector: unknown connector {name!r} (choose none or nixl)")


def create_worker_connector(config: EngineConfig, rank: int, world_size: int) -> KVConnectorWorker:
    name = config.kv_transfer.kv_connector
    if name == "none":
        from kvconnector.noop import NoopConnectorWorker

        return NoopConnectorWorker(config, rank, world_size)
    if name == "nixl":
        from kvconnector.nixl.worker import NixlConnectorWorker

        return NixlConnectorWorker(config, rank, world_size)
    raise ValueError(f"--kv-connector: unknown connector {name!r} (choose none or nixl)")
