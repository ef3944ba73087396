"""Metadata cleared every step: the connector metadata is cleared at the end of every worker
step."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput, WorkerOutput
from engine.sampling_params import SamplingParams
from engine.worker.worker import Worker
from kvconnector.base import KVConnectorMetadata
from kvconnector.noop import NoopConnectorMetadata, NoopConnectorWorker


class RecordingConnector(NoopConnectorWorker):
    """The no-op connector, recording what metadata was bound during each hook."""

    def __init__(self) -> None:
        super().__init__(EngineConfig(), rank=0, world_size=1)
        self.calls: list[tuple[str, object]] = []

    def bind_connector_metadata(self, metadata):
        super().bind_connector_metadata(metadata)
        self.calls.append(("bind", metadata))

    def start_load_kv(self):
        self.calls.append(("start_load_kv", self.connector_metadata))

    def wait_for_save(self, sampled=None):
        self.calls.append(("wait_for_save", self.connector_metadata))

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self.calls.append(("clear", self.connector_metadata))


class FakeRunner:
    """Unit-level stand-in for the model runner (the real one is tested elsewhere)."""

    kv_cache = None
    kv_spec = None

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls = 0

    def init_kv_cache(self, num_blocks):
        pass

    def update_states(self, sched):
        pass

    def execute(self, sched):
        self.calls += 1
        if self.fail:
            raise RuntimeError("forward exploded")
        return WorkerOutput(0, {s.request_id: 1 for s in sched.seqs if s.samples})


def _step(with_tokens: bool) -> SchedulerOutput:
    seqs = []
    if with_tokens:
        seqs = [ScheduledSeq("r1", [1, 2, 3], 0, [0], SamplingParams(temperature=0), samples=True)]
    out = SchedulerOutput(step_id=1, seqs=seqs)
    out.kv_connector_metadata = NoopConnectorMetadata()
    return out


def _worker(runner: FakeRunner, conn: RecordingConnector) -> Worker:
    worker = Worker(EngineConfig(), 0, 1, "cpu", connector=conn, model_runner=runner)
    worker.init_kv_cache(4)
    return worker


def test_normal_step_binds_then_clears_last():
    conn, runner = RecordingConnector(), FakeRunner()
    sched = _step(True)
    out = _worker(runner, conn).execute_model(sched)
    assert out.sampled_token_ids == {"r1": 1}
    assert runner.calls == 1
    names = [c[0] for c in conn.calls]
    assert names == ["bind", "start_load_kv", "wait_for_save", "clear"]
    assert conn.calls[1][1] is sched.kv_connector_metadata  # bound during the step
    assert conn.connector_metadata is None


def test_step_with_nothing_scheduled_still_clears():
    conn, runner = RecordingConnector(), FakeRunner()
    _worker(runner, conn).execute_model(_step(False))
    assert runner.calls == 0  # no forward pass
    assert conn.calls[-1] == ("clear", None)
    assert conn.connector_metadata is None


def test_step_whose_forward_raises_still_clears():
    conn, runner = RecordingConnector(), FakeRunner(fail=True)
    with pytest.raises(RuntimeError, match="forward exploded"):
        _worker(runner, conn).execute_model(_step(True))
    assert conn.calls[-1] == ("clear", None)
    assert conn.connector_metadata is None


def test_a_step_whose_forward_raises_still_posts_its_sends():
    """The step's sends push prefills of earlier steps, which the scheduler-side connector
    already counts in flight: skipping ``wait_for_save`` left them never posted, with no
    deadline (issue 9, hole 7). They are posted with the step's metadata still bound."""
    conn, runner = RecordingConnector(), FakeRunner(fail=True)
    sched = _step(True)
    with pytest.raises(RuntimeError, match="forward exploded"):
        _worker(runner, conn).execute_model(sched)
    assert [c[0] for c in conn.calls] == ["bind", "start_load_kv", "wait_for_save", "clear"]
    assert conn.calls[2][1] is sched.kv_connector_metadata


def test_metadata_base_class_is_abstract():
    with pytest.raises(TypeError):
        KVConnectorMetadata()  # type: ignore[abstract]
