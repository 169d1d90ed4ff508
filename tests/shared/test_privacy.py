"""store:false content never reaches the shared store (CONTRACT.md C5): after store:false
turns through three replicas (JSON and SSE, on their own, off a stored parent, on a stored
conversation, and with an Idempotency-Key), every
key's value (read by type, zstd frames expanded) and every byte of the server's AOF are
scanned for the marker; the stored turns' marker is found there, so the scan can see.
Keys carry the prefix and a scope hash, never the credential."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid

import aiohttp
import redis.asyncio as redis
import zstandard

from ocxproxy.store.shared import dictionary as shared_dictionary
from ocxproxy.store.shared.keys import LAYOUT
from tests.serve import respond
from tests.shared.conftest import MakeKvServer, MakeReplicas
from tests.shared.test_replicas import KEY_A, KEY_B, auth, turn


def expanded(blob: bytes) -> bytes:
    """`blob` followed by the content of every value found anywhere in it: values are
    zstd frames with the layout's dictionary and without the magic number, after the
    encoding byte `d`, and the AOF holds them inside RESP commands. A frame is tried
    after every `d`; most are not one."""
    out = [blob]
    dictionary = zstandard.ZstdCompressionDict(shared_dictionary.DICTIONARY)
    decompressor = zstandard.ZstdDecompressor(dictionary, format=zstandard.FORMAT_ZSTD1_MAGICLESS)
    view = memoryview(blob)
    at = blob.find(b"d")
    while at >= 0:
        with contextlib.suppress(zstandard.ZstdError):  # not a frame after all
            out.append(decompressor.decompressobj().decompress(view[at + 1 :]))
        at = blob.find(b"d", at + 1)
    return b"".join(out)


def scope_of(key: bytes) -> bytes:
    """The scope part of a key name (layout.py: prefix, layout tag, the scope's
    length with the high bit set for text, the scope)."""
    at = len(b"ocx:") + len(LAYOUT)
    return key[at : at + 1 + (key[at] & 0x7F)]


async def value_bytes(client: redis.Redis, key: bytes) -> bytes:
    kind = (await client.type(key)).decode()
    if kind == "string":
        return bytes(await client.get(key) or b"")
    if kind == "list":
        return b"\0".join(await client.lrange(key, 0, -1))
    if kind == "hash":
        pairs = await client.hgetall(key)
        return b"\0".join(k + b"\0" + v for k, v in pairs.items())
    if kind == "set":
        return b"\0".join(await client.smembers(key))
    if kind == "zset":
        return b"\0".join(m for m, _ in await client.zrange(key, 0, -1, withscores=True))
    if kind == "stream":
        entries = await client.xrange(key)
        return b"\0".join(k + b"\0" + v for _, f in entries for k, v in f.items())
    raise AssertionError(f"{key!r}: a value of type {kind} the scan cannot read")


async def test_store_false_never_reaches_the_shared_store(
    make_kv_server: MakeKvServer, make_replicas: MakeReplicas, http: aiohttp.ClientSession
) -> None:
    # no RDB preamble in the AOF: its strings could be LZF-compressed past the scan
    server = await make_kv_server("valkey", extra={"aof-use-rdb-preamble": "no"})
    replicas = await make_replicas(server.url)
    secret, public = f"SECRET-{uuid.uuid4().hex}", f"PUBLIC-{uuid.uuid4().hex}"
    kept, _ = await turn(http, replicas[0], f"{public} one")
    conversation = {"items": [{"role": "user", "content": f"{public} conv"}]}
    async with http.post(
        replicas[1].url + "/v1/conversations", json=conversation, headers=auth()
    ) as r:
        conv = (await r.json())["id"]
    digests: list[bytes] = []
    for i, serve in enumerate(replicas.slots):
        for stream in (False, True):
            alone = {"model": "m", "input": f"{secret} {i}", "store": False, "stream": stream}
            off_parent = {**alone, "previous_response_id": kept}
            in_conversation = {**alone, "conversation": conv}  # read, never appended
            keyed = {**auth(), "Idempotency-Key": f"{secret}-{i}-{stream}"}
            # its fingerprint (aiohttp sends json.dumps) must not leave the process either
            digests.append(hashlib.sha256(json.dumps(alone).encode()).hexdigest().encode())
            for body, headers in (
                (alone, auth()), (off_parent, auth()), (in_conversation, auth()), (alone, keyed)
            ):  # fmt: skip
                status, error, response = await respond(http, serve.url, body, headers)
                assert status == 200 and error is None and response, error
                assert secret in str(response)  # the backend did answer with it
    kept, _ = await turn(http, replicas[1], f"{public} two", kept)
    await turn(http, replicas[2], f"{public} three", key=KEY_B)
    await turn(http, replicas[0], f"{public} four", conversation=conv)
    async with http.get(f"{replicas[2].url}/v1/conversations/{conv}/items", headers=auth()) as r:
        items = str(await r.json())
    assert f"{public} four" in items and secret not in items

    values = []
    prefixes = set()
    async with redis.Redis.from_url(server.url) as client:
        keys = [key async for key in client.scan_iter(count=1000)]
        assert keys
        for key in keys:
            assert key.startswith(b"ocx:"), key
            prefixes.add(scope_of(key))
            assert KEY_A.encode() not in key and KEY_B.encode() not in key
            values.append(key + b"\0" + await value_bytes(client, key))
    everything = expanded(b"\n".join(values))
    assert public.encode() in everything  # the scan does see stored content
    assert secret.encode() not in everything
    assert not any(digest in everything for digest in digests)
    assert KEY_A.encode() not in everything and KEY_B.encode() not in everything
    assert len(prefixes) >= 2  # two credentials, two scope hashes

    aof = expanded(server.aof_bytes())
    assert public.encode() in aof
    assert secret.encode() not in aof
    assert not any(digest in aof for digest in digests)
    assert KEY_A.encode() not in aof and KEY_B.encode() not in aof
