"""The shared remote tier (L4) on Redis or Valkey, one server or a cluster: several processes and machines reuse
one another's images.

Layout under ``prefix`` (default ``vismemo``), the same on one server and on a cluster (no hash tags: the keys
spread over the cluster's slots, so capacity and traffic spread over its nodes):

* ``{prefix}:blob:{key}`` — the entry's blob, the same headed, checksummed, patch-first bytes as
  the host and disk tiers (never pickle). An exact hit reads it whole: the header, then 8 MiB
  ``GETRANGE``s, four per pipelined round trip, on ``read_threads`` connections at once, into one buffer; an
  approximate hit reads one ``GETRANGE`` per reused token, pipelined in one round trip. Blobs carry a TTL
  (``ttl_s``) so that a ``maxmemory-policy volatile-lru`` (or ``volatile-ttl``) server evicts
  blobs and never the index.
* ``{prefix}:index:{s}`` — ``shards`` hashes ``key -> record`` (blob header + the four region descriptors), the
  shard by the key's CRC-32: what a starting process reads to see every entry.
* ``{prefix}:published:{s}`` — one capped stream of the same records per shard; a running process reads what was
  published since its last look, so its approximate lookup sees other processes' entries.

A cluster is found by asking the server (``INFO cluster``) or named with ``cluster=True``; the cluster client
follows MOVED / ASK redirections and resharding. Capacity is the servers' (``maxmemory``); this side counts the
bytes it wrote and read. Faults never reach a request: an unreachable, slow (``timeout_s``) or failing server marks
the tier down for ``retry_s`` seconds (a warning, ``errors`` counted), reads are misses meanwhile and writes are
dropped; after ``retry_s`` the next use reconnects and re-reads the index. On a cluster the same holds per node:
a failed node costs the misses of the keys in its slots only.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.background import background_pool, torch_pool
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.ranges import BlobReader
from vismemo_hf.store.tiers.base import BYTES, PUBLISH, News, TierBase, TierUnavailable

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

#: bytes per GETRANGE of a full read, and ranges per pipelined round trip
READ_CHUNK = 8 << 20
READ_BATCH = 4

logger = logging.getLogger(__name__)


def _record(data: bytes, descriptors: torch.Tensor) -> bytes:
    return data[: blob.HEADER_SIZE] + descriptors.detach().float().cpu().contiguous().numpy().tobytes()


def parse_record(record: bytes, seal: blob.Seal | None = None) -> tuple[blob.BlobHeader, torch.Tensor]:
    """(header, (4, dim) descriptors) of a published record; BlobError when it is malformed (or, with ``seal``,
    when its header's MAC fails)."""
    header = blob.parse_header(record[: blob.HEADER_SIZE], seal)
    body = record[blob.HEADER_SIZE :]
    if len(body) != 4 * header.embed_dim * 4:
        raise blob.BlobError("descriptor record of the wrong size")
    return header, torch.frombuffer(bytearray(body), dtype=torch.float32).reshape(4, header.embed_dim)


def safe_url(url: str) -> str:
    """The URL without its credentials (for logs, errors and reports): user info and query hidden.

    Everything up to the *last* ``@`` is user info (a host never holds one; a password may), and the query
    (``?password=...``) is hidden whole; where that split is ambiguous, everything after the scheme is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<redis url>"
    userinfo, at, host = rest.rpartition("@")
    if any(c in userinfo for c in "?#/"):  # the last @ may sit in a query or path: show no part of it
        return f"{scheme}://***"
    host, query, _ = host.partition("?")
    return f"{scheme}://{'***@' if at else ''}{host}{'?***' if query else ''}"


def url_secrets(url: str) -> list[str]:
    """Every credential a URL carries, raw and percent-decoded: user, password and query values."""
    from urllib.parse import parse_qsl, unquote

    _, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    found = []
    if at:
        found.append(userinfo)
        found.extend(userinfo.split(":", 1))
    query = (host if at else rest).partition("?")[2]
    found.extend(v for _, v in parse_qsl(query, keep_blank_values=True))
    found.extend([unquote(x) for x in found])
    return sorted({x for x in found if len(x) >= 2}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with every secret replaced by ***."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class RedisLink:
    """The connection to one Redis server or cluster, and which of it may be used now: an unreachable, slow or
    failing server is left alone for ``retry_s`` (on a cluster only the failing node: the others serve on), and a
    reconnect or a node's return calls ``on_back`` (what it held may be gone)."""

    def __init__(self, url: str, timeout_s: float, retry_s: float, cluster: bool | None, secrets: list[str],
                 on_back) -> None:
        import redis

        self._redis = redis
        self.url = safe_url(url)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries inside the client: redis-py's default (10 tries, backoff up to 1 s, on a cluster 0.25 s more
        # per CLUSTERDOWN) would stall a request for seconds on a dead server; this link's own answer to a fault is
        # to leave the server (or node) alone for retry_s and serve from the local tiers
        self._raw_url = url
        self._options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self.retry_s, self.cluster, self._secrets, self._on_back = retry_s, cluster, secrets, on_back
        try:
            # parsed now: a bad URL is an error here
            self.client: redis.Redis | RedisCluster = redis.Redis.from_url(url, **self._options)
        except Exception as err:  # noqa: BLE001 - the parser's message may quote the URL
            raise ValueError(f"invalid remote_url {self.url} ({type(err).__name__}: "
                             f"{scrub(str(err), secrets)})") from None
        self.counters = {"errors": 0, "reconnects": 0, "connected": False, "cluster": False, "nodes_down": 0}
        self.connected = False
        self._down_until = 0.0
        self._nodes_down: dict[str, float] = {}  # cluster node -> until when it is left alone
        self._state = threading.RLock()

    @property
    def is_cluster(self) -> bool:
        return bool(self.counters["cluster"])

    def scrub(self, err: Exception) -> str:
        return scrub(str(err), self._secrets)

    def fault(self, what: str, err: Exception, name: str | None = None) -> None:
        """A failed call: on a cluster the node of ``name`` (a Redis key) is left alone for ``retry_s``, the other
        nodes serve on; on one server (or when the node is not known) the whole link is."""
        node = self._node(name) if name is not None and self.is_cluster else None
        with self._state:
            self.counters["errors"] += 1
            if node is not None:
                was_up = node not in self._nodes_down
                self._nodes_down[node] = time.monotonic() + self.retry_s
                self.counters["nodes_down"] = len(self._nodes_down)
            else:
                was_up = self.connected
                self.connected = self.counters["connected"] = False
                self._down_until = time.monotonic() + self.retry_s
        if was_up or self.counters["errors"] == 1:
            where = f"node {node} of " if node is not None else ""
            logger.warning("vismemo: remote tier %s%s failed on %s (%s: %s); serving from local tiers, retrying in "
                           "%.0f s", where, self.url, what, type(err).__name__, self.scrub(err), self.retry_s)

    def _node(self, name: str) -> str | None:
        from redis.cluster import RedisCluster

        client = self.client
        if not isinstance(client, RedisCluster):  # one server: no nodes
            return None
        try:
            return client.get_node_from_key(name).name
        except Exception:  # noqa: BLE001 - slots not known yet
            return None

    def up(self, name: str) -> bool:
        """Whether the node holding Redis key ``name`` may be used now (always, on one server)."""
        if not self._nodes_down:
            return True
        node = self._node(name)
        until = self._nodes_down.get(node) if node is not None else None
        if node is None or until is None:
            return True
        if time.monotonic() < until:
            return False
        with self._state:  # its time is up: try it again
            self._nodes_down.pop(node, None)
            self.counters["nodes_down"] = len(self._nodes_down)
        self._on_back()
        return True

    def available(self) -> bool:
        """Whether the server can be used now (reconnects once ``retry_s`` has passed)."""
        if self.connected:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            self._connect()
        except Exception as err:  # noqa: BLE001 - down, refused, auth, TLS
            self.fault("connect", err)
            return False
        with self._state:
            if self.counters["reconnects"] or self.counters["errors"]:
                logger.warning("vismemo: remote tier %s reachable again", self.url)
            self.counters["reconnects"] += 1
            self.connected = self.counters["connected"] = True
            self._nodes_down.clear()
            self.counters["nodes_down"] = 0
        self._on_back()
        return True

    def _connect(self) -> None:
        """Ping the server; on the first success find out whether it is a cluster and, if so, use a cluster client."""
        self.client.ping()
        if self.is_cluster:
            return
        if self.cluster is None:
            try:
                self.cluster = bool(self.client.info("cluster").get("cluster_enabled"))
            except self._redis.ResponseError:  # INFO not allowed here: a plain server
                self.cluster = False
        if self.cluster:
            from redis.cluster import RedisCluster

            plain, self.client = self.client, RedisCluster.from_url(self._raw_url, **self._options)
            plain.close()
            self.counters["cluster"] = True
            self.client.ping()

    def unroutable(self, err: Exception) -> bool:
        """Whether a server's error reply says the cluster cannot serve the key now (down, a node just restarted,
        failing over, resharding), not that anything is wrong with the entry. redis-py raises ``ClusterDownError``
        / ``TryAgainError`` for it; inside a pipeline their text starts with the command, not ``CLUSTERDOWN``."""
        exceptions = self._redis.exceptions
        if isinstance(err, (exceptions.ClusterDownError, exceptions.TryAgainError)):
            return True
        return str(err).startswith(("CLUSTERDOWN", "TRYAGAIN"))

    def call(self, fn, name: str):
        """``fn()`` against the node of Redis key ``name``; a connection fault is ``RemoteUnavailable``."""
        if not self.up(name):
            raise RemoteUnavailable("the node holding this entry is down")
        try:
            return fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as err:
            self.fault("read", err, name)
            raise RemoteUnavailable(self.scrub(err)) from None
        except self._redis.RedisError as err:  # a cluster that cannot route the key now (CLUSTERDOWN, TRYAGAIN)
            if isinstance(err, self._redis.ResponseError) and not self.unroutable(err):
                raise
            self.fault("read", err, name)
            raise RemoteUnavailable(self.scrub(err)) from None

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


class _ShardGuard:
    """What a remote tier does with a shard whose index or stream key another program took (a value of another type
    under the prefix): that shard is skipped until the link comes back, the other shards serve on; any other failed
    index call is a fault of the link (of its node, on a cluster)."""

    # provided by ``RemoteTier``
    _redis: ModuleType
    link: RedisLink
    url: str
    shards: int
    counters: dict[str, int]
    _reload: set[int]
    _bad_shards: set[int]
    _next_refresh: float
    _state: threading.RLock
    _index_key: Callable[[int], str]
    _stream_key: Callable[[int], str]

    def _index_failed(self, what: str, err: Exception, shards: list[int]) -> bool:
        """After a failed index call on ``shards``; True: stop reading (the link is down, on one server)."""
        if isinstance(err, self._redis.ResponseError) and str(err).startswith("WRONGTYPE"):
            for shard in shards:  # which of them: each key's type answers
                keys = (self._index_key(shard), self._stream_key(shard))
                if len(shards) == 1 or any(self.link.client.type(k) not in (b"none", b"hash", b"stream", "none", "hash",
                                                                             "stream") for k in keys):
                    self._bad_shard(shard, err)
            self._next_refresh = 0.0  # the other shards, next time
            return False
        self.link.fault(what, err, self._index_key(shards[0]))
        return not self.link.is_cluster

    def _back(self) -> None:
        """The link is back (a reconnect): every shard's index is read whole again, skipped shards too."""
        self._reload.update(range(self.shards))
        if hasattr(self, "_bad_shards"):  # not yet while the link first connects, in the constructor
            self._bad_shards.clear()

    def _bad_shard(self, shard: int, err: Exception) -> None:
        """Skip ``shard`` until the link comes back (logged once per shard)."""
        self._reload.discard(shard)
        with self._state:
            first = shard not in self._bad_shards
            self._bad_shards.add(shard)
            self.counters["bad_shards"] = len(self._bad_shards)
        if first:
            logger.warning("vismemo: remote tier %s: shard %d's keys hold values of another type (%s: %s); "
                           "skipping that shard, the others serve on", self.url, shard, type(err).__name__,
                           self.link.scrub(err))


class RemoteTier(_ShardGuard, TierBase):
    """Blobs in a Redis server or cluster shared by every process that points at it: every put is published to it,
    and a full read of a key no tier knows asks it (another process may have published it since the last sync)."""

    name = "remote"
    holds = BYTES
    admits = PUBLISH
    shared = True
    holds_unseen = True

    def __init__(self, url: str, *, prefix: str = "vismemo", timeout_s: float = 0.5, retry_s: float = 5.0,
                 ttl_s: int | None = 7 * 24 * 3600, stream_len: int = 100_000, refresh_s: float = 1.0,
                 cluster: bool | None = None, shards: int = 16, read_threads: int = 4,
                 seal: blob.Seal | None = None):
        try:
            import redis
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError("remote_url needs the redis client: pip install 'vismemo-hf[remote]'") from err
        if not 1 <= int(shards) <= 1024 or int(read_threads) < 1:
            raise ValueError("shards must lie in [1, 1024] and read_threads be >= 1")
        self._redis = redis
        self.prefix, self._secrets = prefix, url_secrets(url)
        self.timeout_s, self.retry_s, self.ttl_s, self.stream_len, self.refresh_s = (
            timeout_s, retry_s, ttl_s, stream_len, refresh_s)
        self.shards, self.read_threads = int(shards), int(read_threads)
        self._reload: set[int] = set(range(self.shards))  # shards whose index is read whole on the next sync
        self.link = RedisLink(url, timeout_s, retry_s, cluster, self._secrets,
                              on_back=self._back)
        self.url = self.link.url  # the URL with credentials lives only in the client
        self.budget = None  # capacity is the server's (maxmemory)
        self.lru: OrderedDict[str, int] = OrderedDict()  # every key the index knows, with its blob size
        self.fingerprints: dict[str, str] = {}  # key -> model fingerprint its record was published with
        self.bytes = 0
        self.counters = {"writes": 0, "write_failures": 0, "writes_refused": 0, "writes_skipped": 0,
                         "bytes_written": 0, "bytes_read": 0, "range_reads": 0, "records_forged": 0, "bad_shards": 0}
        self._stream_ids = ["0-0"] * self.shards
        self._bad_shards: set[int] = set()  # shards skipped until the link comes back (``_ShardGuard``)
        self._next_refresh = 0.0
        self._writer = background_pool("vismemo-remote")
        self._readers = torch_pool("vismemo-remote-read", self.read_threads)
        self._pending: list = []
        self._state = threading.RLock()
        self.seal = seal
        self.reader = BlobReader(self, seal)

    def __str__(self) -> str:
        return f"remote tier {self.url}"

    @property
    def client(self):
        return self.link.client

    def available(self) -> bool:
        return self.link.available()

    def _blob_key(self, key: str) -> str:
        return f"{self.prefix}:blob:{key}"

    def _shard(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.shards

    def _index_key(self, shard: int) -> str:
        return f"{self.prefix}:index:{shard}"

    def _stream_key(self, shard: int) -> str:
        return f"{self.prefix}:published:{shard}"

    # -- index -------------------------------------------------------------------------------------
    def _load_shard(self, shard: int) -> list:
        """Every (key, header, descriptors) of one index shard, and the position of its stream."""
        stream = self._stream_key(shard)
        try:
            last = self.client.xinfo_stream(stream)["last-generated-id"]
        except self._redis.ResponseError:  # no stream yet
            last = b"0-0"
        out = [parsed for key, record in self.client.hscan_iter(self._index_key(shard), count=1000)
               for parsed in self._parse(key, record)]
        self._stream_ids[shard] = last.decode() if isinstance(last, bytes) else str(last)
        self._reload.discard(shard)
        return out

    def load_index(self):
        """Every published (key, header, descriptors) of the shards that need it (all after a (re)connect)."""
        if not self.available():
            return []
        out = []
        for shard in sorted(self._reload):
            if not self.link.up(self._index_key(shard)):
                continue
            try:
                out.extend(self._load_shard(shard))
            except Exception as err:  # noqa: BLE001
                if self._index_failed("index", err, [shard]):
                    return out
        self._next_refresh = time.monotonic() + self.refresh_s
        return out

    def sync(self):
        """New (key, header, descriptors) records: whole shards after a (re)connect, else what was published since
        the last look (at most one look per ``refresh_s``: one XREAD of every stream on one server, one per shard
        on a cluster)."""
        if self._reload:
            return self.load_index()
        if not self.link.connected or time.monotonic() < self._next_refresh:
            return []
        self._next_refresh = time.monotonic() + self.refresh_s
        out = []
        good = [s for s in range(self.shards) if s not in self._bad_shards]
        groups = [[s] for s in good] if self.link.is_cluster else [good] if good else []
        for shards in groups:
            if not self.link.up(self._stream_key(shards[0])):
                continue
            try:
                while True:
                    reply = self.client.xread({self._stream_key(s): self._stream_ids[s] for s in shards}, count=1000)
                    if not reply:
                        break
                    for stream, messages in reply:
                        shard = int((stream.decode() if isinstance(stream, bytes) else stream).rsplit(":", 1)[1])
                        for msg_id, fields in messages:
                            self._stream_ids[shard] = msg_id.decode() if isinstance(msg_id, bytes) else str(msg_id)
                            out.extend(self._parse(fields.get(b"k", b""), fields.get(b"r", b"")))
            except Exception as err:  # noqa: BLE001
                if self._index_failed("refresh", err, shards):
                    return out
        return out

    def _parse(self, key: bytes, record: bytes):
        try:
            header, descriptors = parse_record(record, self.seal)
            if header.key != key.decode("ascii", "replace"):
                raise blob.BlobError("record published under another key")
        except Exception as err:  # noqa: BLE001 - a bad record is skipped, never used
            if isinstance(err, blob.ForgedBlob):
                self.counters["records_forged"] += 1
            logger.warning("vismemo: skipping a malformed remote index record (%s)", err)
            return []
        return [(header.key, header, descriptors)]

    def news(self, unusable: Callable[[str, Exception], None]) -> Iterable[News]:
        """What other processes published since the last look (``sync``), each counted as held."""
        for key, header, descriptors in self.sync():
            self.track(key, header)
            yield key, header.fingerprint, header.grid, descriptors

    def counts(self) -> dict[str, int]:
        return {"forged": self.counters["records_forged"]}  # index records whose header MAC failed

    def track(self, key: str, header: blob.BlobHeader) -> None:
        with self._state:
            self.fingerprints[key] = header.fingerprint
            self._track(key, header.total_bytes)

    def _track(self, key: str, size: int) -> None:
        if key not in self.lru:
            self.lru[key] = size
            self.bytes += size

    def __contains__(self, key: str) -> bool:
        return key in self.lru and self.available() and self.link.up(self._blob_key(key))

    # -- writing -----------------------------------------------------------------------------------
    def publish(self, key: str, encode: Callable[[], bytes], descriptors: torch.Tensor) -> None:
        """Encode (``encode()`` -> blob bytes) and publish in the background: nothing waits for it. The blob lands
        before its record (on a cluster they sit on different nodes), so a record always names a blob."""
        if not self.available() or not self.link.up(self._blob_key(key)):
            self.counters["writes_skipped"] += 1
            return

        def write():
            name = self._blob_key(key)
            try:
                data = encode()
                record = _record(data, descriptors)
                shard = self._shard(key)
                pipe = self.client.pipeline(transaction=not self.link.is_cluster)
                pipe.set(name, data, ex=self.ttl_s)
                if self.link.is_cluster:
                    pipe.execute()
                    name = self._index_key(shard)
                    pipe = self.client.pipeline(transaction=False)
                pipe.hset(self._index_key(shard), key, record)
                pipe.xadd(self._stream_key(shard), {"k": key, "r": record}, maxlen=self.stream_len, approximate=True)
                pipe.execute()
                with self._state:
                    self.counters["writes"] += 1
                    self.counters["bytes_written"] += len(data) + 2 * len(record)
                    self.fingerprints[key] = blob.parse_header(data, self.seal).fingerprint
                    self._track(key, len(data))
            except self._redis.ResponseError as err:  # refused (OOM under maxmemory, ...): reads go on
                if self.link.unroutable(err):  # a cluster that cannot take the key now: a fault of its node
                    with self._state:
                        self.counters["write_failures"] += 1
                    self.link.fault("write", err, name)
                    return
                with self._state:
                    self.counters["write_failures"] += 1
                    self.counters["writes_refused"] += 1
                    first = self.counters["writes_refused"] == 1
                if first:
                    logger.warning("vismemo: remote tier %s refused a write (%s: %s); reads continue",
                                   self.url, type(err).__name__, self.link.scrub(err))
            except Exception as err:  # noqa: BLE001
                with self._state:
                    self.counters["write_failures"] += 1
                self.link.fault("write", err, name)

        self._pending.append(self._writer.submit(write))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _untrack(self, key: str) -> None:
        with self._state:
            self.bytes -= self.lru.pop(key, 0)
            self.fingerprints.pop(key, None)

    def _delete(self, key: str, blob_too: bool) -> None:
        """Delete the index record of ``key`` (and its blob) on the server when reachable."""
        if not self.link.connected:
            return
        name = self._blob_key(key) if blob_too else self._index_key(self._shard(key))
        try:
            pipe = self.client.pipeline(transaction=False)
            if blob_too:
                pipe.delete(self._blob_key(key))
            pipe.hdel(self._index_key(self._shard(key)), key)
            pipe.execute()
        except Exception as err:  # noqa: BLE001
            self.link.fault("delete", err, name)

    def discard(self, key: str) -> None:
        """Forget ``key`` here and delete it (blob and index record) on the server when reachable."""
        self._untrack(key)
        self._delete(key, blob_too=True)

    def forget(self, key: str) -> None:
        """Forget ``key`` here and its stale index record (the blob is gone, e.g. evicted by maxmemory)."""
        self._untrack(key)
        self._delete(key, blob_too=False)

    def leave(self, key: str) -> None:
        """Stop counting ``key`` here; its blob and index record are another trust domain's."""
        self._untrack(key)

    def missing(self, key: str) -> None:
        """A read found the blob gone (evicted by maxmemory, deleted by another process): its record goes too."""
        if key in self.lru:
            self.forget(key)

    pop = discard  # the store demotes nothing out of the shared tier: capacity is the server's

    def touch(self, key: str) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def put(self, key: str, data: bytes) -> None:
        """Write in the background (the store publishes through ``publish`` with the descriptors)."""
        raise NotImplementedError("the remote tier is written with publish(key, encode, descriptors)")

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": None, "entries": len(self.lru), **dict(self.counters),
                **dict(self.link.counters)}

    # -- reading (KeyError: not on the server; ConnectionError & co. are faults, see VisMemoStore) ----
    # -- ByteSource (ranges.py): pipelined GETRANGEs ------------------------------------------------------
    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        name = self._blob_key(key)

        def fetch():
            pipe = self.client.pipeline(transaction=False)
            for start, length in spans:
                pipe.getrange(name, start, start + length - 1)
            return pipe.execute()

        chunks = self.link.call(fetch, name)
        with self._state:
            self.counters["bytes_read"] += sum(len(c) for c in chunks)
        if len(spans) == 1 and not chunks[0]:
            raise KeyError(key)
        return chunks

    def read_into(self, key: str, view: memoryview) -> None:
        """``READ_CHUNK`` ranges, ``READ_BATCH`` per pipelined round trip, ``read_threads`` round trips at once on
        their own connections, each copied into its place in the buffer (no whole-blob reply, no second copy)."""
        total = len(view)
        spans = [(start, min(total, start + READ_CHUNK) - start) for start in range(0, total, READ_CHUNK)]
        batches = [spans[i : i + READ_BATCH] for i in range(0, len(spans), READ_BATCH)]

        def read(batch):
            for (start, length), chunk in zip(batch, self.ranges(key, batch)):
                if not chunk:
                    raise KeyError(key)  # deleted since the header read
                if len(chunk) != length:
                    raise blob.BlobError("blob size does not match its header")
                view[start : start + length] = chunk

        if len(batches) == 1:
            read(batches[0])
            return
        for done in [self._readers.submit(read, b) for b in batches]:
            done.result()

    def check(self, key: str, header: blob.BlobHeader) -> None:
        """The blob is the one its index record announced: same model."""
        if header.fingerprint != self.fingerprints.get(key, header.fingerprint):
            raise blob.BlobError("blob stored under another key or model")

    # -- reads --------------------------------------------------------------------------------------------
    def header(self, key: str) -> blob.BlobHeader:
        return self.reader.header(key)

    def identity(self, key: str) -> tuple[str, str] | None:
        """As its index record says (every read checks the blob's header against the record)."""
        fingerprint = self.fingerprints.get(key)
        return None if fingerprint is None else (key, fingerprint)

    def meta(self, key: str) -> Entry:
        return self.reader.meta(key)

    def lookup(self, key: str) -> blob.LookupSection:
        return self.reader.lookup(key)

    def full(self, key: str) -> Entry:
        """The whole blob, once the value's length agrees with its header (a header naming a huge size is refused
        before any buffer is made for it; partial reads are bounded by the ranges they ask for)."""
        header, name = self.reader.header(key), self._blob_key(key)
        if self.link.call(lambda: self.client.strlen(name), name) != header.total_bytes:
            raise blob.BlobError("blob size does not match its header")
        header, entry = self.reader.read_full(key, header)
        self.track(key, header)  # known now, even if its index record has not been read yet
        return entry

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        """One pipelined round trip for the header, one for the token ranges."""
        with self._state:
            self.counters["range_reads"] += tokens.numel()
        return self.reader.tokens(key, tokens, first_layer)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.link.close()


class RemoteUnavailable(TierUnavailable):
    """The remote tier could not answer (not a property of the entry: the entry is kept)."""
