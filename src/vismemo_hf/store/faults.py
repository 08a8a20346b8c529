"""Where a request meets the store: a store fault becomes a miss (logged with its cause, counted), never an
exception out of ``generate`` and never wrong K/V.

Faults are typed. ``StoreFault`` is the store's own family: a tier that cannot answer now
(``tiers.base.TierUnavailable``) and a blob that must not be used (``blob.BlobError``: corrupt, truncated, forged,
of another layout). I/O faults (``OSError``: a disk gone or full, a socket; ``EOFError``; ``MemoryError``) and the
Redis client's errors are faults too. ``store_call`` is the boundary: a fault gives the call's default.

Anything else a store call raises is a bug of the library, not a fault of the store. It is counted under ``bug``
(``fault_counts``) and logged at error level with its traceback; with ``VISMEMO_STRICT=1`` (the test suite runs so)
it propagates instead, so that a test fails where a user would have been served a silent miss. Without it the
request still degrades to a miss: serving must not break for a bug on a path the tests did not reach."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

logger = logging.getLogger(__name__)


class StoreFault(Exception):
    """A fault of the store or of what it reads (a tier, a blob): the request it meets is a miss."""


#: I/O faults of the interpreter's own (with ``StoreFault`` and the Redis client's errors: ``is_fault``)
IO_FAULTS: tuple[type[BaseException], ...] = (StoreFault, OSError, EOFError, MemoryError)

_COUNTS: Counter[tuple[str, str]] = Counter()
_COUNTS_LOCK = threading.Lock()


def is_fault(err: BaseException) -> bool:
    """Whether ``err`` is a store or I/O fault (else: a bug of the library)."""
    if isinstance(err, IO_FAULTS):
        return True
    return type(err).__module__.split(".")[0] == "redis"  # the client's errors, its import not needed here


def strict() -> bool:
    """``VISMEMO_STRICT=1``: a bug met at the store's boundary propagates instead of becoming a miss."""
    return os.environ.get("VISMEMO_STRICT", "").strip() not in ("", "0", "false", "no")


def _count(what: str, kind: str) -> None:
    with _COUNTS_LOCK:
        _COUNTS[(what, kind)] += 1


def fault_counts() -> dict[str, int]:
    """What store calls met in this process: ``{"fault": n, "bug": m, "read/fault": ..., ...}`` (by kind, and by
    call and kind)."""
    with _COUNTS_LOCK:
        out: Counter[str] = Counter()
        for (what, kind), n in _COUNTS.items():
            out[kind] += n
            out[f"{what}/{kind}"] += n
        return dict(out)


def unexpected(err: BaseException, where: str) -> None:
    """For a handler that must degrade on any error (a tier's indexing, say): count and log a bug, and re-raise it
    in strict mode; a fault is the handler's own to log."""
    if is_fault(err):
        return
    _count(where, "bug")
    if strict():
        raise err
    logger.error("vismemo: %s raised %s: %s, a bug of the library, served as a fault", where, type(err).__name__,
                 err, exc_info=err)


def store_call(what: str, fn, default):
    """Run a store call; a fault is logged and gives ``default`` (a miss, no entry stored), never an error. A bug
    (any other exception) does the same, logged with its traceback, unless ``VISMEMO_STRICT`` is set."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the boundary: faults and (outside strict mode) bugs degrade
        if is_fault(err):
            _count(what, "fault")
            logger.warning("vismemo: store %s failed (%s: %s); continuing without it", what, type(err).__name__,
                           err)
            return default
        unexpected(err, f"store {what}")
        return default
