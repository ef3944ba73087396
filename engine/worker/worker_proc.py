"""Entry point of a TP worker process: set up torch.distributed, serve steps over pipes."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from multiprocessing.connection import Connection

import torch

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
# While a transfer may complete between steps, the worker polls it this often and, when
# one did, sends WAKE on the result pipe: the engine runs the step that reports it at
# once, instead of sending the workers empty steps on a timer.
WATCH_INTERVAL_S = 0.0005
WAKE = b"wake"


class WorkerError(Exception):
    """A worker failed a step; carries the rank and the worker's traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker rank {rank}: {message}")
        self.rank = rank
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[int, str]]:  # pickled through the result pipe
        return (WorkerError, (self.rank, self.message))


def _setup_logging(rank: int, level: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [tp{rank} pid%(process)d] %(name)s: %(message)s",
    )


def worker_main(
    rank: int,
    world_size: int,
    config: EngineConfig,
    dist_port: int,
    task_conn: Connection,
    result_conn: Connection,
    log_level: str = "INFO",
) -> None:
    _setup_logging(rank, log_level)
    # Ctrl-C reaches the whole process group; the engine process shuts workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    device = "cpu"
    if config.parallel.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(config.parallel.worker_threads)
    if world_size > 1:
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{dist_port}",
            rank=rank,
            world_size=world_size,
        )
    from engine.model.parallel import init_tp

    init_tp(rank, world_size)
    from engine.worker.worker import Worker

    # Start-up in two phases: load and profile, then allocate the KV cache the engine sized.
    try:
        worker = Worker(config, rank, world_size, device)
        result_conn.send(("loaded", worker.profile_kv_bytes()))
        num_blocks = task_conn.recv()
        worker.init_kv_cache(num_blocks)
        result_conn.send(("ready", worker.handshake_info()))
    except (EOFError, OSError):
        return  # the engine went away during start-up
    except Exception:
        logger.exception("worker failed to start")
        result_conn.send(("error", traceback.format_exc()))
        return
    logger.info("worker ready (%d KV blocks)", num_blocks)
    connector = worker.connector
    woke = False  # a WAKE is out and no step came since: do not send another
    last_parent_check = time.monotonic()
    try:
        while True:
            watching = connector.watching()
            if not task_conn.poll(WATCH_INTERVAL_S if watching else PARENT_CHECK_S):
                if watching and not woke and connector.progress():
                    result_conn.send_bytes(WAKE)
                    woke = True
                now = time.monotonic()
                if now - last_parent_check >= PARENT_CHECK_S:
                    last_parent_check = now
                    if os.getppid() != parent:
                        logger.warning("engine process went away; worker exiting")
                        return
                continue
            woke = False
            msg = task_conn.recv_bytes()
            if msg == b"shutdown":
                return
            sched = pickle.loads(msg)
            try:
                out = worker.execute_model(sched)
                result_conn.send_bytes(pickle.dumps(out))
            except Exception:
                logger.exception("step %s failed", sched.step_id)
                result_conn.send_bytes(pickle.dumps(WorkerError(rank, traceback.format_exc())))
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        worker.shutdown()
