"""Which attention implementation an enabled model's attention modules run, decided per forward, per thread.

transformers' attention modules look their implementation up at every call, by name, from
``self.config._attn_implementation``. A forward that reuses K/V (a slot layout) must run the ``"vismemo"`` function
in the text model, and an encode that keeps or lends tower K/V the ``"vismemo_tower"`` one in the vision tower; every
other forward, in this thread or another one, must run the model's own. Writing the name on the shared config would
switch it for every thread that runs the model meanwhile (and a second thread would record the first one's switch
as the model's own).

So ``enable`` gives the model's attention modules a ``ConfigView`` of their config instead of the config itself: it
reads and writes through to the config, except that its ``_attn_implementation`` is the name ``routed`` set for it in
the current context (a ``ContextVar``: this thread's, this task's), and the config's own otherwise. Nothing global
changes: the model's configs, their class and their values stay what they were (``disable`` puts the config back).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import torch

#: the views routed in the current context, and the implementation each one names meanwhile
_ROUTES: ContextVar[tuple[tuple[ConfigView, str], ...]] = ContextVar("vismemo_routes", default=())


class ConfigView:
    """A module's view of a shared config: every attribute is the config's, but ``_attn_implementation``, which is
    the name ``routed`` gives this view in the current context when it gives one."""

    __slots__ = ("config",)

    def __init__(self, config) -> None:
        object.__setattr__(self, "config", config)

    @property
    def _attn_implementation(self):
        for view, name in _ROUTES.get():
            if view is self:
                return name
        return self.config._attn_implementation

    @_attn_implementation.setter
    def _attn_implementation(self, value) -> None:
        self.config._attn_implementation = value

    def __getattr__(self, name: str):
        return getattr(object.__getattribute__(self, "config"), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.config, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.config, name)

    def __deepcopy__(self, memo) -> ConfigView:
        return ConfigView(copy.deepcopy(self.config, memo))

    def __reduce__(self):
        return ConfigView, (self.config,)

    def __repr__(self) -> str:
        return f"ConfigView({self.config!r})"


def own(config) -> Any:
    """The config behind ``config`` (itself when it is no view)."""
    return config.config if isinstance(config, ConfigView) else config


def own_implementation(config) -> str | None:
    """The implementation the model runs, whatever a routed forward names meanwhile."""
    return own(config)._attn_implementation_internal


def attention_modules(root: torch.nn.Module, config) -> list[torch.nn.Module]:
    """The modules under ``root`` that look their attention implementation up on ``config`` (each family's
    ``*Attention`` modules; models inside, which keep their own config, are not entered)."""
    from transformers import PreTrainedModel

    found = []
    stack = [root]
    while stack:
        module = stack.pop()
        if module is not root and isinstance(module, PreTrainedModel):
            continue
        if type(module).__name__.endswith("Attention") and own(getattr(module, "config", None)) is own(config):
            found.append(module)
        stack.extend(module.children())
    return found


def install(modules: list[torch.nn.Module], config) -> ConfigView:
    """Give ``modules`` one view of ``config``; returns it (the view they already have when they have one)."""
    views = {id(m.config): m.config for m in modules if isinstance(m.config, ConfigView)}
    view = next(iter(views.values())) if len(views) == 1 else ConfigView(own(config))
    for module in modules:
        cast(Any, module).config = view  # ``nn.Module`` types attribute writes as tensors or modules: a config is neither
    return view


def uninstall(modules: list[torch.nn.Module]) -> None:
    """Give ``modules`` their config back."""
    for module in modules:
        module.config = own(module.config)


@contextmanager
def routed(view: ConfigView, name: str) -> Iterator[None]:
    """``view`` names ``name`` in the current context for the block (nested blocks stack; other threads and tasks
    never see it)."""
    token = _ROUTES.set(((view, name), *_ROUTES.get()))
    try:
        yield
    finally:
        _ROUTES.reset(token)
