"""Where entries live: ``VisMemoStore`` over its tiers (``tiers``: device, host, disk; ``remote``: Redis), the
entry (``entry``) and its byte layout (``blob``)."""

from vismemo_hf.store.entry import Entry
from vismemo_hf.store.store import VisMemoStore, default_store, store_call

__all__ = ["Entry", "VisMemoStore", "default_store", "store_call"]
