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


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _check_origin(origin: str) -> None:
    """``origin`` as a browser sends it (``Origin: https://ui.example:3000``), or ``*``.
    Starlette compares the two strings as they are, so a form a browser never sends
    (upper case, a default port, a trailing slash) would never match: refused, naming
    the form to write."""
    if origin == "*":
        return
    parts = urlsplit(origin)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (
        parts.scheme not in _DEFAULT_PORTS
        or not parts.hostname
        or port == -1
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        raise ConfigError(
            f"--allowed-origins: {origin!r:.80} is not an origin (scheme://host[:port], as a "
            "browser sends it, e.g. https://ui.example:3000; or *)"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    shown = "" if port in (None, _DEFAULT_PORTS[parts.scheme]) else f":{port}"
    form = f"{parts.scheme}://{host}{shown}"
    if origin != form:
        raise ConfigError(
            f"--allowed-origins: {origin!r:.80} would never match: a browser sends that "
            f"origin as {form!r}; write it as {form!r}"
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

    def check_key_header(self, api_key: str | None) -> None:
        """With an API key a browser must send ``Authorization``: a preflight asking for a
        header not allowed is refused, so an ``--allowed-headers`` without it is an error."""
        allowed = {h.lower() for h in self.allowed_headers}
        if api_key and self.enabled and not allowed & {"*", "authorization"}:
            raise ConfigError(
                "--allowed-headers: add authorization: with --api-key a browser sends the key "
                "in that header, and its preflight is refused unless it is allowed (or leave "
                "--allowed-headers out: every header)"
            )

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind the CORS middleware, or ``app`` itself when no origin is allowed."""
        if not self.enabled:
            return app
        from starlette.middleware.cors import CORSMiddleware  # with the HTTP stack, not before

        from engine.httpkit.request_id import REQUEST_ID_HEADER

        # Answer headers a page may read besides the safelisted ones: the request id (to
        # abort or report a request) and a 429's Retry-After.
        exposed = [REQUEST_ID_HEADER, "Retry-After"]

        return CORSMiddleware(
            app,
            allow_origins=list(self.allowed_origins),
            allow_credentials=self.allow_credentials,
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
            expose_headers=exposed,
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
    """The policy of parsed flags or a config object with the four attributes, checked
    against its ``api_key`` if it has one (ConfigError naming the flag when one is wrong)."""
    policy = CorsPolicy(
        allowed_origins=cors_list(values.allowed_origins, "allowed_origins"),
        allow_credentials=bool(values.allow_credentials),
        allowed_methods=cors_list(values.allowed_methods, "allowed_methods") or ("*",),
        allowed_headers=cors_list(values.allowed_headers, "allowed_headers") or ("*",),
    )
    policy.check_key_header(getattr(values, "api_key", None))
    return policy


CORS_HELP = {
    "allowed_origins": "browser origins that may call this server (vLLM's flag): a JSON array "
    "('[\"https://ui.example\"]'), values, or * for any; none by default (vLLM allows all: "
    "docs/api.md says why pdserve does not)",
    "allow_credentials": "let allowed origins send credentials (cookies, Authorization) "
    "(vLLM's flag; not with --allowed-origins *)",
    "allowed_methods": "methods allowed origins may use (vLLM's flag; default: *)",
    "allowed_headers": "request headers allowed origins may send (vLLM's flag; default: *)",
}
