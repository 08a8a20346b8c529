"""Where entries live: ``VisMemoStore`` over its tiers (``tiers``: device, host, disk; ``remote``: Redis), the
entry (``entry``), its byte layout (``blob``) and the coarse lookup index over every tier (``index``)."""

from vismemo_hf.store.entry import Entry
from vismemo_hf.store.faults import StoreFault, fault_counts, store_call
from vismemo_hf.store.store import VisMemoStore, default_store

__all__ = ["Entry", "StoreFault", "VisMemoStore", "default_store", "fault_counts", "store_call"]
