"""Affinity keys (CONTRACT.md C6): which requests belong together, so the Fleet sends them to one
backend and that backend's prompt cache keeps serving them. Pure.

A key is a string whose prefix says where it came from:

- `pck:` + the client's `prompt_cache_key`: the client grouped its requests itself.
- `root:` + the id of a chain's first response: every turn of a chain of
  `previous_response_id`s carries the key its first turn was recorded with (a record keeps
  it), so a chain stays together even when it was first routed by how it opens.
- `head:` + a digest of how a conversation opens (model, instructions, first input item;
  never the whole history): full-history requests of one conversation share it.

The Fleet only compares keys; what they mean is said here and nowhere else.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from ocxproxy.continuation.expand import Request
from ocxproxy.model import Record

PCK_KEY, ROOT_KEY, HEAD_KEY = "pck:", "root:", "head:"


def affinity_of(request: Request, parent: Record | None) -> str:
    """The key a request's backend is chosen by: the client's prompt_cache_key, else its
    chain's (recorded with the parent), else the digest of how the conversation opens."""
    key = request.body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return PCK_KEY + key
    if parent is not None and parent.affinity_key:
        return parent.affinity_key
    body = request.body
    opening = (body.get("model"), body.get("instructions"), request.items[:1])
    digest = hashlib.blake2b(orjson.dumps(opening, option=orjson.OPT_SORT_KEYS), digest_size=16)
    return HEAD_KEY + digest.hexdigest()


def chain_key(key: str | None, parent: Record | None, response: Any) -> str | None:
    """The key a turn routed by `key` is remembered with. A chain's first turn, routed by
    how it opens (or by nothing), hands its chain its own id instead: chains that open
    alike stay apart."""
    response_id = response.get("id") if isinstance(response, dict) else None
    opened = key is None or key.startswith(HEAD_KEY)
    if parent is None and opened and isinstance(response_id, str):
        return ROOT_KEY + response_id
    return key
