"""The remote tier's former place: it lives in ``tiers/remote.py`` now, one file among the other tiers; its names
stay importable from here."""

from vismemo_hf.store.tiers.remote import (
                                           READ_BATCH,
                                           READ_CHUNK,
                                           RedisLink,
                                           RemoteTier,
                                           RemoteUnavailable,
                                           _record,
                                           parse_record,
                                           safe_url,
                                           scrub,
                                           url_secrets,
)

__all__ = ["READ_BATCH", "READ_CHUNK", "RedisLink", "RemoteTier", "RemoteUnavailable", "_record", "parse_record",
           "safe_url", "scrub", "url_secrets"]
