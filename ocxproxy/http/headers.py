"""Which headers cross the proxy, in each direction."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, MutableMapping

from multidict import CIMultiDict, CIMultiDictProxy

from ocxproxy.config import Config

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Trailers", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip
# A request body always goes on decoded (http/body.py), so its Content-Encoding does not.
_NOT_FORWARDED = _HOP_BY_HOP | {"content-encoding"}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def request_id(headers: Mapping[str, str]) -> str:
    """A request's id: the client's X-Request-Id when it is a plain token (letters, digits,
    `._:-`, at most 64), else 16 new random hex digits. The answer carries it, the backend
    request carries it and the access log line names it, so the three can be matched."""
    given = headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.fullmatch(given) else new_request_id()


def new_request_id() -> str:
    """16 random hex digits: unique enough to tell requests apart, not a secret (a tenth of
    os.urandom's cost, which is a system call)."""
    return f"{random.getrandbits(64):016x}"


def answer_request_id(headers: MutableMapping[str, str], request_id: str) -> None:
    """Set the answer's X-Request-Id to the request's; a backend's own, other id stays
    visible as X-Upstream-Request-Id."""
    theirs = headers.get("X-Request-Id")
    if theirs is not None and theirs != request_id:
        headers["X-Upstream-Request-Id"] = theirs
    headers["X-Request-Id"] = request_id


def _hop_by_hop(headers: Mapping[str, str], fixed: frozenset[str] = _HOP_BY_HOP) -> frozenset[str]:
    """The `fixed` fields and those the message's Connection names (RFC 9110 §7.6.1),
    lower-case."""
    getall = getattr(headers, "getall", None)  # a multidict: every Connection field
    named = ",".join(getall("Connection", ())) if getall else headers.get("Connection", "")
    if not named:
        return fixed
    return fixed | {token.strip().lower() for token in named.split(",")}


def upstream_headers(
    client: Mapping[str, str], config: Config, *, identity: bool, request_id: str
) -> CIMultiDict[str]:
    """Client headers for the backend, with the request's id. `identity` asks for an
    uncompressed answer, for the routes whose bodies the proxy reads."""
    drop = _hop_by_hop(client, _NOT_FORWARDED)
    headers: CIMultiDict[str] = CIMultiDict(
        # A list: multidict tries a generator as a mapping first, raising and clearing two
        # AttributeErrors (a build from one costs ~9,000 instructions more).
        [(k, v) for k, v in client.items() if k.lower() not in drop]
    )
    headers["X-Request-Id"] = request_id
    if identity:
        headers["Accept-Encoding"] = "identity"
    if config.upstream_api_key:
        headers["Authorization"] = f"Bearer {config.upstream_api_key}"
    return headers


def client_headers(backend: CIMultiDictProxy[str], *, body_rewritten: bool) -> CIMultiDict[str]:
    """Backend headers for the client; Content-Length is recomputed by aiohttp."""
    drop = _hop_by_hop(backend)
    headers: CIMultiDict[str] = CIMultiDict(
        [(k, v) for k, v in backend.items() if k.lower() not in drop]  # (a list: as above)
    )
    if body_rewritten:
        headers.pop("Content-Encoding", None)
    return headers
