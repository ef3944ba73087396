"""Socket helpers shared by the node server and the proxy."""

from __future__ import annotations

import socket


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
