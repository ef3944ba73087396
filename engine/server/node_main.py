"""Entry point shared by the prefill and decode nodes: flags -> engine -> HTTP server.

Lifecycle: parse flags (a bad value exits 2 naming the flag), bind the HTTP socket (a busy
port fails fast, before the model loads), start the engine, serve with uvicorn. SIGTERM or
SIGINT stops the server, shuts the engine (and its worker processes) down and exits 0;
a signal during engine startup aborts the startup the same way. With ``--register-with``
the node registers with those proxies once it serves and deregisters when a signal starts
its drain (``proxy/announcer.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from engine.config import ConfigError
from engine.httpkit.cors import policy_from
from engine.httpkit.listen import bind_socket, listen_url
from engine.server.cli_args import (
    add_config_args,
    add_server_args,
    auto_tool_parser,
    parse_config,
    set_flag_default,
)
from engine.worker.pipe import stop_fork_server

if TYPE_CHECKING:
    from proxy.announcer import Announcer

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
_ROLE_KV = {"prefill": "producer", "decode": "consumer"}
_LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"


class _Terminated(BaseException):
    """Raised from the signal handler to abort a blocking engine startup."""


def build_parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{role}-node",
        allow_abbrev=False,  # '--api-k' is an error, not --api-key (as the launch scripts read)
        # An error shows two lines, not the usage of every flag (``--help`` has them).
        usage="%(prog)s [MODEL] [options]   (every option: %(prog)s --help)",
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
        self.on_stop: Callable[[], None] | None = None  # e.g. deregister from the proxies

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
            if self.on_stop is not None:
                self.on_stop()
            self.server.request_shutdown()
        else:
            logger.info("%s: already shutting down", name)


_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def registration_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], str | None] | None:
    """The proxies of ``--register-with`` and the ``--advertise-url`` (None: the listening
    address), checked before anything starts; a bad flag exits 2 naming it."""
    if not args.register_with:
        if args.advertise_url:
            parser.error("--advertise-url: only used with --register-with")
        return None
    from proxy.registration import normalize_node_url

    proxies = [p.strip().rstrip("/") for p in args.register_with.split(",") if p.strip()]
    for proxy in proxies:
        parts = urlsplit(proxy)
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            parser.error(f"--register-with: {proxy!r} has an invalid port")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            parser.error(f"--register-with: {proxy!r} is not a proxy URL like http://proxy:8000")
    if not proxies:
        parser.error("--register-with: give a proxy URL like http://proxy:8000")
    if not args.registration_key:
        parser.error(
            "--registration-key: needed with --register-with: the proxies' "
            "--registration-key (or set $PDSERVE_REGISTRATION_KEY)"
        )
    if not args.registration_interval > 0:
        parser.error("--registration-interval: must be > 0 seconds")
    advertise = None
    if args.advertise_url:
        try:
            advertise = normalize_node_url(args.advertise_url)
        except ValueError as e:
            parser.error(f"--advertise-url: {e}")
    elif args.host in _WILDCARD_HOSTS:
        parser.error(
            f"--advertise-url: required with --register-with when --host is {args.host!r}: "
            "give the URL proxies reach this node at (e.g. http://$(POD_IP):8200)"
        )
    else:
        # The listening address is advertised: checked as the proxies will check it (a
        # zone id, ``fe80::1%eth0``, names this host's interface: every registration got
        # 400 while the node served on). Port 0 is picked at bind time: any port checks.
        try:
            normalize_node_url(listen_url(args.host, args.port or 1))
        except ValueError as e:
            parser.error(
                f"--advertise-url: required with --register-with when --host is "
                f"{args.host!r}, which proxies cannot be given: {e}"
            )
    return proxies, advertise


def _import_http_stack() -> None:
    import engine.httpkit.serve  # noqa: F401
    import engine.server.app  # noqa: F401


def run_node(role: Role, argv: list[str] | None = None) -> int:
    """Run a node until SIGTERM/SIGINT; returns the process exit status."""
    parser = build_parser(role)
    args, config = parse_config(parser, argv)
    registration = registration_flags(parser, args)
    try:
        cors = policy_from(args)
    except ConfigError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level, format=_LOG_FORMAT, stream=sys.stderr)
    if args.log_level != "DEBUG":  # one line per registration renewal (--register-with)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.trust_remote_code:
        logger.info(
            "--trust-remote-code: no effect: pdserve runs its own Llama/Qwen2 code, never "
            "code from a checkpoint"
        )
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        return 1
    port = sock.getsockname()[1]
    signals = _Signals()
    signals.install()
    engine = None
    announcer: Announcer | None = None
    try:
        from engine.async_engine import AsyncLLMEngine
        from engine.model.hub import resolve_model_config

        model_root = config.model.model  # as given (a repo id, a directory): /v1/models' root
        try:  # a repo-id --model: its local snapshot, downloaded once, before anything loads
            config = resolve_model_config(config)
        except ConfigError as e:
            print(f"{role}-node: error: {e}", file=sys.stderr)
            return 2
        logger.info("starting %s engine: %s", role, config)
        # The HTTP stack (Starlette, uvicorn: ~0.2 s of imports) loads while the workers
        # start (torch, the model: seconds); the engine start mostly waits on their pipes.
        http_stack = threading.Thread(target=_import_http_stack, name="import-http", daemon=True)
        http_stack.start()
        try:
            engine = AsyncLLMEngine.start(config, log_level=args.log_level)
        except ConfigError as e:  # a flag only the loaded model or memory can judge
            print(f"{role}-node: error: {e}", file=sys.stderr)
            return 2
        finally:
            http_stack.join()  # never left importing while the interpreter exits
        from engine.generation_config import sampling_defaults
        from engine.httpkit.serve import make_server
        from engine.server.app import build_app

        defaults = sampling_defaults(engine.config.model.model, config.model.generation_config)
        if defaults:  # vLLM says the same
            logger.info(
                "requests that do not set them default to %s: the model's generation config "
                "(--generation-config %s; --generation-config vllm ignores it)",
                defaults, config.model.generation_config,
            )  # fmt: skip
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
            tool_call_parser=auto_tool_parser(args),
            reasoning_parser=args.reasoning_parser,
            trust_request_chat_template=args.trust_request_chat_template,
            log_requests=args.log_requests,
            sampling_defaults=defaults,
            max_logprobs=engine.max_logprobs,
            max_logprob_entries=config.model.max_logprob_entries,
            served_model_names=list(engine.config.model.served_names),
            model_root=model_root,
            cors=cors,
            prompt_tokens_details=args.enable_prompt_tokens_details,
        )
        server = make_server(
            app,
            log_level=args.log_level,
            banner=banner,
            lifespan="off",
            own_signals=True,  # _Signals also aborts a blocking engine start-up
            drainer=app.state.drainer,
            uvicorn_log_level=args.uvicorn_log_level,
        )
        if registration is not None:
            from proxy.announcer import Announcer

            proxies, advertise = registration
            url = advertise or listen_url(args.host, port)
            announcer = Announcer(
                proxies, role, url, args.registration_key, args.registration_interval
            )
            signals.on_stop = announcer.request_stop
        from engine.heap import freeze_startup_heap

        freeze_startup_heap(f"{role} node")  # the engine, the app: before the first request
        signals.server = server
        signals.phase = "serving"
        if signals.received:  # a signal raced with the end of startup
            server.should_exit = True
        asyncio.run(_serve(server, sock, announcer))
        return 0
    except _Terminated:
        return 0
    finally:
        signals.phase = "stopping"
        if announcer is not None:
            announcer.stop()  # deregistered (if it was not already)
        sock.close()
        if engine is not None:
            logger.info("shutting down the engine")
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
            else:
                stop_fork_server()
        logger.info("%s node stopped", role)


async def _serve(server: Any, sock: Any, announcer: Announcer | None) -> None:
    """Serve; register with the proxies only once the server accepts connections."""
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    if announcer is not None:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started and not server.should_exit:
            announcer.start()
    await serving
