"""What a node or the proxy needs before its HTTP stack is imported: the listening socket
(bound first, so a busy port fails before a model loads), its URL, and the server's
defaults that flags show. Imports nothing of the HTTP framework."""

from __future__ import annotations

import socket

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6 by the host's form) for uvicorn to serve on.

    Created with ``IPPROTO_TCP`` explicitly: asyncio turns Nagle off (TCP_NODELAY) only on
    connections accepted from such a socket, and streamed tokens are small writes.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
