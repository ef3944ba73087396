"""Stand-ins for unit-level fault injection and fixed-example property tests (shared by
several test files; integration tests use the real parts)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


class NotifsOnly:
    """A worker connector's transport reduced to what D's side uses: the notifications a
    test hands it ("rank 1's WRITE never lands", a forged or stale notif)."""

    def __init__(self) -> None:
        self.inbox: list[bytes] = []

    def get_notifs(self) -> list[bytes]:
        out, self.inbox = self.inbox, []
        return out


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
