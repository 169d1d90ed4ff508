"""A real Prometheus (Debian's package) scrapes a proxy under traffic, with deploy/'s alert
rules loaded; then every dashboard query and every alert expression is evaluated through
its HTTP API. Each must parse, and return series wherever the traffic produced them."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import MakeProxy, ProxyHandle
from tests.deploy.queries import ALERTS, alert_rules, require, selectors, targets, variables
from tests.fakes.backend import FakeBackend
from tests.http.helpers import closed_port

# Dashboard queries that may come back empty after this traffic, and why.
MAY_BE_EMPTY = {
    # Failure reasons of checkpoints and journal commits are exported only once one
    # happens; none does here.
    'sum by (reason) (rate(ocxproxy_snapshot_failures_total{instance=~"$instance"}'
    "[$__rate_interval]))",
    'sum by (reason) (rate(ocxproxy_store_write_failures_total{instance=~"$instance"}'
    "[$__rate_interval]))",
    # The shared store's panels: this proxy runs the single-node store (tests/shared
    # checks those metrics on proxies with --shared-store).
    "histogram_quantile(0.99, sum by (op, le) (rate(ocxproxy_shared_store_seconds_bucket"
    '{instance=~"$instance"}[$__rate_interval])))',
    'sum by (outcome) (rate(ocxproxy_shared_commits_total{instance=~"$instance"}'
    "[$__rate_interval]))",
    'ocxproxy_shared_store_available{instance=~"$instance"}',
    'sum by (instance, outcome) (rate(ocxproxy_shared_commits_total{instance=~"$instance", '
    'outcome!="ok"}[$__rate_interval]))',
    'sum(rate(ocxproxy_shared_segment_cache_total{result="hit",instance=~"$instance"}'
    "[$__rate_interval])) / sum(rate(ocxproxy_shared_segment_cache_total"
    '{instance=~"$instance"}[$__rate_interval]))',
    'max(ocxproxy_store_bytes{tier="shared",instance=~"$instance"}) / '
    'max(ocxproxy_store_capacity_bytes{tier="shared",instance=~"$instance"})',
    # Token counts: this proxy's backend tells no context window, so nothing is counted
    # (tests/http/test_context_window.py checks them against backends that tell one).
    'sum(rate(ocxproxy_token_counts_total{instance=~"$instance", backend=~"$backend"}'
    '[$__rate_interval])) / sum(rate(ocxproxy_requests_total{instance=~"$instance", '
    'route=~"/v1/responses|websocket /v1/responses"}[$__rate_interval]))',
}
# Selectors inside the queries (or their metric, for any selector of it) that may match
# nothing, and why.
SELECTORS_MAY_BE_EMPTY = {
    "ocxproxy_snapshot_failures_total",  # as above
    "ocxproxy_store_write_failures_total",  # as above
    # Nothing is evicted from the disk tier: this traffic stays far under --max-disk-bytes.
    'ocxproxy_store_evictions_total{reason="disk_bytes"}',
    # The shared store's (see MAY_BE_EMPTY).
    "ocxproxy_shared_store_seconds_bucket",
    "ocxproxy_shared_commits_total",
    "ocxproxy_shared_segment_cache_total",
    "ocxproxy_shared_store_available",  # no series without a shared store
    'ocxproxy_store_bytes{tier="shared",instance=~"$instance"}',
    'ocxproxy_store_capacity_bytes{tier="shared",instance=~"$instance"}',
    "ocxproxy_token_counts_total",  # as above
}
# Alerts the traffic provokes (their expression has series now; `for:` keeps them pending).
FIRES = {
    "OcxproxyBackendDown",  # the second backend does not exist
    "OcxproxyLostHistory",  # a continuation of an evicted response
    "OcxproxyStoreEntriesFull",  # --max-entries 12, exceeded
    "OcxproxyAdmissionRejections",  # --max-concurrency 1 while a request stalls
    "OcxproxyServerErrors",  # the backend answers 500 five times
}
# Alerts whose expression is not asserted either way, and why.
UNDECIDED = {
    # One request slowed by a loaded test machine moves the p99 of ~60 requests past 50 ms.
    "OcxproxyOverheadHigh",
}
# Every other alert must be quiet: healthy parts of this traffic must not trip them.
RESIDENT_BYTES = 4096  # a few turns: older ones spill to disk
MAX_ENTRIES = 12
SCRAPE = "1s"


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    """Start Prometheus lazily (the proxy's port is known only later); its finalizer kills
    it by pid, so none outlives the test."""
    binary = require("prometheus")
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        port = closed_port()
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "ocxproxy",
                    "scrape_interval": SCRAPE,
                    "scrape_timeout": SCRAPE,
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        log = (tmp_path / "prometheus.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    binary,
                    f"--config.file={path}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Api:
    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url

    async def get(self, path: str, **params: str) -> Any:
        async with self.http.get(self.url + path, params=params) as resp:
            body = await resp.json(content_type=None)
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    async def wait_ready(self, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                async with self.http.get(self.url + "/-/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("Prometheus did not become ready")
            await asyncio.sleep(0.2)


async def wait_scrapes(handle: ProxyHandle, count: int, within: float = 30.0) -> None:
    """Wait until Prometheus has scraped the proxy `count` more times (each scrape is a
    GET /metrics the proxy counts)."""

    def scrapes() -> float:
        return handle.metric("ocxproxy_requests_total", route="/metrics", outcome="200")

    target = scrapes() + count
    deadline = time.monotonic() + within
    while scrapes() < target:
        assert time.monotonic() < deadline, "Prometheus is not scraping the proxy"
        await asyncio.sleep(0.1)


async def traffic(
    handle: ProxyHandle, backend: FakeBackend, http: aiohttp.ClientSession, round_: int
) -> None:
    """Chains in JSON and SSE, a store:false turn, compactions, spills (a tiny resident
    budget), a failed lookup, a lost (evicted) one, backend errors, admission rejections,
    WebSocket turns."""
    client = handle.client()
    padding = f"round {round_}: " + "some context that makes the turn big enough " * 30
    first = await client.responses.create(model="m", input=padding)
    prev = first.id
    for turn in range(MAX_ENTRIES + 2):  # more records than --max-entries: the first goes
        response = await client.responses.create(
            model="m", input=f"turn {turn} " + padding, previous_response_id=prev
        )
        prev = response.id
    async with client.responses.stream(model="m", input="streamed", previous_response_id=prev) as s:
        await s.get_final_response()
    await client.responses.create(model="m", input="not kept", store=False)
    compact = [{"role": "user", "content": "long work"}, {"type": "compaction_trigger"}]
    await client.responses.create(model="m", input=compact, store=False)  # type: ignore[arg-type]
    await client.responses.compact(model="m", input="long work")
    for lost in ("resp_never_issued", first.id):  # unknown, then evicted
        async with http.post(
            handle.base_url + "/responses",
            json={"model": "m", "input": "x", "previous_response_id": lost},
        ) as resp:
            assert resp.status == 400, await resp.text()
    for _ in range(5):
        backend.fail_next(500)
        async with http.post(handle.base_url + "/responses", json={"input": "x"}) as resp:
            assert resp.status == 500
        await client.responses.create(model="m", input="fine again")  # never 5xx in a row
    for _ in range(3):
        backend.stall_next(1.0)
        seen = len(backend.responses_seen)
        held = asyncio.ensure_future(client.responses.create(model="m", input="slow"))
        await backend.wait_for(
            lambda seen=seen: len(backend.responses_seen) > seen
        )  # it holds the slot
        async with http.post(handle.base_url + "/responses", json={"input": "x"}) as resp:
            assert resp.status == 429
        await held
    async with http.ws_connect(handle.base_url + "/responses") as ws:
        previous = None
        for word in ("hello", "again"):
            fields: dict[str, Any] = {"type": "response.create", "model": "m", "input": word}
            if previous:
                fields["previous_response_id"] = previous
            await ws.send_json(fields)
            while True:
                event = await ws.receive_json(timeout=5)
                if event["type"] in ("response.completed", "error"):
                    break
            assert event["type"] == "response.completed", event
            previous = event["response"]["id"]
    await client.models.list()


async def test_every_dashboard_query_and_alert_works_on_a_real_prometheus(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    http: aiohttp.ClientSession,
    prometheus: Any,
) -> None:
    handle = await make_proxy(
        backend.url,
        f"http://127.0.0.1:{closed_port()}",  # a backend that is never up
        health_interval=0.2,
        max_resident_bytes=RESIDENT_BYTES,
        max_entries=MAX_ENTRIES,
        max_concurrency=1,
        admission_timeout=0.05,
    )
    instance = handle.url.removeprefix("http://")
    api = Api(http, prometheus(instance))
    await api.wait_ready()
    await wait_scrapes(handle, 2)
    await traffic(handle, backend, http, 1)
    await wait_scrapes(handle, 2)
    await traffic(handle, backend, http, 2)  # rates over the last scrapes are not zero
    await wait_scrapes(handle, 3)
    assert handle.metric("ocxproxy_spill_writes_total") > 0  # the store did spill

    # The variables: their label_values() source has the label, with this proxy in it.
    for name, label, want in (
        ("instance", "instance", instance),
        ("backend", "backend", backend.url),
    ):
        query = variables()[name]["query"].replace("$instance", instance)
        source = query.removeprefix("label_values(").rpartition(",")[0]
        values = {series["metric"].get(label) for series in await api.query(source)}
        assert want in values, (name, values)

    empty = []
    for target in targets():
        result = await api.query(target.resolved(instance))  # parses, or the API says why
        if not result:
            empty.append(target.expr)
            continue
        for series in result:
            for label in target.legend_labels:
                assert label in series["metric"], (target.panel, label, series)
    assert set(empty) <= MAY_BE_EMPTY, empty

    rules = alert_rules()
    # (each selector as queried, and as written: with "$instance")
    pairs = {
        pair
        for t in targets()
        for pair in zip(selectors(t.resolved(instance)), selectors(t.expr), strict=True)
    }
    pairs |= {(s, s) for r in rules.values() for s in selectors(r["expr"])}
    for selector, written in pairs:
        if not {selector, written, selector.partition("{")[0]} & SELECTORS_MAY_BE_EMPTY:
            assert await api.query(selector), f"{selector} matches no series"

    firing = set()
    for name, rule in rules.items():
        if await api.query(rule["expr"]):
            firing.add(name)
    assert firing - UNDECIDED == FIRES

    # Prometheus itself loaded and evaluated every rule, and agrees on what is active.
    await wait_scrapes(handle, 2)
    loaded = await api.get("/api/v1/rules")
    health = {r["name"]: r["health"] for g in loaded["groups"] for r in g["rules"]}
    assert health == dict.fromkeys(rules, "ok")
    active = {a["labels"]["alertname"] for a in (await api.get("/api/v1/alerts"))["alerts"]}
    assert active - UNDECIDED == FIRES
