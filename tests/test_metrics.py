"""ocxproxy's own metric types, read back through prometheus_client's exposition."""

from __future__ import annotations

import os
import platform

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ocxproxy import __version__
from ocxproxy.metrics import Metrics
from ocxproxy.speedups import SPEEDUPS
from tests.conftest import ProxyHandle


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered text, parsed by prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_counters_by_position_and_by_name_are_one_child() -> None:
    m = Metrics()
    m.requests.labels("/v1/responses", "200").inc()
    m.requests.labels(route="/v1/responses", outcome="200").inc(2)
    m.requests.labels(outcome="200", route="/v1/responses").inc()
    m.requests.labels("/metrics", "200").inc()
    got = samples(m)
    assert got["ocxproxy_requests_total", (("outcome", "200"), ("route", "/v1/responses"))] == 4
    assert got["ocxproxy_requests_total", (("outcome", "200"), ("route", "/metrics"))] == 1


def test_an_unlabelled_counter_is_exported_at_zero_and_counts() -> None:
    m = Metrics()
    assert samples(m)["ocxproxy_spill_writes_total", ()] == 0
    m.spill_writes.inc()
    m.spill_writes.inc(2)
    assert samples(m)["ocxproxy_spill_writes_total", ()] == 3
    assert m.spill_writes.get() == 3


def test_histogram_buckets_are_cumulative_and_le_is_inclusive() -> None:
    m = Metrics()
    child = m.proxy_overhead.labels(route="/v1/responses")
    for value in (0.0001, 0.0001, 0.0003, 0.002, 5.0):  # 0.0001 is a bucket bound
        child.observe(value)
    got = samples(m)
    label = ("route", "/v1/responses")

    def bucket(le: str) -> float:
        return got["ocxproxy_proxy_overhead_seconds_bucket", tuple(sorted((label, ("le", le))))]

    assert bucket("5e-05") == 0
    assert bucket("0.0001") == 2
    assert bucket("0.00025") == 2
    assert bucket("0.0005") == 3
    assert bucket("0.0025") == 4
    assert bucket("1.0") == 4
    assert bucket("+Inf") == 5
    assert got["ocxproxy_proxy_overhead_seconds_count", (label,)] == 5
    assert got["ocxproxy_proxy_overhead_seconds_sum", (label,)] == pytest.approx(5.0025)


def test_a_gauge_set_function_is_read_at_scrape_time() -> None:
    m = Metrics()
    size = [3]
    m.store_entries.labels(tier="records").set_function(lambda: size[0])
    m.backend_up.labels(backend="http://b").set(1)
    m.backend_up.labels(backend="http://b").dec()
    assert samples(m)["ocxproxy_store_entries", (("tier", "records"),)] == 3
    size[0] = 7
    got = samples(m)
    assert got["ocxproxy_store_entries", (("tier", "records"),)] == 7
    assert got["ocxproxy_backend_up", (("backend", "http://b"),)] == 0


def test_wrong_labels_are_refused() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="takes labels"):
        m.requests.labels("/v1/responses")  # one of two
    with pytest.raises(KeyError):
        m.requests.labels(route="/v1/responses", result="200")  # a name it does not have
    with pytest.raises(ValueError, match="takes labels"):
        m.store_evictions.labels(reason="expired", extra="x")


def test_failure_labels_are_exported_at_zero_before_the_first_failure() -> None:
    """A counter series born at 1 has no increase() for Prometheus: the alerts on the
    first spill failure or lost history need these series to exist at 0 beforehand."""
    got = samples(Metrics())
    for outcome in ("hit", "unknown", "expired", "evicted", "missing", "corrupt"):
        assert got["ocxproxy_expansions_total", (("outcome", outcome),)] == 0
    for outcome in ("resolved", "unknown", "expired", "evicted", "missing"):
        assert got["ocxproxy_item_references_total", (("outcome", outcome),)] == 0
    for reason in ("missing", "corrupt", "write_failed", "read_failed"):
        assert got["ocxproxy_spill_failures_total", (("reason", reason),)] == 0


async def test_metrics_carry_process_and_build_info(
    proxy: ProxyHandle, http: aiohttp.ClientSession
) -> None:
    """A real proxy's /metrics: prometheus_client's process collector (this process: the
    test runs the proxy in it) and ocxproxy_build_info = 1 naming the version, Python and
    whether the compiled fast paths run (CI requires them: compiled there)."""
    async with http.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    found = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    build = {"version": __version__, "python": platform.python_version()}
    build["implementation"] = platform.python_implementation()
    build["speedups"] = "python" if SPEEDUPS is None else "compiled"
    assert found["ocxproxy_build_info", tuple(sorted(build.items()))] == 1
    values = {name: value for (name, labels), value in found.items() if not labels}
    assert values["process_resident_memory_bytes"] > 10 * 1024**2
    assert values["process_cpu_seconds_total"] > 0
    assert 0 < values["process_open_fds"] <= values["process_max_fds"]
    assert abs(values["process_start_time_seconds"] - own_start_time()) < 5


def own_start_time() -> float:
    """This process's start time, from /proc, without the collector's own code."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as stat:
        started = int(stat.read().rsplit(")", 1)[1].split()[19]) / ticks
    with open("/proc/stat") as proc:
        boot = next(int(line.split()[1]) for line in proc if line.startswith("btime"))
    return boot + started
