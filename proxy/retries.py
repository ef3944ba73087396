"""What a failed attempt of one request leads to: another try, a node left out of the
request's routes, the decode node answering alone, or the node's answer for the client.

``Retries`` is the retry policy of a ``Session`` (``proxy/session.py`` runs the pairs,
``proxy/stream_body.py`` a stream under way; both call ``failed`` when an attempt's leg
raised ``UpstreamError``). It keeps what the
request's next routes depend on: the nodes it does not go to again (``excluded``), the
failed attempts counted against ``--max-retries`` (``node_failures``), whether every
failure was a pair without room (``only_no_room``), and whether the next attempt goes to
a decode node alone (``decode_alone``).

A node failure (connection error, timeout, 5xx) takes the node out of rotation and the
request to another pair, until ``--max-retries`` or until no pair is left (``no_route``):
then the client gets 502 ``upstream_error``, or 503 ``overloaded`` with ``Retry-After``
when every pair failed because no decode node reserved the KV in time (P's 409
``kv_transfer_not_reserved``: load, and P stays healthy; the next attempt goes without P
when no other prefill node is left). A node's refusal of the request (4xx) is the client's answer (``PassThrough``). A
load answer (429, or 503 ``overloaded``) moves the request to a node of that role it has
not tried, without counting as a retry; when none is left the client gets the node's
answer and its ``Retry-After``. A decode node refusing to pair with P (its
``--kv-allowed-peers``, no KV connector) takes that pair out of the routes, no node's
fault. A stream moved after D failed mid-answer counts against ``--migration-limit``
(the session's), not ``--max-retries``.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.server.request_fields import APIError, error_body
from proxy.config import ProxyConfig
from proxy.legs import Attempt, UpstreamError
from proxy.metrics import ProxyMetrics
from proxy.router import NoHealthyNode, PairRefused, Router

logger = logging.getLogger(__name__)


class PassThrough(Exception):
    """A node refused the request (4xx, or overloaded): answer the client with the node's
    error (and ``headers``, e.g. its ``Retry-After``)."""

    def __init__(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(body.get("error", {}).get("message", ""))
        self.status = status
        self.body = body
        self.headers = headers or {}


class Retries:
    def __init__(
        self,
        request_id: str,
        cfg: ProxyConfig,
        router: Router,
        metrics: ProxyMetrics,
        decode_alone: bool = False,
    ) -> None:
        """``decode_alone``: the first attempt goes to a decode node without P."""
        self.request_id, self.cfg = request_id, cfg
        self.router, self.metrics = router, metrics
        self.attempts = 0  # pairs (or decode nodes alone) launched
        self.node_failures = 0
        self.only_no_room = True  # every pair failed for want of room (409 not reserved)
        self.excluded: set[str] = set()  # node URLs this request does not go to again
        self.decode_alone = decode_alone  # the next attempt without a prefill node
        self.last: UpstreamError | None = None  # the last failure counted in node_failures
        # The role whose failure (or load) the next launch retries: counted in
        # ``pdproxy_request_retries_total`` once that launch found a pair (``launched``).
        self.retrying: str | None = None

    def launched(self) -> None:
        """The session launched its next attempt: a retry pending is counted now (one that
        found no pair to retry on never happened, and is not)."""
        if self.retrying is not None:
            self.metrics.retries.labels(self.retrying).inc()
            self.retrying = None

    def failed(self, attempt: Attempt, err: UpstreamError, migrating: bool = False) -> None:
        """Clean up a failed pair; raise unless another attempt is allowed (``migrating``:
        the stream moves on under ``--migration-limit``, not ``--max-retries``)."""
        attempt.release()
        if err.overloaded:
            err.node.mark_overloaded()
            self._overloaded(err)
            return
        if err.params_refused and attempt.p is not None and err.node is attempt.d:
            # D cannot pair with P (P's side channel is not in its --kv-allowed-peers, it
            # has no KV connector): both nodes are fine, the router stops pairing them, and
            # the request goes to another pair or to D alone. Not a retry: each refusal
            # takes a pair out of the routes.
            self.router.refuse_pair(attempt.p, attempt.d, err.detail, attempt.pair_key)
            return
        if err.not_reserved:  # the pair failed, not P: try without P, P stays healthy
            logger.info("request %s: %s", self.request_id, err)
        elif err.params_refused is not None:  # the proxy's parameters: never the client's
            logger.warning("request %s: %s", self.request_id, err)
            err.mark_failed()
        elif err.refuses_request:
            logger.info("request %s refused by %s", self.request_id, err)
            raise PassThrough(err.status or 400, err.body or error_body(str(err)))
        else:
            logger.warning("request %s: %s", self.request_id, err)
            err.mark_failed()
        self.excluded.add(err.node.url)
        if err.not_reserved:  # no other prefill node: D prefills by itself, as it just did
            self.decode_alone = not self.router.has_other("prefill", self.excluded)
        if not migrating:
            self.node_failures += 1
        self.last = err
        self.only_no_room = self.only_no_room and err.not_reserved
        if self.node_failures > self.cfg.max_retries:
            raise self._exhausted(err, "") from err
        self.retrying = err.node.role

    def no_route(self, err: NoHealthyNode) -> APIError | PassThrough:
        """The error for the client when no route is left for the request's next attempt
        (``err``): once it failed on a node (taken out of rotation, so often the last of
        its role), what a request whose ``--max-retries`` are spent gets -- 502
        ``upstream_error`` naming the last failure (503 ``overloaded`` when every pair had
        no room) --; else 503 ``no_healthy_nodes``."""
        if self.last is not None and not isinstance(err, PairRefused):
            return self._exhausted(self.last, f" and no other healthy one is left ({err})")
        return APIError(
            f"no healthy prefill/decode pair is available: {err}",
            status_code=503,
            err_type="server_error",
            code="no_healthy_nodes",
        )

    def _exhausted(self, err: UpstreamError, why: str) -> APIError | PassThrough:
        """The request may not try again after ``err`` (``why``: no route is left)."""
        if self.only_no_room:  # no decode node could take the KV in time: load, not a fault
            logger.info("request %s: no pair had room: %s", self.request_id, err)
            message = (
                f"the request found no room on {self.attempts} prefill/decode pair(s){why}: "
                "no decode node reserved blocks for its KV in time; retry later"
            )
            return PassThrough(
                503, error_body(message, "server_error", code="overloaded"), {"Retry-After": "1"}
            )
        return APIError(
            f"the request failed on {self.attempts} prefill/decode pair(s){why}; last error: {err}",
            status_code=502,
            err_type="server_error",
            code="upstream_error",
        )

    def _overloaded(self, err: UpstreamError) -> None:
        """A node answered with load: try another node of its role that this request has
        not tried; when none is left, raise the node's answer for the client."""
        node = err.node
        self.excluded.add(node.url)
        if self.router.has_other(node.role, self.excluded):
            logger.info("request %s: %s; trying another %s node", self.request_id, err, node.role)
            self.retrying = node.role
            return
        logger.info("request %s: every %s node is overloaded: %s", self.request_id, node.role, err)
        body = err.body or error_body(str(err), "rate_limit_error", code="overloaded")
        raise PassThrough(err.status or 429, body, {"Retry-After": err.retry_after or "1"})

    def d_may_answer_alone(self, attempt: Attempt, err: BaseException | None) -> bool:
        """P's leg failed as a node (connection broken, 5xx: a dead P), D's leg is still
        going, and no other P is ready to retry on: D recomputes the prompt when its KV
        does not come, as for a hung P, so its stream can be the whole answer."""
        if not isinstance(err, UpstreamError) or not err.node_fault or err.not_reserved:
            return False
        if attempt.d_task.done() and attempt.d_task.exception() is not None:
            return False
        assert attempt.p is not None
        return not self.router.has_other("prefill", self.excluded | {attempt.p.url})
