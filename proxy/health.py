"""Background health polling of every node.

Every ``health_interval`` seconds each node gets ``GET /health`` (with a timeout). A node
that answers 200 is (re)admitted once its facts are known: ``GET /v1/models`` (model name,
context length) and ``GET /v1/kv_transfer_info`` (side-channel address, incarnation);
these are fetched again whenever the node comes back, since it may have restarted. A
connection error, timeout or non-200 answer takes the node out of rotation.

Each node is checked on its own schedule (Envoy's per-host health checks): every
interval, each node whose last check has ended gets a new one, so a node whose check
waits does not hold up the others'. A check has one deadline for all of it
(``--health-timeout``: the facts and the answers' bodies included), so a node that hangs
or trickles its answer is out of rotation at it, and answers are read up to
``MAX_HEALTH_BODY_BYTES`` (the health client's limit; a bigger one fails the check).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from proxy.node_client import NodeClient, NodeHTTPError
from proxy.nodes import Node, NodePool

logger = logging.getLogger(__name__)

MAX_HEALTH_BODY_BYTES = 1 << 20  # /health, /v1/models, /v1/kv_transfer_info answers
# On a proxy's /health answers: a proxy named as a node (its own URL registered, another
# proxy in a DNS answer) is never routed to -- it would refuse every leg it got.
PROXY_HEADER = "X-PDServe-Proxy"
# How long a /health call may go on after its check gave up on it (a late answer still
# counts as proof of life).
LATE_ANSWER_S = 30.0
# /health calls per node in flight: one a check gave up on, and the next check's (a node
# that answers again is back at that check, whatever became of the hung call).
MAX_CALLS_PER_NODE = 2


class HealthChecker:
    def __init__(
        self, pool: NodePool, client: NodeClient, interval: float, deadline: float | None = None
    ) -> None:
        self.pool = pool
        self.client = client
        self.interval = interval
        # One check, all its calls (health, KV info, models) and their bodies: the timeout.
        self.deadline = client.timeout if deadline is None else deadline
        self._task: asyncio.Task[None] | None = None
        self._first_round = asyncio.Event()
        self._template_warned: set[tuple[Any, ...]] = set()  # _check_templates
        # Each node's /health calls in flight, oldest first, by node (one that left the
        # pool and one that joined again at its address are two nodes: ``NodePool.watched``).
        self._calls: dict[int, list[asyncio.Future[Any]]] = {}
        self._given_up: set[asyncio.Future[Any]] = set()  # calls their check stopped waiting for
        self._checking: dict[int, asyncio.Task[Any]] = {}  # each node's check under way
        self._spawned: set[asyncio.Task[None]] = set()  # the loop's checks (``_run``)

    async def check_node(self, node: Node) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._checking[id(node)] = task
        try:
            await self._check(node, time.monotonic())
        finally:
            if task is not None and self._checking.get(id(node)) is task:
                del self._checking[id(node)]

    async def _check(self, node: Node, began: float) -> None:
        # A /health call may answer after its check gave up on it, and a late answer is
        # still proof of life (``_ended``): a hung node never answers, a loaded one answers
        # late (found by a load round: two missed 0.05 s checks took healthy decode nodes
        # for hung ones). The next check sends a call of its own all the same: a node that
        # answers it is back (before, no call was sent while one was out: a node whose
        # call hung stayed out until that call ended, 30 s). Two out: a miss, no call.
        calls = self._calls.setdefault(id(node), [])
        if len(calls) >= MAX_CALLS_PER_NODE:
            node.mark_unreachable(f"{len(calls)} health checks still unanswered", began)
            return
        # The call's own limit is per read: LATE_ANSWER_S bounds a trickled answer too.
        call = asyncio.ensure_future(
            asyncio.wait_for(
                self.client.get(node.url + "/health", timeout=LATE_ANSWER_S), LATE_ANSWER_S
            )
        )
        calls.append(call)
        call.add_done_callback(functools.partial(self._ended, node))
        await asyncio.wait({call}, timeout=self.deadline)
        if not call.done():
            self._given_up.add(call)
            node.mark_unreachable(f"no health answer within {self.deadline:g} s", began)
            return
        try:
            resp = call.result()
        except (NodeHTTPError, TimeoutError) as e:
            node.mark_unreachable(f"health check failed: {type(e).__name__}: {e}", began)
            return
        except Exception as e:  # noqa: BLE001 - whatever a node sends fails its check only
            node.set_healthy(False, f"health check failed: {type(e).__name__}: {e}")
            return
        node.mark_reachable()  # it answered, whatever it said
        if node.removed:
            return  # it left the pool: only whether it answers matters (its last requests)
        if resp.status_code != 200:
            node.set_healthy(False, f"health check answered {resp.status_code}")
            return
        if PROXY_HEADER.lower() in resp.headers:
            self._misfit(node, "it answers as a pd-proxy, not a node (a proxy is no proxy's node)")
            return
        if not node.healthy or node.model is None or node.incarnation is None:
            left = max(began + self.deadline - time.monotonic(), 0.0)
            try:
                async with asyncio.timeout(left):  # within the check's deadline
                    node.update_info(await self._get_json(node, "/v1/kv_transfer_info"), None)
                    node.update_info(None, await self._get_json(node, "/v1/models"))
            except TimeoutError:  # it answered /health: slow, not hung
                node.set_healthy(False, f"node facts not answered within {self.deadline:g} s")
                return
            except Exception as e:  # noqa: BLE001 - a node's answer, however malformed
                node.set_healthy(False, f"node facts unavailable: {type(e).__name__}: {e}")
                return
            if (mismatch := node.role_mismatch()) is not None:
                self._misfit(node, mismatch)
                return
            if node.role == "prefill" and node.side_channel is None:
                self._misfit(
                    node,
                    "prefill node advertises no KV side channel (it serves colocated): "
                    "start it with --kv-connector nixl",
                )
                return
        node.set_healthy(True)
        self._check_templates(node)

    def forget(self, node: Node) -> None:
        """``node`` left the pool: its /health call still in flight is cancelled unless a
        request is still on it (then it stays watched: ``NodePool.watched``). Each call
        holds one of the client's connections for up to ``LATE_ANSWER_S``: nodes that
        joined and left (registrations, DNS answers) used them all, and the checks of the
        nodes in the pool waited past their deadline for one. Its pairs' chat template
        warnings are forgotten (a node joining at its URL again is warned about afresh)."""
        if node.outstanding == 0:
            for call in list(self._calls.get(id(node), ())):
                call.cancel()
        # (Kept for every URL ever seen, they grew without bound with DNS or registration churn.)
        at = 0 if node.role == "prefill" else 2  # (P url, P template, D url, D template)
        self._template_warned = {k for k in self._template_warned if k[at] != node.url}

    def _check_templates(self, node: Node) -> None:
        """Warn (once per pair) when ``node`` and a node of the other role render chats
        with different chat templates: each renders a chat itself, so a pair of them
        computes different prompts on P and D (the fix: the same --chat-template)."""
        other = "decode" if node.role == "prefill" else "prefill"
        for peer in self.pool.ready(other):
            if None in (node.chat_template, peer.chat_template):
                continue
            if node.chat_template == peer.chat_template:
                continue
            p, d = (node, peer) if node.role == "prefill" else (peer, node)
            key = (p.url, p.chat_template, d.url, d.chat_template)
            if key in self._template_warned:
                continue
            self._template_warned.add(key)
            logger.warning(
                "prefill node %s and decode node %s render chats with different chat "
                "templates (%s, %s): chat requests on this pair compute different prompts on "
                "P and D; start both with the same --chat-template",
                p.url, d.url, p.chat_template, d.chat_template,
            )  # fmt: skip

    @staticmethod
    def _misfit(node: Node, reason: str) -> None:
        """Out of rotation for how it was started. Said in the log once per reason, also for
        a node never healthy (``set_healthy`` logs only a healthy node leaving rotation),
        so that the proxy's 503s are explained where its operator looks."""
        if not node.healthy and node.last_error != reason:
            logger.warning("%s node %s not routed to: %s", node.role, node.url, reason)
        node.set_healthy(False, reason)

    def _ended(self, node: Node, call: asyncio.Future[Any]) -> None:
        """A /health call ended. One its check gave up on that got an answer all the
        same shows the node alive (``Node.unreachable_checks`` starts again)."""
        calls = self._calls.get(id(node), [])
        if call in calls:
            calls.remove(call)
        if not calls:
            self._calls.pop(id(node), None)
        late = call in self._given_up
        self._given_up.discard(call)
        if late and not call.cancelled() and call.exception() is None and node.unreachable:
            logger.info("%s node %s answered a health check late", node.role, node.url)
            node.mark_reachable()

    async def _get_json(self, node: Node, path: str) -> dict[str, Any] | None:
        resp = await self.client.get(node.url + path)
        if resp.status_code == 404 and path == "/v1/kv_transfer_info" and node.role == "decode":
            return None  # a decode node need not advertise its side channel
        resp.raise_for_status()
        data = resp.json()
        if not isinstance(data, dict):
            raise ValueError(f"{path} did not return a JSON object")
        return data

    async def check_all(self) -> None:
        """Check every node at once and wait for every check (the first round; tests run
        rounds by hand); one node's check failing in any way ends no other's."""
        nodes = self.pool.watched()
        await asyncio.gather(*(self._guarded(n) for n in nodes))

    async def _guarded(self, node: Node) -> None:
        try:
            await self.check_node(node)
        except Exception as e:  # noqa: BLE001 - whatever fails, it fails this node's check
            logger.error("health check of %s failed: %r", node.url, e)
            node.set_healthy(False, f"health check failed: {type(e).__name__}")

    async def _run(self) -> None:
        try:
            await self.check_all()
        except Exception:  # never let the poller die
            logger.exception("health check round failed")
        self._first_round.set()
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._start_checks()
            except Exception:  # never let the poller die
                logger.exception("starting health checks failed")

    def _start_checks(self) -> None:
        """A check of every node whose last one has ended: each node on its own schedule,
        so one whose check waits (hung, up to the timeout) delays no other's. (In rounds
        that waited for every check, one hung node made every node's checks
        ``interval + timeout`` apart.)"""
        for node in self.pool.watched():
            if id(node) in self._checking:
                continue
            task = asyncio.create_task(self._guarded(node), name="pdproxy-health-check")
            self._checking[id(node)] = task  # until it runs (``check_node``) and ends
            self._spawned.add(task)
            task.add_done_callback(functools.partial(self._spawn_ended, id(node)))

    def _spawn_ended(self, key: int, task: asyncio.Task[None]) -> None:
        self._spawned.discard(task)
        if self._checking.get(key) is task:  # cancelled before it began
            del self._checking[key]

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pdproxy-health")

    async def wait_first_round(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._first_round.wait(), timeout)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        checks = list(self._spawned)
        for check in checks:
            check.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        calls = [call for node_calls in self._calls.values() for call in node_calls]
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
