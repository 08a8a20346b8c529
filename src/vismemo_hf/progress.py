"""Progress bars of the long commands and the one switch that turns them off.

``progress(iterable, total=..., desc=..., unit=...)`` is a tqdm bar on stderr, as transformers and datasets show
theirs; it is disabled (a tqdm that takes every call and draws nothing) when progress is off: ``vismemo --quiet``,
``set_enabled(False)`` or the environment variable ``VISMEMO_QUIET=1``. ``configure(quiet)`` is what the CLI does
with ``--quiet``: the switch, the INFO lines of the evaluation and benchmark code (training steps, per-size
lookups) shown or hidden, transformers', huggingface_hub's and datasets' own bars off too when quiet, and log
lines written above any bar instead of through it. Library code logs through ``logging``; only the CLI and the
final report of a benchmark print.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

#: loggers whose INFO lines the CLI shows unless --quiet (progress lines of the evaluation and benchmark code; the
#: runtime's own INFO notes stay off)
PROGRESS_LOGGERS = ("vismemo_hf.eval", "vismemo_hf.bench")

_enabled: bool | None = None  # None: from VISMEMO_QUIET
_silenced: set[str] = set()  # the other libraries' bars configure(quiet=True) turned off


def set_enabled(on: bool | None) -> None:
    """Turn progress bars on or off for this process (None: back to ``VISMEMO_QUIET``)."""
    global _enabled
    _enabled = on


def quiet_by_environment() -> bool:
    """Whether ``VISMEMO_QUIET`` asks for no bars (1, true, yes, on)."""
    return os.environ.get("VISMEMO_QUIET", "").strip().lower() in ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether progress bars show: ``set_enabled``'s setting, else not ``VISMEMO_QUIET`` (1, true, yes)."""
    if _enabled is not None:
        return _enabled
    return not quiet_by_environment()


def progress(iterable=None, total=None, desc: str | None = None, unit: str = "it", leave: bool = False,
             disable: bool = False, **kwargs):
    """A tqdm bar on stderr (``disable``, or progress off: a silent one); use it as tqdm: iterate it, or
    ``update`` / ``set_postfix`` it, in a ``with`` block or closed when done. Finished bars are cleared unless
    ``leave``."""
    from tqdm import tqdm

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True,
                disable=disable or not enabled(), **kwargs)


def fit_total(bar, done: int, elapsed: float, budget_s: float, limit: int, offset: int = 0) -> None:
    """A loop bounded by a step count and a wall-clock budget: set ``bar.total`` to the steps it will reach, at the
    rate so far (``done`` steps in ``elapsed`` s; at most ``limit``), plus ``offset`` (steps of earlier runs the bar
    started from), so that the bar's share and ETA follow whichever bound comes first."""
    if done > 0 and elapsed > 0:
        bar.total = offset + min(limit, done + int(done / elapsed * max(0.0, budget_s - elapsed)))


@contextlib.contextmanager
def above_bars():
    """Clear the bars while a line is written to stdout or stderr, and redraw them after."""
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is None:  # no bar can exist
        yield
        return
    with tqdm_module.tqdm.external_write_mode(file=sys.stderr):
        yield


class _AboveBars(logging.StreamHandler):
    """A stream handler that writes above the progress bars; INFO lines of ``PROGRESS_LOGGERS`` without the level
    and logger name (they are the command's own progress lines)."""

    def __init__(self, like: logging.StreamHandler) -> None:
        super().__init__(like.stream)
        self.setLevel(like.level)
        self.setFormatter(like.formatter)
        for f in like.filters:
            self.addFilter(f)

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and record.name.startswith(PROGRESS_LOGGERS):
            return record.getMessage()
        return super().format(record)

    def emit(self, record: logging.LogRecord) -> None:
        with above_bars():
            super().emit(record)


def configure(quiet: bool = False) -> None:
    """The CLI's ``--quiet`` (or its absence): progress bars off (on), the INFO lines of ``PROGRESS_LOGGERS``
    hidden (shown), transformers', huggingface_hub's and datasets' bars off (back on if this turned them off), and
    the root logger's console handlers writing above the bars."""
    set_enabled(not quiet)
    for name in PROGRESS_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.INFO)
    root = logging.getLogger()
    root.handlers = [_AboveBars(h) if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.stdout)
                     else h for h in root.handlers]
    _other_bars(quiet)


def _datasets_bars():
    """datasets' module of bar switches (``from datasets.utils import tqdm`` may give its tqdm class instead)."""
    import importlib

    return importlib.import_module("datasets.utils.tqdm")


def _other_bars(quiet: bool) -> None:
    if quiet:
        import huggingface_hub.utils  # transformers' bars follow it (also when transformers is imported later)

        if not huggingface_hub.utils.are_progress_bars_disabled():
            huggingface_hub.utils.disable_progress_bars()
            _silenced.add("huggingface_hub")
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            if hf_logging.is_progress_bar_enabled():
                hf_logging.disable_progress_bar()
                _silenced.add("transformers")
        if "datasets" in sys.modules:
            ds_tqdm = _datasets_bars()
            if not ds_tqdm.are_progress_bars_disabled():
                ds_tqdm.disable_progress_bars()
                _silenced.add("datasets")
        elif "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ:
            os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"  # read when datasets is imported
            _silenced.add("datasets env")
        return
    if "huggingface_hub" in _silenced:
        import huggingface_hub.utils

        huggingface_hub.utils.enable_progress_bars()
    if "transformers" in _silenced:
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()
    if "datasets" in _silenced:
        _datasets_bars().enable_progress_bars()
    if "datasets env" in _silenced and "datasets" not in sys.modules:
        os.environ.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    _silenced.clear()
