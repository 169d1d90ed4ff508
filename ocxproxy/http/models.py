"""`GET /v1/models`: the backend's list, under the names clients are told to use.

Without served names (`--served-model-name`, or the embedded backend's short name) the
request is passed through as it is. With them, the backend's answer is forwarded with
one model per served name, each a copy of the backend's first model under that name, and
every other mention of the backend's own names (llama.cpp lists its GGUF's path in
several places) replaced by the first served name: no path reaches a client.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ocxproxy.http.context import proxy_of
from ocxproxy.http.passthrough import passthrough


async def list_models(request: web.Request) -> web.StreamResponse:
    served = proxy_of(request).served_models
    answer = await passthrough(request, capture=bool(served))
    if not served or not isinstance(answer, web.Response) or answer.status != 200:
        return answer
    body = answer.body
    try:
        listing = orjson.loads(body if isinstance(body, bytes) else b"")
    except orjson.JSONDecodeError:
        return answer
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return answer
    return web.json_response(renamed(listing, served), dumps=lambda obj: orjson.dumps(obj).decode())


def renamed(listing: dict[str, Any], served: tuple[str, ...]) -> dict[str, Any]:
    """The backend's model list with its models named as `served` says."""
    models = [m for m in listing["data"] if isinstance(m, dict)]
    own = {m["id"] for m in models if isinstance(m.get("id"), str)}
    first = _replaced(models[0], own, served[0]) if models else {"object": "model"}
    first.pop("aliases", None)
    data = [{**first, "id": name} for name in served]
    rest = {k: _replaced(v, own, served[0]) for k, v in listing.items() if k != "data"}
    return {**rest, "object": "list", "data": data}


def _replaced(value: Any, names: set[str], name: str) -> Any:
    """`value` with every string in `names` replaced by `name`, at any depth."""
    if isinstance(value, str):
        return name if value in names else value
    if isinstance(value, list):
        return [_replaced(v, names, name) for v in value]
    if isinstance(value, dict):
        return {k: _replaced(v, names, name) for k, v in value.items()}
    return value
