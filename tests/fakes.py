"""Stand-ins for unit-level fault injection and fixed-example property tests (shared by
several test files; integration tests use the real parts)."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    DeferredSampling,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.worker.model_runner import placeholder_sources
from engine.worker.request_states import RequestStates
from kvconnector.noop import NoopConnectorScheduler


class NotifsOnly:
    """A worker connector's transport reduced to what D's side uses: the notifications a
    test hands it ("rank 1's WRITE never lands", a forged or stale notif)."""

    def __init__(self) -> None:
        self.inbox: list[bytes] = []

    def get_notifs(self) -> list[bytes]:
        out, self.inbox = self.inbox, []
        return out


class RemotePrefill(NoopConnectorScheduler):
    """A decode node's scheduler connector for driving the real scheduler: every prompt's
    KV comes from a prefill node; a test sets ``landed`` ({request id: info, e.g. the
    first token}) to make it arrive in the next step."""

    moves_kv = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, None)  # type: ignore[arg-type]
        self.landed: dict[str, dict[str, Any]] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        return request.num_prompt_tokens - num_computed, True

    def update_connector_output(self, output: ModelRunnerOutput) -> dict[str, dict[str, Any]]:
        landed, self.landed = self.landed, {}
        return landed


def fixed_examples(n: int) -> settings:
    """Hypothesis settings for CI: ``n`` examples, the same every run (derandomized, no
    example database), no deadline (processes on a loaded box are slow)."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


def example_scale(env: str) -> int:
    """A hunt's multiplier of a property test's example counts: the ``PDSERVE_*_EXAMPLES``
    variable ``env`` (1 when unset)."""
    return max(1, int(os.environ.get(env, "1")))


def hunt_timeout(scale: int, seconds: int = 300) -> pytest.MarkDecorator:
    """The pytest-timeout of a property test whose examples ``scale`` multiplies: its CI
    count's limit ``seconds`` (300, pyproject's default) times ``scale``. A fixed limit
    fires inside an example of a long hunt: a failure to hypothesis, whose replay of the
    cut example then fails with FlakyStrategyDefinition instead of naming a bug."""
    return pytest.mark.timeout(seconds * scale)


class PagedToyModel:
    """A worker stand-in: writes each step's tokens into their cache slots, and samples
    from what the cache holds (a hash of the sequence's tokens read through its table)."""

    def __init__(self, block_size: int, vocab: int) -> None:
        self.block_size, self.vocab = block_size, vocab
        self.cache: dict[tuple[int, int], int] = {}  # (block, offset) -> token id
        self.states = RequestStates()
        # The last sampling step's ids and each request's row in them (as the runner).
        self.prev_ids: list[int] = []
        self.prev_rows: dict[str, int] = {}
        self.placeholders = 0

    def execute(
        self, so: SchedulerOutput, deferred: DeferredSampling | None = None
    ) -> ModelRunnerOutput:
        """``deferred``: a ``sampling_deferred`` step's bans, made after the step before's
        update (the engine's ``sample_tokens``)."""
        so = pickle.loads(pickle.dumps(so))  # what a worker receives
        assert so.sampling_deferred == (deferred is not None), "deferred bans: both or none"
        late = deferred.bad_token_ids if deferred is not None else {}
        self.states.update(so)
        self.placeholders += sum(1 for q in so.seqs if q.token_ids[-1] == PLACEHOLDER_TOKEN_ID)
        for i, row in zip(*placeholder_sources(so.seqs, self.prev_rows), strict=True):
            so.seqs[i].token_ids[-1] = self.prev_ids[row]
        sampled: dict[str, int] = {}
        for seq in so.seqs:
            bad = late.get(len(sampled), seq.bad_token_ids) if seq.samples else ()
            table = self.states.block_ids(seq.request_id).tolist()
            for j, token in enumerate(seq.token_ids):
                pos = seq.start_pos + j
                self.cache[(table[pos // self.block_size], pos % self.block_size)] = token
            if seq.samples:
                h = 17
                for pos in range(seq.start_pos + seq.num_tokens):
                    h = (
                        h * 1_000_003
                        + self.cache[(table[pos // self.block_size], pos % self.block_size)]
                    ) % (2**61 - 1)
                token = h % self.vocab
                while token in seq.banned_token_ids or token in bad:
                    token = (token + 1) % self.vocab
                sampled[seq.request_id] = token
        if sampled:  # as the model runner: a step that samples nothing keeps the last
            self.prev_ids = list(sampled.values())
            self.prev_rows = {rid: j for j, rid in enumerate(sampled)}
        return ModelRunnerOutput(sampled_token_ids=sampled)
