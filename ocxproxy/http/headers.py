"""Which headers cross the proxy, in each direction."""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from ocxproxy.config import Config

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Trailers", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


def upstream_headers(
    client: Mapping[str, str], config: Config, *, identity: bool
) -> CIMultiDict[str]:
    """Client headers for the backend. `identity` asks for an uncompressed answer, for the
    routes whose bodies the proxy reads."""
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in client.items() if k.lower() not in _HOP_BY_HOP
    )
    if identity:
        headers["Accept-Encoding"] = "identity"
    if config.upstream_api_key:
        headers["Authorization"] = f"Bearer {config.upstream_api_key}"
    return headers


def client_headers(backend: CIMultiDictProxy[str], *, body_rewritten: bool) -> CIMultiDict[str]:
    """Backend headers for the client; Content-Length is recomputed by aiohttp."""
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in backend.items() if k.lower() not in _HOP_BY_HOP
    )
    if body_rewritten:
        headers.pop("Content-Encoding", None)
    return headers
