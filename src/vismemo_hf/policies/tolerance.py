"""A model's calibrated context tolerance: how much of a hit after another context (other text or images before the
image, an agent's screen that moved in its window) the model lets a routing reuse, measured on the model itself.

Whether reusing K/V computed after one context is safe after another is the model's property (CacheBlend recomputes
about 15 % of the tokens on its models; a small reader changes its answer after a few words). Without a measurement
the routing's safe default holds: a small text change is checked, a larger one or another image before the image is
computed in full. ``vismemo calibrate --context`` measures, on the model, the agreement with a full prefill of each
candidate routing on the context classes of ``vismemo report context`` (text of 1-300 characters, 1-3 other pages
before the page, an agent's window that slid by a screen) and writes the routing that recomputes least while agreeing
on every class into ``configs/context/NAME.yaml``: the model's fingerprint, the ``ContextRouting`` fields it changes
(none: the default is the best that passes) and the calibration's figures.

Any cache then serves that model with them (``for_model``) where its policy checks contexts with its own default
routing; a policy given another ``context``, and the paper's routings, keep theirs. The presets are found along the
presets' search path (``presets.search_path``), by fingerprint, once per model and process.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

from vismemo_hf import presets
from vismemo_hf.policies.base import ContextRouting, RoutingPolicy

logger = logging.getLogger(__name__)

KIND = "context"
_KEYS = {"fingerprint", "context", "calibration"}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """One model's calibrated context routing: the ``ContextRouting`` fields over a routing's default (``options``),
    from the preset at ``path``."""

    fingerprint: str
    options: dict
    path: Path | None = None


def load(path: str | Path) -> Tolerance:
    """The tolerance in a context preset (a YAML path, or a name on the search path); a malformed one is a
    ValueError that names the file."""
    found = presets.find(KIND, str(path))
    assert found is not None  # without missing_ok, find raises instead
    data = presets.read(found, presets.KINDS[KIND])
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"unknown context preset key(s) {unknown} in {found}; it takes {sorted(_KEYS)}")
    fingerprint, options = data.get("fingerprint"), data.get("context") or {}
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"context preset {found} names no model fingerprint: write it with vismemo calibrate --context")
    if not isinstance(options, dict):
        raise ValueError(f"context in {found} must be a mapping of ContextRouting fields, got {options!r}")
    fields = {f.name for f in dataclasses.fields(ContextRouting)}
    if set(options) - fields:
        raise ValueError(f"context in {found} has no field(s) {sorted(set(options) - fields)}; it takes {sorted(fields)}")
    try:
        dataclasses.replace(ContextRouting(routing="check"), **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"context in {found}: {err}") from None
    return Tolerance(fingerprint, dict(options), found)


_FOUND: dict[str, Tolerance | None] = {}
_LOCK = threading.Lock()


def calibrated(fingerprint: str) -> Tolerance | None:
    """The calibrated tolerance of the model ``fingerprint`` names, from the context presets on the search path (the
    first that names it), or None; looked for once per model and process (``forget`` looks again)."""
    with _LOCK:
        if fingerprint in _FOUND:
            return _FOUND[fingerprint]
    found = None
    for _, path, _ in presets.listing(KIND):
        try:
            tolerance = load(path)
        except ValueError as err:  # a broken preset must not stop the model's requests: said, and passed over
            logger.warning("vismemo: context preset skipped: %s", err)
            continue
        if tolerance.fingerprint == fingerprint:
            found = tolerance
            break
    with _LOCK:
        _FOUND[fingerprint] = found
    return found


def forget() -> None:
    """Look for every model's preset again (after ``vismemo calibrate --context`` wrote one in this process)."""
    with _LOCK:
        _FOUND.clear()


def own_context(policy: RoutingPolicy) -> ContextRouting:
    """The context routing ``policy``'s class gives when none is passed."""
    field = next(f for f in dataclasses.fields(policy) if f.name == "context")
    return cast("Callable[[], ContextRouting]", field.default_factory)()


def for_model(policy: RoutingPolicy, fingerprint: str, context_given: bool = False) -> RoutingPolicy:
    """``policy`` as it serves the model ``fingerprint`` names: with the model's calibrated context routing where the
    policy checks contexts with its own default routing and none was given (``context_given``: passed as an option; a
    policy instance or preset with another routing keeps it too, and one that reuses every token after another
    context, the paper's, has no check to calibrate); else ``policy`` itself."""
    tolerance = calibrated(fingerprint) if not context_given else None
    if tolerance is None or not tolerance.options or policy.context.routing != "check" or \
            policy.context != own_context(policy):
        return policy
    return dataclasses.replace(policy, context=dataclasses.replace(policy.context, **tolerance.options))
