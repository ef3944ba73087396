"""The listening socket the node and the proxy serve on."""

from __future__ import annotations

import asyncio
import socket

from engine.httpkit.serve import bind_socket


def test_accepted_connections_send_small_writes_at_once():
    """Streamed tokens are small writes: the server side of a connection must have Nagle
    off (TCP_NODELAY), or chunks wait ~40 ms for the client's delayed ACK."""

    async def main() -> int:
        sock = bind_socket("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_client(reader, writer) -> None:
            raw = writer.get_extra_info("socket")
            seen.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
