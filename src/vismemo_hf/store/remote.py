"""The shared remote tier (L4) on Redis or Valkey: several processes and machines reuse one another's images.

Layout under ``prefix`` (default ``vismemo``):

* ``{prefix}:blob:{key}`` — the entry's blob, the same headed, checksummed, patch-first bytes as
  the host and disk tiers (never pickle). An exact hit reads it whole: the header, then 8 MiB
  ``GETRANGE``s, four per pipelined round trip, into one buffer; an approximate hit reads one
  ``GETRANGE`` per reused token, pipelined in one round trip. Blobs carry a TTL
  (``ttl_s``) so that a ``maxmemory-policy volatile-lru`` (or ``volatile-ttl``) server evicts
  blobs and never the index.
* ``{prefix}:index`` — hash ``key -> record`` (blob header + the four region descriptors): what a
  starting process reads to see every entry.
* ``{prefix}:published`` — stream of the same records, capped; a running process reads what was
  published since its last look, so its approximate lookup sees other processes' entries.

Capacity is Redis's (``maxmemory``); this side counts the bytes it wrote and read. Faults never
reach a request: an unreachable, slow (``timeout_s``) or failing server marks the tier down for
``retry_s`` seconds (a warning, ``errors`` counted), reads are misses meanwhile and writes are
dropped; after ``retry_s`` the next use reconnects and re-reads the index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.ranges import BlobReader

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


class RemoteTier:
    """Blobs in a Redis server shared by every process that points at it."""

    name = "remote"
    shared = True

    def __init__(self, url: str, *, prefix: str = "vismemo", timeout_s: float = 0.5, retry_s: float = 5.0,
                 ttl_s: int | None = 7 * 24 * 3600, stream_len: int = 100_000, refresh_s: float = 1.0,
                 seal: blob.Seal | None = None):
        try:
            import redis
        except ImportError as err:  # pragma: no cover - depends on the install
            raise ImportError("remote_url needs the redis client: pip install 'vismemo-hf[remote]'") from err
        self._redis = redis
        self.url, self.prefix = safe_url(url), prefix  # the URL with credentials lives only in the client
        self._secrets = url_secrets(url)
        self.timeout_s, self.retry_s, self.ttl_s, self.stream_len, self.refresh_s = (
            timeout_s, retry_s, ttl_s, stream_len, refresh_s)
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - the parser's message may quote the URL
            raise ValueError(f"invalid remote_url {self.url} ({type(err).__name__}: "
                             f"{scrub(str(err), self._secrets)})") from None
        self.budget = None  # capacity is the server's (maxmemory)
        self.lru: OrderedDict[str, int] = OrderedDict()  # every key the index knows, with its blob size
        self.fingerprints: dict[str, str] = {}  # key -> model fingerprint its record was published with
        self.bytes = 0
        self.counters = {"errors": 0, "writes": 0, "write_failures": 0, "writes_refused": 0, "writes_skipped": 0,
                      "bytes_written": 0, "bytes_read": 0, "range_reads": 0, "reconnects": 0,
                      "records_forged": 0, "connected": False}
        self._down_until = 0.0
        self._stream_id = "0-0"
        self._next_refresh = 0.0
        self._connected = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vismemo-remote")
        self._pending: list = []
        self._state = threading.RLock()
        self.needs_reload = True  # read the whole index on the next sync (start, reconnect)
        self.seal = seal
        self.reader = BlobReader(self, seal)

    def _blob_key(self, key: str) -> str:
        return f"{self.prefix}:blob:{key}"

    # -- availability ------------------------------------------------------------------------------
    def _fault(self, what: str, err: Exception) -> None:
        with self._state:
            self.counters["errors"] += 1
            was_up = self._connected
            self._connected = self.counters["connected"] = False
            self._down_until = time.monotonic() + self.retry_s
        if was_up or self.counters["errors"] == 1:
            logger.warning("vismemo: remote tier %s failed on %s (%s: %s); serving from local tiers, retrying in %.0f s",
                           self.url, what, type(err).__name__, scrub(str(err), self._secrets), self.retry_s)

    def available(self) -> bool:
        """Whether the server can be used now (reconnects, re-reading the index, once ``retry_s`` has passed)."""
        if self._connected:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            self.client.ping()
        except Exception as err:  # noqa: BLE001 - down, refused, auth, TLS
            self._fault("connect", err)
            return False
        with self._state:
            if self.counters["reconnects"] or self.counters["errors"]:
                logger.warning("vismemo: remote tier %s reachable again", self.url)
            self.counters["reconnects"] += 1
            self._connected = self.counters["connected"] = True
            self.needs_reload = True
        return True

    # -- index -------------------------------------------------------------------------------------
    def load_index(self):
        """Every published (key, header, descriptors): the whole index hash, then the stream's position."""
        if not self.available():
            return []
        try:
            last = self.client.xinfo_stream(f"{self.prefix}:published")["last-generated-id"]
        except self._redis.ResponseError:  # no stream yet
            last = b"0-0"
        except Exception as err:  # noqa: BLE001
            self._fault("index", err)
            return []
        out = []
        try:
            for key, record in self.client.hscan_iter(f"{self.prefix}:index", count=1000):
                out.extend(self._parse(key, record))
        except Exception as err:  # noqa: BLE001
            self._fault("index", err)
            return []
        self._stream_id = last.decode() if isinstance(last, bytes) else str(last)
        self._next_refresh = time.monotonic() + self.refresh_s
        self.needs_reload = False
        return out

    def sync(self):
        """New (key, header, descriptors) records: the whole index after a (re)connect, else what was
        published since the last look (at most one round trip per ``refresh_s``)."""
        if self.needs_reload:
            return self.load_index()
        if not self._connected or time.monotonic() < self._next_refresh:
            return []
        self._next_refresh = time.monotonic() + self.refresh_s
        out = []
        try:
            while True:
                reply = self.client.xread({f"{self.prefix}:published": self._stream_id}, count=1000)
                if not reply:
                    return out
                for msg_id, fields in reply[0][1]:
                    self._stream_id = msg_id.decode()
                    out.extend(self._parse(fields.get(b"k", b""), fields.get(b"r", b"")))
        except Exception as err:  # noqa: BLE001
            self._fault("refresh", err)
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

    def track(self, key: str, header: blob.BlobHeader) -> None:
        with self._state:
            self.fingerprints[key] = header.fingerprint
            self._track(key, header.total_bytes)

    def _track(self, key: str, size: int) -> None:
        if key not in self.lru:
            self.lru[key] = size
            self.bytes += size

    def __contains__(self, key: str) -> bool:
        return key in self.lru and self.available()

    # -- writing -----------------------------------------------------------------------------------
    def write_async(self, key: str, encode, descriptors: torch.Tensor) -> None:
        """Encode (``encode()`` -> blob bytes) and publish in the background: nothing waits for it."""
        if not self.available():
            self.counters["writes_skipped"] += 1
            return

        def write():
            try:
                data = encode()
                record = _record(data, descriptors)
                pipe = self.client.pipeline(transaction=True)
                pipe.set(self._blob_key(key), data, ex=self.ttl_s)
                pipe.hset(f"{self.prefix}:index", key, record)
                pipe.xadd(f"{self.prefix}:published", {"k": key, "r": record}, maxlen=self.stream_len,
                          approximate=True)
                pipe.execute()
                with self._state:
                    self.counters["writes"] += 1
                    self.counters["bytes_written"] += len(data) + 2 * len(record)
                    self.fingerprints[key] = blob.parse_header(data, self.seal).fingerprint
                    self._track(key, len(data))
            except self._redis.ResponseError as err:  # refused (OOM under maxmemory, ...): reads go on
                with self._state:
                    self.counters["write_failures"] += 1
                    self.counters["writes_refused"] += 1
                    first = self.counters["writes_refused"] == 1
                if first:
                    logger.warning("vismemo: remote tier %s refused a write (%s: %s); reads continue",
                                   self.url, type(err).__name__, scrub(str(err), self._secrets))
            except Exception as err:  # noqa: BLE001
                with self._state:
                    self.counters["write_failures"] += 1
                self._fault("write", err)

        self._pending.append(self._writer.submit(write))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _untrack(self, key: str) -> None:
        with self._state:
            self.bytes -= self.lru.pop(key, 0)
            self.fingerprints.pop(key, None)

    def discard(self, key: str) -> None:
        """Forget ``key`` here and delete it (blob and index record) on the server when reachable."""
        self._untrack(key)
        if not self._connected:
            return
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self._blob_key(key))
            pipe.hdel(f"{self.prefix}:index", key)
            pipe.execute()
        except Exception as err:  # noqa: BLE001
            self._fault("delete", err)

    def forget(self, key: str) -> None:
        """Forget ``key`` here and its stale index record (the blob is gone, e.g. evicted by maxmemory)."""
        self._untrack(key)
        if self._connected:
            try:
                self.client.hdel(f"{self.prefix}:index", key)
            except Exception as err:  # noqa: BLE001
                self._fault("delete", err)

    pop = discard  # the store demotes nothing out of the shared tier: capacity is the server's

    def touch(self, key: str) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def put(self, key: str, data: bytes) -> None:
        """Write in the background (the store publishes through ``write_async`` with the descriptors)."""
        raise NotImplementedError("the remote tier is written with write_async(key, encode, descriptors)")

    @staticmethod
    def sizeof(data: bytes) -> int:
        return len(data)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": None, "entries": len(self.lru), **dict(self.counters)}

    # -- reading (KeyError: not on the server; ConnectionError & co. are faults, see VisMemoStore) ----
    def _call(self, fn):
        try:
            return fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as err:
            self._fault("read", err)
            raise RemoteUnavailable(scrub(str(err), self._secrets)) from None

    # -- ByteSource (ranges.py): pipelined GETRANGEs ------------------------------------------------------
    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        def fetch():
            pipe = self.client.pipeline(transaction=False)
            for start, length in spans:
                pipe.getrange(self._blob_key(key), start, start + length - 1)
            return pipe.execute()

        chunks = self._call(fetch)
        self.counters["bytes_read"] += sum(len(c) for c in chunks)
        if len(spans) == 1 and not chunks[0]:
            raise KeyError(key)
        return chunks

    def read_into(self, key: str, view: memoryview) -> None:
        """``READ_CHUNK`` ranges, ``READ_BATCH`` per pipelined round trip, copied into the buffer (no whole-blob
        reply object, no second copy)."""
        total = len(view)
        spans = [(start, min(total, start + READ_CHUNK) - start) for start in range(0, total, READ_CHUNK)]
        for first in range(0, len(spans), READ_BATCH):
            batch = spans[first : first + READ_BATCH]
            for (start, length), chunk in zip(batch, self.ranges(key, batch)):
                if not chunk:
                    raise KeyError(key)  # deleted since the header read
                if len(chunk) != length:
                    raise blob.BlobError("blob size does not match its header")
                view[start : start + length] = chunk

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

    def lookup(self, key: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.reader.lookup(key)

    def full(self, key: str) -> Entry:
        header, entry = self.reader.read_full(key)
        self.track(key, header)  # known now, even if its index record has not been read yet
        return entry

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        """One pipelined round trip for the header, one for the token ranges."""
        self.counters["range_reads"] += tokens.numel()
        return self.reader.tokens(key, tokens, first_layer)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


class RemoteUnavailable(RuntimeError):
    """The remote tier could not answer (not a property of the entry: the entry is kept)."""
