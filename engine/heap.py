"""Keep the garbage collector's full collections off the serving path.

A process that imported torch (and Starlette, NIXL, ...) and loaded a model tracks ~180k
objects; a full (generation 2) collection walks them all: ~75 ms on the 2-core CI box,
landing in whichever step or request it falls, far past an inter-token-latency target.
Those start-up objects live as long as the process, so once start-up is done they are
collected once and frozen (``gc.freeze``: moved where collections never look), as vLLM
does. Only objects made while serving are walked after that.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze every object alive now; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of the garbage collector's walks", what, frozen)
    return frozen
