"""The two legs of a disaggregated request: one prefill call and one decode call.

``Legs`` owns the shared ``NodeClient`` to the nodes (``proxy/node_client.py``) and knows how to start a
pair (``Attempt``): P gets the client's body with ``do_remote_decode`` (non-streaming; it
answers with the first token), D gets it with ``do_remote_prefill`` and P's side-channel
address. A decode-only attempt (``--disagg-min-prompt-tokens``) has no prefill leg: D gets
the client's body with only the transfer id, a plain request it prefills itself. Both
legs carry the client's request id as their label (``X-Request-Id``) and one transfer id
made for this attempt (``<label>-<random>``, never the label itself, so two clients using
one ``X-Request-Id`` never share a transfer); aborts name that transfer id, which finds
the legs' requests on both nodes. A leg
that fails raises ``UpstreamError``; ``node_fault`` tells a node failure (connection
error, timeout, 5xx: retry elsewhere) from a refusal of the request (4xx: the client's);
``overloaded`` marks a load answer (429, or 503 with ``code: overloaded``): the node is
healthy but busy, neither a failure of the node nor the client's fault; only a refusal
of the request itself (``refuses_request``) is the client's answer. D's error event is
such an error too, of the status it stands for (``event_error``), wherever in its stream
it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from engine.httpkit.admission import OVERLOADED_CODE
from engine.httpkit.big_json import parse_off_loop
from engine.httpkit.error_status import event_status
from engine.httpkit.request_id import REQUEST_ID_HEADER
from kvconnector.base import KV_NOT_RESERVED
from kvconnector.params import KVTransferParams
from proxy.answers import MalformedAnswer, parse_completion
from proxy.node_client import NodeClient, NodeHTTPError, NodeResponse
from proxy.nodes import Node
from proxy.validation import ProxyRequest
from proxy.waiting import wait_watched

logger = logging.getLogger(__name__)

# A decode node is never judged hung (``Attempt.d_gone``) sooner than this after the first
# of its unanswered health checks began, whatever --health-timeout says: a loaded node's
# step (or its answer to a check) may take a second or two (a load round saw 0.05 s
# checks, two in a row, take healthy nodes for hung ones).
MIN_HUNG_S = 5.0


class UpstreamError(Exception):
    def __init__(
        self,
        node: Node,
        message: str,
        *,
        status: int | None = None,
        body: dict[str, Any] | None = None,
        retry_after: str | None = None,
    ) -> None:
        super().__init__(f"{node.role} node {node.url}: {message}")
        self.detail = message
        self.node = node
        self.status = status
        self.body = body
        self.retry_after = retry_after  # the node's Retry-After header, if any
        self._marked = False  # ``mark_failed`` took the node out for this error

    def mark_failed(self) -> None:
        """Take the node out of rotation for this error, once however many paths handle
        it (a leg's failure is marked when it happens: ``Attempt``)."""
        if not self._marked:
            self._marked = True
            self.node.mark_failed(self.detail)

    @property
    def overloaded(self) -> bool:
        """A load answer: 429, or a 503 whose error code says ``overloaded``."""
        if self.status == 429:
            return True
        code = (self.body or {}).get("error", {}).get("code")
        return self.status == 503 and code == OVERLOADED_CODE

    @property
    def not_reserved(self) -> bool:
        """P's leg ended because no decode node reserved its transfer (D gave up first):
        the pair failed, neither P nor the request."""
        code = (self.body or {}).get("error", {}).get("code")
        return self.status == 409 and code == KV_NOT_RESERVED

    @property
    def params_refused(self) -> str | None:
        """The ``kv_transfer_params`` field a node refused (a 4xx naming it), else None.
        The proxy built those parameters (a client may not send them through it), so
        this is a fault of the nodes' configuration, never the client's: a decode node
        whose ``--kv-allowed-peers`` does not cover P's side channel
        (``kv_transfer_params.remote_side_channel``), a node serving the other role."""
        if self.status is None or not 400 <= self.status < 500:
            return None
        param = (self.body or {}).get("error", {}).get("param")
        return param if isinstance(param, str) and param.startswith("kv_transfer_params") else None

    @property
    def node_fault(self) -> bool:
        """The node failed (no answer, 5xx, or a status a node never gives a request:
        1xx/2xx/3xx); only a 4xx refuses the request itself (passed to the client)."""
        if self.status is None or self.status < 400:
            return True
        return self.status >= 500 and not self.overloaded

    @property
    def refuses_request(self) -> bool:
        """The node refused the request itself, the client's fault (another node would
        too): a 4xx that is neither load, nor P's ``kv_transfer_not_reserved``, nor about
        the ``kv_transfer_params`` the proxy made. ``Retries`` passes it to the client;
        anything else is retried or moved."""
        if self.node_fault or self.overloaded or self.not_reserved:
            return False
        return self.params_refused is None


async def _error_from_response(node: Node, resp: NodeResponse) -> UpstreamError:
    raw = await resp.aread()
    body: dict[str, Any] | None = None
    with contextlib.suppress(ValueError):
        parsed = json.loads(raw)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            body = parsed
    detail = body["error"].get("message") if body else raw[:200].decode("utf-8", "replace")
    return UpstreamError(node, f"HTTP {resp.status_code}: {detail}", status=resp.status_code,
                         body=body, retry_after=resp.headers.get("retry-after"))  # fmt: skip


def event_error(node: Node, event: dict[str, Any], before_token: bool = True) -> UpstreamError:
    """D's error event as the error of the HTTP answer it stands for (``event_status``).
    Before any of D's tokens reached the client (``before_token``) it is handled as that
    answer would be -- retried elsewhere, passed through as the node's refusal, moved for
    load; after them (``DecodeRelay.relay``) all but the client's 4xx are handled as D's
    stream breaking there (the stream moved, or ended with the proxy's event)."""
    error = event.get("error")
    if not isinstance(error, dict):  # ``{"error": "text"}``: no type to tell by
        error = {"message": str(error)[:200], "type": "server_error", "param": None, "code": None}
        event = {"error": error}
    status = event_status(error)
    message = str(error.get("message"))[:200]
    where = "before its first token" if before_token else "after its tokens"
    return UpstreamError(node, f"error event {status} {where}: {message}",
                         status=status, body=event)  # fmt: skip


class Legs:
    """Shared node client plus fire-and-forget housekeeping (aborts, stream closes)."""

    def __init__(self, client: NodeClient) -> None:
        self.client = client
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` detached (survives the cancellation of the request that spawned it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float = 5.0) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    async def abort(self, node: Node, transfer_id: str) -> None:
        """Abort the leg of ``transfer_id`` on ``node`` (running, or holding blocks)."""
        try:
            resp = await self.client.post(
                node.url + "/v1/abort",
                json={"transfer_id": transfer_id},
                headers={REQUEST_ID_HEADER: transfer_id},
                timeout=5.0,
            )
            if resp.status_code != 200:
                logger.info(
                    "abort of %s on %s answered %s", transfer_id, node.url, resp.status_code
                )
        except NodeHTTPError as e:
            logger.info("abort of %s on %s failed: %s", transfer_id, node.url, e)

    async def prefill(self, req: ProxyRequest, node: Node, rid: str, tid: str) -> dict[str, Any]:
        body = {k: v for k, v in req.body.items() if k != "stream_options"}
        body["stream"] = False
        kv = KVTransferParams(do_remote_decode=True, transfer_id=tid)
        body["kv_transfer_params"] = kv.to_dict()
        with node.lease():
            try:
                resp = await self.client.post(
                    node.url + req.path, json=body, headers={REQUEST_ID_HEADER: rid}
                )
            except NodeHTTPError as e:
                raise UpstreamError(node, f"{type(e).__name__}: {e}") from e
            if resp.status_code != 200:
                raise await _error_from_response(node, resp)
            try:
                data = await parse_off_loop(parse_completion, resp.content)  # may be large
            except MalformedAnswer as e:
                raise UpstreamError(node, f"malformed prefill response: {e}", status=502) from e
            choice = data["choices"][0]
            first = (data.get("kv_transfer_params") or {}).get("first_token")
            ids, reason = choice.get("token_ids"), choice.get("finish_reason")
            if first is None and not ids:
                # E.g. a leg aborted on P: streamed on, its "first token" would be none,
                # and D (told to skip the first token) would drop the real one.
                raise UpstreamError(node, f"prefill answer without a token ({reason})", status=502)
        return data

    async def open_decode(
        self,
        req: ProxyRequest,
        node: Node,
        rid: str,
        tid: str,
        side_channel: str | None,
        skip_first: bool,
    ) -> NodeResponse:
        """Send the decode leg; returns the (streaming) response once its headers arrived.
        Without ``side_channel`` D prefills the prompt itself (no KV comes)."""
        if side_channel is None:
            kv = KVTransferParams(transfer_id=tid)
        else:
            kv = KVTransferParams(
                do_remote_prefill=True,
                transfer_id=tid,
                remote_side_channel=side_channel,
                skip_first_token=skip_first,
            )
        body = {**req.body, "kv_transfer_params": kv.to_dict()}
        try:
            resp = await self.client.send_stream(
                "POST", node.url + req.path, json=body, headers={REQUEST_ID_HEADER: rid}
            )
        except NodeHTTPError as e:
            raise UpstreamError(node, f"{type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            try:
                raise await _error_from_response(node, resp)
            finally:
                resp.close()
        return resp


class Attempt:
    """One (P, D) pair working on one request, or D alone when ``p`` is None;
    ``release`` cleans up whatever is left."""

    def __init__(
        self,
        legs: Legs,
        req: ProxyRequest,
        p: Node | None,
        d: Node,
        rid: str,
        skip_first: bool,
        *,
        poll_s: float | None = None,
        d_checks: int = 0,
    ) -> None:
        """``rid``: the client's request id (the legs' label). Waits for D's answer look at
        D's health every ``poll_s`` seconds and give D up once ``d_checks`` health checks in
        a row got no answer (0: never; see ``d_gone``)."""
        assert p is None or p.side_channel is not None
        self.legs, self.p, self.d, self.rid = legs, p, d, rid
        self.transfer_id = f"{rid}-{uuid.uuid4().hex[:12]}"  # this attempt's alone
        tid = self.transfer_id
        self.p_task: asyncio.Future[dict[str, Any]] | None = None
        if p is not None:
            self.p_task = asyncio.ensure_future(legs.prefill(req, p, rid, tid))
            self.p_task.add_done_callback(_leg_ended)
        d.begin_request()
        self._d_leased = True
        side = p.side_channel if p is not None else None
        self.d_task = asyncio.ensure_future(legs.open_decode(req, d, rid, tid, side, skip_first))
        self.d_task.add_done_callback(_leg_ended)
        self.d_stream: NodeResponse | None = None
        self.finished = False  # D's answer was read to its end
        self.prestream = False  # P's first token goes to the client before D's stream
        self.pair_key: tuple[Any, ...] | None = None  # ``Router.pair_key`` at the start
        self.poll_s, self.d_checks = poll_s, d_checks
        self._aborted = False
        # Called once, by the first ``release``, with whether P answered its leg and whether
        # D finished the answer (the router learns what the nodes now hold).
        self.on_release: Callable[[bool, bool], None] | None = None

    @property
    def decode_only(self) -> bool:
        return self.p is None

    @property
    def prefill_served(self) -> bool:
        """P answered its leg (it computed the prompt)."""
        t = self.p_task
        return t is not None and t.done() and not t.cancelled() and t.exception() is None

    def d_gone(self) -> UpstreamError | None:
        """D is hung (a connection that stays open but never answers; a dead node's
        connection fails by itself): its last ``d_checks`` health checks got no answer,
        and no bytes of any answer came from it since the first of them began. One missed
        check is not enough (a loaded node may answer one late), nor are missed checks
        while D still sends tokens to anyone."""
        d, n = self.d, self.d.unreachable_checks
        if not self.d_checks or n < self.d_checks or d.unreachable_since is None:
            return None
        if time.monotonic() - d.unreachable_since < MIN_HUNG_S:
            return None  # however short the checks' timeout: a step may take a while
        if self.legs.client.heard_since(d.url, d.unreachable_since):
            return None
        return UpstreamError(d, f"no answer to {n} health checks in a row, nor any bytes since")

    async def watched(self, aw: Awaitable[Any]) -> Any:
        """Await ``aw`` (a read of D's answer); raise ``d_gone``'s error if D hangs first."""
        task = asyncio.ensure_future(aw)
        try:
            await wait_watched(task, self.d_gone, self.poll_s)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_consume)

    async def wait_prefill(self, poll_s: float | None = None) -> dict[str, Any]:
        """P's answer. If D fails first, its error is raised instead (and P is dropped).
        With ``poll_s``, P becoming unreachable (its health check got no answer) while
        this waits raises too, checked every ``poll_s`` seconds: a hung P never answers.
        A P that answers "not ready" (draining) finishes its legs: the wait goes on."""
        p_task, p, d_task = self.p_task, self.p, self.d_task
        assert p_task is not None and p is not None, "a decode-only attempt has no P"

        def stop() -> BaseException | None:
            if d_task.done():
                if (err := d_task.exception()) is not None:
                    return err
            elif (err := self.d_gone()) is not None:
                return err  # P would wait for D's reservation until its KV timeout
            # Whatever D's state (its stream may be open): a hung P never answers.
            if poll_s is not None and p.unreachable:
                return UpstreamError(p, "unreachable while its answer was awaited")
            return None

        await wait_watched(p_task, stop, poll_s, others=(d_task,))
        return p_task.result()

    async def wait_decode(self) -> NodeResponse:
        """D's open response. If P fails first, P's error is raised; if D hangs
        (``d_gone``), D's."""
        p_task = self.p_task

        def stop() -> BaseException | None:
            if p_task is not None and p_task.done() and p_task.exception() is not None:
                return p_task.exception()
            return self.d_gone()

        await wait_watched(self.d_task, stop, self.poll_s, others=(p_task,))
        self.d_stream = self.d_task.result()
        return self.d_stream

    def release(self) -> None:
        """Drop both legs; unless D finished, abort the request on both nodes (and on P
        when D finished without P's answer: P's leg would wait for its reservation until
        its own deadline).

        Never awaits, so it is safe in ``finally`` blocks of cancelled tasks.
        """
        if self.on_release is not None:
            on_release, self.on_release = self.on_release, None
            on_release(self.prefill_served, self.finished)
        p_running = self.p_task is not None and not self.p_task.done()
        for task in (self.p_task, self.d_task):
            if task is None:
                continue
            if not task.done():
                task.cancel()
            task.add_done_callback(_consume)
        if self.d_stream is not None:
            self.d_stream.close()
            self.d_stream = None
        if self._d_leased:
            self._d_leased = False
            self.d.outstanding -= 1
        if not self._aborted and (not self.finished or p_running):
            self._aborted = True
            if not self.finished:
                self.legs.spawn(self.legs.abort(self.d, self.transfer_id))
            if self.p is not None:
                self.legs.spawn(self.legs.abort(self.p, self.transfer_id))


def _leg_ended(task: asyncio.Future[Any]) -> None:
    """A leg failed as a node (``node_fault``): its node leaves the rotation now, whether
    or not the request still waits for it -- D's answer may have come first (D recomputed
    the prompt) and be relayed still while P's leg fails; P's leg may end too and be
    handled first, the attempt dropped -- and nothing would look at that leg again."""
    if task.cancelled():
        return
    err = task.exception()
    if isinstance(err, UpstreamError) and err.node_fault:
        err.mark_failed()


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished leg's outcome so asyncio does not log it as never retrieved, and
    close a decode answer nobody claimed (D answered after the attempt was dropped): an
    open answer holds one of the client's connection slots."""
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, NodeResponse):
            result.close()
