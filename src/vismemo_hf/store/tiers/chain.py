"""The chain of tiers, fastest first, built in this one place (``chain``): device (L1, one per device of
``device_bytes``, each with its own budget) -> host (L2) -> its victim share -> disk (L3) -> remote (L4).

``VisMemoStore`` and ``Placement`` walk the chain in this order and ask each tier what it is (``Tier``); nothing
else knows which tier comes where. A new tier is its own file in this folder implementing ``Tier`` (``TierBase``
gives the usual answers) plus its place in ``chain`` here, or in the list given as ``VisMemoStore(tiers=...)``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.tiers.base import FITS, RANKED, Tier
from vismemo_hf.store.tiers.device import DeviceTier
from vismemo_hf.store.tiers.disk import DiskTier
from vismemo_hf.store.tiers.host import HostTier
from vismemo_hf.store.tiers.remote import RemoteTier

logger = logging.getLogger(__name__)

#: the names of the built-in tiers: each is in every ``stats()``, held or not
NAMES = ("device", "host", "disk", "remote")


def checked_device(device) -> torch.device:
    """``device`` as a torch device that exists on this machine (else a ValueError now, not at the first put)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"not a torch device: {device!r}") from err
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {device} does not exist here (CUDA devices: {torch.cuda.device_count()})")
    if device.type == "meta":
        raise ValueError("the device tier needs a device that holds data, not meta")
    return device


def open_disk(disk_dir, disk_bytes: int | None, seal: blob.Seal | None) -> DiskTier | None:
    """The disk tier of ``disk_dir``, or None: none asked for, or an unusable directory (logged)."""
    if disk_dir is None:
        return None
    try:
        return DiskTier(str(disk_dir), disk_bytes, seal)
    except Exception as err:  # noqa: BLE001 - unwritable or unusable directory
        logger.warning("vismemo: disk tier %s unusable (%s: %s); serving without it", disk_dir,
                       type(err).__name__, err)
        return None


def chain(device_budgets: Mapping[str, int | None], host_bytes: int | None, victim_share: float = 0.0,
          disk_dir: str | os.PathLike[str] | None = None, disk_bytes: int | None = None, remote_url: str | None = None,
          remote_options: Mapping[str, object] | None = None, seal: blob.Seal | None = None) -> list[Tier]:
    """The store's tiers, fastest first: a device tier per ``{device: budget}``, the host tier and its victim share
    (``victim_share`` of ``host_bytes``), the disk tier of ``disk_dir`` when usable, the remote tier of
    ``remote_url``. ``seal``: what every blob tier checks its blobs' MACs with (None: unsealed)."""
    tiers: list[Tier] = [DeviceTier(budget, checked_device(name)) for name, budget in device_budgets.items()]
    main_host: int | None = None
    victim_host: int | None = None
    if host_bytes is not None:
        main_host = int(host_bytes * (1 - victim_share))
        victim_host = host_bytes - main_host
    tiers.append(HostTier(main_host, seal=seal))
    tiers.append(HostTier(victim_host, name="host", seal=seal, ranked=True))
    disk = open_disk(disk_dir, disk_bytes, seal)
    if disk is not None:
        tiers.append(disk)
    if remote_url:
        options = cast("Mapping[str, Any]", remote_options or {})  # RemoteTier's keywords, as the caller gave them
        tiers.append(RemoteTier(remote_url, **options, seal=seal))
    return tiers


class Roles:
    """The built-in tiers of ``tiers`` by the place ``chain`` gives them, for callers that reach into one (tests,
    benchmarks, ``vismemo bench``): ``devices`` (a list), ``device`` (the first), ``host``, ``victim`` (its victim
    share), ``disk`` and ``remote``, None where the chain has none. The store's own code never uses them."""

    tiers: list

    def _named(self, name: str, admits: str | None = None) -> list:
        return [t for t in self.tiers if t.name == name and admits in (None, t.admits)]

    @property
    def devices(self) -> list[DeviceTier]:
        return self._named("device")

    @property
    def device(self) -> DeviceTier | None:
        return next(iter(self._named("device")), None)

    @property
    def host(self) -> HostTier | None:
        return next(iter(self._named("host", FITS)), None)

    @property
    def victim(self) -> HostTier | None:
        return next(iter(self._named("host", RANKED)), None)

    @property
    def disk(self) -> DiskTier | None:
        return next(iter(self._named("disk")), None)

    @property
    def remote(self) -> RemoteTier | None:
        return next(iter(self._named("remote")), None)
