"""The shared store's dashboard panels and alerts on a real Prometheus (as
tests/deploy/test_real_prometheus.py does for the rest): a replica on a real Valkey under
traffic, then the server killed under a turn. Every shared-store query returns series
where the traffic made them, and the shared store's alerts fire (their expressions have
series; `for:` keeps them pending) while the journal's alert stays quiet."""

from __future__ import annotations

from typing import Any

import aiohttp

from ocxproxy.aio import spawn
from tests.conftest import MakeProxy
from tests.deploy.queries import alert_rules, targets
from tests.deploy.test_real_prometheus import Api, prometheus, wait_scrapes  # noqa: F401
from tests.fakes.backend import FakeBackend
from tests.serve import respond
from tests.shared.servers import KvServer

FAILED_COMMITS = (
    'sum by (instance, outcome) (rate(ocxproxy_shared_commits_total{instance=~"$instance", '
    'outcome!="ok"}[$__rate_interval]))'
)


async def test_shared_store_panels_and_alerts_on_a_real_prometheus(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    valkey_server: KvServer,
    http: aiohttp.ClientSession,
    prometheus: Any,  # noqa: F811
) -> None:
    handle = await make_proxy(backend.url, shared_store=valkey_server.url, state_dir=None)
    instance = handle.url.removeprefix("http://")
    api = Api(http, prometheus(instance))
    await api.wait_ready()
    await wait_scrapes(handle, 2)
    client = handle.client()
    for _ in range(2):  # two rounds: rates over the last scrapes are not zero
        prev = None
        for turn in range(4):
            response = await client.responses.create(
                model="m", input=f"turn {turn}", previous_response_id=prev
            )
            prev = response.id
        await wait_scrapes(handle, 2)
    await wait_scrapes(handle, 1)

    shared = [t for t in targets() if "ocxproxy_shared_" in t.expr or 'tier="shared"' in t.expr]
    assert len(shared) >= 5
    for target in shared:
        result = await api.query(target.resolved(instance))
        assert bool(result) == (target.expr != FAILED_COMMITS), (target.expr, result)
    rules = alert_rules()
    names = ("OcxproxySharedStoreUnavailable", "OcxproxySharedCommitFailures")
    for name in (*names, "OcxproxyStoreUnavailable"):
        assert not await api.query(rules[name]["expr"]), name  # healthy: quiet

    backend.stall_next(1.0)  # the server dies while a turn runs: its commit fails
    body = {"model": "m", "input": "doomed", "previous_response_id": prev}
    auth = {"Authorization": "Bearer sk-test-a"}  # the SDK client's key: its scope
    pending = spawn(respond(http, handle.url, body, auth), name="doomed-turn")
    await backend.wait_for(lambda: any(b"doomed" in s.body for s in backend.responses_seen))
    valkey_server.kill9()
    status, error, acknowledged = await pending
    assert status >= 500 and error is not None and acknowledged is None, (status, error)
    await wait_scrapes(handle, 3)

    (failed,) = [t for t in shared if t.expr == FAILED_COMMITS]
    assert await api.query(failed.resolved(instance)), "the failed commit is not on its panel"
    for name in names:
        assert await api.query(rules[name]["expr"]), f"{name} does not fire"
    # The journal's alert is for a single node's disk: a shared replica is not its case.
    assert not await api.query(rules["OcxproxyStoreUnavailable"]["expr"])
    loaded = await api.get("/api/v1/rules")
    health = {r["name"]: r["health"] for g in loaded["groups"] for r in g["rules"]}
    assert health == dict.fromkeys(rules, "ok")
