"""The CUDA branch of ``engine/worker/staging.py`` on CPU, with a fake device.

On a GPU, ``HostStaging`` copies through pinned buffers whose copies run after the host
returns (``non_blocking``), and ``Readback`` copies the sampled ids back the same way; a
buffer rewritten while its copy may still run hands the step wrong tokens, silently.
Here the copies are made real but *deferred*, as a GPU stream defers them: a copy runs
only when the event recorded after it is waited on (or a later event is, in order). So a
buffer rewritten before its event was waited on changes what the pending copy delivers,
and the tests see it.
"""

from __future__ import annotations

import pytest
import torch

from engine.worker import staging


class FakeStream:
    """One in-order queue of deferred copies; an event is a position in it."""

    def __init__(self) -> None:
        self.queued: list = []  # pending copies, in order
        self.done = 0  # how many ran

    def run_until(self, n: int) -> None:
        while self.done < n:
            self.queued[self.done]()
            self.done += 1


@pytest.fixture
def stream(monkeypatch) -> FakeStream:
    s = FakeStream()
    real_empty, real_copy = torch.empty, torch.Tensor.copy_

    class Event:
        def __init__(self) -> None:
            self.at: int | None = None

        def record(self) -> None:
            self.at = len(s.queued)

        def synchronize(self) -> None:
            assert self.at is not None, "waited on an event never recorded"
            s.run_until(self.at)

        def query(self) -> bool:
            return self.at is not None and s.done >= self.at

    def empty(*args, pin_memory: bool = False, device=None, **kwargs):
        return real_empty(*args, **kwargs)  # "pinned" and "device" memory: host tensors

    def copy_(dst, src, non_blocking: bool = False):
        if not non_blocking:
            return real_copy(dst, src)
        s.queued.append(lambda: real_copy(dst, src))  # reads src when it runs
        return dst

    monkeypatch.setattr(staging.torch.cuda, "Event", Event)
    monkeypatch.setattr(staging.torch, "empty", empty)
    monkeypatch.setattr(staging.torch.Tensor, "copy_", copy_)
    return s


CUDA = torch.device("cuda")  # a name only: nothing here touches a driver


def test_a_pinned_slot_is_rewritten_only_after_its_copy_ran(stream: FakeStream) -> None:
    st = staging.HostStaging(CUDA, slots=2)
    outs = [st.to_device(torch.full((8,), i, dtype=torch.int64)) for i in range(5)]
    stream.run_until(len(stream.queued))  # the device catches up
    for i, out in enumerate(outs):
        assert out.tolist() == [i] * 8, f"copy {i} delivered another step's values"
    # A larger host tensor replaces a slot's buffer: its last copy ran first too.
    big = st.to_device(torch.arange(5000, dtype=torch.int64))
    stream.run_until(len(stream.queued))
    assert big.tolist() == list(range(5000))


def test_the_static_buffer_path_copies_into_out(stream: FakeStream) -> None:
    st = staging.HostStaging(CUDA)
    out = torch.zeros(6, dtype=torch.int64)
    assert st.to_device(torch.tensor([1, 2, 3]), out=out) is out
    assert st.to_device(torch.tensor([4, 5]), out=out) is out  # one slot: waits for the first
    stream.run_until(len(stream.queued))
    assert out.tolist() == [4, 5, 3, 0, 0, 0]


def test_readback_keeps_a_held_steps_ids_while_the_next_step_is_read_back(
    stream: FakeStream,
) -> None:
    rb = staging.Readback(CUDA)
    held = rb.start(torch.tensor([11, 12, 13]))  # step N, held by the worker
    assert not held.ready()
    nxt = rb.start(torch.tensor([21, 22, 23]))  # step N+1 launched before N is sent
    stream.run_until(len(stream.queued))  # the device finished both before N is read
    assert held.result() == [11, 12, 13]
    after = rb.start(torch.tensor([31, 32, 33]))  # N+2: N's buffer again, N+1 unread
    assert nxt.result() == [21, 22, 23]
    assert after.result() == [31, 32, 33]
    assert held.ready() and nxt.ready()
