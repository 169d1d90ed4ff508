"""Every `/v1/responses/{id}…` route is the proxy's own (CONTRACT.md C2, C5): an unknown,
deleted or other credential's id gets the proxy's OpenAI-shaped 404, the same for all
three, and the backend hears nothing of it; with `--forward-unknown-ids` an id the proxy
does not know goes to the backend, whose state it may be."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend

ROUTES = [
    ("GET", ""),
    ("DELETE", ""),
    ("GET", "/input_items"),
    ("POST", "/cancel"),
]


def proxy_404(response_id: str) -> dict[str, object]:
    message = f"Response with id '{response_id}' not found."
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }
    }


async def answer(
    http: aiohttp.ClientSession, url: str, method: str, key: str = "sk-a"
) -> tuple[int, object, str]:
    async with http.request(method, url, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json(content_type=None), r.headers.get("Server", "")


@pytest.mark.parametrize("prefix", ["/v1", ""])
async def test_unknown_deleted_and_foreign_ids_are_the_proxys_404(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession, prefix: str
) -> None:
    client = proxy.client(api_key="sk-a")
    gone = await client.responses.create(model="m", input="to delete")
    await client.responses.delete(gone.id)
    foreign = await proxy.client(api_key="sk-b").responses.create(model="m", input="theirs")
    seen = len(backend.seen)
    for response_id in ("resp_never_made", gone.id, foreign.id):
        for method, tail in ROUTES:
            url = f"{proxy.url}{prefix}/responses/{response_id}{tail}"
            status, body, server = await answer(http, url, method)
            assert (status, body) == (404, proxy_404(response_id)), (method, tail)
            assert "fake" not in server.lower()
    assert len(backend.seen) == seen  # none of it was forwarded
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(foreign.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel(gone.id)


async def test_cancel_of_a_stored_response_is_a_400(
    proxy: ProxyHandle, backend: FakeBackend
) -> None:
    client = proxy.client()
    made = await client.responses.create(model="m", input="done already")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.cancel(made.id)
    assert "background" in refused.value.message
    assert (await client.responses.retrieve(made.id)).status == "completed"
    assert len(backend.seen) == 1


async def test_forward_unknown_ids_sends_unknown_ids_to_the_backend(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, forward_unknown_ids=True)
    made = await proxy.client(api_key="sk-a").responses.create(model="m", input="kept")
    for method, tail in ROUTES:
        backend.seen.clear()
        url = f"{proxy.url}/v1/responses/resp_elsewhere{tail}"
        status, body, _ = await answer(http, url, method)
        assert [(s.method, s.path) for s in backend.seen] == [
            (method, f"/v1/responses/resp_elsewhere{tail}")
        ]
        assert body != proxy_404("resp_elsewhere")  # the backend's answer (its own 404)
    backend.seen.clear()
    status, body, _ = await answer(http, f"{proxy.url}/v1/responses/{made.id}", "GET")
    assert status == 200 and backend.seen == []  # a known id is still the proxy's
