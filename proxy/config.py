"""Frozen, validated proxy configuration, from flags, environment and a config file.

Precedence (highest first): command-line flags, environment (``PDPROXY_<FIELD>``, e.g.
``PDPROXY_PREFILL``, ``PDPROXY_MAX_INFLIGHT``), a ``--config`` file (JSON, TOML or YAML, keys are
field names with ``_`` or ``-``), then the defaults below. Every error names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import DEFAULT_MAX_LOGPROB_ENTRIES, ConfigError, flag_name, require
from engine.httpkit.cors import CORS_HELP, CorsPolicy, cors_list
from kvconnector.nixl.peers import PeerAllowlist
from proxy.dns import parse_dns_name

ENV_PREFIX = "PDPROXY_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ROUTING_POLICIES = ("least_load", "round_robin", "prefix")


class ProxyConfigError(ConfigError):
    """A proxy setting is invalid; the message names the flag to fix."""


def _require(cond: bool, name: str, msg: str) -> None:
    require(cond, name, msg, ProxyConfigError)


_URL_RE = re.compile(r"^https?://[^/\s]+$")


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "prefill node URLs (http://host:port); may be empty when nodes are "
            "discovered (--prefill-dns, --registration-key)"
        },
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "decode node URLs (http://host:port); may be empty when nodes are "
            "discovered (--decode-dns, --registration-key)"
        },
    )
    prefill_dns: tuple[str, ...] = field(
        default=(),
        metadata={
            "metavar": "NAME:PORT",
            "help": "DNS names resolved every --discovery-interval; each address is a "
            "prefill node http://ADDR:PORT (e.g. a Kubernetes headless service)",
        },
    )
    decode_dns: tuple[str, ...] = field(
        default=(),
        metadata={"metavar": "NAME:PORT", "help": "as --prefill-dns, for decode nodes"},
    )
    discovery_interval: float = field(
        default=5.0, metadata={"help": "seconds between resolutions of the DNS names"}
    )
    registration_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "let nodes register themselves (POST /v1/nodes/register, a node's "
            "--register-with) with 'Authorization: Bearer <key>'; unset: registration off"
        },
    )
    registration_ttl: float = field(
        default=30.0,
        metadata={
            "help": "seconds a registration lasts unless the node renews it (nodes renew "
            "every third of it at least); then the node leaves the pool"
        },
    )
    max_registered_nodes: int = field(
        default=256, metadata={"help": "most nodes registered at once; more get 429"}
    )
    registration_allowed_nodes: str = field(
        default="*",
        metadata={
            "help": "node URLs a registration may name (others get 403): comma-separated "
            "HOST, HOST:PORT, CIDR, 'loopback' or '*' (any, the default), as a node's "
            "--kv-allowed-peers; e.g. the nodes' subnet 10.0.0.0/8"
        },
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0 = any free port)"})
    max_inflight: int = field(
        default=256, metadata={"help": "in-flight requests before answering 429"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "context length for max_tokens checks (default: the nodes' own)"},
    )
    max_retries: int = field(
        default=1, metadata={"help": "retries on another P/D pair before any token was sent"}
    )
    migration_limit: int = field(
        default=0,
        metadata={
            "help": "times a stream whose decode node fails after sending tokens moves to "
            "another pair, which replays the answer so far (checked token by token, not sent "
            "again) and goes on; 0: the stream ends with an error event (Dynamo's "
            "--migration-limit)"
        },
    )
    health_interval: float = field(
        default=1.0, metadata={"help": "seconds between node health checks"}
    )
    health_timeout: float = field(
        default=2.0, metadata={"help": "timeout of one node health check, in seconds"}
    )
    unreachable_checks: int = field(
        default=3,
        metadata={
            "help": "health checks in a row without an answer (and no bytes from the node "
            "since) after which requests give up on a decode node: a stream under way ends "
            "with an error event, a request with nothing sent yet moves to another pair "
            "(0: never)"
        },
    )
    connect_timeout: float = field(
        default=5.0, metadata={"help": "timeout to connect to a node, in seconds"}
    )
    request_timeout: float = field(
        default=600.0,
        metadata={
            "help": "max seconds to wait for a node's next bytes (and for a decode "
            "stream's next event: comment lines do not count; and for the whole body of "
            "a non-streamed answer once its headers came)"
        },
    )
    max_connections: int = field(
        default=1024,
        metadata={
            "help": "node calls in flight at once, each on a keep-alive connection "
            "(a further call waits for one to end); up to as many idle ones kept per node"
        },
    )
    node_skip_first_token: bool = field(
        default=False,
        metadata={
            "help": "ask decode nodes to omit the first token (kv_transfer_params."
            "skip_first_token) instead of dropping it in the proxy"
        },
    )
    max_request_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={"help": "largest request body accepted; larger ones get 413"},
    )
    max_logprob_entries: int = field(
        default=DEFAULT_MAX_LOGPROB_ENTRIES,
        metadata={
            "help": "the most log-probability entries the answer of a request with several "
            "choices (n, a batch of prompts) may hold, all choices together (as on the nodes; "
            "without a tokenizer a prompt counts a token per byte of its text, at most the "
            "context); more is a 400"
        },
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM, seconds in-flight requests may take before their streams "
            "are ended with an error event"
        },
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "require 'Authorization: Bearer <key>' from clients on every path but "
            "/health, /ping and /metrics"
        },
    )
    node_api_key: str | None = field(
        default=None,
        repr=False,
        metadata={"help": "the nodes' --api-key, sent on every call to them"},
    )
    routing: str = field(
        default="least_load",
        metadata={
            "help": "how P and D nodes are chosen: least_load (fewest requests in flight), "
            "round_robin, or prefix (SGLang's cache-aware rule: the node holding the longest "
            "prefix of the prompt while loads are balanced)"
        },
    )
    cache_threshold: float = field(
        default=0.5,
        metadata={
            "help": "--routing prefix: the share of the prompt a node must hold to be chosen "
            "for it; below it the node with the least cached text is chosen"
        },
    )
    balance_abs_threshold: int = field(
        default=32,
        metadata={
            "help": "--routing prefix: loads are imbalanced, and the least loaded node is "
            "chosen, when the nodes' requests in flight differ by more than this (max - min) "
            "and max > min x --balance-rel-threshold"
        },
    )
    balance_rel_threshold: float = field(
        default=1.5,
        metadata={"help": "--routing prefix: see --balance-abs-threshold"},
    )
    prefix_max_chars: int = field(
        default=1 << 22,
        metadata={
            "help": "prompt text remembered per node for prefix routing, in characters "
            "(least recently used forgotten first)"
        },
    )
    disagg_min_prompt_tokens: int = field(
        default=0,
        metadata={
            "help": "serve a request on the decode node alone (no prefill node) when its "
            "prompt, minus the prefix that decode node already holds, is shorter than this "
            "many tokens (estimated from its length); 0 = always disaggregate"
        },
    )
    prefill_fallback: bool = field(
        default=False,
        metadata={
            "help": "when no prefill node is ready (all down, none configured), serve requests "
            "on decode nodes alone -- they prefill the prompt themselves, slower, and their "
            "prefills stall the decodes running there -- instead of answering 503"
        },
    )
    chars_per_token: float = field(
        default=4.0,
        metadata={
            "help": "characters per prompt token assumed until the nodes' answers tell "
            "(token estimates for --disagg-min-prompt-tokens)"
        },
    )
    log_level: str = field(default="INFO", metadata={"help": "logging level"})
    allowed_origins: tuple[str, ...] = field(
        default=(), metadata={"metavar": "ORIGIN", "help": CORS_HELP["allowed_origins"]}
    )
    allow_credentials: bool = field(
        default=False, metadata={"help": CORS_HELP["allow_credentials"]}
    )
    allowed_methods: tuple[str, ...] = field(
        default=("*",), metadata={"metavar": "METHOD", "help": CORS_HELP["allowed_methods"]}
    )
    allowed_headers: tuple[str, ...] = field(
        default=("*",), metadata={"metavar": "HEADER", "help": CORS_HELP["allowed_headers"]}
    )

    @property
    def cors(self) -> CorsPolicy:
        """Which browser origins may call the proxy (``engine.httpkit.cors``)."""
        return CorsPolicy(
            self.allowed_origins, self.allow_credentials, self.allowed_methods, self.allowed_headers
        )

    def __post_init__(self) -> None:
        try:  # vLLM's JSON arrays arrive split like URL lists: cors_list joins them again
            object.__setattr__(
                self, "allowed_origins", cors_list(self.allowed_origins, "allowed_origins")
            )
            for name in ("allowed_methods", "allowed_headers"):
                object.__setattr__(self, name, cors_list(getattr(self, name), name) or ("*",))
            self.cors.check_key_header(self.api_key)  # at start-up, the error naming the flag
        except ConfigError as e:
            raise ProxyConfigError(str(e)) from None
        for role in ("prefill", "decode"):
            urls = getattr(self, role)
            found = bool(urls) or bool(getattr(self, f"{role}_dns")) or bool(self.registration_key)
            fallback = role == "prefill" and self.prefill_fallback
            _require(
                found or fallback,
                role,
                f"at least one {role} node URL is required, or a DNS name to find them "
                f"(--{role}-dns NAME:PORT), or --registration-key to let nodes register"
                + (" (or --prefill-fallback: decode nodes alone)" if role == "prefill" else ""),
            )
            for name in getattr(self, f"{role}_dns"):
                try:
                    parse_dns_name(name)
                except ValueError as e:
                    raise ProxyConfigError(f"{flag_name(role + '_dns')}: {e}") from None
            for url in urls:
                _require(
                    bool(_URL_RE.match(url)),
                    role,
                    f"{url!r} is not a node base URL like http://10.0.0.1:8100",
                )
            _require(len(set(urls)) == len(urls), role, "a node URL is listed twice")
            for url in urls:
                _require(
                    "%25" not in url,
                    role,
                    f"{url!r}: write an IPv6 zone id as the proxy's own interface name, "
                    f"unescaped: {url.replace('%25', '%', 1)} (the %25 form never resolves)",
                )
        # A URL is one role, as for registration and --*-dns (below): the same node given as
        # both would be two nodes at one address, paired with itself.
        both = {u.lower() for u in self.prefill} & {u.lower() for u in self.decode}
        _require(
            not both,
            "decode",
            f"{', '.join(sorted(both))} is given for both roles (a node URL is one role); a "
            "node that serves either leg (kv_both) is given in one role, and to serve "
            "requests on nodes alone give them as --decode with --prefill-fallback",
        )
        # A discovered URL is one role (the same NAME:PORT for both shared one source: the
        # decode entry found its addresses "listed" already, as prefill nodes: added none).
        names = {parse_dns_name(n) for n in self.prefill_dns}
        for entry in self.decode_dns:
            _require(
                parse_dns_name(entry) not in names,
                "decode_dns",
                f"{entry} is given for both roles (a node URL is one role: give each role "
                "its own port)",
            )
        _require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        _require(self.max_inflight >= 1, "max_inflight", "must be >= 1")
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            "max_model_len",
            "must be at least 2 tokens",
        )
        _require(0 <= self.max_retries <= 5, "max_retries", "must be in [0, 5]")
        _require(0 <= self.migration_limit <= 10, "migration_limit", "must be in [0, 10]")
        _require(self.unreachable_checks >= 0, "unreachable_checks", "must be >= 0 (0: never)")
        for name in ("health_interval", "health_timeout", "connect_timeout", "request_timeout"):
            _require(getattr(self, name) > 0, name, "must be > 0 seconds")
        for name in ("discovery_interval", "registration_ttl"):
            _require(getattr(self, name) > 0, name, "must be > 0 seconds")
        _require(self.max_registered_nodes >= 1, "max_registered_nodes", "must be >= 1")
        try:
            PeerAllowlist.parse(self.registration_allowed_nodes)
        except ValueError as e:
            _require(False, "registration_allowed_nodes", str(e))
        _require(
            self.registration_allowed_nodes.strip() == "*" or bool(self.registration_key),
            "registration_allowed_nodes",
            "has no effect without --registration-key (registration is off): set the key, "
            "or leave this out",
        )
        _require(self.max_connections >= 1, "max_connections", "must be >= 1")
        _require(self.max_request_bytes >= 1, "max_request_bytes", "must be >= 1")
        _require(self.max_logprob_entries >= 1, "max_logprob_entries", "must be >= 1")
        _require(self.shutdown_timeout >= 0, "shutdown_timeout", "must be >= 0 seconds")
        _require(self.log_level in LOG_LEVELS, "log_level", f"must be one of {LOG_LEVELS}")
        _require(self.routing in ROUTING_POLICIES, "routing", f"must be one of {ROUTING_POLICIES}")
        _require(0.0 <= self.cache_threshold <= 1.0, "cache_threshold", "must be in [0, 1]")
        _require(self.balance_abs_threshold >= 0, "balance_abs_threshold", "must be >= 0")
        _require(self.balance_rel_threshold >= 1.0, "balance_rel_threshold", "must be >= 1")
        _require(
            self.prefix_max_chars >= 1024, "prefix_max_chars", "must be at least 1024 characters"
        )
        _require(self.disagg_min_prompt_tokens >= 0, "disagg_min_prompt_tokens", "must be >= 0")
        _require(0.05 <= self.chars_per_token <= 100, "chars_per_token", "must be in [0.05, 100]")


_HINTS = typing.get_type_hints(ProxyConfig)
_FIELDS = {f.name: f for f in dataclasses.fields(ProxyConfig)}


def _base_type(name: str) -> Any:
    tp = _HINTS[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is tuple:
        return tuple
    if args and typing.get_origin(tp) in (typing.Union, types.UnionType):
        return args[0]
    return tp


def _split_urls(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(u for u in re.split(r"[,\s]+", value) if u)
    if isinstance(value, list | tuple) and all(isinstance(u, str) for u in value):
        return tuple(u.strip() for u in value if u.strip())
    raise ProxyConfigError(f"{flag_name(name)}: must be a list, got {value!r:.80}")


def _coerce(name: str, value: Any) -> Any:
    """Convert a file/env value to the field's type; errors name the flag."""
    tp = _base_type(name)
    if value is None:
        return None
    if tp is tuple:
        return _split_urls(value, name)
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ProxyConfigError(f"{flag_name(name)}: must be true or false, got {value!r}")
    if name == "log_level":
        return str(value).upper()
    if tp is str and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # a list of entries (--registration-allowed-nodes)
    try:
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return tp(value)
    except (TypeError, ValueError):
        raise ProxyConfigError(
            f"{flag_name(name)}: must be {'an integer' if tp is int else 'a number'}, "
            f"got {value!r:.80}"
        ) from None


def load_config_file(path: str) -> dict[str, Any]:
    """Read a JSON, TOML or YAML (by extension; else JSON, then TOML) file of settings."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ProxyConfigError(f"--config: cannot read {path}: {e}") from e
    try:
        if path.endswith((".yaml", ".yml")):  # as the nodes' --config
            import yaml

            try:
                data = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ProxyConfigError(f"--config: {path} is not valid YAML: {e}") from e
        elif path.endswith(".toml"):
            data: Any = tomllib.loads(raw.decode())
        else:
            try:
                data = json.loads(raw)
            except json.JSONDecodeError:
                if path.endswith(".json"):
                    raise
                data = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProxyConfigError(f"--config: {path} is neither valid JSON nor TOML: {e}") from e
    if isinstance(data, dict) and isinstance(data.get("proxy"), dict):
        data = data["proxy"]  # allow a [proxy] table
    if not isinstance(data, dict):
        raise ProxyConfigError(f"--config: {path} must hold an object/table of settings")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            raise ProxyConfigError(f"--config: unknown setting {key!r} in {path}")
        out[name] = _coerce(name, value)
    return out


def env_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = environ.get(ENV_PREFIX + name.upper())
        if value is not None and value.strip() != "":
            out[name] = _coerce(name, value)
    return out


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field; values not given stay absent (so file/env/defaults apply)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="JSON, TOML or YAML (.yaml/.yml) file of settings (keys = flag names)",
    )
    for name, f in _FIELDS.items():
        tp = _base_type(name)
        default = f.default if f.default is not dataclasses.MISSING else None
        env = ENV_PREFIX + name.upper()
        help_text = f.metadata.get("help", "")
        if default not in (None, ()) and "default:" not in help_text:
            shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
            help_text += f" (default: {shown})"
        help_text += f" [env {env}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if tp is tuple:
            kwargs.update(nargs="+", metavar=f.metadata.get("metavar", "URL"))
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name == "log_level":
            kwargs.update(type=str.upper, choices=LOG_LEVELS)
        elif name == "routing":
            kwargs.update(type=str, choices=ROUTING_POLICIES)
        else:
            kwargs["type"] = tp
        parser.add_argument(flag_name(name), **kwargs)


def config_from_sources(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    """Merge defaults < config file < environment < flags into a validated ProxyConfig."""
    settings: dict[str, Any] = {}
    path = getattr(args, "config", None) or (environ or os.environ).get(ENV_PREFIX + "CONFIG")
    if path:
        settings.update(load_config_file(path))
    settings.update(env_settings(os.environ if environ is None else environ))
    for name in _FIELDS:
        if hasattr(args, name):
            value = getattr(args, name)
            settings[name] = _split_urls(value, name) if _base_type(name) is tuple else value
    try:
        return ProxyConfig(**settings)
    except TypeError as e:  # pragma: no cover - guarded by _FIELDS
        raise ProxyConfigError(str(e)) from e
