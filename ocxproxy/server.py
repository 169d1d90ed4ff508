"""Wiring: build_app(config) → the aiohttp application; run(config) serves it."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import signal
import sys
import weakref
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

from aiohttp import web

from ocxproxy import heap
from ocxproxy.aio import cancel_and_wait, spawn
from ocxproxy.config import Config, connections_for_fds, fd_limit
from ocxproxy.continuation.compaction import Sealer
from ocxproxy.continuation.envelope import ServedModels
from ocxproxy.http import (
    conversations,
    health,
    models,
    passthrough,
    responses,
    rewarm,
    websocket,
)
from ocxproxy.http.access_log import AccessLog
from ocxproxy.http.context import CUT_GRACE, PROXY, UNPREFIXED, V1, Proxy
from ocxproxy.http.front import FrontSite, close_after_answer
from ocxproxy.http.middleware import handle_errors, tag_answer
from ocxproxy.metrics import Metrics
from ocxproxy.store import StoreInterface, default_state_dir, open_store
from ocxproxy.store.compaction_key import compaction_key
from ocxproxy.upstream.fleet import Backend
from ocxproxy.upstream.kvsave import KvSaves, default_budget
from ocxproxy.upstream.pool import UpstreamPool

log = logging.getLogger("ocxproxy")

SWEEP_INTERVAL = 60.0
SWITCH_INTERVAL = 0.001  # seconds (sys.setswitchinterval)


def build_app(config: Config, *, metrics: Metrics | None = None) -> web.Application:
    metrics = metrics or Metrics()
    store = open_store(config, metrics)
    proxy = Proxy(config, store, UpstreamPool(config.upstream, config, metrics), metrics)
    if config.access_log != "off":
        proxy.access_log = AccessLog(config.access_log)
    # The body limit is enforced while reading, in responses.read_body and by aiohttp here.
    app = web.Application(middlewares=[handle_errors], client_max_size=config.max_body_bytes)
    app[PROXY] = proxy
    app.on_response_prepare.append(tag_answer)
    app[websocket.WEBSOCKETS] = weakref.WeakSet()
    app.cleanup_ctx.append(_store_lifecycle)  # first: a state dir it cannot use refuses fast
    app.cleanup_ctx.append(_local_backend)
    app.cleanup_ctx.append(_upstream_session)
    r = app.router
    r.add_get("/healthz", health.healthz)
    r.add_get("/readyz", health.readyz)
    r.add_get("/metrics", health.metrics)
    # The API under /v1 and without it: a base URL that lacks /v1 reaches the same routes
    # (the backend always gets /v1, context.upstream_path).
    r.add_routes([web.route(d.method, V1 + d.path, d.handler, **d.kwargs) for d in API_ROUTES])
    bare = r.add_routes(API_ROUTES)
    app[UNPREFIXED] = frozenset(route.resource.canonical for route in bare if route.resource)
    r.add_route("*", "/{tail:.*}", passthrough.passthrough)  # as it came
    return app


API_ROUTES = [  # without their /v1 prefix
    web.post("/responses", responses.create_response),
    web.get("/responses", websocket.responses_socket),  # upgrade, else passthrough
    web.post("/responses/input_tokens", responses.create_sibling),
    web.post("/responses/compact", responses.compact_response),
    web.get("/responses/{response_id}", responses.get_response),
    web.delete("/responses/{response_id}", responses.delete_response),
    web.get("/responses/{response_id}/input_items", responses.list_input_items),
    web.post("/responses/{response_id}/cancel", responses.cancel_response),
    *conversations.ROUTES,
    web.get("/models", models.list_models),  # the backend's, under the served names
    web.route("*", "/models/{model:.+}", passthrough.passthrough),
]


async def _local_backend(app: web.Application) -> AsyncIterator[None]:
    """With no --upstream, run the embedded llama.cpp backend as a managed child."""
    proxy = app[PROXY]
    if proxy.config.upstream:
        saves = await _external_kv_saves(proxy)
        try:
            yield
        finally:
            if saves is not None:
                await saves.close()
        return
    from ocxproxy.upstream import local

    model = proxy.config.local_model or local.default_model_path()
    if model is None or not local.is_available():
        raise local.LocalBackendError(local.MISSING_MESSAGE)
    saves = await _kv_saves(proxy)
    backend = local.LocalBackend(
        model,
        slot_save_path=saves.directory if saves else None,
        temperature=proxy.config.local_temperature,
    )
    url = await backend.start()
    served = proxy.pool.add(url)

    def restarted() -> None:  # a new epoch: what it cached is gone (upstream/misses.py)
        proxy.pool.fleet.restarted(served)

    backend.on_restart = restarted
    if saves is not None:
        await saves.attach(url, lambda: backend.boot, model)
        proxy.kv_saves = saves
    # A short name, never the model file's path; with the values llama.cpp samples a
    # request that sets none with, which its Responses show (not OpenAI's 1.0).
    names = proxy.served_models or (local.served_name(model),)
    try:
        proxy.served_models = ServedModels(names, await backend.sampling())
    except local.LocalBackendError as exc:
        proxy.served_models = names
        log.warning(
            "the embedded backend's sampling values are unknown (%s): Responses show "
            "OpenAI's defaults for temperature and top_p, not llama.cpp's",
            exc,
        )
    log.info("embedded llama.cpp backend at %s (model %s)", url, proxy.served_models[0])
    watchdog = spawn(backend.watch(), name="local-backend-watchdog")
    try:
        yield
    finally:
        if saves is not None:
            await saves.close()
        await cancel_and_wait(watchdog)
        await backend.stop()


async def _kv_saves(proxy: Proxy, directory: Path | None = None) -> KvSaves | None:
    """Warm resume's saves, in `directory` (default: the state dir's `kv/`, for the
    embedded backend); None when off (--kv-save off, or --zdr: nothing on disk)."""
    config = proxy.config
    if config.kv_save == "off" or config.zdr:
        return None
    if directory is None:
        directory = (config.state_dir or default_state_dir()) / "kv"
        await asyncio.to_thread(directory.mkdir, mode=0o700, parents=True, exist_ok=True)
        await asyncio.to_thread(directory.chmod, 0o700)
    budget = config.kv_save_bytes or default_budget(directory)
    saves = KvSaves(directory, budget, config.kv_save_every, proxy.pool.http, proxy.metrics)
    await saves.open()
    return saves


async def _external_kv_saves(proxy: Proxy) -> KvSaves | None:
    """With --kv-save-dir, warm resume on each --upstream that is a llama-server started
    with --slot-save-path there (and one slot): a chain saved on one is restored on
    another it is routed to. The others get a warning; none: no warm resume."""
    config = proxy.config
    if config.kv_save_dir is None:
        return None
    saves = await _kv_saves(proxy, config.kv_save_dir)
    if saves is None:
        return None
    started = secrets.token_hex(8)  # a start is known as this proxy's and the backend's downs
    for backend in proxy.pool.fleet.backends:
        why = await saves.supported(backend.url)
        if why is not None:
            log.warning("--kv-save-dir: no warm resume on %s: %s", backend.url, why)
            continue
        await saves.attach(
            backend.url,
            partial(_boot_of, started, backend),
            None,
            external=True,
            kv_types=config.kv_cache_types,
        )
        log.info("warm resume on %s: KV saves in %s", backend.url, config.kv_save_dir)
    if not saves.backends:
        await saves.close()
        return None
    proxy.kv_saves = saves
    return saves


def _boot_of(started: str, backend: Backend) -> str:
    return f"{started}:{backend.epoch}"


async def _store_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Load the snapshot before serving (readyz says so); flush it on shutdown."""
    proxy = app[PROXY]
    config = proxy.config
    await proxy.store.start()  # first: it takes the state dir, or refuses to start
    try:
        proxy.sealer = Sealer(compaction_key(config, config.state_dir or default_state_dir()))
        if config.shared_store is not None:  # every replica seals with the same key
            from ocxproxy.store.shared.store import SharedStore

            assert isinstance(proxy.store, SharedStore)
            await proxy.store.claim_compaction_key(proxy.sealer.fingerprint)
    except BaseException:
        await proxy.store.close()
        raise
    await proxy.backgrounds.load()  # a background response left running is failed now
    heap.trim()  # what loading the index used and freed
    proxy.ready = True
    sweeper = spawn(_sweep(proxy.store), name="store-sweeper")
    try:
        yield
    finally:
        proxy.ready = False
        await cancel_and_wait(sweeper)
        await proxy.backgrounds.close()
        await proxy.store.close()


async def _sweep(store: StoreInterface) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL)
        await store.sweep()


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    """The backend session, and the active health probe that runs while it is open."""
    pool = app[PROXY].pool
    interval = app[PROXY].config.health_interval
    prober = spawn(pool.watch(interval), name="backend-prober") if interval > 0 else None
    budget = app[PROXY].config.rewarm_budget
    rewarmer = spawn(rewarm.watch(app[PROXY]), name="backend-rewarm") if budget else None
    try:
        yield
    finally:
        if rewarmer is not None:
            await cancel_and_wait(rewarmer)
        if prober is not None:
            await cancel_and_wait(prober)
        await pool.close()


class Listener:
    """A started app: its URL, and close() for the orderly shutdown."""

    def __init__(self, runner: web.AppRunner) -> None:
        self.runner = runner
        self.hosts = [address[0] for address in runner.addresses]
        host, port = runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def close(self) -> None:
        """Stop listening; let requests and WebSocket turns in flight finish by
        `--shutdown-timeout`, and cut what still runs then (each ends with an error that
        says why); then aiohttp's shutdown and the cleanup contexts in reverse. (Before
        aiohttp's shutdown, which stops reading every connection it serves.)"""
        app = self.runner.app
        proxy = app[PROXY]
        stopping = proxy.stop()
        await asyncio.gather(
            *(site.stop() for site in self.runner.sites),  # the front end's requests too
            websocket.close_websockets(app),
            stopping.finish([*proxy.handlers, *proxy.backgrounds.running()]),
        )
        await self.runner.cleanup()


async def listen(app: web.Application, host: str, port: int) -> Listener:
    """Start the app (its startup hooks and cleanup contexts) and listen on host:port
    through the front end (http/front.py)."""
    app.on_response_prepare.append(close_after_answer)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=CUT_GRACE,  # what is left after Listener.close's own wait
        keepalive_timeout=app[PROXY].config.keepalive_timeout,  # for handed-over connections
        auto_decompress=False,  # request bodies are decoded, bounded, by http/body.py
    )
    await runner.setup()
    try:
        await FrontSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return Listener(runner)


def _check_fd_room(config: Config) -> None:
    """Warn when the connection cap lets the process run out of file descriptors: past
    them, a new connection is closed unanswered instead of getting its 503."""
    limit, cap = fd_limit(), config.max_connections
    if limit is not None and (cap == 0 or cap > connections_for_fds()):
        log.warning(
            "--max-connections %s exceeds what the file-descriptor limit (%d) leaves room "
            "for (%d): past that, new connections are closed unanswered. Raise the limit "
            "(ulimit -n, LimitNOFILE=) or leave --max-connections at its default.",
            cap or "0 (no bound)",
            limit,
            connections_for_fds(),
        )


def _check_exposure(config: Config, hosts: list[str]) -> None:
    """Warn when clients beyond this machine can reach a proxy that asks for no key."""
    exposed = [host for host in hosts if not _is_loopback(host)]
    if exposed and not config.api_keys:
        log.warning(
            "listening on %s, beyond loopback, without --api-keys: anyone who reaches the "
            "port can use the backends and the turns stored without a key. Set --api-keys, "
            "or --host 127.0.0.1.",
            ", ".join(exposed),
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


async def serve(config: Config, *, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down in order (cleanup contexts in reverse)."""
    _check_fd_room(config)
    app = build_app(config)
    listener = await listen(app, config.host, config.port)
    _check_exposure(config, listener.hosts)
    fleet = app[PROXY].pool.fleet
    settler = spawn(heap.keep_settled(lambda: fleet.in_flight == 0), name="heap-settler")
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Ready only once a stop is graceful: a supervisor may signal right after this line.
        print(f"ocxproxy listening on {listener.url}/v1", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("shutting down")
    finally:
        await cancel_and_wait(settler)
        await listener.close()


def run(config: Config) -> None:
    # A thread that wants the GIL (the store's committer, back from its fsync with turns
    # waiting on it) gets it after at most this long while the event loop is busy; the
    # default 5 ms lengthened every durable turn under load.
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
