"""Which stores a create turn reads and writes (CONTRACT.md C3, C5).

A turn reads its previous response and its `item_reference` items in the caller's scope:
over WebSocket in the connection's own memory-only store first (which holds that
connection's store:false turns), else in the proxy's store. It is remembered in the proxy's
store, in the connection's own store (store:false, or a chain that started there), or
nowhere; only a store:true turn outside --zdr may reach disk.
"""

from __future__ import annotations

from ocxproxy.continuation.expand import Request
from ocxproxy.continuation.references import not_found
from ocxproxy.errors import FailureReason, StoreFailure
from ocxproxy.http.context import Proxy
from ocxproxy.model import Record
from ocxproxy.store import Store, StoreInterface


async def resolve_items(
    proxy: Proxy, scope: str, refs: dict[int, str], local: Store | None
) -> tuple[dict[int, bytes], dict[StoreInterface, list[str]]]:
    """Each referenced item's stored bytes, by input index, and the stores they came from
    (with the ids found in each):
    from the caller's scope, over WebSocket the connection's own store first (its
    store:false items too), else the shared store's stored items. An id found nowhere is
    an InvalidRequest naming it, unless the operator forwards unknown ids (the reference
    then goes as it came)."""
    metrics = proxy.metrics.item_references
    stores = ((local, True), (proxy.store, False)) if local is not None else ((proxy.store, False),)
    wanted: dict[StoreInterface, list[tuple[int, Record, str]]] = {}
    for index, item_id in refs.items():
        for store, unstored in stores:
            try:
                record = await store.find_item(scope, item_id, unstored=unstored)
            except StoreFailure:
                continue
            wanted.setdefault(store, []).append((index, record, item_id))
            break
        else:
            metrics.labels(outcome=str(FailureReason.UNKNOWN)).inc()
            if not proxy.config.forward_unknown_ids:
                raise not_found(item_id)
    resolved: dict[int, bytes] = {}
    for store, entries in wanted.items():
        try:
            datas = await store.item_bytes([(record, item_id) for _, record, item_id in entries])
        except StoreFailure as failure:  # which one: ask for each
            metrics.labels(outcome=str(failure.reason)).inc()
            datas = []
            for _, record, item_id in entries:
                try:
                    datas += await store.item_bytes([(record, item_id)])
                except StoreFailure:
                    raise not_found(item_id) from None
        resolved.update((index, data) for (index, _, _), data in zip(entries, datas, strict=True))
    metrics.labels(outcome="resolved").inc(len(resolved))
    return resolved, {store: [item_id for *_, item_id in found] for store, found in wanted.items()}


async def wait_for_room(proxy: Proxy, target: StoreInterface | None) -> None:
    """A turn the shared store will take waits while its disk writer is behind (bounded);
    one remembered elsewhere, or nowhere, does not."""
    if target is proxy.store:
        await proxy.store.wait_for_room()


async def resolve_previous(
    proxy: Proxy, scope: str, prev: str, local: Store | None
) -> tuple[StoreInterface, Record]:
    """The caller's previous response, over WebSocket from the connection's own store first."""
    if local is not None:
        try:
            return local, local.lookup_nowait(scope, prev)
        except StoreFailure:
            pass
    return proxy.store, await proxy.store.lookup(scope, prev)


def retention(
    proxy: Proxy,
    request: Request,
    local: Store | None,
    parent_store: StoreInterface | None,
    remember: bool = True,
) -> tuple[StoreInterface | None, bool]:
    """Where a turn is remembered and whether it may reach disk (CONTRACT.md C3, C5)."""
    if not remember:
        return None, False
    if local is not None and (parent_store is local or not request.store):
        return local, False
    if request.store:
        return proxy.store, not proxy.config.zdr
    if proxy.config.retain_unstored:
        return proxy.store, False
    return None, False
