"""Where a request meets the store: a store fault becomes a miss (logged, counted), never an exception out of
``generate`` and never wrong K/V."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def store_call(what: str, fn, default):
    """Run a store call; a fault is logged and gives ``default`` (a miss, no entry stored), never an error."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - any store failure must degrade, not break serving
        logger.warning("vismemo: store %s failed (%s: %s); continuing without it", what, type(err).__name__, err)
        return default
