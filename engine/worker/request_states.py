"""What a worker keeps across steps for each request it computes: the block table and the
sampling parameters.

The scheduler sends a request's table and parameters once -- in its first step, and again
in its first step after a preemption gave it new blocks (``ScheduledSeq.new_table``) --
and afterwards only the blocks appended to the table (``new_block_ids``), so a step's
message does not grow with the length of its sequences nor carry every request's
parameters (vLLM's cached-request data, for the same reason). ``update`` applies a step's
changes before its forward, on every rank, and drops the state of the requests that
finished or were preempted (a preempted request's old table and penalty rows would
otherwise stay for as long as it waits). Every change is checked against the table
length the scheduler holds: a worker whose tables fell out of step raises instead of
reading the wrong blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.scheduler_output import SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.penalties import PenaltyHistory


class RequestStateError(RuntimeError):
    pass


class BlockTable:
    """One request's block ids in a numpy buffer that grows by doubling: a step's packing
    copies it row by row as arrays (a list of Python ints costs ~16x more at 256 x 128)."""

    def __init__(self, block_ids: Sequence[int]) -> None:
        self._buf = np.array(block_ids, dtype=np.int64).reshape(-1)
        self._len = len(self._buf)

    def __len__(self) -> int:
        return self._len

    def extend(self, block_ids: Sequence[int]) -> None:
        n = len(block_ids)
        if not n:
            return
        if self._len + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self._len + n, 16), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = block_ids
        self._len += n

    def array(self) -> np.ndarray:
        return self._buf[: self._len]


@dataclass
class RequestState:
    table: BlockTable
    sampling_params: SamplingParams | None
    penalty: PenaltyHistory | None = None  # with penalties: the tokens so far


class RequestStates:
    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def block_ids(self, request_id: str) -> np.ndarray:
        """The request's block table (a view: valid until its next change)."""
        return self._states[request_id].table.array()

    def penalty(self, request_id: str) -> PenaltyHistory | None:
        return self._states[request_id].penalty

    def sampling_params(self, request_id: str) -> SamplingParams:
        params = self._states[request_id].sampling_params
        if params is None:
            raise RequestStateError(f"{request_id} samples, but no sampling parameters came")
        return params

    def update(self, sched: SchedulerOutput) -> None:
        """Apply one step's changes: drop finished and preempted requests' state, then
        create or extend the scheduled ones'."""
        for rid in (*sched.finished_request_ids, *sched.preempted_request_ids):
            self._states.pop(rid, None)
        for seq in sched.seqs:
            rid = seq.request_id
            if seq.new_table:
                state = RequestState(BlockTable(seq.new_block_ids), seq.sampling_params)
                self._states[rid] = state
            else:
                found = self._states.get(rid)
                if found is None:
                    raise RequestStateError(f"a change to the block table of {rid}, unknown here")
                state = found
                state.table.extend(seq.new_block_ids)
            if seq.penalty_token_ids is not None:
                if seq.new_table:
                    state.penalty = PenaltyHistory(seq.num_prompt_tokens)
                elif state.penalty is None:
                    raise RequestStateError(f"tokens of {rid} for penalties, but not its first")
                state.penalty.add(seq.penalty_token_ids)
            have = len(state.table)
            if seq.num_blocks >= 0 and have != seq.num_blocks:
                raise RequestStateError(
                    f"block table of {rid} out of step: {have} blocks here, "
                    f"{seq.num_blocks} at the scheduler"
                )
