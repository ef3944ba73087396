"""OpenAI-shaped error responses, also for the framework's own errors."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.httpkit.disconnect import ClientDisconnected
from engine.server.protocol import APIError, error_body

logger = logging.getLogger(__name__)


def json_error(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """``APIError`` -> its body and status; 404/405 and body validation -> OpenAI errors;
    a client gone before its body was in -> 499 and an INFO line."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return json_error(exc)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, _: ClientDisconnected) -> Response:
        # Any route that reads a body (the utility paths too): an ordinary disconnect.
        logger.info("%s %s: client disconnected", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0].get("loc", ()) if p != "body") if errs else None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return JSONResponse(error_body(f"{loc}: {msg}" if loc else msg, param=loc or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), err_type), status_code=exc.status_code)
