"""Stand-ins for unit-level fault injection and fixed-example property tests (shared by
several test files; integration tests use the real parts)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler_output import ModelRunnerOutput
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
