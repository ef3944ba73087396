"""Models by name: ``--model ORG/NAME`` resolved to a local snapshot through huggingface_hub.

``resolve_model`` turns a Hugging Face repo id into the directory of a cached snapshot,
downloading only what the engine reads (config, safetensors weights and their index,
tokenizer files, generation config). 'tiny' and local directories pass through unchanged.
It honours the usual environment: ``HF_HUB_OFFLINE`` (cache only), ``HF_HUB_CACHE`` /
``HF_HOME`` (where the cache is; ``--download-dir`` overrides both) and ``HF_TOKEN``.

``resolve_model_config`` is called once at start-up (``run_node``, ``EngineCore``) so the
tokenizer, the workers and the connector all see a local path, while the served model
name stays what the user typed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

from engine.config import TINY_MODEL, ConfigError, EngineConfig, is_repo_id

logger = logging.getLogger(__name__)

ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]
_TRUE = re.compile(r"^(1|true|yes|on)$", re.IGNORECASE)


def hub_offline() -> bool:
    return bool(_TRUE.match(os.environ.get("HF_HUB_OFFLINE", "").strip()))


def hub_cache_dir(download_dir: str | None = None) -> str | None:
    """``--download-dir``, else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library's."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local directory for ``model``: 'tiny' and directories as they are, a repo id
    through the Hugging Face cache (downloading if allowed). Raises ``ConfigError`` naming
    ``--model`` (or ``--revision``) when it cannot."""
    if model == TINY_MODEL or os.path.isdir(model):
        return model
    if not is_repo_id(model):
        raise ConfigError(
            f"--model: {model!r} is neither 'tiny', a checkpoint directory, "
            "nor a Hugging Face repo id (org/name)"
        )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - a dependency
        raise ConfigError(f"--model: {model!r} needs huggingface_hub to download: {e}") from e
    offline = hub_offline()
    cache = hub_cache_dir(download_dir)
    if cache:
        where = cache
    else:  # the library's own default (~/.cache/huggingface/hub): name it, so it can be looked at
        from huggingface_hub import constants

        where = constants.HF_HUB_CACHE
    logger.info(
        "resolving model %s (revision %s) through the Hugging Face cache %s%s",
        model,
        revision or "main",
        where,
        " (offline)" if offline else "",
    )
    try:
        path = snapshot_download(
            model,
            revision=revision,
            cache_dir=cache,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except RevisionNotFoundError as e:
        raise ConfigError(f"--revision: {revision!r} not found for {model!r}: {e}") from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ConfigError(
            f"--model: {model!r} is not a local directory and was not found on the Hugging "
            "Face Hub (a private or gated repo needs HF_TOKEN)"
        ) from e
    except LocalEntryNotFoundError as e:
        how = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise ConfigError(
            f"--model: {model!r} is not a local directory, not in the Hugging Face cache "
            f"({where}) and {how}; download it first or point --model at a directory"
        ) from e
    except Exception as e:  # network, HTTP and file-system errors of the library
        raise ConfigError(f"--model: cannot fetch {model!r} from the Hugging Face Hub: {e}") from e
    path = str(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model: the snapshot of {model!r} at {path} has no config.json")
    logger.info("model %s: using %s", model, path)
    return path


def resolve_model_config(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model.model`` a local path (unchanged when it already is); the
    served name stays the one the user gave (``--served-model-name``, else ``--model``)."""
    mc = config.model
    path = resolve_model(mc.model, mc.revision, mc.download_dir)
    if path == mc.model:
        return config
    return config.replace(
        model=dataclasses.replace(mc, model=path, served_model_name=mc.served_names)
    )
