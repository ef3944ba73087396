"""``POST /v1/responses`` on the proxy: admitted as a chat request is (``--max-inflight``:
a 429 before its body is read, a request being read counts), then translated and served
as one (``engine/responses_api/route.py``), counted under endpoint ``responses``."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from engine.responses_api.route import serve_responses
from proxy.serving import ProxyServing
from proxy.validation import CHAT

logger = logging.getLogger(__name__)
LABEL = "responses"


async def serve(serving: ProxyServing, request: Request) -> Response:
    refused = serving.admit(LABEL)
    if refused is not None:
        return refused
    handed = False  # the reading slot is the chat request's once it starts

    async def chat(req: Request, max_bytes: int) -> Response:
        nonlocal handed
        handed = True
        return await serving.generate(req, CHAT, LABEL, admitted=True, max_bytes=max_bytes)

    try:
        resp = await serve_responses(request, chat, serving.cfg.max_request_bytes)
    finally:
        if not handed:
            serving.reading -= 1
    if not handed:  # refused before it was a chat request: a 400, or the client left
        kind = "client_disconnect" if resp.status_code == 499 else "bad_request"
        logger.debug("a /v1/responses request answered %s before it was served", resp.status_code)
        serving.count(LABEL, resp, kind)
    return resp
