"""The seam between the store and its tiers: a tier is its file implementing ``Tier`` plus its place in the chain.

A tier defined here only, a dict of blobs behind ``ranges.BlobReader``, placed in the chain ``tiers.chain`` builds,
serves puts, hits (promoted or sparse), evictions, faults and stats through ``VisMemoStore`` as the built-in tiers
do; and ``store.py`` / ``placement.py`` never ask which tier a tier is (read from their syntax)."""

import ast
from collections import OrderedDict
from pathlib import Path

import torch

from vismemo_hf import VisMemoStore
from vismemo_hf.core.thresholds import ModelReference
from vismemo_hf.store import blob
from vismemo_hf.store.ranges import BlobReader
from vismemo_hf.store.tiers import BYTES, FITS, Tier, TierBase, TierUnavailable, chain

from test_store import _entry

STORE = Path(__file__).resolve().parents[1] / "src" / "vismemo_hf" / "store"


class SlowTier(TierBase):
    """Blobs in a plain dict (a slower RAM or NVMe tier, say): ``TierBase``'s answers plus reads through
    ``BlobReader`` over ``ranges`` / ``read_into`` / ``check``. ``down``: every read fails as a server's would;
    ``vanished``: keys whose bytes went behind the store's back."""

    name = "slow"
    holds = BYTES
    admits = FITS

    def __init__(self, budget: int | None) -> None:
        self.budget, self.bytes, self.lru = budget, 0, OrderedDict()
        self.reader = BlobReader(self)
        self.down = False
        self.vanished: set[str] = set()  # keys it still counts whose bytes are gone
        self.range_reads = 0

    def put(self, key: str, data: bytes) -> None:
        self.lru[key] = bytearray(data)
        self.bytes += len(data)

    def pop(self, key: str) -> bytes:
        data = self.lru.pop(key)
        self.bytes -= len(data)
        return bytes(data)

    def _blob(self, key: str) -> bytearray:
        if self.down:
            raise TierUnavailable("the slow tier is down")
        if key in self.vanished:
            raise KeyError(key)
        return self.lru[key]  # KeyError: not here

    # ByteSource
    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        data = self._blob(key)
        self.range_reads += len(spans)
        return [bytes(data[start : start + length]) for start, length in spans]

    def read_into(self, key: str, view: memoryview) -> None:
        data = self._blob(key)
        if len(data) != len(view):
            raise blob.BlobError("blob size does not match its header")
        view[:] = data

    def check(self, key: str, header: blob.BlobHeader) -> None:
        if len(self._blob(key)) != header.total_bytes:
            raise blob.BlobError("blob size does not match its header")

    # reads
    def identity(self, key: str) -> tuple[str, str]:
        header = self.reader.header(key)
        return header.key, header.fingerprint

    def full(self, key):
        return self.reader.full(key)

    def meta(self, key):
        return self.reader.meta(key)

    def lookup(self, key):
        return self.reader.lookup(key)

    def tokens(self, key, tokens, first_layer):
        return self.reader.tokens(key, tokens, first_layer)


def _store_with_slow_tier(blobs: int):
    """device (room for one entry) -> slow (room for ``blobs`` blobs) -> host -> victim share, both off."""
    size, blob_size = _entry("x").nbytes, len(blob.encode(_entry("x")))
    slow = SlowTier(blobs * blob_size)
    built = chain({"cpu": size}, host_bytes=0)
    store = VisMemoStore(tiers=[built[0], slow, *built[1:]])
    assert isinstance(slow, Tier) and [t.name for t in store.tiers] == ["device", "slow", "host", "host"]
    return store, slow


def test_a_tier_defined_in_a_test_serves_entries_through_the_store():
    store, slow = _store_with_slow_tier(2)
    entries = {k: _entry(k, seed=i) for i, k in enumerate("abcd")}
    for entry in entries.values():  # the device holds one: each put moves the one before down to the slow tier
        assert store.put(entry)
    assert store.tier_of("d") == "device" and slow.lru.keys() == {"b", "c"}
    assert store.tier_of("a") is None and "a" not in store and len(store) == 3  # out of the slow tier: gone
    stats = store.stats()
    assert stats["evictions"] == 4 and stats["demotions"] == 3 and stats["puts"] == 4
    assert stats["tiers"]["slow"] == {"bytes": slow.bytes, "budget": slow.budget, "entries": 2}
    assert stats["tiers"]["slow"]["bytes"] <= slow.budget and stats["tiers"]["host"]["entries"] == 0

    got = store.get("b", "fp")  # an exact hit from the slow tier: promoted, d moves down in its place
    assert torch.equal(got.kv, entries["b"].kv) and store.tier_of("b") == "device"
    assert slow.lru.keys() == {"c", "d"} and store.stats()["promotions"] == 1
    assert store.stats()["hits_by_tier"]["slow"] == 1

    rows = torch.tensor([3, 0])
    kv = store.get_tokens("c", "fp", rows, 1)  # an approximate hit's sparse read: never promotes
    assert torch.equal(kv, entries["c"].kv[rows][:, 1:]) and store.tier_of("c") == "slow" and slow.range_reads
    assert store.peek("c", "fp").key == "c" and store.lookup_section("c", "fp") is not None
    store.set_reference("fp", ModelReference(torch.zeros(8), torch.zeros(8), 0.0))  # the lookup's centring means
    assert [k for k, _ in store.candidates("fp", entries["c"].grid, entries["c"].descriptors, 0.5, 5)][0] == "c"
    assert store.get("c", "other-model") is None  # another model's key: a miss

    store.discard("c")
    assert "c" not in slow.lru and "c" not in store
    assert store.stats()["tiers"]["slow"]["entries"] == 1
    store.clear()
    assert not slow.lru and len(store) == 0 and store.stats()["tiers"]["slow"]["bytes"] == 0
    store.close()


def test_faults_of_a_tier_defined_in_a_test_are_misses():
    store, slow = _store_with_slow_tier(3)
    entries = {k: _entry(k, seed=i) for i, k in enumerate("abc")}
    for entry in entries.values():
        store.put(entry)
    assert slow.lru.keys() == {"a", "b"}

    slow.down = True  # the tier cannot answer: a miss, the entry kept for when it is back
    assert store.get("a", "fp") is None and store.get_tokens("a", "fp", torch.tensor([0]), 0) is None
    assert store.tier_of("a") == "slow" and store.stats()["corrupt"] == 0
    slow.down = False
    assert torch.equal(store.get("a", "fp").kv, entries["a"].kv)

    slow.lru["b"][blob.HEADER_SIZE + 1] ^= 0x40  # one K/V byte altered: a miss, removed, counted
    assert store.get("b", "fp") is None and "b" not in store and "b" not in slow.lru
    assert store.stats()["corrupt"] == 1

    assert slow.lru.keys() == {"c"}  # "a" promoted, "c" moved down in its place
    slow.vanished.add("c")  # deleted behind the store's back (another process, a server's eviction): a miss, forgotten
    assert store.get("c", "fp") is None and "c" not in store and "c" not in slow.lru and slow.bytes == 0
    assert store.stats()["corrupt"] == 1 and store.tier_of("a") == "device"
    store.close()


# -- store.py and placement.py never ask which tier a tier is ---------------------------------------------------------
#: the places the chain gives the built-in tiers (``tiers.Roles``): for callers only, never for the store's own code
ROLES = {"device", "devices", "host", "victim", "disk", "remote", "chain"}
TIER_CLASSES = {"DeviceTier", "HostTier", "DiskTier", "RemoteTier"}
#: the names store.py and placement.py give a tier
TIER_VARIABLES = {"tier", "lower", "t"}


def _trees():
    return {name: ast.parse((STORE / name).read_text()) for name in ("store.py", "placement.py")}


def _on_self(node: ast.Attribute) -> bool:
    """``self.<attr>`` or ``self.placement.<attr>``."""
    value = node.value
    if isinstance(value, ast.Attribute) and value.attr == "placement":
        value = value.value
    return isinstance(value, ast.Name) and value.id == "self"


def _is_tier(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in TIER_VARIABLES or isinstance(node, ast.Attribute) and (
        node.attr in ROLES and _on_self(node))


def _tier_comparisons(node: ast.Compare) -> list[str]:
    """What in one comparison tells tiers apart: a tier compared by identity or equality (``tier is self.disk``,
    ``tier == other``), a tier looked up in a collection (``lower in self.devices``), a tier's name compared."""
    why, sides = [], [node.left, *node.comparators]
    for op, left, right in zip(node.ops, sides, sides[1:]):
        constant = any(isinstance(s, ast.Constant) for s in (left, right))  # ``x is None``, ``secret is not False``
        if isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) and not constant and (
                _is_tier(left) or _is_tier(right)):
            why.append("a tier compared by identity or equality")
        if isinstance(op, (ast.In, ast.NotIn)) and _is_tier(left):
            why.append("a tier looked up among others")
        if any(isinstance(s, ast.Attribute) and s.attr == "name" for s in (left, right)):
            why.append("a tier told by its name")
    return why


def test_the_store_never_tells_tiers_apart_by_identity_role_or_class():
    found = []
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr in ROLES and _on_self(node):
                found.append(f"{where} role attribute {ast.unparse(node)}")
            if isinstance(node, ast.Name) and node.id in TIER_CLASSES:
                found.append(f"{where} tier class {node.id}")
            if isinstance(node, ast.ImportFrom) and any(a.name in TIER_CLASSES for a in node.names):
                found.append(f"{where} imports a tier class")
            if isinstance(node, ast.Compare):
                found += [f"{where} {why}: {ast.unparse(node)}" for why in _tier_comparisons(node)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "type"):
                if any(isinstance(a, ast.Name) and a.id in TIER_VARIABLES for a in node.args[:1]):
                    found.append(f"{where} the type of a tier asked: {ast.unparse(node)}")
    assert not found, found


def test_the_store_uses_tiers_only_through_the_protocol():
    declared = {n for n in vars(Tier) if not n.startswith("_")} | set(Tier.__annotations__) | {"__contains__"}
    used = {}
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in TIER_VARIABLES:
                used.setdefault(node.attr, f"{name}:{node.lineno}")
    assert used, "premise: the store reads its tiers under these names"
    assert {"put", "pop", "budget", "lru", "holds", "admits", "news", "missing"} <= set(used)
    outside = {attr: where for attr, where in used.items() if attr not in declared}
    assert not outside, outside
