"""The proxy's request handlers: one client request becomes a ``Session`` on a P/D pair;
utility endpoints go to one healthy node; models and health come from the node pool."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.httpkit.big_json import json_response, may_be_large
from engine.httpkit.body import read_body
from engine.httpkit.disconnect import ClientDisconnected, race_disconnect
from engine.httpkit.drain import Drainer
from engine.httpkit.errors import json_error
from engine.httpkit.sse import SSEResponse
from engine.server.request_checks import check_structured
from engine.server.request_fields import APIError
from proxy import choices
from proxy.config import ProxyConfig
from proxy.health import PROXY_HEADER
from proxy.legs import Legs
from proxy.metrics import ProxyMetrics, StreamError
from proxy.node_client import NodeClient, NodeHTTPError
from proxy.nodes import NodePool
from proxy.retries import PassThrough
from proxy.router import Router
from proxy.session import Session
from proxy.validation import CHAT, validate_request

logger = logging.getLogger(__name__)

PROXY_HEADERS = {PROXY_HEADER: "1"}  # a proxy named as a node is never routed to


# Bodies up to this size are validated on the event loop (well under a millisecond);
# larger ones in a worker thread.
INLINE_VALIDATION_BYTES = 16 * 1024


def _refusal_kind(status: int) -> str | None:
    """The error kind of a request refused with ``status``: every 400 the client gets is a
    ``bad_request``, the proxy's own and a node's passed through (a prompt longer than the
    context: only a node's tokenizer can tell)."""
    return "bad_request" if status == 400 else None


class ProxyServing:
    def __init__(
        self,
        cfg: ProxyConfig,
        pool: NodePool,
        router: Router,
        metrics: ProxyMetrics,
        drainer: Drainer,
    ) -> None:
        self.cfg, self.pool, self.router = cfg, pool, router
        self.metrics, self.drainer = metrics, drainer
        self.inflight = 0
        self.reading = 0  # requests whose bodies are being read and validated
        self.legs: Legs | None = None  # set by the app's lifespan
        self.client: NodeClient | None = None

    def count(self, label: str, resp: Response, kind: str | None = None) -> Response:
        """``resp`` counted in ``pdproxy_requests_total`` under endpoint ``label`` (and in
        the errors by ``kind``)."""
        self.metrics.requests.labels(label, str(resp.status_code)).inc()
        if kind is not None:
            self.metrics.errors.labels(kind).inc()
        return resp

    def admit(self, label: str) -> Response | None:
        """The 429 of a request past ``--max-inflight`` (counted under ``label``); None when
        it is admitted: it then holds a reading slot, given back by ``generate``."""
        cfg = self.cfg
        if self.inflight + self.reading >= cfg.max_inflight:
            err = APIError(
                f"the proxy is at its limit of {cfg.max_inflight} requests in flight; retry later",
                status_code=429,
                err_type="rate_limit_error",
                code="too_many_requests",
            )
            return self.count(label, json_error(err, {"Retry-After": "1"}), "overloaded")
        self.reading += 1  # until it is in flight (no await between) or refused
        return None

    async def generate(
        self,
        request: Request,
        endpoint: str,
        label: str | None = None,
        admitted: bool = False,
        max_bytes: int | None = None,
    ) -> Response:
        """A completion or chat request: refuse at ``--max-inflight`` (429, before the body
        is read: requests being read count too), validate (400) before any node is
        touched, then serve it on a P/D pair as JSON or a stream. ``admitted``: the
        caller's ``admit`` holds its reading slot already (``/v1/responses``, which reads
        the body before it is a chat request); ``label``: its endpoint in the metrics;
        ``max_bytes``: the body's size cap when not ``--max-request-bytes`` (its translated
        body, whose client's body passed the cap)."""
        cfg, pool, metrics = self.cfg, self.pool, self.metrics
        rid = request.state.request_id
        path = label or ("chat" if endpoint == CHAT else "completions")

        def answer(resp: Response, kind: str | None = None) -> Response:
            return self.count(path, resp, kind)

        if not admitted:
            refused = self.admit(path)
            if refused is not None:
                return refused
        try:
            limit = cfg.max_model_len or pool.max_model_len()
            raw = await read_body(request, max_bytes or cfg.max_request_bytes)
            if len(raw) <= INLINE_VALIDATION_BYTES:  # microseconds: no thread hop
                req = validate_request(
                    endpoint, raw, pool.model_names(), limit, cfg.max_logprob_entries
                )
            else:  # off the event loop: a huge body must not stall the other clients' streams
                req = await anyio.to_thread.run_sync(
                    validate_request, endpoint, raw, pool.model_names(), limit,
                    cfg.max_logprob_entries,
                )  # fmt: skip
            if req.parsed.structured_output is not None:  # a grammar check: off the loop
                await anyio.to_thread.run_sync(check_structured, req.parsed.structured_output)
        except APIError as e:
            return answer(json_error(e), "bad_request")
        except ClientDisconnected:  # gone before its body was in
            logger.info("request %s: client disconnected while sending its body", rid)
            return answer(Response(status_code=499), "client_disconnect")
        finally:
            self.reading -= 1
        assert self.legs is not None, "the app's lifespan has not started"
        # Several choices (n > 1, a batch of prompts): a session each, counted in flight.
        k, n = max(1, len(req.children)), req.parsed.n
        if k > cfg.max_inflight:
            err = APIError(
                f"the request asks for {k} choices; this proxy serves at most "
                f"{cfg.max_inflight} at once (--max-inflight)",
                param="n",
            )
            return answer(json_error(err), "bad_request")
        if k > 1 and self.inflight + k > cfg.max_inflight:
            err = APIError(
                f"the request's {k} choices would pass the proxy's limit of "
                f"{cfg.max_inflight} requests in flight ({self.inflight} now); retry later",
                status_code=429,
                err_type="rate_limit_error",
                code="too_many_requests",
            )
            return answer(json_error(err, {"Retry-After": "1"}), "overloaded")
        # Its choices count the request's stream error once (one error event ends it).
        stream_error = StreamError(metrics)
        sessions = [
            Session(
                c,
                rid,
                cfg,
                self.router,
                self.legs,
                metrics,
                index=i if k > 1 else None,
                stream_error=stream_error,
            )  # fmt: skip
            for i, c in enumerate(req.children or [req])
        ]
        session = sessions[0]
        self.inflight += k
        metrics.inflight.inc(k)
        streaming = False

        released = False

        def done() -> None:  # once: the stream's end and its response's close both call it
            nonlocal released
            if released:
                return
            released = True
            self.inflight -= k
            metrics.inflight.dec(k)
            for s in sessions:
                s.close()

        async def on_close() -> None:  # also when the client left before the first byte
            done()

        try:
            if not req.stream:
                work = session.complete() if k == 1 else choices.complete_all(sessions, n)
                body = await race_disconnect(request, work)
                return answer(await json_response(body, large=may_be_large(req.parsed)))
            start = session.start_stream() if k == 1 else choices.start_all(sessions, n)
            await race_disconnect(request, start)
            streaming = True
        except ClientDisconnected:
            logger.info("request %s: client disconnected; aborted on both nodes", rid)
            return answer(Response(status_code=499), "client_disconnect")
        except PassThrough as e:  # a node's refusal; 429 when every node was overloaded
            kind = "overloaded" if e.status in (429, 503) else _refusal_kind(e.status)
            return answer(JSONResponse(e.body, e.status, headers=e.headers), kind)
        except APIError as e:
            kind = "unavailable" if e.status_code == 503 else "upstream"
            return answer(json_error(e), _refusal_kind(e.status_code) or kind)
        finally:
            if not streaming:
                done()

        async def body_iter() -> AsyncIterator[str]:
            events = session.events() if k == 1 else choices.events_all(sessions, n)
            try:
                # Closed first: a merged stream's choices stop before their sessions close
                # (else a choice would see its stream break and rerun it).
                async with contextlib.aclosing(events):
                    async for chunk in events:
                        yield chunk
            finally:
                failed = any(s.outcome == "error" for s in sessions)  # the others: aborted
                if not failed and any(s.outcome == "pending" for s in sessions):
                    metrics.errors.labels("client_disconnect").inc()
                    logger.info("request %s: client disconnected mid-stream; aborted", rid)
                done()

        return answer(SSEResponse(body_iter(), on_close=on_close))

    async def forward(self, request: Request, path: str) -> Response:
        """A node utility endpoint (``/tokenize``, ``/detokenize``): the body as it came, to
        one healthy node (decode first; every node serves the same model), its answer back."""
        raw = await read_body(request, self.cfg.max_request_bytes)
        nodes = [n for role in ("decode", "prefill") for n in self.pool.nodes(role) if n.ready]
        if not nodes:
            err = APIError(
                "no healthy node to answer", status_code=503, err_type="server_error",
                code="no_healthy_node",
            )  # fmt: skip
            return json_error(err)
        node = nodes[0]
        try:
            assert self.client is not None, "the app's lifespan has not started"
            resp = await self.client.post(
                node.url + path, content=raw, headers={"Content-Type": "application/json"}
            )
        except NodeHTTPError as e:
            err = APIError(
                f"node {node.url} did not answer {path}: {e!r}", status_code=502,
                err_type="server_error", code="upstream_error",
            )  # fmt: skip
            return json_error(err)
        media = resp.headers.get("content-type", "application/json")
        return Response(resp.content, status_code=resp.status_code, media_type=media)

    def models(self) -> JSONResponse:
        cards: list[dict[str, Any]] = []
        for name in self.pool.model_names():
            lens = [  # the ready decode nodes hold prompt and answer (a P only the prompt)
                n.max_model_len
                for n in self.pool.ready("decode")
                if name in (n.names or (n.model,)) and n.max_model_len
            ]
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pdserve",
                    "root": self.pool.model_root(name) or name,
                    "parent": None,
                    "max_model_len": self.cfg.max_model_len or (min(lens) if lens else None),
                }
            )
        return JSONResponse({"object": "list", "data": cards})

    def health(self) -> JSONResponse:
        pool, drainer = self.pool, self.drainer
        if drainer.draining:
            return JSONResponse(
                {"status": "draining", "in_flight": drainer.in_flight}, 503, PROXY_HEADERS
            )
        leaving = pool.leaving()
        nodes = {
            role: [
                {
                    "url": n.url,
                    "healthy": n.ready,
                    "state": "leaving" if n.removed else "ready" if n.ready else "unhealthy",
                    "outstanding": n.in_flight,
                    "error": n.last_error,
                    "sources": sorted(n.sources),
                }  # fmt: skip
                for n in [*pool.nodes(role), *(n for n in leaving if n.role == role)]
            ]
            for role in ("prefill", "decode")
        }
        if pool.serving:
            fallback = {} if pool.ready("prefill") else {"prefill_fallback": True}
            return JSONResponse({"status": "ok", **fallback, **nodes}, headers=PROXY_HEADERS)
        reason = "no healthy decode node" if not pool.ready("decode") else "no healthy prefill node"
        return JSONResponse(
            {"status": "unavailable", "reason": reason, **nodes}, 503, PROXY_HEADERS
        )
