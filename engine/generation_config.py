"""``--generation-config`` (vLLM's): a checkpoint's ``generation_config.json`` sampling
values as the defaults of requests that do not set them.

As vLLM reads it: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens``, each only where it differs from
transformers' own ``GenerationConfig`` default (vLLM takes ``to_diff_dict()``: a file's
``top_k: 50`` is that default, not applied). ``max_new_tokens`` caps every answer
(vLLM takes the least of it, the request's ``max_tokens`` and the context left).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> (request field, transformers' GenerationConfig default).
_KEYS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def sampling_defaults(model_dir: str, setting: str) -> dict[str, Any]:
    """Request field -> default, from ``setting`` (``--generation-config``): ``vllm``
    none, ``auto`` the checkpoint's file, else the file in that directory. A model
    without the file (``tiny``) has none."""
    if setting == "vllm":
        return {}
    path = os.path.join(model_dir if setting == "auto" else setting, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, Any] = {}
    for key, (name, hf_default) in _KEYS.items():
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value == hf_default:
            continue
        out[name] = value
    return out


def apply_defaults(body: Any, defaults: dict[str, Any]) -> Any:
    """``body`` (a request's JSON) with each sampling default where it sets no value of
    its own (null is no value); ``max_tokens`` is not one of them (a cap: the caller's)."""
    if not isinstance(body, dict) or not defaults:
        return body
    for name, value in defaults.items():
        if name != "max_tokens" and body.get(name) is None:
            body[name] = value
    return body


def default_sampling_params(model_dir: str, setting: str) -> Any:
    """vLLM's ``LLM.get_default_sampling_params()``: ``SamplingParams`` with the
    checkpoint's defaults (``sampling_defaults``; ``max_new_tokens`` as ``max_tokens``) and
    vLLM's own for the rest. ``ValueError`` naming the file for a value out of range."""
    from engine.sampling_params import InvalidRequestError, SamplingParams

    values = sampling_defaults(model_dir, setting)
    if values.get("top_k") == 0:  # transformers' "off"
        values["top_k"] = -1
    try:
        return SamplingParams(**values)
    except InvalidRequestError as e:
        where = model_dir if setting == "auto" else setting
        raise ValueError(f"{where}/generation_config.json: {e}") from None
