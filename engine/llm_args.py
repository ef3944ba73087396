"""The offline ``LLM``'s keyword arguments (vLLM's ``LLM(model=..., **kwargs)``) as an
``EngineConfig``.

The names are the CLI's (``engine.server.cli_args``), derived from the same config
dataclasses: every config field by its name (``max_num_seqs``, ``block_size``,
``gpu_memory_utilization``, ...) and by its flag aliases (``--tensor-parallel-size`` is
``tensor_parallel_size``), its values read as the flag reads them (``dtype="half"``,
``max_model_len="32k"``). vLLM's ``LLM`` arguments that the CLI takes as vLLM flags
without a config field (``trust_remote_code``, ``enable_chunked_prefill``,
``kv_transfer_config``, ``tokenizer``) are read as those flags are; any other name is a
``TypeError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal, get_args, get_origin

from engine.config import ConfigError, EngineConfig
from engine.server.cli_args import config_sections, human_readable_int, unwrap_optional

# vLLM's LLM arguments that are vLLM flags here, not config fields (``add_vllm_args``).
VLLM_ONLY = ("trust_remote_code", "enable_chunked_prefill", "kv_transfer_config", "tokenizer")


def config_keywords() -> dict[str, tuple[str, dataclasses.Field[Any], Any]]:
    """Keyword -> (section, field, field type), for every config field and flag alias."""
    out: dict[str, tuple[str, dataclasses.Field[Any], Any]] = {}
    for section, cls in config_sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            entry = (section, f, hints[f.name])
            out[f.name] = entry
            for alias in f.metadata.get("aliases", ()):
                if alias.startswith("--"):  # -tp is a short flag, not a keyword
                    out[alias[2:].replace("-", "_")] = entry
    return out


def _value(key: str, f: dataclasses.Field[Any], tp: Any, value: Any) -> Any:
    """``value`` as the field's flag would read it: a choice's other spellings (a torch
    dtype by its name), vLLM's sizes for a token count, a list or a string as a tuple;
    then checked against the field's type (a ``ConfigError`` naming ``key``: the config's
    own checks compare values, and a wrong type failed them naming nothing)."""
    tp, optional = unwrap_optional(tp)
    if get_origin(tp) is Literal and type(value).__module__ == "torch":  # torch.bfloat16
        value = str(value).removeprefix("torch.")
    if get_origin(tp) is Literal and isinstance(value, str):
        value = f.metadata.get("value_aliases", {}).get(value, value)
    elif tp is int and f.metadata.get("human_readable") and isinstance(value, str):
        try:
            value = human_readable_int(value)
        except ValueError as e:
            raise ConfigError(f"{f.name}: {e}") from None
    elif get_origin(tp) is tuple and get_args(tp) == (str, ...) and isinstance(value, list | str):
        value = (value,) if isinstance(value, str) else tuple(value)  # vLLM's: str or list
    if not (value is None and optional) and not _is(tp, value):
        want = (
            "one of " + ", ".join(map(repr, get_args(tp)))
            if get_origin(tp) is Literal
            else getattr(tp, "__name__", str(tp))
        )
        raise ConfigError(f"{key}={value!r:.60}: must be {want}")
    return value


def _is(tp: Any, value: Any) -> bool:
    """Whether ``value`` is of the config field type ``tp`` (bool is no number here)."""
    if get_origin(tp) is Literal:
        return value in get_args(tp)
    if get_origin(tp) is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """The config of ``LLM(model, **kwargs)``; ``TypeError`` naming unknown keywords,
    ``ConfigError`` (a ``ValueError``) naming the setting for a bad value."""
    known = config_keywords()
    unknown = sorted(k for k in kwargs if k not in known and k not in VLLM_ONLY)
    if unknown:
        raise TypeError(
            f"LLM() got unexpected keyword argument(s): {', '.join(unknown)} (pdserve takes "
            "the config fields of `decode-node --help`, by flag name with '_' for '-')"
        )
    sections: dict[str, dict[str, Any]] = {name: {} for name in config_sections()}
    given: dict[str, str] = {}
    if model is not None:
        kwargs = {"model": model, **kwargs}
    for key, value in kwargs.items():
        if key in VLLM_ONLY:
            continue
        section, f, tp = known[key]
        if f.name in given:
            raise TypeError(f"LLM() got {f.name} twice (as {given[f.name]} and {key})")
        given[f.name] = key
        sections[section][f.name] = _value(key, f, tp, value)
    _vllm_only(kwargs, sections)
    built = {name: cls(**sections[name]) for name, cls in config_sections().items()}
    return EngineConfig(**built)


def _vllm_only(kwargs: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    """vLLM's arguments taken as ``decode-node`` takes their flags (``add_vllm_args``)."""
    if kwargs.get("enable_chunked_prefill") is False:
        raise ConfigError(
            "enable_chunked_prefill=False: not supported: pdserve always chunks a long "
            "prompt into steps of max_num_batched_tokens tokens"
        )
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is not None and tokenizer != sections["model"].get("model", "tiny"):
        raise ConfigError(
            f"tokenizer={tokenizer!r}: pdserve reads the tokenizer from the model's "
            "checkpoint (give no tokenizer, or the model's)"
        )
    kv = kwargs.get("kv_transfer_config")
    if kv is not None:  # vLLM's KVTransferConfig as a dict or its JSON
        from engine.device import resolve_device
        from engine.server.cli_args import kv_transfer_settings

        text = kv if isinstance(kv, str) else json.dumps(kv)
        device = resolve_device(sections["parallel"].get("device", "auto"))
        for dest, value in kv_transfer_settings(text, device).items():
            sections["kv_transfer"].setdefault(dest, value)
