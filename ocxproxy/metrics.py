"""Every Prometheus metric of the proxy, on one object with its own registry.

Components receive the Metrics object; nothing imports a global. Names follow
`ocxproxy_<thing>_<unit>`.

The metric types are our own, not prometheus_client's: a turn updates about twenty of
them, and prometheus_client's `labels()` + `inc()`/`observe()` (validation, locks, one
object per sample) cost ~120 µs a turn, the largest share of the proxy's own CPU. Here a
labelled child is a dict lookup and an update is an attribute add; all updates happen on
the event loop thread. prometheus_client still renders them, through one Collector.
"""

from __future__ import annotations

import bisect
import math
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ocxproxy import __version__
from ocxproxy.errors import FailureReason
from ocxproxy.speedups import SPEEDUPS

_FAST_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_SLOW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
# Why a continuation's prefix was not cached (upstream/misses.py explains each), in the
# order a shortfall is explained: what the proxy itself did to the prefix first (a failed
# or impossible restore, a compaction, a moved drop point), then where the turn went, then
# what happened to the backend, then the prompt's own start.
CACHE_MISS_REASONS = (
    "restore_failed",
    "fingerprint_mismatch",
    "compacted",
    "truncated",
    "rerouted",
    "backend_restarted",
    "diverged",
    "evicted",
)
_SPILL_FAILURES = (
    FailureReason.MISSING,
    FailureReason.CORRUPT,
    FailureReason.WRITE_FAILED,
    FailureReason.READ_FAILED,
)


class Value:
    """One sample of a counter or gauge."""

    __slots__ = ("function", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.function: Callable[[], float] | None = None

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value

    def set_function(self, function: Callable[[], float]) -> None:
        """The gauge reads `function()` at each scrape instead."""
        self.function = function

    def get(self) -> float:
        return self.function() if self.function is not None else self.value


class Buckets:
    """One histogram: a count per bucket (the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # `le` is inclusive
        self.sum += value


C = TypeVar("C", Value, Buckets)


class _Family(Generic[C]):
    """A named metric and its children by label values."""

    _only: C  # the one child of a metric without labels

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], C] = {}
        self._key = _key_of(self.labelnames)
        if not self.labelnames:
            self._only = self.labels()

    def new_child(self) -> C:
        raise NotImplementedError

    def labels(self, *values: str, **named: str) -> C:
        key = values or self._key(named)
        child = self.children.get(key)
        if child is None:
            if len(key) != len(self.labelnames) or len(named) not in (0, len(key)):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
            child = self.children[key] = self.new_child()
        return child

    def collect(self) -> Metric:
        raise NotImplementedError


class Counter(_Family[Value]):
    def new_child(self) -> Value:
        return Value()

    def inc(self, amount: float = 1.0) -> None:
        self._only.value += amount

    def get(self) -> float:
        return self._only.get()

    def collect(self) -> Metric:
        name = self.name.removesuffix("_total")
        family = CounterMetricFamily(name, self.doc, labels=self.labelnames)
        for key, child in self.children.items():
            family.add_metric(key, child.get())
        return family


class Gauge(Counter):
    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str] = (), *, until_set: bool = False
    ) -> None:
        super().__init__(name, doc, labelnames)
        if until_set:  # a gauge of an optional part: no series until the part sets it
            self.children.clear()

    def set(self, value: float) -> None:
        self._only.value = value
        self.children[()] = self._only

    def dec(self, amount: float = 1.0) -> None:
        self._only.value -= amount

    def set_function(self, function: Callable[[], float]) -> None:
        self._only.function = function
        self.children[()] = self._only

    def collect(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in self.children.items():
            family.add_metric(key, child.get())
        return family


class Histogram(_Family[Buckets]):
    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str], *, buckets: tuple[float, ...]
    ) -> None:
        self.bounds = tuple(sorted(buckets))
        super().__init__(name, doc, labelnames)

    def new_child(self) -> Buckets:
        return Buckets(self.bounds)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [_le(b) for b in self.bounds] + ["+Inf"]
        for key, child in self.children.items():
            running, cumulative = 0, []
            for le, count in zip(les, child.counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric(key, cumulative, child.sum)
        return family


def _key_of(names: tuple[str, ...]) -> Callable[[dict[str, str]], tuple[str, ...]]:
    """Label values by name → the children's key, in the metric's label order."""
    if len(names) == 1:
        name = names[0]
        return lambda named: (named[name],)
    if names:
        return itemgetter(*names)
    return lambda named: ()


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.build_info = GaugeMetricFamily(
            "ocxproxy_build_info",
            "Always 1; the labels say which ocxproxy runs on which Python, and whether its"
            " compiled fast paths run (speedups: compiled, or python without the build)",
            labels=["version", "python", "implementation", "speedups"],
        )
        speedups = "python" if SPEEDUPS is None else "compiled"
        self.build_info.add_metric(
            [__version__, platform.python_version(), platform.python_implementation(), speedups],
            1,
        )

    def collect(self) -> Iterator[Metric]:
        yield self.build_info
        for value in vars(self.metrics).values():
            if isinstance(value, Counter | Histogram):
                yield value.collect()


class Metrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "ocxproxy_requests_total",
            "Requests by route and outcome",
            ["route", "outcome"],
        )
        self.expansions = Counter(
            "ocxproxy_expansions_total",
            "previous_response_id expansions by outcome (hit or failure reason)",
            ["outcome"],
        )
        self.item_references = Counter(
            "ocxproxy_item_references_total",
            "item_reference input items by outcome (resolved or failure reason)",
            ["outcome"],
        )
        self.compactions = Counter(
            "ocxproxy_compactions_total",
            "Compactions the proxy served, by route (trigger, compact, threshold) and outcome",
            ["route", "outcome"],
        )
        self.compaction_summary_tokens = Counter(
            "ocxproxy_compaction_summary_tokens_total",
            "Tokens of the summaries compactions sealed (the backend's output tokens)",
            ["route"],
        )
        self.compaction_prewarms = Counter(
            "ocxproxy_compaction_prewarms_total",
            "Compacted windows sent to the backend ahead of the next turn, by outcome",
            ["outcome"],
        )
        self.compaction_retries = Counter(
            "ocxproxy_compaction_retries_total",
            "Summary requests asked again without tools: the model called a tool instead",
            ["route"],
        )
        self.turns_recorded = Counter(
            "ocxproxy_turns_recorded_total",
            "Turns remembered, by where they live",
            ["kind"],
        )
        self.turns_not_recorded = Counter(
            "ocxproxy_turns_not_recorded_total",
            "Finished turns not remembered, by reason",
            ["reason"],
        )
        self.proxy_overhead = Histogram(
            "ocxproxy_proxy_overhead_seconds",
            "Time spent in the proxy per request, excluding time waiting on the backend",
            ["route"],
            buckets=_FAST_BUCKETS,
        )
        self.upstream_latency = Histogram(
            "ocxproxy_upstream_latency_seconds",
            "Backend request duration, to the last byte",
            ["backend"],
            buckets=_SLOW_BUCKETS,
        )
        self.upstream_ttfb = Histogram(
            "ocxproxy_upstream_ttfb_seconds",
            "Backend time to response headers",
            ["backend"],
            buckets=_SLOW_BUCKETS,
        )
        self.upstream_requests = Counter(
            "ocxproxy_upstream_requests_total",
            "Backend requests by outcome",
            ["backend", "outcome"],
        )
        self.upstream_in_flight = Gauge(
            "ocxproxy_upstream_in_flight", "Backend requests in flight", ["backend"]
        )
        # Fleet (CONTRACT.md C6)
        self.backend_up = Gauge(
            "ocxproxy_backend_up",
            "1 while a backend is considered healthy, 0 while it is skipped",
            ["backend"],
        )
        self.backend_ejections = Counter(
            "ocxproxy_backend_ejections_total",
            "Backends that passive evidence (timeouts, 5xx in a row) would take out: ejected, "
            "or kept in because too few would be left",
            ["backend", "outcome"],
        )
        self.request_faults = Counter(
            "ocxproxy_backend_request_faults_total",
            "5xx answers to a request body that had already got one: counted against the "
            "request, not the backend",
        )
        self.affinity = Counter(
            "ocxproxy_affinity_total",
            "Keyed requests by placement: hit (their backend), new (placed by load), "
            "reroute (their backend was down or full)",
            ["result"],
        )
        self.admission_rejected = Counter(
            "ocxproxy_admission_rejected_total",
            "Requests answered 429 because a concurrency bound was reached, by bound",
            ["limit"],
        )
        self.cached_tokens = Counter(
            "ocxproxy_backend_cached_tokens_total",
            "Input tokens the backend reported as served from its prefix cache",
            ["backend"],
        )
        self.input_tokens = Counter(
            "ocxproxy_backend_input_tokens_total",
            "Input tokens the backend reported",
            ["backend"],
        )
        # The same two, for continuation turns only (an expanded previous_response_id):
        # their history was sent before, so this ratio is what the prefix cache should win.
        self.continuation_cached_tokens = Counter(
            "ocxproxy_continuation_cached_tokens_total",
            "Input tokens of continuation turns the backend served from its prefix cache",
            ["backend"],
        )
        self.continuation_input_tokens = Counter(
            "ocxproxy_continuation_input_tokens_total",
            "Input tokens of continuation turns the backend reported",
            ["backend"],
        )
        self.cached_ratio = Histogram(
            "ocxproxy_backend_cached_ratio",
            "Per-turn cached_tokens / input_tokens reported by the backend",
            ["backend"],
            buckets=_RATIO_BUCKETS,
        )
        # Continuations whose cached tokens fell short of their chain's prefix, by reason
        # (upstream/misses.py), out of those compared.
        self.cache_checks = Counter(
            "ocxproxy_cache_checks_total",
            "Continuations whose reported cached tokens were compared with the prefix "
            "their previous turn left in the backend's cache",
        )
        self.cache_misses = Counter(
            "ocxproxy_cache_miss_total",
            "Continuations whose cached tokens fell short of the expected prefix, by reason",
            ["reason"],
        )
        self.cache_missed_tokens = Counter(
            "ocxproxy_cache_missed_tokens_total",
            "Prefix tokens the backend computed again on those continuations, by reason",
            ["reason"],
        )
        for reason in CACHE_MISS_REASONS:  # exported at 0 from the start
            self.cache_misses.labels(reason=reason)
            self.cache_missed_tokens.labels(reason=reason)
        # Warm resume's KV saves (upstream/kvsave.py)
        self.kv_saves = Counter(
            "ocxproxy_kv_saves_total",
            "KV saves of a chain's slot after its turn, by outcome (saved; stale: the slot "
            "held another prompt by then; error: the backend or the disk refused)",
            ["outcome"],
        )
        self.kv_save_bytes = Counter(
            "ocxproxy_kv_save_bytes_total", "Bytes of KV state written by saves"
        )
        self.kv_save_seconds = Histogram(
            "ocxproxy_kv_save_seconds",
            "Time of a KV save (off the reply path: the backend's slot is busy meanwhile)",
            (),
            buckets=_SLOW_BUCKETS,
        )
        self.kv_restores = Counter(
            "ocxproxy_kv_restores_total",
            "KV restores before a continuation the backend had lost, by outcome (ok; "
            "failed: restored but not used; error: refused; fingerprint_mismatch: not tried)",
            ["outcome"],
        )
        self.kv_restore_seconds = Histogram(
            "ocxproxy_kv_restore_seconds",
            "Time of a KV restore (on the continuation's path)",
            (),
            buckets=_SLOW_BUCKETS,
        )
        self.kv_saved_bytes = Gauge("ocxproxy_kv_saved_bytes", "Bytes of KV saves on disk")
        self.kv_evictions = Counter(
            "ocxproxy_kv_evictions_total", "KV saves removed to stay within --kv-save-bytes"
        )
        self.rewarms = Counter(
            "ocxproxy_rewarm_total",
            "Chains replayed to a backend that started again (no save API), by outcome "
            "(warmed; yielded: real turns kept cutting it off; failed)",
            ["outcome"],
        )
        self.rewarm_tokens = Counter(
            "ocxproxy_rewarm_tokens_total", "Prefix tokens of the chains re-warmed"
        )
        for outcome in ("saved", "stale", "error"):
            self.kv_saves.labels(outcome=outcome)
        for outcome in ("ok", "failed", "error", "fingerprint_mismatch"):
            self.kv_restores.labels(outcome=outcome)
        self.context_window = Gauge(
            "ocxproxy_backend_context_window_tokens",
            "The context window the proxy learned for a backend (or --context-window)",
            ["backend"],
        )
        self.token_counts = Counter(
            "ocxproxy_token_counts_total",
            "Round trips asking a backend to count a request's tokens (turns near the window)",
            ["backend"],
        )
        self.truncations = Counter(
            "ocxproxy_truncation_steps_total",
            "truncation:auto turns that moved their chain's drop point (items dropped "
            "from the front)",
        )
        self.context_refusals = Counter(
            "ocxproxy_context_length_exceeded_total",
            "Requests refused with context_length_exceeded before any generation, by "
            "truncation mode",
            ["truncation"],
        )
        for mode in ("disabled", "auto"):  # exported at 0 from the start
            self.context_refusals.labels(truncation=mode)
        self.stream_repairs = Counter(
            "ocxproxy_stream_repairs_total",
            "SSE streams that lacked spec fields and were repaired",
        )
        # Store (CONTRACT.md C4)
        self.store_entries = Gauge(
            "ocxproxy_store_entries",
            "Stored responses and segments by tier",
            ["tier"],
        )
        self.store_bytes = Gauge("ocxproxy_store_bytes", "Stored bytes by tier", ["tier"])
        self.store_capacity_entries = Gauge(
            "ocxproxy_store_capacity_entries",
            "The bound on ocxproxy_store_entries, by tier (--max-entries for records)",
            ["tier"],
        )
        self.store_capacity_bytes = Gauge(
            "ocxproxy_store_capacity_bytes",
            "The bound on ocxproxy_store_bytes, by tier (--max-resident-bytes, --max-disk-bytes)",
            ["tier"],
        )
        self.store_evictions = Counter(
            "ocxproxy_store_evictions_total",
            "Records or segments evicted, by reason",
            ["reason"],
        )
        self.spill_writes = Counter(
            "ocxproxy_spill_writes_total", "Segments written to the journal (new or compacted)"
        )
        self.spill_reads = Counter(
            "ocxproxy_spill_reads_total", "Segments read back from the journal (not resident)"
        )
        self.spill_failures = Counter(
            "ocxproxy_spill_failures_total",
            "Spill tier failures by reason",
            ["reason"],
        )
        self.snapshot_writes = Counter(
            "ocxproxy_snapshot_writes_total", "Checkpoints (snapshots of the index) written"
        )
        self.snapshot_failures = Counter(
            "ocxproxy_snapshot_failures_total",
            "Snapshot write or load failures by reason",
            ["reason"],
        )
        self.snapshot_age = Gauge(
            "ocxproxy_snapshot_age_seconds",
            "Age of the oldest change not yet in the checkpoint (0: none)",
        )
        self.journal_commits = Counter(
            "ocxproxy_journal_commits_total", "Journal group commits (one write + fsync each)"
        )
        self.journal_cut = Counter(
            "ocxproxy_journal_cut_total",
            "Torn or corrupt journal tails cut at start-up (entries after them are lost)",
        )
        self.journal_lag = Gauge(
            "ocxproxy_journal_lag_seconds",
            "Age of the oldest change waiting to be durable in the journal (0: none)",
        )
        self.store_write_failures = Counter(
            "ocxproxy_store_write_failures_total",
            "Journal commits that failed (disk full, I/O error), by errno",
            ["reason"],
        )
        self.store_disk_full = Counter(
            "ocxproxy_store_disk_full_total",
            "Times evicting could not take the store back under --max-disk-bytes (what is "
            "left is pinned or others' files): new turns are refused until there is room",
        )
        self.store_available = Gauge(
            "ocxproxy_store_available",
            "1 while the journal takes writes, 0 after a failed commit until one succeeds",
        )
        # The shared tier (--shared-store)
        self.shared_seconds = Histogram(
            "ocxproxy_shared_store_seconds",
            "Shared store round trips by operation (begin, item, fetch, commit, delete, ping)",
            ["op"],
            buckets=_FAST_BUCKETS,
        )
        self.shared_commits = Counter(
            "ocxproxy_shared_commits_total", "Shared store commits by outcome", ["outcome"]
        )
        self.shared_cache = Counter(
            "ocxproxy_shared_segment_cache_total",
            "Segments a shared-store turn needed, found in this replica's cache or fetched",
            ["result"],
        )
        self.shared_available = Gauge(
            "ocxproxy_shared_store_available",
            "1 while the shared store answers (0: unreachable); no series without one",
            until_set=True,
        )
        # Background responses (CONTRACT.md C11)
        self.background_jobs = Gauge(
            "ocxproxy_background_responses",
            "Background responses not finished yet, by status (queued, in_progress)",
            ["status"],
        )
        self.background_finished = Counter(
            "ocxproxy_background_finished_total",
            "Background responses finished, by final status",
            ["status"],
        )
        self.background_refused = Counter(
            "ocxproxy_background_refused_total",
            "Background creates refused with 429: the queue was full",
        )
        self.background_resumes = Counter(
            "ocxproxy_background_resumes_total",
            "Streams of a background response opened by GET ?stream=true",
        )
        self.background_cancels = Counter(
            "ocxproxy_background_cancels_total",
            "Background responses cancelled (a second cancel of one is not counted)",
        )
        self.background_lost = Counter(
            "ocxproxy_background_lost_total",
            "Background responses whose process died unfinished (found at start, or their "
            "replica's lease lapsed), or that the shared store lost mid-run: failed",
        )
        self.background_take_back_failures = Counter(
            "ocxproxy_background_take_back_failures_total",
            "Background turns stored before a cancel won against their end that could not "
            "be taken back in full: still stored, or their items still in their conversation",
        )
        self.background_log_bytes = Gauge(
            "ocxproxy_background_log_bytes", "Bytes of background event logs kept"
        )
        # WebSocket (CONTRACT.md C3)
        self.ws_open = Gauge("ocxproxy_websocket_connections", "Open WebSocket connections")
        self.ws_frames = Counter(
            "ocxproxy_websocket_frames_total",
            "WebSocket frames by direction",
            ["direction"],
        )
        self.ws_turns = Counter(
            "ocxproxy_websocket_turns_total",
            "WebSocket turns by outcome",
            ["outcome"],
        )
        self.ws_cache = Counter(
            "ocxproxy_websocket_cache_total",
            "Connection-local cache lookups",
            ["result"],
        )
        # Known failure labels start at 0: a series born at 1 shows no increase(), so an
        # alert on the first failure of a kind would never fire.
        for status in ("completed", "incomplete", "failed", "cancelled"):
            self.background_finished.labels(status=status)
        self.expansions.labels(outcome="hit")
        self.item_references.labels(outcome="resolved")
        for reason in FailureReason:
            self.expansions.labels(outcome=str(reason))
            self.item_references.labels(outcome=str(reason))
        for reason in _SPILL_FAILURES:
            self.spill_failures.labels(reason=str(reason))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        # process_*: CPU seconds, resident and virtual memory, open and max file
        # descriptors, start time (read from /proc at scrape time; none where there is none).
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Timing:
    """Where a request's time went; the handler subtracts it from its own wall time.
    `with timing.waiting():` brackets each wait on a backend (a plain class: a generator
    context manager costs microseconds on every chunk). Also where it went: the backend
    and the create exchange, and the request's id (X-Request-Id), for the access log."""

    __slots__ = ("_since", "backend", "exchange", "request_id", "upstream")

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self.upstream = 0.0  # seconds spent waiting on the backend
        self._since = 0.0
        self.backend: str | None = None  # the backend last tried
        self.exchange: Any = None  # the create turn's Exchange (http/exchange.py), if any

    def waiting(self) -> Timing:
        return self

    def __enter__(self) -> None:
        self._since = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.upstream += time.perf_counter() - self._since
