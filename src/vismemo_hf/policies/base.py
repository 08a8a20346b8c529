"""Policy base class, registry and presets."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar, cast

import torch

from vismemo_hf.core.plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals

_REGISTRY: dict[str, type[RoutingPolicy]] = {}
#: the fewest probes that verify a changed context's reuse (``RoutingPolicy.context_recompute``)
MIN_PROBES = 4


#: a ``RoutingPolicy`` subclass ``register_policy`` is given, and returns
PolicyT = TypeVar("PolicyT", bound="RoutingPolicy")


def register_policy(cls: type[PolicyT]) -> type[PolicyT]:
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def _preset(name: str) -> dict | None:
    """A policy preset (a YAML path, or the stem of a file in configs/policies/), or None."""
    from vismemo_hf.presets import find, read

    path = find("policies", name, missing_ok=not str(name).endswith((".yaml", ".yml")))  # a missing file: say so
    if path is None:
        return None
    data = read(path, "policy preset")
    if "policy" not in data:
        raise ValueError(f"policy preset {path} needs a `policy:` name")
    data["_path"] = path
    return data


def get_policy(policy: str | RoutingPolicy, **options: object) -> RoutingPolicy:
    """A policy from a registered name or a preset, with options (unknown options are an error)."""
    if isinstance(policy, RoutingPolicy):
        if options:
            raise TypeError("options cannot be combined with a policy instance")
        return policy
    cls = _REGISTRY.get(policy)
    if cls is None:
        preset = _preset(policy)
        if preset is None:
            from vismemo_hf.presets import available

            raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(available_policies())}; "
                             f"presets: {', '.join(available('policies'))}")
        name, path = preset.pop("policy"), preset.pop("_path")
        try:
            return get_policy(name, **{**preset, **options})
        except (TypeError, ValueError) as err:  # the file is what to fix: name it
            raise ValueError(f"policy preset {path}: {err}") from err
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"policy {policy!r} has no option(s) {unknown}; it takes {sorted(known)}")
    return cls(**cast("dict[str, Any]", options))  # each option's type is checked by the policy's __post_init__


def _fits(value: object, annotation: str) -> bool:
    """Whether ``value`` is of the annotated type (the annotations the policies use: int, float, bool, str, None,
    list[float], and unions of them). An unknown annotation accepts anything."""
    for part in (p.strip() for p in annotation.split("|")):
        if part == "None" and value is None:
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if part == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part == "list[float]" and isinstance(value, (list, tuple)) and all(_fits(v, "float") for v in value):
            return True
        if part not in ("None", "bool", "int", "float", "str", "list[float]"):
            return True
    return False


def check_field_types(policy) -> None:
    """A policy option of the wrong type (``warmup_layers=1.5``, ``recompute_ratio="0.3"``) is a ``TypeError`` when
    the policy is built, never a failure inside ``generate`` (a layer count of 1.5 indexes nothing)."""
    for f in fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"policy {policy.name!r}: {f.name} must be a number, got nan")
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if not _fits(value, annotation):
            wanted = annotation.replace("list[float]", "a list of floats")
            raise TypeError(f"policy {policy.name!r}: {f.name} must be {wanted}, got {value!r}")


@dataclass(frozen=True)
class SignalNeeds:
    """The warmup signals a routing reads (``WarmupSignals``): the runner collects these and nothing else."""

    attention: bool = False
    deviation: bool = False
    check_kv: bool = False


@dataclass(frozen=True)
class ContextRouting:
    """How a routing reuses a hit after another context than its alias's (another text before the image, other
    images or videos before it, an agent's screen that moved in its window): docs/METHOD.md §2-3. A policy's
    ``context`` (``RoutingPolicy(context=ContextRouting(...))``, or a dict of these fields in a preset).
    """

    name: ClassVar[str] = "context"

    #: ``"reuse"`` every token (docs/METHOD.md §2, whose K/V then carry the old context from layer 1 on) or
    #: ``"check"``: compute every token up to ``check_layer``, then recompute the ``recompute_ratio`` whose fresh K/V
    #: deviate most from the stored ones there (CacheBlend's selection), and also every token whose relative K + V
    #: deviation there exceeds ``tolerance`` (a long or very different text moves every token); reuse the rest
    routing: str = "reuse"
    check_layer: int = 1
    recompute_ratio: float = 0.15
    tolerance: float = 0.005
    #: ``"check"``: when it would recompute more than this share of the image, every token is computed instead
    #: (``ImagePlan.fallback == "context"``): the context moved most of the image
    miss_ratio: float = 0.5
    #: and this share of the tokens it reuses (at least ``MIN_PROBES``), spread over their check-layer deviation, is
    #: computed at every layer to verify the rest (``ImagePlan.verify``): a context's effect can grow with depth
    #: where the check layer does not see it; past ``probe_tolerance`` the image is computed in full
    probe_share: float = 0.0625
    probe_tolerance: float = 0.008
    #: and when, with the reuse, the model's next token has a top probability below this, the image is computed in
    #: full (an unsure answer is one that any approximation may change)
    min_confidence: float = 0.8
    #: and the first this many generated tokens are watched the same way (``runtime/watch.py``): at an unsure one the
    #: sequence so far is computed in full
    watch_tokens: int = 16
    #: a context that differs from the alias's in at most this many tokens of text (a label, a word of an
    #: instruction: ``core.context.context_change``) is a small change: the check recomputes the
    #: ``recompute_ratio`` whose K/V deviate most and verifies the rest by the probes, against
    #: ``small_tolerance``, and by the confidence guard and watch, without ``tolerance`` and ``miss_ratio`` (a short
    #: change lifts the first layers' deviation of most tokens while what the answer reads stays close;
    #: ``vismemo report context``); a larger or unknown change: ``check_large``
    small_change: int = 8
    small_tolerance: float = 0.1
    #: a larger or unknown change (other images or videos before the image, more than ``small_change`` tokens of
    #: text): False computes the image in full from the start (``fallback="context"``); True checks it
    #: (``tolerance``, ``miss_ratio``, probes against ``probe_tolerance``).
    #: A change that large moves the deep layers' K/V of most tokens where the check layer does not see it, and a
    #: check that passes there can reuse a reading the new text changes: on the context report's front it disagreed
    #: with a full prefill on the tiny reader after 11-40 characters while computing most such images in full anyway
    check_large: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.routing not in ("reuse", "check"):
            raise ValueError(f"context routing must be 'reuse' or 'check', got {self.routing!r}")
        if self.check_layer < 0 or not 0.0 <= self.recompute_ratio <= 1.0 or self.tolerance < 0:
            raise ValueError("context check_layer and tolerance must be >= 0, recompute_ratio in [0, 1]")
        if not 0.0 <= self.miss_ratio <= 1.0 or not 0.0 <= self.probe_share <= 1.0:
            raise ValueError("context miss_ratio and probe_share must lie in [0, 1]")
        if self.small_change < 0 or self.small_tolerance < 0:
            raise ValueError("context small_change and small_tolerance must be >= 0")
        if self.probe_tolerance < 0 or not 0.0 <= self.min_confidence <= 1.0 or self.watch_tokens < 0:
            raise ValueError("context probe_tolerance and watch_tokens must be >= 0, min_confidence in [0, 1]")


@dataclass
class RoutingPolicy:
    """Shared parameters and the exact-hit / miss plans; subclasses route approximate hits.

    ``prefetch_tokens`` runs before warmup: the late-layer K/V of those tokens are read
    while warmup runs, and ``plan`` (after the first ``warmup_layers`` layers, with their
    signals) should reuse a subset of them, or pay a second read.
    """

    name: ClassVar[str] = ""
    #: which warmup signals ``plan`` reads (``WarmupSignals``); the runner collects only these
    needs_attention: ClassVar[bool] = False
    needs_check_kv: ClassVar[bool] = False
    needs_deviation: ClassVar[bool] = False

    warmup_layers: int = 3
    recompute_ratio: float = 0.3
    reuse_ratio: float = 0.1
    #: a hit after another context before the image (another text, other images before it): how its reuse is
    #: checked (``ContextRouting``; a dict of some of its fields changes those of the policy's own)
    context: ContextRouting = field(default_factory=lambda: ContextRouting())
    #: reused tokens a compressed alias entry holds no K/V for (docs/METHOD.md §4): ``"mask"`` them (VL-Cache's choice;
    #: they are left out of attention) or ``"recompute"`` them (compute them at every layer)
    missing: str = "mask"

    def __post_init__(self) -> None:
        if isinstance(self.context, dict):  # fields over the policy's own context routing
            own = cast("Callable[[], ContextRouting]", next(f for f in fields(self) if f.name == "context").default_factory)
            unknown = sorted(set(self.context) - {f.name for f in fields(ContextRouting)})
            if unknown:
                raise TypeError(f"policy {self.name!r}: context has no field(s) {unknown}; it takes "
                                f"{sorted(f.name for f in fields(ContextRouting))}")
            self.context = dataclasses.replace(own(), **self.context)
        if not isinstance(self.context, ContextRouting):
            raise TypeError(f"policy {self.name!r}: context must be a ContextRouting or a dict of its fields, got "
                            f"{self.context!r}")
        check_field_types(self)
        if not 0.0 <= self.recompute_ratio <= 1.0 or not 0.0 <= self.reuse_ratio <= 1.0:
            raise ValueError("recompute_ratio and reuse_ratio must lie in [0, 1]")
        if self.warmup_layers < 0:
            raise ValueError("warmup_layers must be >= 0")
        if self.missing not in ("mask", "recompute"):
            raise ValueError(f"missing must be 'mask' or 'recompute', got {self.missing!r}")

    # -- what the prefill runner asks (it reads no field of a policy) ---------------------------------------
    def signal_needs(self, kind: HitKind) -> SignalNeeds:
        """The signals the plan of an image of ``kind`` is made from (an exact hit checked after another
        context compares K/V at the check layer)."""
        if kind is HitKind.EXACT:
            return SignalNeeds(check_kv=True)
        return SignalNeeds(self.needs_attention, self.needs_deviation, self.needs_check_kv)

    def reuses_encoder(self) -> bool:
        """Whether an approximate hit found by its pixels encodes only the tokens whose pixels changed and keeps
        the alias's encoder output for the rest (docs/METHOD.md §1); False: its tower runs on the whole image (a
        routing that reads the encoder output of every token, as the paper's does)."""
        return False

    def reuses_prefix(self) -> bool:
        """Whether a request that starts as an earlier one did reuses that prefix's K/V whole (``runtime.prefix``:
        exact, so every routing does, but ``full``, the baseline that computes everything)."""
        return True

    def decision_layer(self, kind: HitKind) -> int:
        """The layer before which the plan of an image of ``kind`` is made (the end of its warmup)."""
        return self.context.check_layer if kind is HitKind.EXACT else self.warmup_layers

    def early_plan(self, kind: HitKind, image: ImageFeatures, alias: ImageFeatures | None, prefix_changed: bool,
                   n_layers: int, context_change: int | None = None) -> ImagePlan | None:
        """The plan made before any layer runs, limited to what the alias holds; None: made at ``decision_layer``
        from the warmup's signals (``route``). A hit after a context change that is not small (``context_change``:
        the tokens of text the contexts differ in, None when unknown or not text alone) is computed in full unless
        ``context.check_large``; an exact hit that would be checked at a layer the model does not have is too."""
        if kind is HitKind.MISS:
            return self.miss_plan(image)
        if alias is None:
            raise ValueError(f"an {kind} hit needs the alias it was found by")
        if self.context_in_full(prefix_changed, context_change):
            return ImagePlan.full(kind, image.n_tokens, alias.key, fallback="context")
        if kind is HitKind.APPROXIMATE:
            return None
        plan = self.exact_plan(image, alias.key, prefix_changed)
        if plan is None:
            return ImagePlan.full(HitKind.EXACT, image.n_tokens, alias.key) if self.context.check_layer >= n_layers \
                else None
        return plan.limited_to(alias, self.missing)

    def context_in_full(self, prefix_changed: bool, context_change: int | None) -> bool:
        """Whether a hit after another context (``prefix_changed``) that differs from its alias's by
        ``context_change`` tokens of text is computed in full before any layer runs (``early_plan``)."""
        return prefix_changed and self.context.routing == "check" and not self.context.check_large and \
            not self.small_change(context_change)

    def lends_encoder(self, prefix_changed: bool, context_change: int | None, changed: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None) -> bool:
        """Whether an approximate hit found by its pixels may be lent its alias's encoder output (when the routing
        ``reuses_encoder``; ``changed``: its (N,) tokens whose pixels changed, ``rows``: each token's row, which a
        routing that reuses the encoder may look at): in its alias's context; after another one only where the
        routing checks the change and verifies the reuse (probes or the confidence guard, which then see the lent
        output's error too, and whose fallbacks start again from the whole encode) and does not compute the image in
        full before any layer runs (``context_in_full``). A routing that reuses after another context unverified
        encodes the image whole: the lent output's error would add to the context's, unchecked."""
        if not prefix_changed:
            return True
        verified = self.context.probe_share > 0 or self.context.min_confidence > 0
        return self.context.routing == "check" and verified and not self.context_in_full(True, context_change)

    def prefetch(self, kind: HitKind, image: ImageFeatures, alias: ImageFeatures) -> tuple[torch.Tensor, int]:
        """(tokens, first layer): the alias K/V to read before the warmup runs, only tokens the alias holds. Every
        token from layer 0 when the plan compares fresh and cached K/V of the warmup layers."""
        if kind is HitKind.EXACT or self.signal_needs(kind).deviation:
            tokens, first = torch.arange(image.n_tokens), 0
        else:
            tokens, first = self.prefetch_tokens(image, alias).sort().values, self.warmup_layers
        return (tokens if alias.kv_tokens is None else tokens[alias.stored(tokens)]), first

    def route(self, kind: HitKind, image: ImageFeatures, alias: ImageFeatures, prefetched: torch.Tensor,
              signals: WarmupSignals) -> ImagePlan:
        """The plan made at ``decision_layer`` from the warmup's signals, limited to what the alias holds."""
        if kind is HitKind.EXACT:
            plan = self.context_plan(image, alias.key, signals)
        else:
            plan = self.plan(image, alias, prefetched, signals)
        return plan.limited_to(alias, self.missing)

    @staticmethod
    def budget(ratio: float, n_tokens: int) -> int:
        return min(n_tokens, math.ceil(ratio * n_tokens - 1e-9))

    def exact_plan(self, image: ImageFeatures, alias: str, prefix_changed: bool = False) -> ImagePlan | None:
        """The plan of an exact hit, or None to decide at ``context.check_layer`` with ``context_plan``."""
        if prefix_changed and self.context.routing == "check":
            return None
        return ImagePlan.exact(image.n_tokens, alias)

    def context_recompute(self, signals: WarmupSignals, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(recompute, probes) for a changed context (``context.routing="check"``), both sorted: the
        ``context.recompute_ratio`` whose K/V deviate most at the check layer, every token past ``context.tolerance``,
        and the probes that verify the rest (``context.probe_share`` of it at every rank of its deviation); None when
        the check alone is more than ``context.miss_ratio`` of the image (compute it all). A small change
        (``small_context``) recomputes the ``context.recompute_ratio`` alone and never returns None."""
        deviation = signals.check_deviation
        if deviation is None:
            raise ValueError("the context check needs the fresh and cached K/V of the check layer")
        score = (deviation[0] + deviation[1]).float()
        count = self.budget(self.context.recompute_ratio, n)
        if not self.small_context(signals):
            count = max(count, int((score > self.context.tolerance).sum()))
            if count > self.context.miss_ratio * n:
                return None
        order = torch.sort(score, descending=True, stable=True).indices
        rest = order[count:]
        probes = rest[:0]
        if rest.numel() and self.context.probe_share > 0:
            m = min(rest.numel(), max(MIN_PROBES, math.ceil(self.context.probe_share * n)))
            probes = rest[torch.linspace(0, rest.numel() - 1, m).round().long().unique()]
        return torch.cat([order[:count], probes]).sort().values, probes.sort().values

    def small_change(self, context_change: int | None) -> bool:
        """Whether a context change of ``context_change`` tokens (None: unknown) is small (``context.small_change``)."""
        return context_change is not None and context_change <= self.context.small_change

    def small_context(self, signals: WarmupSignals) -> bool:
        """Whether the changed context of ``signals`` is a small change."""
        return self.small_change(signals.context_change)

    def context_plan(self, image: ImageFeatures, alias: str, signals: WarmupSignals) -> ImagePlan:
        """An exact hit after another context: recompute what the context changed (``context_recompute``)."""
        n = image.n_tokens
        context = self.context_recompute(signals, n)
        if context is None:
            return ImagePlan.full(HitKind.EXACT, n, alias, fallback="context")
        recompute, probes = context
        rest = torch.ones(n, dtype=torch.bool)
        rest[recompute] = False
        return ImagePlan(HitKind.EXACT, n, self.context.check_layer, recompute, torch.nonzero(rest).flatten(),
                         torch.zeros(0, dtype=torch.long), alias,
                         **self.verification(probes, signals))

    def verification(self, probes: torch.Tensor, signals: WarmupSignals) -> dict:
        """The ``ImagePlan`` fields that verify a reuse after another context by ``probes``."""
        tolerance = self.context.small_tolerance if self.small_context(signals) else self.context.probe_tolerance
        return {"verify": probes, "verify_tolerance": tolerance,
                "verify_confidence": self.context.min_confidence, "verify_watch": self.context.watch_tokens}

    def miss_plan(self, image: ImageFeatures) -> ImagePlan:
        return ImagePlan.full(HitKind.MISS, image.n_tokens)

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        """Tokens whose K/V (layers >= ``warmup_layers``) to read before warmup; default none."""
        return torch.zeros(0, dtype=torch.long)

    def plan(
        self, image: ImageFeatures, alias: ImageFeatures, prefetched: torch.Tensor, signals: WarmupSignals
    ) -> ImagePlan:
        raise NotImplementedError


def changed_tokens(image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor | None:
    """(N,) True at the tokens whose pixels differ from the alias's (patch hashes; tokens the alias does not show
    count as changed); None when either image's hashes are unknown."""
    if image.patch_hashes is None or alias.patch_hashes is None:
        return None
    return image.patch_hashes != alias.patch_hashes


def reading_dependents(changed: torch.Tensor, rows: torch.Tensor, reach: int | str) -> torch.Tensor:
    """(N,) True at ``changed`` tokens and at the tokens after each of them in its token row (``rows``: (N,) the row
    of each token, rows in runs, as ``ImageFeatures.token_rows`` gives them): the next ``reach``, or (``"row"``) the
    rest of the row. In reading order a later token attends to an earlier one (the rest of a number, a word, a
    record is read through it), so its cached K/V hold what the changed token showed before."""
    changed, rows = changed.reshape(-1).bool().cpu(), rows.reshape(-1).cpu()
    n = changed.numel()
    at = torch.arange(n)
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = rows[1:] != rows[:-1]
    row_start = torch.where(starts, at, torch.zeros_like(at)).cummax(0).values
    seen = torch.cat([torch.zeros(1, dtype=torch.long), changed.long().cumsum(0)])  # seen[i]: changed before i
    first = row_start if reach == "row" else torch.maximum(row_start, at - int(reach))
    return seen[at + 1] > seen[first]


def split_by_score(
    score: torch.Tensor, candidates: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top ``k`` of ``candidates`` by ``score``, the rest), both sorted by token index; ties keep index order."""
    order = torch.sort(score[candidates], descending=True, stable=True).indices
    return candidates[order[:k]].sort().values, candidates[order[k:]].sort().values


def approximate_plan(policy: RoutingPolicy, image: ImageFeatures, alias: ImageFeatures, recompute, reuse,
                     mask=None, **extra) -> ImagePlan:
    """An approximate-hit plan; ``mask`` defaults to the tokens neither recomputed nor reused."""
    n = image.n_tokens
    if mask is None:
        rest = torch.ones(n, dtype=torch.bool)
        rest[recompute] = False
        rest[reuse] = False
        mask = torch.nonzero(rest).flatten()
    return ImagePlan(HitKind.APPROXIMATE, n, extra.pop("warmup_layers", policy.warmup_layers), recompute, reuse,
                     mask, alias.key, **extra)
