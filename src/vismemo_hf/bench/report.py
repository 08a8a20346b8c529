"""What every report in ``results/`` starts with: the command that made it and the machine it ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def command(prog: str, args, options: list[str], extra: str = "") -> str:
    """``vismemo PROG --option value ...`` for the argparse ``options`` (attribute names) of ``args``."""
    parts = [f"vismemo {prog}"]
    for name in options:
        parts.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return " ".join(parts) + extra


def machine(device: str = "cpu", note: str = "") -> str:
    """The device (GPU name, or CPU architecture and threads), torch version and an optional note."""
    if str(device).startswith("cuda"):
        where = torch.cuda.get_device_name()
    else:
        where = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads of {os.cpu_count()} cores)"
    return f"{where}, torch {torch.__version__}" + (f"; {note}" if note else "")


def header(title: str, cmd: str, mach: str) -> list[str]:
    """The first lines of a markdown report."""
    return [f"# {title}", "", f"Command: `{cmd}`  ", f"Machine: {mach}", ""]


def write(lines: list[str], out: str | Path) -> None:
    """Write a markdown report (its folder made if missing) and print it."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines))
    print("\n".join(lines))
