"""The KV connector contract -- written once, here.

A connector moves KV cache between engines. It has two halves that live in different
processes and never share memory:

* ``KVConnectorScheduler`` runs in the engine process next to the scheduler. It decides
  which tokens come from a peer, keeps per-request transfer state, and tells the workers
  what to do each step through a ``KVConnectorMetadata`` object attached to the
  ``SchedulerOutput``.
* ``KVConnectorWorker`` runs in every TP worker process. It owns the worker's side of the
  transport (registered KV memory, NIXL agent) and carries out the step's metadata.

Scheduler side, called by ``engine.core.scheduler.Scheduler``:

0. ``prepare_request(request)`` once, when the scheduler admits a request (after its id
   and prompt checks, before the capacity check). It refuses transfer parameters this
   node cannot serve (``InvalidRequestError``; the connector's own checks, such as which
   peers it may connect to, are ``check_transfer_params``) and applies the P/D request
   policy: the
   prefill leg samples only the first token (``max_tokens=1``); an unseeded sampled
   request with transfer parameters (a P/D leg, or a decode node's leg alone) is seeded
   from its transfer id (``transfer_seed``), so that P, a D that recomputes after a
   failed load, and a rerun the proxy moved a stream to draw the same tokens. The parameters themselves
   (``kvconnector.params.KVTransferParams``) were parsed and shape-checked where the
   request entered the node; ``Request.transfer_id`` is the transfer id.
1. ``get_num_new_matched_tokens(request, num_computed_tokens) -> (n, load_async)`` when a
   waiting request is first considered: ``n`` tokens beyond the local prefix-cache hit will
   arrive from a peer. ``load_async=True`` puts the request in ``WAITING_FOR_REMOTE_KV``
   after its blocks are reserved; it is not scheduled until the KV has landed.
   ``delay_admission(request) -> bool`` before that, each time a new request is
   considered: True keeps it waiting this step while the requests behind it may pass
   (the NIXL producer holds a prefill leg until its decode node reserved the blocks,
   ``--kv-reserve-first``; a delayed request the connector gives up on comes back in
   ``ConnectorEvents.failed_waiting`` and the scheduler fails it).
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)`` right after the
   blocks for those tokens were allocated (the decode side announces them to the peer).
3. ``build_connector_meta(scheduler_output, block_ids) -> KVConnectorMetadata`` once per
   step, after scheduling. ``block_ids(request_id)`` is a request's whole block table (the
   step's ``ScheduledSeq`` carries only the blocks appended to it). Always returns an
   object (possibly empty); the scheduler attaches it to the step.
4. ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)`` when a
   request ends for any reason. ``delay_free=True`` means the connector still needs the
   blocks (a send in flight, or a peer that may still write into them); the scheduler
   keeps the request in ``held`` and frees them only when the request appears in an
   aggregated ``finished_sending`` set or in the ``free_blocks`` of a later
   ``take_events()``. ``kv_transfer_params`` (a ``KVTransferParams`` or None) goes out
   with the request's final output (the prefill node's answer to the proxy).
   ``abort_held(request)`` is called when the client of such a held request goes away.
5. ``update_connector_output(output) -> {request id: info}`` with each step's
   *aggregated* ``ModelRunnerOutput``. Returns the waiting requests whose remote KV has
   landed -- on every rank, for the request's current transfer -- with the info that came
   with it (``first_token``). The keys of ``output.finished_recving`` are the connector's
   own transfer keys (the NIXL connector's are reservation nonces), not request ids: only
   the connector can tell a current transfer from a stale or forged one.
6. ``take_events() -> ConnectorEvents`` once per step: requests whose remote KV failed or
   timed out (the scheduler recomputes or fails them by the failure policy) and held
   blocks that may now be freed. This is where every connector deadline turns into a
   terminal outcome.

Worker side, called by ``engine.worker.worker.Worker`` every step, in this order::

    bind_connector_metadata(meta)      # before the forward pass
    start_load_kv()                    # pull-style loads (unused by push)
    ...forward pass (skipped when nothing is scheduled); when wants_layer_hook(),
       save_kv_layer(i) after layer i wrote its KV (pipelined sends post pieces)...
    wait_for_save(sampled)             # issue/advance sends of this step; ``sampled``:
                                       # this rank's sampled tokens, None if the forward
                                       # raised (sends whose KV it was computing fail);
                                       # with async scheduling they may still be on the
                                       # device ({}) unless needs_sampled_ids()
    get_finished(finished_req_ids)     # -> (finished_sending, finished_recving) of THIS rank
    clear_connector_metadata()         # always last, also when the forward raised

Per-rank finished sets are aggregated across all ranks by
``engine.executor.aggregator.KVOutputAggregator`` before the scheduler sees them: a
request is finished only when every rank has reported it. A transfer that ends without
completing is named in its step's ``KVConnectorMetadata.ended_transfer_keys()``: every
rank drops what it counted for it, and the executor has the aggregator drop its partial
count, so no count outlives its transfer.

``register_kv_caches(kv_cache, spec)`` is called once at worker start; ``handshake_info()``
returns what peers need to reach this rank (sent to the engine at start and served on the
side channel). Optional transports (``nixl``, ``ucxx``) are imported inside
``try/except ImportError`` so that this package imports without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.core.request import Request
    from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from engine.kv_cache_layout import KVCacheSpec
    from engine.stats import Stats, StatsGroup
    from kvconnector.params import KVTransferParams


def transfer_seed(transfer_id: str) -> int:
    """The sampling seed of an unseeded disaggregated request, the same on P and D."""
    return int.from_bytes(hashlib.sha256(transfer_id.encode()).digest()[:8], "little") >> 1


class KVConnectorMetadata(ABC):  # noqa: B024 - abstract on purpose, see is_empty
    """Per-step instructions from the scheduler-side connector to every worker.

    Abstract: each connector defines its own subclass. Instances are pickled to the
    workers with the ``SchedulerOutput``.
    """

    @abstractmethod
    def is_empty(self) -> bool:
        """True when the step carries no connector work."""

    def ended_transfer_keys(self) -> Sequence[str]:
        """Transfer keys (as reported in ``finished_recving``) that ended without
        completing: ranks and the aggregator drop their partial counts of them."""
        return ()


# The error code of a prefill leg that ended because no decode node reserved blocks for
# it (none within --kv-transfer-timeout, or the decode node gave up first): HTTP 409, as
# the leg names a transfer no decode node holds; a proxy retries the request elsewhere.
KV_NOT_RESERVED = "kv_transfer_not_reserved"


@dataclass
class ConnectorEvents:
    """Terminal outcomes the scheduler-side connector reached since the last step."""

    # request id -> reason: its remote KV will not come (timeout, failure, refusal).
    failed_loads: dict[str, str] = field(default_factory=dict)
    # request ids whose held blocks may be freed now (sends done, cancelled, timed out).
    free_blocks: set[str] = field(default_factory=set)
    # request id -> reason: a request it delayed (delay_admission) that must not start;
    # it fails with that reason (``KV_NOT_RESERVED``), or ends as aborted when the reason
    # is None.
    failed_waiting: dict[str, str | None] = field(default_factory=dict)


class KVConnectorScheduler(ABC):
    # True for connectors that move KV between nodes (they serve P/D requests).
    moves_kv = False

    def __init__(self, config: EngineConfig, kv_spec: KVCacheSpec) -> None:
        """``kv_spec``: one rank's KV layout, computed once by the engine (its dtype and
        sizes are what peers must match); the connector never loads the model itself."""
        self.config = config
        self.kv_spec = kv_spec

    def set_worker_info(self, infos: list[dict[str, Any]]) -> None:  # noqa: B027
        """Called once at start with every rank's ``handshake_info()`` (rank order)."""

    def prepare_request(self, request: Request) -> None:
        """Refuse P/D parameters this node can't serve; apply the P/D request policy.

        The one place of that policy (see the module docstring, step 0); connectors do
        not override it.
        """
        params = request.kv_transfer_params
        if params is None:
            return
        if params.disaggregated:
            if not self.moves_kv:
                raise InvalidRequestError(
                    "kv_transfer_params need a KV connector; start the node with "
                    "--kv-connector nixl",
                    "kv_transfer_params",
                )
            self.check_transfer_params(params)
        sp = request.sampling_params
        if params.do_remote_decode:
            sp = dataclasses.replace(sp, max_tokens=1)  # P samples only the first token
        named = params.disaggregated or params.transfer_id is not None
        if sp.seed is None and not sp.greedy and named:
            sp = dataclasses.replace(sp, seed=transfer_seed(request.transfer_id))
        request.sampling_params = sp

    def check_transfer_params(self, params: KVTransferParams) -> None:  # noqa: B027
        """Refuse (``InvalidRequestError``) parameters this connector must not act on,
        e.g. a peer address it may not connect to."""

    def info(self) -> dict[str, Any]:
        """What clients (the proxy) need to pair this node with peers."""
        return {}

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    @abstractmethod
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_ids: Callable[[str], list[int]]
    ) -> KVConnectorMetadata: ...

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]: ...

    def abort_held(self, request: Request) -> None:  # noqa: B027
        """A finished request whose blocks the connector holds was aborted by its client.

        Drop work that has not started (so its blocks come back in a ``free_blocks``
        event); a transfer already in flight still runs to completion.
        """

    def update_connector_output(self, output: ModelRunnerOutput) -> dict[str, dict[str, Any]]:
        """Sees each step's aggregated output; returns {request id: info} of the waiting
        requests whose remote KV landed (contract step 5)."""
        return {}

    def take_events(self) -> ConnectorEvents:
        return ConnectorEvents()

    def has_pending_work(self) -> bool:
        """True while transfers or holds are outstanding (the engine keeps stepping)."""
        return False

    def needs_worker_poll(self) -> bool:
        """True while workers may report progress (sends in flight, KV expected).

        A step with no tokens, no finished requests and empty metadata is not sent to the
        workers unless this is True; held blocks that only wait on a deadline need none.
        """
        return False

    def stats(self) -> Stats | StatsGroup | None:
        """A typed snapshot (``engine.stats``), or None when there is nothing to report."""
        return None

    def delay_admission(self, request: Request) -> bool:
        """True: leave this new request waiting for now (see the contract, step 1)."""
        return False

    def admission_retry_at(self) -> float | None:
        """When (``time.monotonic()``) a request this step delayed may be admitted anyway:
        an idle engine loop waits no longer than that."""
        return None

    def set_wake(self, wake: Callable[[], None]) -> None:
        """The engine loop's wake-up: call it (from any thread) when a peer's message
        changed what the next step can do (a reservation arrived, a load failed), so the
        engine steps now instead of at its next idle timeout."""
        self._wake = wake

    def wake(self) -> None:
        wake = getattr(self, "_wake", None)
        if wake is not None:
            wake()

    def shutdown(self) -> None:  # noqa: B027
        pass


class KVConnectorWorker(ABC):
    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._metadata: KVConnectorMetadata | None = None

    # -- metadata lifecycle (seed rule 2) ---------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata | None:
        return self._metadata

    # -- transport ---------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None: ...

    def handshake_info(self) -> dict[str, Any]:
        return {}

    def start_load_kv(self) -> None:  # noqa: B027
        pass

    def wants_layer_hook(self) -> bool:
        """True when this step's forward should call ``save_kv_layer`` after each layer."""
        return False

    def needs_sampled_ids(self) -> bool:
        """True when this step's ``wait_for_save`` sends sampled ids (e.g. a pipelined
        push's last piece carries the first token): the worker reads them back first."""
        return False

    def save_kv_layer(self, layer: int) -> None:  # noqa: B027
        """Layer ``layer`` of this step's forward has written its KV (all sequences)."""

    def wait_for_save(self, sampled: dict[str, int] | None = None) -> None:  # noqa: B027
        pass

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """This rank's (finished_sending, finished_recving) since the last call."""

    def take_recv_info(self) -> dict[str, dict[str, Any]]:
        """Data that arrived with finished receives (e.g. the first sampled token)."""
        return {}

    def take_failures(self) -> dict[str, str]:
        return {}

    # -- between steps (low fixed cost) ----------------------------------------------
    def watching(self) -> bool:
        """True while a transfer may complete between steps (the worker process then
        calls ``progress`` every few hundred microseconds instead of idling)."""
        return False

    def progress(self) -> bool:
        """Advance transfers between steps; True when a completion waits for the next
        step's ``get_finished`` -- the worker process then wakes the engine, which runs
        that step at once instead of polling the workers on a timer."""
        return False

    def stats(self) -> Stats | StatsGroup | None:
        """A typed snapshot (``engine.stats``), or None when there is nothing to report."""
        return None

    def shutdown(self) -> None:  # noqa: B027
        pass
