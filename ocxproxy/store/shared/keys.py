"""Every key the shared tier names on its Valkey/Redis server (the values and the scripts
that read and write them: layout.py, conversation_scripts.py).

All keys start with the prefix (--shared-prefix). A response's keys are binary: the
prefix, the layout's tag (LAYOUT: data of another layout is never read, its keys are
other names), the caller's scope (CONTRACT.md C5: its length, then the scope hash's 16
bytes, or the text of a scope that is no hash such as `anonymous`, its length's high bit
set), so one credential's keys never answer another's; then a kind and a name:

    s + sha256 (32 bytes)   a segment: its metadata and items, written once
    c + token (8 bytes)     a chain: the list of its segments' digests (32 bytes each)
    r + response id         a record: `{length}:{chain token}` then its meta and the
                            response object (without its id, which is the key's)
    i + end (ms, decimal)   an item index bucket: a hash, 8 bytes of BLAKE2b of an item id
                            -> the id of the newest record whose own segment holds it,
                            for records expiring in the bucket's span; the hash expires
                            at the span's end (one key per span, not per item)
    d                       the scope's index buckets (a sorted set of ends), newest first
    b + response id         a background response: a hash (status, the latest Response,
                            stream, owner: the token of the replica running it, id, scope)
    b + response id + \\0   its event log: a list, one event's SSE bytes per sequence_number
    p + response id         the ids of the background responses that continue it (a set,
                            for --ttl): a DELETE of it has them keep their whole input

Conversations, their lease and Idempotency-Keys are named in text, under the prefix and
the scope as text (a conversation never expires, so these names stay what servers
already hold):

    {prefix}{scope}:conv:{id}          hash: `head` (created_at, metadata, backend), `ver`,
                                       `resp` (the response id of the last turn appended)
    {prefix}{scope}:conv:{id}:items    list: one entry per append
    {prefix}{scope}:lock:{id}          the conversation's lease: a token, with a TTL
    {prefix}{scope}:idem:{id}          a completed Idempotency-Key: fingerprint and response
    {prefix}{scope}:idemrun:{id}       an Idempotency-Key in flight: fingerprint and token

The byte budget's bookkeeping (no content) is a reserved scope of length 0,
`{prefix}{LAYOUT}\\0` + chains, bytes, total (response chains), kept, keptbytes,
kepttotal (what is kept: conversations, completed keys); the replicas' compaction key
fingerprint is `{prefix}compaction-key`, a setting that never expires. Background
responses' bookkeeping is there too (background_keys): `bgrunning`, a sorted set of the
queued and running ones' keys by the end of their owner's lease (ms, the server's clock);
`bglogs`, the ended ones' event logs by end; `bglogsizes`, each log's bytes; `bglogtotal`,
their total; and `bg`, the pub/sub channel that tells every replica a log grew or a
response is to be cancelled.
"""

from __future__ import annotations

import hashlib

# A new layout, or a new dictionary, is a new tag: keys written under another are not read.
LAYOUT = b"\x03"
_SCOPES = 4096  # scopes whose key names a ScopeKeys keeps built


class Keys:
    """Key names of one scope."""

    __slots__ = ("base", "prefix", "scope", "text")

    def __init__(self, prefix: str, scope: str) -> None:
        self.prefix, self.scope = prefix, scope
        self.base = prefix.encode() + LAYOUT + scope_tag(scope)
        self.text = f"{prefix}{scope}:"

    # -- responses (binary) ----------------------------------------------------------------

    def record(self, record_id: str) -> bytes:
        return self.base + b"r" + record_id.encode()

    def chain(self, token: bytes) -> bytes:
        return self.base + b"c" + token

    def segment(self, digest: str) -> bytes:
        return self.base + b"s" + bytes.fromhex(digest)

    def bucket(self, ends_ms: int) -> bytes:
        return self.base + b"i" + str(ends_ms).encode()

    def buckets(self) -> bytes:
        return self.base + b"d"

    def background(self, response_id: str) -> bytes:
        return self.base + b"b" + response_id.encode()

    def continuing(self, response_id: str) -> bytes:
        return self.base + b"p" + response_id.encode()

    # -- conversations and Idempotency-Keys (text) ----------------------------------------

    def conversation(self, conversation_id: str) -> list[str]:
        """The conversation's hash, its items' list and its lease."""
        head = f"{self.text}conv:{conversation_id}"
        return [head, head + ":items", f"{self.text}lock:{conversation_id}"]

    def idempotency(self, record_id: str) -> list[str]:
        """The completed key and the key in flight."""
        return [f"{self.text}idem:{record_id}", f"{self.text}idemrun:{record_id}"]


class ScopeKeys:
    """The key names of scopes under one prefix, built once per scope (a turn needs them
    several times)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._built: dict[str, Keys] = {}

    def __call__(self, scope: str) -> Keys:
        keys = self._built.get(scope)
        if keys is None:
            if len(self._built) >= _SCOPES:
                self._built.clear()
            keys = self._built[scope] = Keys(self.prefix, scope)
        return keys


def scope_tag(scope: str) -> bytes:
    """A scope in key names: its length, then its bytes: a hex hash's raw bytes, or the
    text of any other scope (`anonymous`), its length's high bit set so that no hash's
    bytes can spell it."""
    try:
        raw = bytes.fromhex(scope)
        if raw.hex() == scope:
            return bytes((len(raw),)) + raw
    except ValueError:
        pass
    raw = scope.encode()
    return bytes((0x80 | len(raw),)) + raw


def item_field(item_id: str) -> bytes:
    """An item id's field in the index: 8 bytes of its BLAKE2b (the id itself is in the
    segment, which the lookup checks; two ids alike in 64 bits cost a lookup, no leak:
    the index is the scope's own)."""
    return hashlib.blake2b(item_id.encode(), digest_size=8).digest()


def bucket_end(expires_ms: int, ttl_ms: int) -> int:
    """The end of the index bucket for a record expiring at `expires_ms`: buckets span an
    eighth of the TTL, so an entry outlives its record by no more, and a scope has
    nine or so."""
    span = max(1, ttl_ms // 8)
    return -(-expires_ms // span) * span


def budget_keys(prefix: str) -> tuple[bytes, bytes, bytes]:
    """The byte budget's keys: chains by expiry, bytes per chain, the total."""
    base = prefix.encode() + LAYOUT + b"\0"
    return base + b"chains", base + b"bytes", base + b"total"


def kept_keys(prefix: str) -> list[bytes]:
    """What is kept (by expiry), each one's bytes, their total, the budget's total."""
    base = prefix.encode() + LAYOUT + b"\0"
    return [base + b"kept", base + b"keptbytes", base + b"kepttotal", base + b"total"]


def compaction_key_name(prefix: str) -> str:
    """Where the replicas' compaction key fingerprint is kept: a setting, never expired."""
    return prefix + "compaction-key"


def background_log(job: bytes) -> bytes:
    """The event log of the background response whose key is `job`."""
    return job + b"\0"


def background_keys(prefix: str) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """Background bookkeeping: the running ones by lease end, the ended logs by end, the
    logs' bytes, their total; and the channel."""
    base = prefix.encode() + LAYOUT + b"\0"
    return (
        base + b"bgrunning",
        base + b"bglogs",
        base + b"bglogsizes",
        base + b"bglogtotal",
        base + b"bg",
    )
