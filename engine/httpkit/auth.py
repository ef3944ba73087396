"""API keys: ``Authorization: Bearer <key>`` on every path but the open ones."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.request_fields import error_body

OPEN_PATHS = frozenset(["/health", "/ping", "/metrics"])  # /ping: vLLM's health check


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    """Constant-time comparison against every configured key."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given.encode(), key.encode())
    return ok


class ApiKeyMiddleware:
    """Answers 401 (OpenAI's ``invalid_api_key``) unless the request carries one of
    ``keys`` as a bearer token; ``open_paths`` (health, ping, metrics) need none. No keys: open."""

    def __init__(
        self, app: ASGIApp, keys: tuple[str, ...] = (), open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.keys = tuple(k for k in keys if k)
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        auth = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        scheme, _, token = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and key_matches(token.strip(), self.keys):
            await self.app(scope, receive, send)
            return
        body = error_body(
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
