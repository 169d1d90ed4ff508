"""Re-warm (CONTRACT.md C12): after a backend with no save API (vLLM, SGLang, a
llama-server without `--slot-save-path`) started again, or came back from being down, the
prefixes of the chains it served most recently are sent to it again with a one-token
answer, newest first, within `--rewarm-budget` tokens, so their next turns find them
cached. Real turns go first: a replay starts only while the backend has no request in
flight, and is cut off (its connection closed, which stops the backend's work) the moment
one arrives, then tried again once the backend is idle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

import orjson

from ocxproxy.continuation.compaction import compacted_history
from ocxproxy.continuation.expand import expand
from ocxproxy.errors import StoreFailure
from ocxproxy.http.context import Proxy
from ocxproxy.upstream.fleet import Backend
from ocxproxy.upstream.http1 import Http1Error

log = logging.getLogger("ocxproxy.rewarm")

# What a Response echoes of its request that is rendered before the history.
HEAD_FIELDS: Final = (
    "model", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "text",
)  # fmt: skip
SCAN: Final = 1000  # the newest turns looked at for chains to replay
TRIES: Final = 3  # replays of one chain cut off by real turns before it is skipped
REPLAY_TIMEOUT: Final = 600.0
FOREVER: Final = 1e9


async def watch(proxy: Proxy) -> None:
    """Until cancelled: re-warm each backend whose epoch changed (it was down, or
    restarted) once it is up again. A backend whose chains warm resume restores is left
    out."""
    fleet = proxy.pool.fleet
    seen = {backend.url: backend.epoch for backend in fleet.backends}

    def changed() -> bool:
        return any(b.healthy and seen.setdefault(b.url, b.epoch) != b.epoch for b in fleet.backends)

    while True:
        await fleet.wait_for(changed, within=FOREVER)
        for backend in list(fleet.backends):
            if not backend.healthy or seen.get(backend.url, backend.epoch) == backend.epoch:
                continue
            seen[backend.url] = backend.epoch
            saves = proxy.kv_saves
            if backend.dialect != "responses" or (
                saves is not None and backend.url in saves.backends
            ):
                continue
            try:
                await rewarm(proxy, backend)
            except Exception:  # a replay is an optimisation: never the proxy's failure
                log.exception("re-warming %s failed", backend.url)


async def rewarm(proxy: Proxy, backend: Backend) -> None:
    """Replay the newest chains `backend` served, newest first, within the budget."""
    budget = proxy.config.rewarm_budget
    metrics = proxy.metrics
    warmed: set[str] = set()  # segments of the chains replayed: their prefixes are warm
    newest = list(proxy.cache_book.served.items())[-SCAN:]
    for key, served in reversed(newest):
        if budget <= 0:
            break
        fact = proxy.book.get(key)  # (a conversation's turns' facts are the conversation's)
        if served.backend != backend.url or fact is None or fact.tokens > budget:
            continue
        if served.edited:  # a conversation no longer what its latest turn forwarded
            continue
        conversation = key if served.turn else None
        try:
            record = await proxy.store.lookup(served.scope, served.turn or key)
            own = record.own
            if own is None or own.key in warmed:
                continue  # a prefix of a chain replayed already
            history = await proxy.store.history(record)
            response = orjson.loads(await proxy.store.response_bytes(record))
        except (StoreFailure, orjson.JSONDecodeError):
            continue
        if conversation is not None:  # as its turns forward it: from its latest summary on
            history = compacted_history(conversation, history)
        warmed.update(segment.key for segment in record.segments)
        head = {k: response[k] for k in HEAD_FIELDS if response.get(k) is not None}
        body = expand({**head, "max_output_tokens": 1, "store": False}, history, [])
        outcome = await _replay(proxy, backend, body)
        metrics.rewarms.labels(outcome=outcome).inc()
        if outcome == "warmed":
            budget -= fact.tokens
            metrics.rewarm_tokens.inc(fact.tokens)


async def _replay(proxy: Proxy, backend: Backend, body: bytes) -> str:
    fleet = proxy.pool.fleet
    for _ in range(TRIES):
        await fleet.wait_for(lambda: backend.in_flight == 0 or not backend.healthy, FOREVER)
        if not backend.healthy:
            return "failed"
        send = asyncio.ensure_future(_post(proxy, backend, body))
        real = asyncio.ensure_future(
            fleet.wait_for(lambda: backend.in_flight > 0, within=REPLAY_TIMEOUT)
        )
        done, _ = await asyncio.wait({send, real}, return_when=asyncio.FIRST_COMPLETED)
        for task in (send, real):
            if task not in done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if send in done:
            return "warmed" if send.result() else "failed"
    return "yielded"


async def _post(proxy: Proxy, backend: Backend, body: bytes) -> bool:
    headers = {**proxy.pool.windows.headers, "Content-Type": "application/json"}
    try:
        async with asyncio.timeout(REPLAY_TIMEOUT):
            response = await proxy.pool.http.request(
                "POST", backend.url, "/v1/responses", headers, body
            )
            try:
                await response.read()
            except BaseException:
                response.close()
                raise
            response.release()
    except (Http1Error, TimeoutError, OSError):
        return False
    return response.status == 200
