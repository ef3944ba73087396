"""Cross-origin requests from browsers (CORS): vLLM's flags, off unless origins are named.

``--allowed-origins``, ``--allow-credentials``, ``--allowed-methods`` and
``--allowed-headers`` are vLLM's flags (nodes and the proxy take them alike). vLLM allows
every origin by default; pdserve allows none until ``--allowed-origins`` names some (``*``
for any): with every origin allowed, any web page a user opens can drive a server the
browser reaches -- an unauthenticated node on localhost or the LAN -- and read its answers.
A list is given as vLLM takes it, one JSON array (``'["https://ui.example"]'``), or as
several values or a comma-separated string. With origins named, every HTTP request passes
through Starlette's ``CORSMiddleware`` first: it answers preflights (``OPTIONS`` with
``Access-Control-Request-Method``) itself, before the API key is asked for (a browser
sends none on a preflight), and adds the ``Access-Control-*`` headers to the answers of
allowed origins.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from engine.config import ConfigError, flag_name

if TYPE_CHECKING:
    from starlette.types import ASGIApp

_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP method or header name


def cors_list(values: Iterable[str] | str | None, name: str) -> tuple[str, ...]:
    """One flag's values: a JSON array of strings (vLLM's form; also split over several
    values by a comma/space splitter), or plain values, each possibly comma-separated."""
    if values is None:
        return ()
    parts = [values] if isinstance(values, str) else [str(v) for v in values]
    pieces = (p.strip().strip(",").strip() for p in parts)
    text = ",".join(p for p in pieces if p)
    if text.startswith("["):
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, list) or not all(isinstance(v, str) for v in data):
            raise ConfigError(f"{flag_name(name)}: not a JSON array of strings: {text!r:.80}")
        items = data
    else:
        items = text.split(",")
    return tuple(dict.fromkeys(v.strip() for v in items if v.strip()))


def _check_origin(origin: str) -> None:
    if origin == "*":
        return
    parts = urlsplit(origin)
    if (
        parts.scheme not in ("http", "https")
        or not parts.netloc
        or parts.path
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        raise ConfigError(
            f"--allowed-origins: {origin!r:.80} is not an origin (scheme://host[:port], as a "
            "browser sends it, e.g. https://ui.example:3000; or *)"
        )


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser origins may call this server, and with what (vLLM's flags)."""

    allowed_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            _check_origin(origin)
        for name in ("allowed_methods", "allowed_headers"):
            for value in getattr(self, name):
                if value != "*" and not _TOKEN.fullmatch(value):
                    raise ConfigError(f"{flag_name(name)}: {value!r:.80} is not a name")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ConfigError(
                "--allow-credentials: not with --allowed-origins *: a browser would send its "
                "cookies and credentials to this server from any page; name the origins"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind the CORS middleware, or ``app`` itself when no origin is allowed."""
        if not self.enabled:
            return app
        from starlette.middleware.cors import CORSMiddleware  # with the HTTP stack, not before

        return CORSMiddleware(
            app,
            allow_origins=list(self.allowed_origins),
            allow_credentials=self.allow_credentials,
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
        )


def add_cors_args(group: Any) -> None:
    """vLLM's four flags, on a node's argument group."""
    group.add_argument(
        "--allowed-origins", nargs="+", default=None, help=CORS_HELP["allowed_origins"]
    )
    group.add_argument(
        "--allow-credentials", action="store_true", help=CORS_HELP["allow_credentials"]
    )
    group.add_argument(
        "--allowed-methods", nargs="+", default=None, help=CORS_HELP["allowed_methods"]
    )
    group.add_argument(
        "--allowed-headers", nargs="+", default=None, help=CORS_HELP["allowed_headers"]
    )


def policy_from(values: Any) -> CorsPolicy:
    """The policy of parsed flags or a config object with the four attributes (ConfigError
    naming the flag when one is wrong)."""
    return CorsPolicy(
        allowed_origins=cors_list(values.allowed_origins, "allowed_origins"),
        allow_credentials=bool(values.allow_credentials),
        allowed_methods=cors_list(values.allowed_methods, "allowed_methods") or ("*",),
        allowed_headers=cors_list(values.allowed_headers, "allowed_headers") or ("*",),
    )


CORS_HELP = {
    "allowed_origins": "browser origins that may call this server (vLLM's flag): a JSON array "
    "('[\"https://ui.example\"]'), values, or * for any; none by default (vLLM allows all: "
    "docs/api.md says why pdserve does not)",
    "allow_credentials": "let allowed origins send credentials (cookies, Authorization) "
    "(vLLM's flag; not with --allowed-origins *)",
    "allowed_methods": "methods allowed origins may use (vLLM's flag; default: *)",
    "allowed_headers": "request headers allowed origins may send (vLLM's flag; default: *)",
}
