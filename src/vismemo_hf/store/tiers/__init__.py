"""The store's tiers, one file each, and the chain they form (``chain.py``: device -> host -> victim share -> disk
-> remote, built there and nowhere else).

* ``base.py``: ``Tier``, what the store asks of a tier, and ``TierBase``, the answers most tiers give alike.
* ``device.py``: ``DeviceTier`` (L1), decoded entries, K/V on the tier's device; reads are indexing.
* ``host.py``: ``HostTier`` (L2, and its victim share), blobs as uint8 tensors (pinned when CUDA exists); sparse
  reads gather. Full reads of the lower tiers land in pinned buffers too (``ranges.read_buffer``).
* ``disk.py``: ``DiskTier`` (L3), blobs as raw-byte files of a ``diskcache`` directory (``directory.py``), read
  through ``ranges.BlobReader``: sparse reads are positioned reads of the ranges they need.
* ``remote.py``: ``RemoteTier`` (L4), Redis or Valkey, one server or a cluster, shared by machines.

Each tier holds entries in its own form and knows only its own bytes; recency order lives in each tier (``lru``),
what to evict and where it goes is ``Placement``'s, asked of each tier through ``Tier``.
"""

from vismemo_hf.store.tiers.base import BYTES, COPY, ENTRY, FITS, PUBLISH, RANKED, News, Tier, TierBase, TierUnavailable
from vismemo_hf.store.tiers.chain import NAMES, Roles, chain, checked_device, open_disk
from vismemo_hf.store.tiers.device import DeviceTier, layer_major, token_rows
from vismemo_hf.store.tiers.directory import (
                                         FOREIGN_KEY,
                                         QUARANTINE,
                                         ReadOnlyDirectory,
                                         SafeDisk,
                                         damaged,
                                         open_index,
                                         passing,
                                         quarantine,
                                         sweep_orphans,
)
from vismemo_hf.store.tiers.disk import ORPHAN_S, REOPEN_S, DiskTier
from vismemo_hf.store.tiers.host import HostTier
from vismemo_hf.store.tiers.remote import RemoteTier, RemoteUnavailable

__all__ = ["BYTES", "COPY", "ENTRY", "FITS", "FOREIGN_KEY", "NAMES", "ORPHAN_S", "PUBLISH", "QUARANTINE", "RANKED",
           "REOPEN_S", "DeviceTier", "DiskTier", "HostTier", "News", "ReadOnlyDirectory", "RemoteTier",
           "RemoteUnavailable", "Roles", "SafeDisk", "Tier", "TierBase", "TierUnavailable", "chain", "checked_device",
           "damaged", "layer_major", "open_disk", "open_index", "passing", "quarantine", "sweep_orphans",
           "token_rows"]
