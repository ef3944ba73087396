"""``free_port()`` (engine/bench/cluster.py, re-exported by the test harness): ports for
processes that bind seconds later must not be ones the kernel may hand to anyone else
meanwhile, nor ones this process already gave out."""

from __future__ import annotations

import socket

from engine.bench.cluster import _ephemeral_low, free_port


def test_free_ports_are_never_repeated_and_lie_below_the_kernels_ephemeral_range() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    low = _ephemeral_low()
    if low > 13024:  # Linux's default range starts at 32768
        assert all(low - 12000 <= p < low for p in ports), (low, min(ports), max(ports))


def test_a_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
