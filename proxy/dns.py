"""DNS discovery: ``--prefill-dns`` / ``--decode-dns NAME:PORT``.

Every ``--discovery-interval`` seconds each name is resolved (``getaddrinfo``, in a thread;
a Kubernetes headless service answers with its pods' addresses) and each address becomes a
node ``http://ADDR:PORT`` of that role: new addresses join the pool, vanished ones leave
(``proxy/discovery.py``). A name that does not exist (NXDOMAIN: e.g. a headless service
with no pods) lists no node; any other lookup failure (timeout, no DNS server) keeps what
the name listed before, since the nodes are health-checked anyway. A refresh waits for a
lookup up to its deadline (``LOOKUP_TIMEOUT_S``: past it, it counts as failed,
``dns_timeout`` as well as ``dns_error``), and the lookup runs on: its answer, when it
comes, is the name's answer then (``dns_late``; a resolver slower than the deadline still
moves the pool, late; no newer answer can exist, since no other lookup of the name ran
beside it, so it is not dropped as stale), and a name whose lookup still runs is not
looked up again (a hung resolver holds one thread per name, not one per refresh); a name
lists at most ``MAX_NODES_PER_NAME`` addresses. The resolver is a plain function
``name -> [address, ...]`` so tests can inject one.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Callable, Sequence

from proxy.discovery import Membership, RoleConflict
from proxy.nodes import Role

logger = logging.getLogger(__name__)

Resolver = Callable[[str], list[str]]
LOOKUP_TIMEOUT_S = 10.0
MAX_NODES_PER_NAME = 256
# Labels of 1-63 characters (longer ones make getaddrinfo raise UnicodeError: IDNA).
HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
    r"(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*\.?$"
)


class NameNotFound(OSError):
    """The name does not exist (or has no address): it lists no node."""


class LookupTimeout(TimeoutError):
    """No answer within ``LOOKUP_TIMEOUT_S``, or the name's lookup of an earlier refresh
    still runs: counted as ``dns_timeout`` (and ``dns_error``)."""


def parse_dns_name(text: str) -> tuple[str, int]:
    """``(name, port)`` of ``NAME:PORT``; ``ValueError`` otherwise."""
    name, sep, port = text.strip().rpartition(":")
    if not sep or not HOST_NAME.match(name.lower()) or not port.isdigit():
        raise ValueError(
            f"{text!r:.80} is not NAME:PORT (e.g. pdserve-decode:8200; a name's labels "
            "are 1-63 characters)"
        )
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r:.80}: the port must be in [1, 65535]")
    return name.lower(), int(port)


def system_resolver(name: str) -> list[str]:
    """The addresses ``name`` resolves to (IPv4 and IPv6), in the resolver's order."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NameNotFound(f"{name}: {e.strerror}") from e
        raise
    out: list[str] = []
    for *_, sockaddr in infos:
        addr = str(sockaddr[0])
        if addr not in out:
            out.append(addr)
    return out


def _retrieved(future: asyncio.Future[list[str]]) -> None:
    """Mark a lookup's error as seen: one that ended past its deadline was the refresh's
    failed lookup already (asyncio logged "Task exception was never retrieved", with a
    traceback, for each one that then failed)."""
    if not future.cancelled():
        future.exception()


def node_url(addr: str, port: int) -> str | None:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:  # e.g. a link-local address with a zone
        return None
    return f"http://[{ip.compressed}]:{port}" if ip.version == 6 else f"http://{ip}:{port}"


class DnsDiscovery:
    def __init__(
        self,
        members: Membership,
        names: Sequence[tuple[Role, str, int]],
        resolver: Resolver = system_resolver,
    ) -> None:
        self.members = members
        self.names = list(names)
        self.resolver = resolver
        self._failing: set[str] = set()  # sources whose last lookup failed (logged once)
        self._late_logged: set[str] = set()  # names whose late answer was logged (``_late``)
        self._running: dict[str, asyncio.Future[list[str]]] = {}  # lookups past a deadline
        # (source, URL) listed but a node of the other role: warned once, until it leaves
        # the answer (a warning per address per refresh flooded the log).
        self._conflicts: set[tuple[str, str]] = set()

    async def _lookup(self, name: str) -> list[str] | Exception:
        running = self._running.get(name)
        if running is not None and not running.done():
            return LookupTimeout(f"the lookup of {name} from an earlier refresh still runs")
        began = time.monotonic()
        future = asyncio.ensure_future(asyncio.to_thread(self.resolver, name))
        future.add_done_callback(_retrieved)  # one past its deadline may fail unawaited
        self._running[name] = future
        try:
            # shield: past the deadline the thread runs on, and its answer is taken when
            # it comes (``_late``); the next refresh sees it running
            return await asyncio.wait_for(asyncio.shield(future), LOOKUP_TIMEOUT_S)
        except TimeoutError:
            future.add_done_callback(functools.partial(self._late, name, began))
            return LookupTimeout(f"no answer within {LOOKUP_TIMEOUT_S:g} s")
        except NameNotFound:
            return []
        # OSError, or e.g. UnicodeError (IDNA): this name's failure alone.
        except Exception as e:  # noqa: BLE001
            return e

    def _late(self, name: str, began: float, future: asyncio.Future[list[str]]) -> None:
        """A lookup past its deadline ended: its answer (addresses, or NXDOMAIN) is the
        name's answer now -- the latest there is, no other lookup of the name ran beside
        it. A resolver always slower than the deadline moved the pool never: each late
        answer was dropped and the next refresh began a lookup as slow. A failure is the
        refresh's failed lookup already."""
        if future.cancelled() or self.members.closed:
            return
        error = future.exception()
        if error is not None and not isinstance(error, NameNotFound):
            return
        addrs = [] if error is not None else future.result()
        if name not in self._late_logged:  # once while its lookups stay slow
            self._late_logged.add(name)
            logger.info(
                "dns:%s answered late (after %.1f s): its answer is taken; lookups past "
                "%g s still count as dns_error", name, time.monotonic() - began,
                LOOKUP_TIMEOUT_S,
            )  # fmt: skip
        for role, listed, port in self.names:
            if listed == name:  # per NAME:PORT, as dns_error and dns_timeout
                self.members.events["dns_late"] += 1
                self._apply(role, name, port, addrs)

    async def refresh(self) -> None:
        """Resolve every name once and bring the pool in line. A name given for several
        entries (both roles, or two ports) is looked up once: its answer serves each."""
        unique = list(dict.fromkeys(name for _, name, _ in self.names))
        results = await asyncio.gather(*(self._lookup(name) for name in unique))
        answers = dict(zip(unique, results, strict=True))
        for role, name, port in self.names:
            addrs = answers[name]
            source = f"dns:{name}:{port}"
            if isinstance(addrs, Exception):
                self.members.events["dns_error"] += 1
                if isinstance(addrs, LookupTimeout):
                    self.members.events["dns_timeout"] += 1
                if source not in self._failing:
                    logger.warning("%s: lookup failed, keeping its nodes: %s", source, addrs)
                self._failing.add(source)
                continue
            self._failing.discard(source)
            self._late_logged.discard(name)
            self._apply(role, name, port, addrs)

    def _apply(self, role: Role, name: str, port: int, addrs: list[str]) -> None:
        """Bring the nodes ``name:port`` lists in line with its answer ``addrs``."""
        source = f"dns:{name}:{port}"
        if len(addrs) > MAX_NODES_PER_NAME:
            logger.warning(
                "%s lists %d addresses; taking the first %d",
                source, len(addrs), MAX_NODES_PER_NAME,
            )  # fmt: skip
            addrs = addrs[:MAX_NODES_PER_NAME]
        urls = {u for u in (node_url(a, port) for a in addrs) if u is not None}
        listed = self.members.listed_by(source)
        for url in sorted(urls - listed):
            try:
                self.members.add(role, url, source)
            except RoleConflict as e:
                if (source, url) not in self._conflicts:
                    self._conflicts.add((source, url))
                    logger.warning("%s: %s; not added", source, e)
            else:
                self._conflicts.discard((source, url))
        self._conflicts -= {(s, u) for s, u in self._conflicts if s == source and u not in urls}
        for url in sorted(listed - urls):
            self.members.drop(url, source)
