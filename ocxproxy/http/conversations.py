"""The `/v1/conversations` routes (OpenAI's Conversations API) on aiohttp.

Every write (metadata, items, delete) takes the conversation's lock, as a create turn on
it does, so no write can interleave with a turn: a second writer gets 400
`conversation_locked` (the store keeps the state: `Store.conversations`).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import orjson
from aiohttp import web

from ocxproxy.continuation.conversation import (
    check_items,
    check_metadata,
    conversation_object,
    deleted_object,
)
from ocxproxy.continuation.listing import (
    ListQuery,
    includes_of,
    item_view,
    page,
    parse_list_query,
)
from ocxproxy.errors import InvalidRequest, NotFound
from ocxproxy.http.body import read_body
from ocxproxy.http.context import Proxy, proxy_of, scope_of
from ocxproxy.store import Conversation


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def _body(request: web.Request, proxy: Proxy) -> dict[str, Any]:
    raw = await read_body(request, proxy.config.max_body_bytes)
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


async def _load(request: web.Request) -> tuple[Proxy, str, Conversation]:
    proxy = proxy_of(request)
    scope = scope_of(request.headers)
    conversation = await proxy.store.conversations.load(
        scope, request.match_info["conversation_id"]
    )
    return proxy, scope, conversation


def _view(conversation: Conversation) -> dict[str, Any]:
    return conversation_object(conversation.id, conversation.meta)


async def create_conversation(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    body = await _body(request, proxy)
    items = check_items(body.get("items"), required=False)
    metadata = check_metadata(body.get("metadata"))
    conversation = await proxy.store.conversations.create(
        scope_of(request.headers), items, metadata
    )
    return _json(_view(conversation))


async def get_conversation(request: web.Request) -> web.StreamResponse:
    _, _, conversation = await _load(request)
    return _json(_view(conversation))


async def update_conversation(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    body = await _body(request, proxy)
    if "metadata" not in body:
        raise InvalidRequest("Missing required parameter: 'metadata'.", param="metadata")
    metadata = check_metadata(body["metadata"])
    async with _locked(request):
        _, _, conversation = await _load(request)
        conversation = await proxy.store.conversations.set_metadata(conversation, metadata)
    return _json(_view(conversation))


async def delete_conversation(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    async with _locked(request):
        _, _, conversation = await _load(request)
        await proxy.store.conversations.delete(conversation)
    if proxy.kv_saves is not None:  # its turns' KV save goes too
        proxy.kv_saves.forget(conversation.id)
    return _json(deleted_object(conversation.id))


async def create_items(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    include = includes_of(request.query)
    body = await _body(request, proxy)
    items = check_items(body.get("items"), required=True)
    if not items:
        raise InvalidRequest("Invalid 'items': expected at least one item.", param="items")
    async with _locked(request):
        _, _, conversation = await _load(request)
        conversation = await proxy.store.conversations.add_items(conversation, items)
    ids = conversation.meta.ids[-1]
    data = [item_view(item, item_id, include) for item_id, item in zip(ids, items, strict=True)]
    query = ListQuery(None, len(data), "asc", include)
    return _json(page(data, query))


async def list_items(request: web.Request) -> web.StreamResponse:
    query = parse_list_query(request.query, includes_of(request.query))
    proxy, _, conversation = await _load(request)
    pairs = await proxy.store.conversations.items(conversation)
    views = [item_view(item, item_id, query.include) for item_id, item in pairs]
    return _json(page(views, query))


async def get_item(request: web.Request) -> web.StreamResponse:
    include = includes_of(request.query)
    proxy, _, conversation = await _load(request)
    item_id = request.match_info["item_id"]
    if conversation.meta.find(item_id) is None:
        raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
    for found_id, item in await proxy.store.conversations.items(conversation):
        if found_id == item_id:
            return _json(item_view(item, item_id, include))
    raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")


async def delete_item(request: web.Request) -> web.StreamResponse:
    proxy = proxy_of(request)
    async with _locked(request):
        _, _, conversation = await _load(request)
        conversation = await proxy.store.conversations.delete_item(
            conversation, request.match_info["item_id"]
        )
    proxy.cache_book.edited(conversation.id)  # its next turn's cache miss is no eviction
    return _json(_view(conversation))


def _locked(request: web.Request) -> AbstractAsyncContextManager[None]:
    """The conversation's lock around an items or metadata write (400 while taken)."""
    proxy = proxy_of(request)
    return proxy.store.conversations.locked(
        scope_of(request.headers), request.match_info["conversation_id"], proxy.lease_duration
    )


_BASE = "/conversations"
# Without their /v1 prefix: server.py serves them with and without it.
ROUTES = [
    web.post(_BASE, create_conversation),
    web.get(_BASE + "/{conversation_id}", get_conversation),
    web.post(_BASE + "/{conversation_id}", update_conversation),
    web.delete(_BASE + "/{conversation_id}", delete_conversation),
    web.post(_BASE + "/{conversation_id}/items", create_items),
    web.get(_BASE + "/{conversation_id}/items", list_items),
    web.get(_BASE + "/{conversation_id}/items/{item_id}", get_item),
    web.delete(_BASE + "/{conversation_id}/items/{item_id}", delete_item),
]
