"""http/health.py: liveness, readiness and Prometheus metrics (CONTRACT.md C2, C7)."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend
from tests.http.helpers import closed_port


async def scrape(http: aiohttp.ClientSession, proxy: ProxyHandle) -> dict[tuple[str, str], float]:
    """Every sample as {(name, sorted labels): value}."""
    async with http.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[(sample.name, labels)] = sample.value
    return samples


def total(samples: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    want = {f"{k}={v}" for k, v in labels.items()}
    return sum(
        value
        for (sample, label_text), value in samples.items()
        if sample == name and want <= set(label_text.split(","))
    )


async def test_healthz(proxy: ProxyHandle, http: aiohttp.ClientSession) -> None:
    async with http.get(proxy.url + "/healthz") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}


async def test_readyz_with_a_healthy_backend(
    backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(backend.url, health_interval=0.05)
    async with http.get(proxy.url + "/readyz") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["status"] == "ready"
    assert body["backends"] == {backend.url: "up"}


async def test_readyz_is_503_when_the_only_backend_is_down(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    proxy = await make_proxy(url, health_interval=0.05)
    async with asyncio.timeout(5):
        while True:  # the first probe runs as the proxy starts
            async with http.get(proxy.url + "/readyz") as resp:
                if resp.status == 503:
                    body = await resp.json()
                    break
            await asyncio.sleep(0.02)
    assert body["status"] == "not ready"
    assert body["backends"] == {url: "down"}
    async with http.get(proxy.url + "/healthz") as resp:
        assert resp.status == 200  # alive, just not ready


async def test_readyz_notices_a_failed_request_without_probes(
    make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(f"http://127.0.0.1:{closed_port()}")
    async with http.post(proxy.url + "/v1/responses", json={"input": "x"}) as resp:
        assert resp.status == 502
    async with http.get(proxy.url + "/readyz") as resp:
        assert resp.status == 503


async def test_metrics_move_after_requests(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    for declared in (
        "# TYPE ocxproxy_requests_total counter",
        "# TYPE ocxproxy_expansions_total counter",
        "# TYPE ocxproxy_proxy_overhead_seconds histogram",
        "# TYPE ocxproxy_backend_cached_tokens_total counter",
        "# TYPE ocxproxy_backend_cached_ratio histogram",
        "# TYPE ocxproxy_upstream_ttfb_seconds histogram",
    ):
        assert declared in text
    for at_zero in (  # exported before anything happened, so increase() sees the first one
        'ocxproxy_admission_rejected_total{limit="total"} 0.0',
        'ocxproxy_admission_rejected_total{limit="backend"} 0.0',
        'ocxproxy_expansions_total{outcome="evicted"} 0.0',
        'ocxproxy_spill_failures_total{reason="write_failed"} 0.0',
    ):
        assert at_zero in text

    client = proxy.client()
    r1 = await client.responses.create(model="m", input="a fairly long first message " * 8)
    r2 = await client.responses.create(model="m", input="second", previous_response_id=r1.id)
    async with client.responses.stream(model="m", input="s", previous_response_id=r2.id) as s:
        await s.get_final_response()
    for _ in range(2):
        async with http.post(
            proxy.url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_gone"}
        ) as resp:
            assert resp.status == 400
    await client.models.list()

    after = await scrape(http, proxy)
    route = "/v1/responses"
    assert total(after, "ocxproxy_requests_total", route=route, outcome="200") == 3
    assert total(after, "ocxproxy_requests_total", route=route, outcome="400") == 2
    assert total(after, "ocxproxy_requests_total", outcome="200") >= 4  # + /v1/models
    assert total(after, "ocxproxy_expansions_total", outcome="hit") == 2
    assert total(after, "ocxproxy_expansions_total", outcome="unknown") == 2
    overhead = total(after, "ocxproxy_proxy_overhead_seconds_count", route=route)
    assert overhead == 5
    assert total(after, "ocxproxy_proxy_overhead_seconds_sum", route=route) > 0
    assert total(after, "ocxproxy_proxy_overhead_seconds_count", route="/metrics") == 0
    cached = total(after, "ocxproxy_backend_cached_tokens_total", backend=backend.url)
    assert cached > 0  # turns 2 and 3 re-sent turn 1's prefix
    inputs = total(after, "ocxproxy_backend_input_tokens_total", backend=backend.url)
    assert inputs > cached
    assert total(after, "ocxproxy_backend_cached_ratio_count", backend=backend.url) == 3
    # Turns 2 and 3 continued a chain; turn 1 (nothing cached) did not.
    cont_inputs = total(after, "ocxproxy_continuation_input_tokens_total", backend=backend.url)
    assert 0 < cont_inputs < inputs
    assert total(after, "ocxproxy_continuation_cached_tokens_total", backend=backend.url) == cached
    assert total(after, "ocxproxy_store_capacity_entries", tier="records") == 100_000
    assert total(after, "ocxproxy_store_capacity_bytes", tier="resident") == 32 * 1024**2
    assert total(after, "ocxproxy_store_capacity_bytes", tier="disk") == 1024**3
    assert total(after, "ocxproxy_turns_recorded_total") == 3
    assert total(after, "ocxproxy_upstream_requests_total", backend=backend.url) == 4
    assert total(after, "ocxproxy_upstream_ttfb_seconds_count", backend=backend.url) == 4
    assert total(after, "ocxproxy_upstream_latency_seconds_count", backend=backend.url) == 4


async def test_metrics_count_repaired_streams(
    llama_backend: FakeBackend, make_proxy: MakeProxy, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(llama_backend.url)
    async with proxy.client().responses.stream(model="m", input="x") as stream:
        await stream.get_final_response()
    assert total(await scrape(http, proxy), "ocxproxy_stream_repairs_total") == 1


async def test_metrics_count_turns_not_remembered(
    proxy: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    client = proxy.client()
    await client.responses.create(model="m", input="x", store=False)
    backend.status_next("failed")
    await client.responses.create(model="m", input="y")
    after = await scrape(http, proxy)
    assert total(after, "ocxproxy_turns_not_recorded_total", reason="store_false") == 1
    assert total(after, "ocxproxy_turns_not_recorded_total", reason="failed") == 1


async def test_without_a_shared_store_there_is_no_shared_availability_series(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    """A node on the single-node store must not look like one whose shared store is down."""
    samples = await scrape(http, proxy)
    assert ("ocxproxy_store_available", "") in samples
    assert not [name for name, _ in samples if name.startswith("ocxproxy_shared_store_avail")]
