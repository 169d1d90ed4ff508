"""Every Prometheus metric of the proxy, on one object with its own registry.

Components receive the Metrics object; nothing imports a global. Names follow
`ocxproxy_<thing>_<unit>`.
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

_FAST_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_SLOW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ocxproxy_requests_total",
            "Requests by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.expansions = Counter(
            "ocxproxy_expansions_total",
            "previous_response_id expansions by outcome (hit or failure reason)",
            ["outcome"],
            registry=r,
        )
        self.turns_recorded = Counter(
            "ocxproxy_turns_recorded_total",
            "Turns remembered, by where they live",
            ["kind"],
            registry=r,
        )
        self.turns_not_recorded = Counter(
            "ocxproxy_turns_not_recorded_total",
            "Finished turns not remembered, by reason",
            ["reason"],
            registry=r,
        )
        self.proxy_overhead = Histogram(
            "ocxproxy_proxy_overhead_seconds",
            "Time spent in the proxy per request, excluding time waiting on the backend",
            ["route"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "ocxproxy_upstream_latency_seconds",
            "Backend request duration, to the last byte",
            ["backend"],
            buckets=_SLOW_BUCKETS,
            registry=r,
        )
        self.upstream_ttfb = Histogram(
            "ocxproxy_upstream_ttfb_seconds",
            "Backend time to response headers",
            ["backend"],
            buckets=_SLOW_BUCKETS,
            registry=r,
        )
        self.upstream_requests = Counter(
            "ocxproxy_upstream_requests_total",
            "Backend requests by outcome",
            ["backend", "outcome"],
            registry=r,
        )
        self.upstream_in_flight = Gauge(
            "ocxproxy_upstream_in_flight", "Backend requests in flight", ["backend"], registry=r
        )
        # Fleet (C6)
        self.backend_up = Gauge(
            "ocxproxy_backend_up",
            "1 while a backend is considered healthy, 0 while it is skipped",
            ["backend"],
            registry=r,
        )
        self.affinity = Counter(
            "ocxproxy_affinity_total",
            "Keyed requests by placement: hit (their backend), new (placed by load), "
            "reroute (their backend was down or full)",
            ["result"],
            registry=r,
        )
        self.admission_rejected = Counter(
            "ocxproxy_admission_rejected_total",
            "Requests answered 429 because a concurrency bound was reached, by bound",
            ["limit"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "ocxproxy_backend_cached_tokens_total",
            "Input tokens the backend reported as served from its prefix cache",
            ["backend"],
            registry=r,
        )
        self.input_tokens = Counter(
            "ocxproxy_backend_input_tokens_total",
            "Input tokens the backend reported",
            ["backend"],
            registry=r,
        )
        self.cached_ratio = Histogram(
            "ocxproxy_backend_cached_ratio",
            "Per-turn cached_tokens / input_tokens reported by the backend",
            ["backend"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.stream_repairs = Counter(
            "ocxproxy_stream_repairs_total",
            "SSE streams that lacked spec fields and were repaired",
            registry=r,
        )
        # Store (C4)
        self.store_entries = Gauge(
            "ocxproxy_store_entries",
            "Stored responses and segments by tier",
            ["tier"],
            registry=r,
        )
        self.store_bytes = Gauge(
            "ocxproxy_store_bytes", "Stored bytes by tier", ["tier"], registry=r
        )
        self.store_evictions = Counter(
            "ocxproxy_store_evictions_total",
            "Records or segments evicted, by reason",
            ["reason"],
            registry=r,
        )
        self.spill_writes = Counter(
            "ocxproxy_spill_writes_total", "Spill files written", registry=r
        )
        self.spill_reads = Counter("ocxproxy_spill_reads_total", "Spill files read", registry=r)
        self.spill_failures = Counter(
            "ocxproxy_spill_failures_total",
            "Spill tier failures by reason",
            ["reason"],
            registry=r,
        )
        self.snapshot_writes = Counter(
            "ocxproxy_snapshot_writes_total", "Snapshots written", registry=r
        )
        self.snapshot_failures = Counter(
            "ocxproxy_snapshot_failures_total",
            "Snapshot write or load failures by reason",
            ["reason"],
            registry=r,
        )
        self.snapshot_age = Gauge(
            "ocxproxy_snapshot_age_seconds",
            "Seconds since the last durable snapshot",
            registry=r,
        )
        # WebSocket (C3)
        self.ws_open = Gauge(
            "ocxproxy_websocket_connections", "Open WebSocket connections", registry=r
        )
        self.ws_frames = Counter(
            "ocxproxy_websocket_frames_total",
            "WebSocket frames by direction",
            ["direction"],
            registry=r,
        )
        self.ws_turns = Counter(
            "ocxproxy_websocket_turns_total",
            "WebSocket turns by outcome",
            ["outcome"],
            registry=r,
        )
        self.ws_cache = Counter(
            "ocxproxy_websocket_cache_total",
            "Connection-local cache lookups",
            ["result"],
            registry=r,
        )

        for metric in vars(self).values():
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:
                _cache_children(metric)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _cache_children(metric: MetricWrapperBase) -> None:
    """Memoize `labels()`: it validates, sorts and takes a lock on every call (~10 µs, and
    the hot path labels a dozen metrics a turn). Label values here are few: routes,
    outcomes, backends, reasons."""
    metric.__dict__["labels"] = functools.lru_cache(maxsize=4096)(metric.labels)
