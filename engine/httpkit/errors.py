"""OpenAI-shaped error responses, also for the framework's own errors."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.httpkit.disconnect import ClientDisconnected
from engine.server.request_fields import APIError, error_body

logger = logging.getLogger(__name__)


def json_error(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def install_error_handlers(app: Starlette) -> None:
    """``APIError`` -> its body and status; 404/405 -> OpenAI errors; a client gone before
    its body was in -> 499 and an INFO line."""

    async def _api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return json_error(exc)

    async def _disconnected(request: Request, _: Exception) -> Response:
        # Any route that reads a body (the utility paths too): an ordinary disconnect.
        logger.info("%s %s: client disconnected", request.method, request.url.path)
        return Response(status_code=499)

    async def _http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), err_type), status_code=exc.status_code, headers=exc.headers
        )

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientDisconnected, _disconnected)
    app.add_exception_handler(StarletteHTTPException, _http_error)
