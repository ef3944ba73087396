"""Entry point shared by the prefill and decode nodes: flags -> engine -> HTTP server.

Lifecycle: parse flags (a bad value exits 2 naming the flag), bind the HTTP socket (a busy
port fails fast, before the model loads), start the engine, serve with uvicorn. SIGTERM or
SIGINT stops the server, shuts the engine (and its worker processes) down and exits 0;
a signal during engine startup aborts the startup the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from types import FrameType
from typing import Any, Literal

from engine.httpkit.serve import bind_socket, listen_url, make_server
from engine.server.cli_args import (
    add_config_args,
    add_server_args,
    parse_config,
    set_flag_default,
)

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
_ROLE_KV = {"prefill": "producer", "decode": "consumer"}
_LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"


class _Terminated(BaseException):
    """Raised from the signal handler to abort a blocking engine startup."""


def build_parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{role}-node",
        description=f"pdserve {role} node: an OpenAI-compatible server over one engine",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as with --model (like 'vllm serve MODEL')",
    )
    add_server_args(parser)
    add_config_args(parser)
    set_flag_default(parser, "kv_role", _ROLE_KV[role])
    return parser


class _Signals:
    """SIGTERM/SIGINT: abort startup, stop serving, or be ignored while shutting down."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.server: Any = None
        self.received: list[int] = []

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if self.phase == "starting":
            logger.info("%s during startup: aborting", name)
            raise _Terminated(signum)
        if self.phase == "serving" and self.server is not None:
            logger.info("%s: draining, then shutting down (again: stop now)", name)
            self.server.request_shutdown()
        else:
            logger.info("%s: already shutting down", name)


def run_node(role: Role, argv: list[str] | None = None) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit status."""
    args, config = parse_config(build_parser(role), argv)
    logging.basicConfig(level=args.log_level, format=_LOG_FORMAT, stream=sys.stderr)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        return 1
    port = sock.getsockname()[1]
    signals = _Signals()
    signals.install()
    engine = None
    try:
        from engine.async_engine import AsyncLLMEngine
        from engine.config import ConfigError
        from engine.model.hub import resolve_model_config
        from engine.server.app import build_app

        try:  # a repo-id --model: its local snapshot, downloaded once, before anything loads
            config = resolve_model_config(config)
        except ConfigError as e:
            print(f"{role}-node: error: {e}", file=sys.stderr)
            return 2
        logger.info("starting %s engine: %s", role, config)
        engine = AsyncLLMEngine.start(config, log_level=args.log_level)
        banner = (
            f"pdserve {role} node listening on {listen_url(args.host, port)} "
            f"(model {engine.model_name}, tp {config.parallel.tp})"
        )
        app = build_app(
            engine,
            args.max_request_bytes,
            args.shutdown_timeout,
            args.api_key,
            max_admitted=config.scheduler.max_admitted_requests,
        )
        server = make_server(
            app,
            log_level=args.log_level,
            banner=banner,
            lifespan="off",
            own_signals=True,  # _Signals also aborts a blocking engine start-up
            drainer=app.state.drainer,
        )
        signals.server = server
        signals.phase = "serving"
        if signals.received:  # a signal raced with the end of startup
            server.should_exit = True
        asyncio.run(server.serve(sockets=[sock]))
        return 0
    except _Terminated:
        return 0
    finally:
        signals.phase = "stopping"
        sock.close()
        if engine is not None:
            logger.info("shutting down the engine")
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
        logger.info("%s node stopped", role)
