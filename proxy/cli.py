"""`pd-proxy` command: ``serve`` the proxy, or try a deployment with ``complete``/``chat``.

    pd-proxy serve --prefill URL [URL ...] --decode URL [URL ...] --port 8000
    pd-proxy serve --prefill-dns NAME:PORT --decode-dns NAME:PORT     # DNS discovery
    pd-proxy serve --registration-key KEY        # nodes register (--register-with)
    pd-proxy complete "Hello" --url http://127.0.0.1:8000 --max-tokens 32 --stream
    pd-proxy chat --url http://127.0.0.1:8000

Bad settings exit 2 with a message naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.httpkit.serve import bind_socket, listen_url, make_server
from proxy.client import run_chat, run_complete
from proxy.config import ProxyConfigError, add_proxy_args, config_from_sources

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"
DEFAULT_URL = os.environ.get("PDPROXY_URL", "http://127.0.0.1:8000")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-proxy",
        description="pdserve proxy: pairs prefill and decode nodes per request",
        allow_abbrev=False,  # a flag is spelled whole: '--api-k' is an error, not --api-key
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="run the OpenAI-compatible proxy",
        usage="%(prog)s [options]   (every option: %(prog)s --help)",
    )
    add_proxy_args(serve)
    parser.set_defaults(command_parser=None)
    serve.set_defaults(command_parser=serve)  # errors found after parsing: serve's usage

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=DEFAULT_URL, help=f"proxy URL (default: {DEFAULT_URL})")
        p.add_argument("--model", default=None, help="model name (default: the served one)")
        p.add_argument(
            "--max-tokens", type=int, default=128, help="tokens to generate (default: 128)"
        )
        p.add_argument(
            "--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)"
        )
        p.add_argument(
            "--timeout", type=float, default=300.0, help="request timeout, seconds (default: 300)"
        )
        p.add_argument(
            "--api-key",
            default=os.environ.get("PDPROXY_API_KEY") or os.environ.get("OPENAI_API_KEY"),
            help="the proxy's key (default: $PDPROXY_API_KEY or $OPENAI_API_KEY)",
        )

    complete = sub.add_parser(
        "complete", allow_abbrev=False, help="send one completion request and print it"
    )
    complete.add_argument("prompt", help="the prompt text")
    client_args(complete)
    complete.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    chat = sub.add_parser(
        "chat", allow_abbrev=False, help="interactive chat (reads lines until EOF or /exit)"
    )
    client_args(chat)
    chat.add_argument("--system", default=None, help="an optional system message")
    return parser


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        cfg = config_from_sources(args)
    except ProxyConfigError as e:
        parser.error(str(e))
    logging.basicConfig(level=cfg.log_level, format=_LOG_FORMAT, stream=sys.stderr)
    if cfg.log_level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per node call
    try:
        sock = bind_socket(cfg.host, cfg.port)
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", cfg.host, cfg.port, e)
        return 1
    from proxy.app import build_app

    sources = [f"prefill: {' '.join(cfg.prefill) or '-'}", f"decode: {' '.join(cfg.decode) or '-'}"]
    if cfg.prefill_dns or cfg.decode_dns:
        sources.append("dns: " + " ".join(cfg.prefill_dns + cfg.decode_dns))
    if cfg.registration_key:
        sources.append("registration on")
    port = sock.getsockname()[1]
    banner = f"pdserve proxy listening on {listen_url(cfg.host, port)} ({'; '.join(sources)})"
    app = build_app(cfg)
    server = make_server(app, log_level=cfg.log_level, banner=banner, drainer=app.state.drainer)
    from engine.heap import freeze_startup_heap

    freeze_startup_heap("proxy")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    logger.info("proxy stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        sys.exit(serve(args, args.command_parser))
    if args.command == "complete":
        sys.exit(run_complete(args))
    sys.exit(run_chat(args))
