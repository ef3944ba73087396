"""Command-line flags derived from the config dataclasses.

A field ``max_num_seqs`` becomes ``--max-num-seqs``; its type comes from the annotation
(``Literal`` -> choices, ``bool`` -> ``--x/--no-x``, ``int | None`` -> optional int) and
its help from ``metadata["help"]``. Flags not given on the command line are absent from
the parsed namespace, so the dataclass defaults (and ``parser.set_defaults``) apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

from engine.config import ConfigError, EngineConfig, flag_name
from engine.httpkit.cors import add_cors_args
from engine.httpkit.listen import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_TIMEOUT_S

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def config_sections() -> dict[str, type]:
    """EngineConfig's section name -> section dataclass (model, cache, parallel, ...)."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type for a CLI flag: {tp}")
    return tp, False


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return "" if f.default is None else f" (default: {f.default})"
    return ""


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(text: str) -> int:
    """vLLM's sizes for token counts: ``32k`` is 32,000 (k, m, g: powers of 1000; a decimal
    such as ``25.6k`` is fine when the result is whole), ``32K`` is 32,768 (K, M, G: powers
    of 1024, of a whole number); plain digits as they are."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 32k = 32000, 32K = 32768)")
    number, unit = m.groups()
    if unit.isupper() and "." in number:
        raise ValueError(f"{text!r}: K, M and G take a whole number (or use k, m, g)")
    value = float(number) * _SIZE_UNITS[unit] if "." in number else int(number) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


human_readable_int.__name__ = "size"  # argparse's "invalid size value: 'x'"


def _add_field(group: Any, f: dataclasses.Field[Any], tp: Any) -> None:
    tp, _ = unwrap_optional(tp)
    help_text = f.metadata.get("help", "") + _default_text(f)
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif get_origin(tp) is Literal:
        choices = list(get_args(tp))
        kwargs.update(type=type(choices[0]), choices=choices)
        if spellings := f.metadata.get("value_aliases"):  # vLLM's other names of a choice
            kwargs["type"] = lambda value: spellings.get(value, value)
    elif tp is int and f.metadata.get("human_readable"):  # vLLM's 32k / 32K
        kwargs["type"] = human_readable_int
    elif tp in (int, float, str):
        kwargs["type"] = tp
    elif get_origin(tp) is tuple and get_args(tp) == (str, ...):  # NAME [NAME ...]
        kwargs.update(type=str, nargs="+")
    else:
        raise TypeError(f"unsupported type for CLI flag {flag_name(f.name)}: {tp}")
    group.add_argument(flag_name(f.name), *f.metadata.get("aliases", ()), **kwargs)


# --help group titles of the EngineConfig sections, in the lower case of the others
# ("server options", "tool calling options").
_GROUP_TITLES = {"Cache": "KV cache", "KVTransfer": "KV transfer"}


def add_config_args(
    parser: argparse.ArgumentParser, dataclass_types: list[type] | None = None
) -> argparse.ArgumentParser:
    """Add one flag per field of each dataclass (default: every EngineConfig section)."""
    seen: dict[str, type] = {}
    for cls in dataclass_types or list(config_sections().values()):
        hints = typing.get_type_hints(cls)
        title = cls.__name__.removesuffix("Config") or cls.__name__
        title = _GROUP_TITLES.get(title, title.lower())
        doc = (cls.__doc__ or "").strip().replace("``", "")
        if doc.startswith(cls.__name__ + "("):  # dataclass-generated signature, not prose
            doc = ""
        group = parser.add_argument_group(f"{title} options", doc or None)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                raise TypeError(
                    f"flag {flag_name(f.name)} is defined by both {seen[f.name].__name__} "
                    f"and {cls.__name__}"
                )
            seen[f.name] = cls
            _add_field(group, f, hints[f.name])
    return parser


def set_flag_default(parser: argparse.ArgumentParser, dest: str, value: Any) -> None:
    """Override a config flag's default (e.g. kv_role per node role), help text included."""
    parser.set_defaults(**{dest: value})
    for action in parser._actions:
        if action.dest == dest and action.help:
            action.help = re.sub(r" \(default: [^)]*\)$", "", action.help)
            action.help += f" (default: {value})"


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("server options")
    group.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of settings, keys = flag names with '-' or '_' "
        "(e.g. 'max-num-seqs: 32'); flags on the command line win",
    )
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument(
        "--port", type=int, default=8000, help="HTTP port (0 = any free port) (default: 8000)"
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body accepted; larger ones get 413 "
        f"(default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or None,
        help="require 'Authorization: Bearer <key>' on every path but /health, /ping and /metrics "
        "(default: $PDSERVE_API_KEY, else vLLM's $VLLM_API_KEY; unset: no key)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds in-flight requests may take to finish before their "
        f"streams are ended with an error (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:.0f})",
    )
    group.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="logging level (default: INFO)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat request's own 'chat_template' (vLLM's flag; the template runs "
        "in a Jinja sandbox on this node); without it such requests are a 400",
    )
    add_cors_args(group)
    add_registration_args(parser)
    add_tool_args(parser)
    add_reasoning_args(parser)
    add_vllm_args(parser)
    return parser


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_KV_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm serve`` that pdserve has no flag of its own for; each does what
    vLLM's does or is refused saying why (docs/deploy.md, "Coming from vLLM")."""
    group = parser.add_argument_group(
        "vLLM flags", "flags a `vllm serve` command line carries, taken as vLLM takes them"
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted, no effect: pdserve runs its own Llama/Qwen2 code, never a "
        "checkpoint's (the node logs so)",
    )
    group.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=True,
        help="log each request's start and end at INFO (pdserve's default; vLLM's is off)",
    )
    group.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="log each request's start and end at DEBUG only",
    )
    group.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accepted: pdserve always chunks a long prompt into steps of "
        "--max-num-batched-tokens; --no-enable-chunked-prefill is refused",
    )
    group.add_argument(
        "--uvicorn-log-level",
        type=str.lower,
        choices=UVICORN_LOG_LEVELS,
        default=None,
        help="level of the HTTP server's (uvicorn's) log; debug and trace log every "
        "request line (default: --log-level's)",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="completions' and chat answers' usage carries prompt_tokens_details."
        "cached_tokens, the prompt tokens the prefix cache held (absent when none, as "
        "vLLM's; Responses: input_tokens_details.cached_tokens) (default: off)",
    )
    group.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        default=None,
        help='vLLM\'s P/D config, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\': '
        "kv_connector NixlConnector is --kv-connector nixl, kv_role kv_producer/"
        "kv_consumer/kv_both is --kv-role producer/consumer/both, engine_id --engine-id, "
        "kv_load_failure_policy --kv-failure-policy; other keys are refused",
    )


def kv_transfer_settings(text: str, device: str) -> dict[str, Any]:
    """``--kv-transfer-config`` as pdserve's settings (dest -> value); ``ConfigError`` for
    what pdserve cannot do."""
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--kv-transfer-config: not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--kv-transfer-config: must be a JSON object")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    out: dict[str, Any] = {}
    connector = cfg.pop("kv_connector", None)
    if connector != "NixlConnector":
        raise ConfigError(
            f"--kv-transfer-config: kv_connector {connector!r} is not supported: pdserve's "
            'connector is NIXL ("NixlConnector", i.e. --kv-connector nixl)'
        )
    out["kv_connector"] = "nixl"
    if "kv_role" in cfg:
        role = cfg.pop("kv_role")
        if role not in _KV_ROLES:
            raise ConfigError(
                f"--kv-transfer-config: kv_role {role!r} is not one of {', '.join(_KV_ROLES)}"
            )
        out["kv_role"] = _KV_ROLES[role]
    if "engine_id" in cfg:
        out["engine_id"] = str(cfg.pop("engine_id"))
    if "kv_load_failure_policy" in cfg:
        policy = cfg.pop("kv_load_failure_policy")
        if policy not in ("recompute", "fail"):
            raise ConfigError(
                f"--kv-transfer-config: kv_load_failure_policy {policy!r} is not recompute or fail"
            )
        out["kv_failure_policy"] = policy
    buffer = cfg.pop("kv_buffer_device", device)
    if buffer != device:
        raise ConfigError(
            f"--kv-transfer-config: kv_buffer_device {buffer!r} is not supported with "
            f"--device {device}: pdserve sends the KV from where it is computed"
        )
    extra = cfg.pop("kv_connector_extra_config", {})
    if extra not in ({}, {"backends": ["UCX"]}):
        raise ConfigError(
            f"--kv-transfer-config: kv_connector_extra_config {extra!r:.80} is not supported "
            "(pdserve's NIXL uses the UCX backend; --kv-transport picks nixl or ucxx)"
        )
    if cfg:
        raise ConfigError(
            f"--kv-transfer-config: {', '.join(sorted(cfg))} not supported (pdserve takes "
            "kv_connector, kv_role, engine_id, kv_load_failure_policy, kv_buffer_device; "
            "the side channel is --side-channel-host/--side-channel-port)"
        )
    return out


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """Tool calling's node flags (vLLM's spelling; docs/api.md "Tool calling")."""
    from engine.tools.parsers import PARSERS

    group = parser.add_argument_group(
        "tool calling options",
        '"auto" tool choice (the default of a chat request with tools): the model\'s '
        "text is parsed for tool calls; give a P/D pair's nodes the same flags",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='accept "auto" tool choice, the calls found by --tool-call-parser '
        "(default: off: such requests are a 400)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help='how "auto" tool choice finds tool calls in the model\'s text (hermes: '
        "<tool_call>{...}</tool_call>); needed by --enable-auto-tool-choice",
    )


def add_reasoning_args(parser: argparse.ArgumentParser) -> None:
    from engine.reasoning import PARSERS

    group = parser.add_argument_group(
        "reasoning options",
        "reasoning models: a chat answer's thinking as reasoning_content; give a P/D "
        "pair's nodes the same flag",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=sorted(PARSERS),
        default=None,
        help="split chat answers into reasoning_content and content (deepseek_r1: the "
        "answer starts in its reasoning, up to </think>; qwen3: reasoning between the "
        "<think> and </think> the model writes) (default: off)",
    )


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The parser of "auto" tool choice, None when it is off."""
    if not getattr(args, "enable_auto_tool_choice", False):
        return None
    return args.tool_call_parser


def add_registration_args(parser: argparse.ArgumentParser) -> None:
    """A node registering itself with proxies (``proxy/announcer.py``, docs/proxy.md)."""
    group = parser.add_argument_group(
        "registration options",
        "register this node with pd-proxy instances started with --registration-key, "
        "so they route to it without listing it",
    )
    group.add_argument(
        "--register-with",
        metavar="URL[,URL...]",
        default=None,
        help="proxy base URL(s), comma-separated: register there once serving, renew every "
        "--registration-interval, deregister on shutdown",
    )
    group.add_argument(
        "--advertise-url",
        metavar="URL",
        default=None,
        help="the base URL proxies reach this node at (default: http://HOST:PORT of --host "
        "and --port; required when --host is 0.0.0.0 or ::)",
    )
    group.add_argument(
        "--registration-key",
        default=os.environ.get("PDSERVE_REGISTRATION_KEY") or None,
        help="the proxies' --registration-key, sent as a bearer token "
        "(default: $PDSERVE_REGISTRATION_KEY)",
    )
    group.add_argument(
        "--registration-interval",
        type=float,
        default=10.0,
        help="seconds between renewals (heartbeats); at least three per the proxy's "
        "--registration-ttl are sent (default: 10)",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig from parsed flags. Raises ConfigError naming the flag."""
    sections: dict[str, Any] = {}
    for name, cls in config_sections().items():
        kwargs = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        sections[name] = cls(**kwargs)
    return EngineConfig(**sections)


def _setting_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Settings a config file may hold: every optional flag's name (``max_num_seqs``, the
    aliases too), but not ``--help``, ``--config`` or the ``--no-x`` spelling of a switch."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in ("help", "config"):
            continue
        for opt in action.option_strings:
            if not opt.startswith("--no-"):
                out[opt.lstrip("-").replace("-", "_")] = action
    return out


_LEFT_OUT = object()  # a switch set to false in a config file: as if not given


def _file_value(action: argparse.Action, value: Any, path: str) -> Any:
    flag = action.option_strings[0]
    bad = ConfigError(f"{flag}: invalid value {value!r:.80} in --config {path}")
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(action, argparse._StoreConstAction):  # store_true/false: no value
        if not isinstance(value, bool):
            raise bad
        return action.const if value else _LEFT_OUT  # true: the flag given (vLLM's reading)
    if action.nargs == "+":  # NAME [NAME ...]: a list of them, or one
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str | int | float) for v in values):
            raise bad
        return [str(v) for v in values]
    if isinstance(value, dict) and action.metavar == "JSON":  # vLLM's nested mapping
        value = json.dumps(value)
    if isinstance(value, bool | list | dict):
        raise bad
    if action.type is not None:
        try:
            value = action.type(str(value))  # type: ignore[misc]
        except (TypeError, ValueError):
            raise bad from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{flag}: {value!r} in --config {path} is not one of {choices}")
    return value


def load_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """A YAML ``--config`` file as parser defaults (``dest -> value``), each value checked
    like its flag's. Raises ConfigError naming the setting."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of settings")
    actions = _setting_actions(parser)
    out: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise ConfigError(f"--config: unknown setting {key!r} in {path}")
        if value is None:  # null: the flag's default
            continue
        if (setting := _file_value(action, value, path)) is not _LEFT_OUT:
            out[action.dest] = setting
    return out


# vLLM's environment variables for its NIXL side channel -> pdserve's flag. vLLM gives
# TP rank r port PORT + r; a pdserve node has one side channel (rank 0's engine serves it).
VLLM_SIDE_CHANNEL_ENV = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "side_channel_host",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "side_channel_port",
}


def vllm_environment(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> dict[str, Any]:
    """The flag defaults vLLM's variables in ``env`` set (dest -> value), for the flags
    ``parser`` has; ``ConfigError`` naming the variable for a bad value."""
    dests = {a.dest for a in parser._actions}
    out: dict[str, Any] = {}
    for name, dest in VLLM_SIDE_CHANNEL_ENV.items():
        value = env.get(name)
        if not value or dest not in dests:
            continue
        flag = flag_name(dest)
        if dest == "side_channel_port":
            if not value.isdigit() or not 0 <= int(value) < 65536:
                raise ConfigError(f"{name}={value!r}: must be a port in [0, 65535] (as {flag})")
            out[dest] = int(value)
        else:
            out[dest] = value
    # vLLM's key variable, below pdserve's own: a vLLM deployment's VLLM_API_KEY must not
    # leave the node open.
    if "api_key" in dests and env.get("VLLM_API_KEY") and not env.get("PDSERVE_API_KEY"):
        out["api_key"] = env["VLLM_API_KEY"]
    return out


def parse_config(
    parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> tuple[argparse.Namespace, EngineConfig]:
    """Parse ``argv``; a bad value exits with status 2 and a message naming the flag.

    Settings of a ``--config`` file become the parser's defaults, so flags given on the
    command line win. A positional ``MODEL`` (``decode-node ORG/NAME``, vLLM's ``serve``
    spelling) is the same as ``--model``. vLLM's side-channel variables
    (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``) and ``VLLM_API_KEY`` are defaults below
    both."""
    try:
        parser.set_defaults(**vllm_environment(parser, os.environ))
    except ConfigError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    positional = getattr(args, "model_tag", None)
    if positional is not None and getattr(args, "model", positional) != positional:
        parser.error(f"--model: given twice ({args.model!r} and positional {positional!r})")
    if getattr(args, "config", None):
        try:
            parser.set_defaults(**load_config_file(parser, args.config))
        except ConfigError as e:
            parser.error(str(e))
        args = parser.parse_args(argv)
    kv_text = getattr(args, "kv_transfer_config", None)
    if kv_text:  # vLLM's P/D config: pdserve's flags, as defaults the command line may repeat
        try:
            from engine.device import resolve_device

            device = resolve_device(getattr(args, "device", "auto"))  # unset: not in args
            kv = kv_transfer_settings(kv_text, device)
        except ConfigError as e:
            parser.error(str(e))
        parser.set_defaults(**kv)
        args = parser.parse_args(argv)
        for dest, value in kv.items():
            if getattr(args, dest) != value:
                flag = "--" + dest.replace("_", "-")
                parser.error(
                    f"--kv-transfer-config: says {dest} {value!r}, {flag} says {getattr(args, dest)!r}"
                )
    if getattr(args, "enable_chunked_prefill", None) is False:
        parser.error(
            "--no-enable-chunked-prefill: not supported: pdserve always chunks a long "
            "prompt into steps of --max-num-batched-tokens tokens"
        )
    if positional is not None:
        args.model = positional
    if not 0 <= getattr(args, "port", 0) < 65536:
        parser.error(f"--port: must be in [0, 65535], got {args.port}")
    if getattr(args, "shutdown_timeout", 0) < 0:
        parser.error(f"--shutdown-timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    if getattr(args, "max_request_bytes", 1) < 1:
        parser.error(f"--max-request-bytes: must be >= 1, got {args.max_request_bytes}")
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice: needs --tool-call-parser")
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    return args, config
