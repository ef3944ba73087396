"""Nodes registering with the proxy: ``POST /v1/nodes/register`` and ``/v1/nodes/deregister``.

A node started with ``--register-with PROXY_URL`` posts ``{"role": "prefill"|"decode",
"url": "http://host:port"}`` (its own advertised base URL) and posts it again every few
seconds (a heartbeat: a restarted proxy learns its nodes again); on a graceful shutdown it
deregisters with the same body. ``proxy/announcer.py`` is that node side.

Both endpoints need ``Authorization: Bearer <--registration-key>`` (401 otherwise; 403
when the proxy has no key, i.e. registration is off). A body is at most 4 KiB of JSON
whose ``role`` and ``url`` are checked (400 naming the field; unknown fields are
ignored): an http(s) URL with a host (a name or an IP address that is not the unspecified
address) and an explicit port, nothing else. A URL is one role (409), and at most
``--max-registered-nodes`` nodes are registered at once (429); a URL whose host (and port)
``--registration-allowed-nodes`` does not list is refused (403: the key's holder can
otherwise point the proxy's client traffic at any address). A registration not renewed
within ``--registration-ttl`` seconds expires: the node leaves the pool. A refused
request never changes the pool.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.httpkit.auth import key_matches
from engine.httpkit.body import read_body
from engine.httpkit.errors import json_error
from engine.log_limit import LimitedLog
from engine.server.json_body import parse_json_body
from engine.server.request_fields import APIError
from kvconnector.nixl.peers import PeerAllowlist
from proxy.discovery import Membership, RoleConflict
from proxy.dns import HOST_NAME
from proxy.nodes import Role

logger = logging.getLogger(__name__)

REGISTER_PATH = "/v1/nodes/register"
DEREGISTER_PATH = "/v1/nodes/deregister"
MAX_BODY_BYTES = 4096
SOURCE = "registered"
ROLES: tuple[Role, ...] = ("prefill", "decode")
ANY_NODE = PeerAllowlist(any_peer=True)


NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*", re.IGNORECASE)


def normalize_node_url(text: str) -> str:
    """``scheme://host:port`` of a node's base URL, or ``ValueError`` saying what is wrong."""
    if not isinstance(text, str) or not text or len(text) > 300 or text != text.strip():
        raise ValueError("must be a node base URL like http://10.0.0.3:8200")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{text!r:.80}: the scheme must be http or https")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{text!r:.80}: no user or password in a node URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{text!r:.80}: a base URL, without path, query or fragment")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r:.80}: the port must be a number in [1, 65535]") from None
    if port is None or not 1 <= port <= 65535:
        raise ValueError(f"{text!r:.80}: give the port (http://host:PORT), in [1, 65535]")
    host = parts.hostname or ""
    if "%" in host:
        raise ValueError(
            f"{text!r:.80}: no IPv6 zone id (%interface): it names an interface of the host "
            "that wrote the URL, not one the proxy reaches the node through; advertise a "
            "global or unique-local address or a host name (the node's --advertise-url)"
        )
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        if not HOST_NAME.match(host) or "[" in parts.netloc:
            raise ValueError(f"{text!r:.80}: the host is not a valid name or address") from None
        if NUMERIC_LABEL.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]):
            # "0", "127.1", "2130706433", "0.0.0.0.": the resolver reads them as addresses
            # (past the unspecified-address check); no real name ends in a number.
            raise ValueError(
                f"{text!r:.80}: an address must be written a.b.c.d (or [v6]), not {host!r:.40}"
            ) from None
        return f"{parts.scheme}://{host}:{port}"
    # ::ffff:0.0.0.0 is 0.0.0.0 written as IPv6 (Python 3.11 does not call it unspecified).
    mapped = getattr(addr, "ipv4_mapped", None)
    if any(a is not None and (a.is_unspecified or a.is_multicast) for a in (addr, mapped)):
        raise ValueError(
            f"{text!r:.80}: {host} is not an address others can reach; advertise the "
            "node's own address"
        )
    if mapped is not None:
        addr = mapped  # an IPv4 address written as IPv6: named (and allowed) as itself
    shown = f"[{addr.compressed}]" if addr.version == 6 else addr.compressed
    return f"{parts.scheme}://{shown}:{port}"


def parse_registration(raw: bytes) -> tuple[Role, str]:
    """``(role, url)`` of a register/deregister body; ``APIError`` 400 naming the field."""
    # The API's own parser: nesting past its depth (json.loads raised RecursionError past
    # ~1000 levels: a 500), integer literals past the digit limit, lone surrogates are 400s.
    body: Any = parse_json_body(raw)
    if not isinstance(body, dict):
        raise APIError('the body must be a JSON object: {"role": ..., "url": ...}')
    role = body.get("role")
    if role not in ROLES:
        raise APIError(f"role must be 'prefill' or 'decode', got {role!r:.40}", param="role")
    try:
        url = normalize_node_url(body.get("url"))  # type: ignore[arg-type]
    except ValueError as e:
        raise APIError(f"url: {e}", param="url") from None
    return role, url


class Registry:
    """The registered nodes and their deadlines (``clock`` seconds)."""

    def __init__(
        self,
        members: Membership,
        key: str,
        ttl: float,
        max_nodes: int,
        clock: Callable[[], float] = time.monotonic,
        allowed: PeerAllowlist = ANY_NODE,
    ) -> None:
        self.members = members
        self.allowed = allowed
        self.key = key
        self.ttl = ttl
        self.max_nodes = max_nodes
        self.clock = clock
        self.deadlines: dict[str, float] = {}  # url -> when it expires

    def authorize(self, header: str | None) -> None:
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token.strip(), (self.key,)):
            raise APIError(
                "registration needs 'Authorization: Bearer <key>' with the proxy's "
                "--registration-key",
                status_code=401,
                code="invalid_api_key",
            )

    def register(self, role: Role, url: str) -> dict[str, Any]:
        parts = urlsplit(url)  # normalized: scheme://host:port
        if not self.allowed.allows(f"tcp://{parts.netloc}"):
            raise APIError(
                f"{url} is not a node this proxy lets register (its --registration-allowed-nodes)",
                param="url",
                status_code=403,
                err_type="permission_error",
                code="node_not_allowed",
            )
        renewed = url in self.deadlines
        if not renewed and len(self.deadlines) >= self.max_nodes:
            raise APIError(
                f"{self.max_nodes} nodes are registered already (the proxy's "
                "--max-registered-nodes); retry later",
                status_code=429,
                err_type="rate_limit_error",
                code="too_many_nodes",
            )
        try:
            self.members.add(role, url, SOURCE)
        except RoleConflict as e:
            raise APIError(str(e), param="role", status_code=409, code="role_conflict") from None
        self.deadlines[url] = self.clock() + self.ttl
        if not renewed:
            logger.info("%s node %s registered", role, url)
        status = "renewed" if renewed else "registered"
        return {"status": status, "role": role, "url": url, "expires_in": self.ttl}

    def deregister(self, role: Role, url: str) -> dict[str, Any]:
        node = self.members.pool.get(url)
        if node is not None and node.role != role:
            raise APIError(
                f"{url} is a {node.role} node of this proxy, not a {role} node",
                param="role",
                status_code=409,
                code="role_conflict",
            )
        if self.deadlines.pop(url, None) is None:
            return {"status": "not_registered", "role": role, "url": url}
        logger.info("%s node %s deregistered", role, url)
        self.members.drop(url, SOURCE)
        return {"status": "deregistered", "role": role, "url": url}

    def expire(self) -> list[str]:
        """Drop the registrations whose deadline passed; their URLs."""
        now = self.clock()
        gone = [url for url, deadline in self.deadlines.items() if deadline <= now]
        for url in gone:
            del self.deadlines[url]
            logger.warning("node %s: registration expired (no heartbeat for %.0f s)", url, self.ttl)
            self.members.events["expired"] += 1
            self.members.drop(url, SOURCE)
        return gone

    async def run_expiry(self) -> None:
        self.expire()


async def serve_registration(
    registry: Registry | None, members: Membership, request: Request, path: str
) -> JSONResponse:
    """``POST`` of ``REGISTER_PATH`` or ``DEREGISTER_PATH``: the key, then the body."""
    try:
        if registry is None:
            raise APIError(
                "this proxy takes no node registrations: start it with --registration-key",
                status_code=403,
                err_type="permission_error",
                code="registration_disabled",
            )
        registry.authorize(request.headers.get("authorization"))
        role, url = parse_registration(await read_body(request, MAX_BODY_BYTES))
        if path == REGISTER_PATH:
            return JSONResponse(registry.register(role, url))
        return JSONResponse(registry.deregister(role, url))
    except APIError as e:
        members.events["refused"] += 1  # every one is counted; the log is rate-limited
        client = request.client.host if request.client else "?"
        _refusal_log.warning(
            "refused", "%s from %s refused (%d): %s", path, client, e.status_code, e.message
        )
        return json_error(e)


# A flood of unauthenticated posts must not flood the log.
_refusal_log = LimitedLog(logger, 1.0)
