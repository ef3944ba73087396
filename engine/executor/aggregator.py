"""All-ranks aggregation of per-worker step outputs (seed rule 1).

Each TP worker reports, per step, the request ids whose KV it finished sending and
finished receiving. A request is finished for the scheduler only in the step in which the
*last* rank reports it. The per-rank sets never reach the scheduler: the aggregated output
always carries freshly built sets -- empty ones in steps where nothing completed on all
ranks (the upstream bug passed rank 0's partial sets through in that case). Counts live
across steps; once a request completes its count is dropped, so a later report of the
same id starts a new count. Where ranks give different reasons for one transfer (a send
failure, a received transfer's ``kv_error``), the first reported is kept (earliest step,
then lowest rank). ``forget(keys)`` drops the counts of transfers that ended without
completing (the connector names them in a step's metadata); a later report of a forgotten
key is ignored, so a straggling rank cannot start a count that never ends.

One implementation serves both collection paths: ``aggregate`` takes the outputs,
``async_aggregate`` takes futures of them and calls ``aggregate`` when all are done.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

from engine.core.scheduler_output import ModelRunnerOutput, WorkerOutput
from engine.stats import Stats

MAX_FORGOTTEN = 65536


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self._remaining_send: dict[str, int] = {}
        self._remaining_recv: dict[str, int] = {}
        # Info that came with a rank's receive report, kept until all ranks reported.
        self._recv_info: dict[str, dict] = {}
        # Send failures a rank reported, kept until the send is finished on all ranks.
        self._send_failed: dict[str, str] = {}
        # Keys of transfers that ended without completing (most recent MAX_FORGOTTEN).
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def forget(self, keys: Iterable[str]) -> None:
        """Drop every partial count and info of ``keys``; ignore their later reports."""
        with self._lock:
            for key in keys:
                self._remaining_send.pop(key, None)
                self._remaining_recv.pop(key, None)
                self._recv_info.pop(key, None)
                self._send_failed.pop(key, None)
                self._forgotten[key] = None
                self._forgotten.move_to_end(key)
            while len(self._forgotten) > MAX_FORGOTTEN:
                self._forgotten.popitem(last=False)

    def _count(self, remaining: dict[str, int], ids: set[str], done: set[str]) -> None:
        for req_id in ids:
            if req_id in self._forgotten:
                continue
            left = remaining.get(req_id, self.world_size) - 1
            if left == 0:
                remaining.pop(req_id, None)
                done.add(req_id)
            else:
                remaining[req_id] = left

    def aggregate(self, outputs: Sequence[WorkerOutput], output_rank: int = 0) -> ModelRunnerOutput:
        if len(outputs) != self.world_size:
            raise ValueError(f"expected {self.world_size} worker outputs, got {len(outputs)}")
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        kv_stats: Stats | None = None
        with self._lock:
            # Ranks in order: where they report different reasons for one transfer, the
            # one passed on is the first -- earliest step, then lowest rank -- not the
            # one the loop saw last (the logged and exported reason stays put).
            for out in sorted(outputs, key=lambda o: o.rank):
                self._count(self._remaining_send, out.finished_sending, finished_sending)
                self._count(self._remaining_recv, out.finished_recving, finished_recving)
                for req_id, info in out.kv_recv_info.items():
                    if req_id not in self._forgotten:
                        merged = self._recv_info.setdefault(req_id, {})
                        error = merged.get("kv_error")
                        merged.update(info)
                        if error is not None:
                            merged["kv_error"] = error
                for req_id, why in out.kv_failed.items():
                    self._send_failed.setdefault(req_id, why)
                if out.kv_stats is not None:  # per-rank counters add up
                    kv_stats = out.kv_stats if kv_stats is None else kv_stats + out.kv_stats
            kv_recv_info = {r: self._recv_info.pop(r, {}) for r in finished_recving}
            kv_failed = {
                r: self._send_failed.pop(r) for r in finished_sending if r in self._send_failed
            }
        first = next(o for o in outputs if o.rank == output_rank)
        return ModelRunnerOutput(
            sampled_token_ids=first.sampled_token_ids,
            logprobs=first.logprobs,
            prompt_logprobs=first.prompt_logprobs,
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            kv_recv_info=kv_recv_info,
            kv_failed=kv_failed,
            kv_stats=kv_stats,
            worker_busy_s=max(o.busy_s for o in outputs),
            done_at=time.perf_counter(),
        )

    def async_aggregate(
        self, futures: Sequence[Future[WorkerOutput]], output_rank: int = 0
    ) -> Future[ModelRunnerOutput]:
        """A future of ``aggregate(results)``, resolved when every rank's future is done."""
        result: Future[ModelRunnerOutput] = Future()
        pending = [len(futures)]
        lock = threading.Lock()

        def on_done(f: Future) -> None:
            with lock:
                if result.done():
                    return
                pending[0] -= 1
                if f.exception() is not None:
                    # Fail at once: the other ranks may be stuck in a collective with the
                    # failed one and never answer.
                    result.set_exception(f.exception())  # type: ignore[arg-type]
                    return
                if pending[0] != 0:
                    return
            try:
                outputs = [f.result() for f in futures]
                result.set_result(self.aggregate(outputs, output_rank))
            except BaseException as e:  # a worker died or failed: propagate
                result.set_exception(e)

        for f in futures:
            f.add_done_callback(on_done)
        return result

    @property
    def pending_ids(self) -> set[str]:
        with self._lock:
            return set(self._remaining_send) | set(self._remaining_recv)
