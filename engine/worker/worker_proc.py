"""Entry point of a TP worker process: set up torch.distributed, serve steps over pipes."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import time
import traceback
from multiprocessing.connection import Connection

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import DeferredSampling, WorkerOutput
from engine.worker.pipe import WAKE, StepCancelled, WorkerError, deferred_for

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
# While a transfer may complete between steps, the worker polls it this often and, when
# one did, sends WAKE on the result pipe: the engine runs the step that reports it at
# once, instead of sending the workers empty steps on a timer.
WATCH_INTERVAL_S = 0.0005
# Async scheduling: how often a worker holding an output looks for the next step while its
# sampled ids are on their way (a spin of short polls; the wait ends with the ids).
HOLD_POLL_S = 0.0001
# Set to 1 to let the TP ranks of a node share its visible GPUs (``rank_placement``).
SHARE_GPU_ENV = "PDSERVE_TP_SHARE_GPU"


def rank_placement(
    rank: int, world_size: int, device: str, num_gpus: int, share: bool = False
) -> tuple[str, str]:
    """The torch device of TP rank ``rank`` and the backend of the node's process group.

    On CUDA, rank ``r`` runs on ``cuda:r`` of the GPUs the node sees (set them per node with
    ``CUDA_VISIBLE_DEVICES``) and the ranks talk over NCCL. NCCL refuses two ranks on one
    GPU, so a node seeing fewer GPUs than ranks is refused, unless ``share``
    (``PDSERVE_TP_SHARE_GPU=1``): then rank ``r`` runs on ``cuda:r % num_gpus`` and the group
    is gloo over CUDA tensors (staged through host memory: slow, without CUDA graphs). That
    is for running the TP paths (per-rank KV in VRAM, its transfers, the aggregation of
    the ranks' outputs) on a one-GPU host, not for serving."""
    if device != "cuda":
        return "cpu", "gloo"
    if world_size <= num_gpus:
        return f"cuda:{rank}", "nccl"
    if not share or num_gpus < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        hint = f"; {SHARE_GPU_ENV}=1 runs the ranks on shared GPUs over gloo (slow, for tests)"
        raise RuntimeError(
            f"--tp {world_size} needs {world_size} CUDA GPUs (one per rank), this node sees "
            f"{num_gpus} (CUDA_VISIBLE_DEVICES={visible})" + (hint if num_gpus else "")
        )
    return f"cuda:{rank % num_gpus}", "gloo"


def _shared_gpu_config(config: EngineConfig, world_size: int, num_gpus: int) -> EngineConfig:
    """Ranks sharing a GPU over gloo: no CUDA graphs (gloo's collectives cannot be
    captured), and each rank's memory budget is its share of the GPU."""
    per_gpu = -(-world_size // num_gpus)
    cache = config.cache
    return config.replace(
        model=dataclasses.replace(config.model, enforce_eager=True),
        cache=dataclasses.replace(
            cache, gpu_memory_utilization=cache.gpu_memory_utilization / per_gpu
        ),
    )


def _setup_logging(rank: int, level: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [tp{rank} pid%(process)d] %(name)s: %(message)s",
    )


def next_step_arrives(held: WorkerOutput, task_conn: Connection) -> bool:
    """Async scheduling: whether the next step comes while ``held``'s sampled ids are on
    their way from the device (the engine sends it once it has the step before), so the
    worker launches it before it sends ``held``; False once the ids are there first."""
    pending = held.pending_sampled[1]
    try:
        while not pending.ready():
            if task_conn.poll(HOLD_POLL_S):
                return True
    except Exception:  # e.g. a CUDA error seen by the event's query: send() reports it
        return False
    return task_conn.poll(0)


class _ShutDown(Exception):
    """The engine said shutdown (or went away) while a step waited for its masks."""


def wait_for_deferred(task_conn: Connection, step_id: int, parent: int) -> DeferredSampling:
    """Rank 0, in a step sent with ``sampling_deferred``: the step's grammar masks and
    bans, the next message the engine sends (after it updated the step before). Ends
    with the engine: ``shutdown``, or its process gone (the engine's ``--step-timeout``
    bounds the rest)."""
    while not task_conn.poll(PARENT_CHECK_S):
        if os.getppid() != parent:
            raise _ShutDown("engine process went away")
    msg = task_conn.recv_bytes()
    if msg == b"shutdown":
        raise _ShutDown("shutdown")
    return deferred_for(pickle.loads(msg), step_id)


def send_output(result_conn: Connection, rank: int, out: WorkerOutput, t0: float) -> None:
    """Send a step's output, its sampled ids read back first; a failure reading them (a
    device error surfacing late) is sent as that step's ``WorkerError``, in its place."""
    try:
        out.resolve_sampled()
    except Exception:
        logger.exception("reading back the sampled ids of a step failed")
        result_conn.send_bytes(pickle.dumps(WorkerError(rank, traceback.format_exc())))
        return
    out.busy_s = time.perf_counter() - t0
    result_conn.send_bytes(pickle.dumps(out))


def worker_main(
    rank: int,
    world_size: int,
    config: EngineConfig,
    rendezvous: tuple[int, socket.socket | None],
    task_conn: Connection,
    result_conn: Connection,
    log_level: str = "INFO",
) -> None:
    _setup_logging(rank, log_level)
    # Ctrl-C, ``kill -TERM -PGID`` and systemd (KillMode=control-group) signal the whole
    # group; the engine process drains, then shuts its workers down (a worker killed here
    # would fail the requests the drain is finishing). A parent that dies is noticed below.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    device, backend = "cpu", "gloo"
    if config.parallel.device == "cuda":
        num_gpus = torch.cuda.device_count()
        try:
            share = os.environ.get(SHARE_GPU_ENV) == "1"
            device, backend = rank_placement(rank, world_size, "cuda", num_gpus, share)
        except RuntimeError as e:  # how the node was started, not a bug: one line
            result_conn.send(("config_error", str(e)))
            return
        torch.cuda.set_device(device)
        if backend == "gloo" and world_size > 1:
            config = _shared_gpu_config(config, world_size, num_gpus)
            if rank == 0:
                logger.warning(
                    "--tp %d on %d visible GPU(s): ranks share GPUs over gloo (%s=1), "
                    "CUDA graphs off; slow, for tests",
                    world_size,
                    num_gpus,
                    SHARE_GPU_ENV,
                )
    else:
        torch.set_num_threads(config.parallel.worker_threads)
    if world_size > 1:
        import torch.distributed as dist

        # The engine's socket, bound before any rank started (rank 0 serves the store on
        # it; ``multiproc.rendezvous_socket``): the port cannot be anyone else's. Left
        # open while the worker lives (the store serves on that descriptor).
        port, listening = rendezvous
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=rank == 0,
            master_listen_fd=listening.fileno() if listening is not None else None,
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    from engine.model.parallel import init_tp

    init_tp(rank, world_size)
    from engine.worker.worker import Worker

    # Start-up in two phases: load and profile, then allocate the KV cache the engine sized.
    try:
        worker = Worker(config, rank, world_size, device)
        result_conn.send(("loaded", worker.profile_kv_bytes()))
        msg = task_conn.recv_bytes()
        if msg == b"shutdown":  # the engine gave the start up (another rank, its deadline)
            logger.info("start-up cancelled by the engine; worker exiting")
            worker.shutdown()
            return
        num_blocks = pickle.loads(msg)
        worker.init_kv_cache(num_blocks)
        result_conn.send(("ready", worker.handshake_info()))
    except (EOFError, OSError):
        return  # the engine went away during start-up
    except Exception:
        logger.exception("worker failed to start")
        result_conn.send(("error", traceback.format_exc()))
        return
    logger.info("worker ready (%d KV blocks)", num_blocks)
    from engine.heap import freeze_startup_heap

    freeze_startup_heap(f"tp{rank} worker")
    connector = worker.connector
    woke = False  # a WAKE is out and no step came since: do not send another
    last_parent_check = time.monotonic()
    # Async scheduling: a step's output whose sampled ids are still on their way from the
    # device, held while the next step (already queued) is launched, then sent before it.
    held: tuple[WorkerOutput, float] | None = None
    last_sent = 0.0

    def send(out: WorkerOutput, t0: float) -> None:
        # The step's time counts from when this rank could start it: received, and the
        # output of the step before it gone (a step launched while that one's ids were
        # read back ran behind it), as the engine counts the round trip that holds it.
        nonlocal last_sent
        send_output(result_conn, rank, out, max(t0, last_sent))
        last_sent = time.perf_counter()

    def deferred_source(step_id: int) -> DeferredSampling:
        # The engine makes the masks from the step before's output: send that first.
        nonlocal held
        if held is not None:
            send(*held)
            held = None
        return wait_for_deferred(task_conn, step_id, parent)

    try:
        while True:
            if held is not None and not next_step_arrives(held[0], task_conn):
                send(*held)  # no step queued behind it: nothing to overlap
                held = None
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
            t0 = time.perf_counter()
            sched = pickle.loads(msg)
            if isinstance(sched, DeferredSampling):
                continue  # the mask of a step that failed before it sampled
            error = None
            try:
                out = worker.execute_model(sched, deferred_source)  # launched (CUDA), or done
            except _ShutDown:
                return
            except StepCancelled as e:  # the step before failed: its traceback was logged
                logger.warning("rank %d: cancelled %s", rank, e)
                error = WorkerError(rank, f"cancelled {e}")
            except Exception:
                logger.exception("step %s failed", sched.step_id)
                error = WorkerError(rank, traceback.format_exc())
            if held is not None:  # the step before this one, in order
                send(*held)
                held = None
            if error is not None:
                result_conn.send_bytes(pickle.dumps(error))
            elif out.pending_sampled is not None:
                held = (out, t0)
            else:
                send(out, t0)
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        worker.shutdown()
