"""upstream/fleet.py: the Fleet's choice, health state and admission, without sockets."""

from __future__ import annotations

import asyncio

import pytest

from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.errors import RateLimited, UpstreamError
from ocxproxy.metrics import Metrics
from ocxproxy.upstream.fleet import (
    BACKOFF_MAX,
    ERRORS_BEFORE_DOWN,
    Choice,
    Fleet,
    Placement,
    Refusal,
    Routing,
)

A, B, C = "http://a:1", "http://b:1", "http://c:1"
NOW = 1000.0


def fleet(*urls: str, **kwargs: object) -> Fleet:
    return Fleet(urls or (A, B), Metrics(), **kwargs)  # type: ignore[arg-type]


def chosen(f: Fleet, key: str | None, preferred: str | None = None, **kw: object) -> Choice:
    choice = f.choose(key, preferred, NOW, **kw)  # type: ignore[arg-type]
    assert isinstance(choice, Choice), choice
    return choice


def gauge(f: Fleet, name: str, **labels: str) -> float | None:
    return f.metrics.registry.get_sample_value(name, labels)


def test_a_new_key_goes_to_the_least_loaded_backend() -> None:
    f = fleet()
    f.backends[0].in_flight = 3
    assert chosen(f, "k1") == Choice(f.backends[1], Placement.NEW)
    f.backends[1].in_flight = 5
    assert chosen(f, "k2") == Choice(f.backends[0], Placement.NEW)


def test_ties_are_broken_by_the_key_so_new_keys_spread() -> None:
    f = fleet(A, B, C)
    homes = {chosen(f, f"key-{i}").backend.url for i in range(30)}
    assert homes == {A, B, C}
    assert chosen(fleet(A, B, C), "key-7").backend.url == chosen(f, "key-7").backend.url


def test_a_key_sticks_to_its_home_whatever_the_load() -> None:
    f = fleet()
    home = chosen(f, "k").backend
    home.in_flight = 10
    assert chosen(f, "k") == Choice(home, Placement.HIT)
    assert f.stats().keys == 1


def test_the_chains_backend_wins_over_the_keys_home() -> None:
    f = fleet()
    home = chosen(f, "k").backend
    other = f.backends[1] if home is f.backends[0] else f.backends[0]
    assert chosen(f, "k", preferred=other.url) == Choice(other, Placement.HIT)
    assert chosen(f, "k").backend is other  # the key's home followed the chain


def test_a_down_home_reroutes_and_the_key_moves_along() -> None:
    f = fleet()
    a, b = f.backends
    f.mark_down(a, "test", NOW)
    assert chosen(f, "k", preferred=A) == Choice(b, Placement.REROUTE)
    f.mark_up(a)
    assert chosen(f, "k") == Choice(b, Placement.HIT)  # stays where it moved


def test_an_unknown_preferred_backend_is_ignored() -> None:
    f = fleet()
    assert chosen(f, None, preferred="http://gone:1").placement is Placement.NEW


def test_keyless_requests_go_to_the_least_loaded_uncounted() -> None:
    f = fleet()
    f.backends[0].in_flight = 1
    assert chosen(f, None) == Choice(f.backends[1], None)
    assert f.stats().keys == 0


def test_round_robin_ignores_affinity() -> None:
    f = fleet(routing=Routing.ROUND_ROBIN)
    urls = [chosen(f, "k", preferred=A).backend.url for _ in range(4)]
    assert sorted(urls) == [A, A, B, B]
    assert urls[0] != urls[1]
    assert chosen(f, "k").placement is None


@pytest.mark.parametrize(
    ("max_concurrency", "max_per_backend", "loads", "spill", "expected"),
    [
        (0, 0, (50, 50), False, A),  # no bounds
        (2, 0, (1, 1), False, Refusal.TOTAL),
        (0, 1, (1, 0), False, Refusal.BACKEND),  # home full: wait for it
        (0, 1, (1, 0), True, B),  # after the wait: spill over
        (0, 1, (1, 1), True, Refusal.BACKEND),
    ],
)
def test_admission_bounds(
    max_concurrency: int,
    max_per_backend: int,
    loads: tuple[int, int],
    spill: bool,
    expected: str | Refusal,
) -> None:
    f = fleet(max_concurrency=max_concurrency, max_per_backend=max_per_backend)
    for backend, load in zip(f.backends, loads, strict=True):
        backend.in_flight = load
    f.in_flight = sum(loads)
    result = f.choose("k", A, NOW, spill=spill)
    if isinstance(expected, Refusal):
        assert result is expected
    else:
        assert isinstance(result, Choice)
        assert result.backend.url == expected


def test_all_down_is_refused_and_excluded_backends_count_as_down() -> None:
    f = fleet()
    assert f.choose("k", None, NOW, exclude={A, B}) is Refusal.DOWN
    for backend in f.backends:
        f.mark_down(backend, "test", NOW)
    assert f.choose("k", None, NOW) is Refusal.DOWN
    assert not f.is_ready(NOW)


def test_without_probes_a_down_backend_is_retried_after_its_backoff() -> None:
    f = fleet()
    a = f.backends[0]
    f.mark_down(a, "test", NOW)
    assert not a.is_available(NOW + 0.5, probing=False)
    assert a.is_available(NOW + 1.0, probing=False)
    assert not a.is_available(NOW + 1.0, probing=True)  # with probes, only a probe revives
    for _ in range(10):
        f.mark_down(a, "again", NOW)
    assert a.backoff == BACKOFF_MAX
    assert a.failures == 1  # it went down once
    f.mark_up(a)
    assert a.healthy and a.backoff == 1.0


def test_5xx_in_a_row_mark_a_backend_down_and_an_answer_brings_it_back() -> None:
    f = fleet()
    a = f.backends[0]
    for _ in range(ERRORS_BEFORE_DOWN - 1):
        f.observe_status(a, 503, NOW)
    f.observe_status(a, 200, NOW)
    for _ in range(ERRORS_BEFORE_DOWN - 1):
        f.observe_status(a, 500, NOW)
    assert a.healthy
    assert gauge(f, "ocxproxy_backend_up", backend=A) == 1
    f.observe_status(a, 502, NOW)
    assert not a.healthy
    assert gauge(f, "ocxproxy_backend_up", backend=A) == 0
    f.observe_status(a, 404, NOW)
    assert a.healthy
    assert gauge(f, "ocxproxy_backend_up", backend=A) == 1


def test_the_key_table_is_bounded() -> None:
    f = fleet(max_keys=3)
    for i in range(10):
        chosen(f, f"k{i}")
    assert f.stats().keys == 3
    assert list(f._homes) == ["k7", "k8", "k9"]


def test_repr_and_stats_show_live_state() -> None:
    f = fleet()
    f.mark_down(f.backends[1], "test", NOW)
    f._reserve(f.backends[0])
    assert repr(f) == (
        f"<Fleet affinity [{A} up 1 in flight, {B} down 0 in flight] waiting=0 keys=0>"
    )
    stats = f.stats()
    assert (stats.backends, stats.up, stats.in_flight, stats.waiting) == (2, 1, 1, 0)
    f.release(f.backends[0])
    assert gauge(f, "ocxproxy_upstream_in_flight", backend=A) == 0


async def test_admit_waits_for_a_slot_then_takes_it() -> None:
    f = fleet(A, max_concurrency=1, admission_timeout=5.0)
    first = await f.admit("k", None)
    waiter = spawn(f.admit("k", None), name="waiter")
    await asyncio.sleep(0.01)
    assert not waiter.done() and f.stats().waiting == 1
    f.release(first.backend)
    async with asyncio.timeout(1):
        second = await waiter
    assert second.backend is first.backend and f.in_flight == 1


async def test_admit_gives_up_with_429_after_the_timeout() -> None:
    f = fleet(A, max_concurrency=1, admission_timeout=0.05)
    await f.admit("k", None)
    with pytest.raises(RateLimited) as info:
        await f.admit("k", None)
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert gauge(f, "ocxproxy_admission_rejected_total", limit="total") == 1
    assert f.stats().waiting == 0


async def test_admit_spills_over_when_home_stays_full() -> None:
    f = fleet(max_per_backend=1, admission_timeout=0.02)
    home = await f.admit("k", None)
    moved = await f.admit("k", None)
    assert moved.backend is not home.backend and moved.placement is Placement.REROUTE


async def test_admit_queue_is_bounded_by_the_overall_limit() -> None:
    f = fleet(A, max_concurrency=1, admission_timeout=5.0)
    await f.admit(None, None)
    waiter = spawn(f.admit(None, None), name="waiter")
    await asyncio.sleep(0.01)
    with pytest.raises(RateLimited):  # a second waiter is not queued: 429 at once
        async with asyncio.timeout(1):
            await f.admit(None, None)
    await cancel_and_wait(waiter)
    assert f.stats().waiting == 0


async def test_admit_fails_at_once_when_nothing_is_up() -> None:
    f = fleet()
    for backend in f.backends:
        f.mark_down(backend, "test")
    f.probing = True
    with pytest.raises(UpstreamError) as info:
        async with asyncio.timeout(0.5):
            await f.admit("k", None)
    assert info.value.status == 503 and info.value.code == "no_backend_available"


def test_a_5xx_to_a_body_that_already_got_one_counts_against_the_request() -> None:
    f = fleet()
    a = f.backends[0]
    for _ in range(ERRORS_BEFORE_DOWN + 2):  # the SDK's retries of one bad request
        f.observe_status(a, 500, NOW, body=b'{"input":"bad"}')
    assert a.healthy and a.errors_in_row == 0  # the first one taken back too
    for i in range(ERRORS_BEFORE_DOWN):  # distinct requests failing: the backend's doing
        f.observe_status(a, 500, NOW, body=[b'{"input":', b'"%d"}' % i])
    assert not a.healthy and a.ejected


def test_passive_evidence_ejects_at_most_half_the_fleet_and_never_the_last() -> None:
    f = fleet(A, B, C, "http://d:1")
    for backend in f.backends:
        for _ in range(ERRORS_BEFORE_DOWN):
            f.observe_status(backend, 503, NOW)
    assert [b.healthy for b in f.backends].count(False) == 2
    only = fleet(A)
    for _ in range(2 * ERRORS_BEFORE_DOWN):
        only.observe_status(only.backends[0], 503, NOW)
    assert not only.eject(only.backends[0], "a timeout", NOW)
    assert only.backends[0].healthy
    assert gauge(only, "ocxproxy_backend_ejections_total", backend=A, outcome="kept") == 3


def test_when_every_backend_is_out_the_ejected_ones_take_requests() -> None:
    """Panic routing: a refused connection marks B down for sure; A, out on passive
    evidence only, keeps serving while the probe decides."""
    f = fleet()
    a, b = f.backends
    assert f.eject(a, "no answer within the read timeout", NOW)
    f.mark_down(b, "connection refused", NOW)
    assert chosen(f, "k").backend is a
    f.mark_down(a, "health probe failed", NOW)  # the probe's word is final
    assert f.choose("k", None, NOW) is Refusal.DOWN
