"""``free_port()`` (engine/bench/cluster.py, re-exported by the test harness): ports for
processes that bind seconds later must not be ones the kernel may hand to anyone else
meanwhile, nor ones this process already gave out."""

from __future__ import annotations

import os
import socket

from engine.bench.cluster import _ephemeral_low, free_port, port_range


def test_free_ports_are_never_repeated_and_lie_below_the_kernels_ephemeral_range() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    # $PDSERVE_PORT_RANGE when set (each xdist worker has a slice), else just below the
    # kernel's ephemeral range (Linux's default starts at 32768).
    span = port_range()
    if span is None:
        assert _ephemeral_low() <= 13024
    else:
        lo, hi = span
        assert hi <= _ephemeral_low() or "PDSERVE_PORT_RANGE" in os.environ
        assert all(lo <= p < hi for p in ports), (lo, hi, min(ports), max(ports))


def test_a_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
