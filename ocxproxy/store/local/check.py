"""Store.check(): drift between the index, the tiers and the journal (diskcache's `check`).
Diagnostic only: it reads the journal from disk, so call it while the store is idle.
Uses only the store's public read-only views.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ocxproxy.model import Segment, unplace
from ocxproxy.store.local import segment_files
from ocxproxy.store.local.journal import Journal
from ocxproxy.store.local.keydir import SEG_OVERHEAD
from ocxproxy.store.local.segment_files import FILES

if TYPE_CHECKING:
    from ocxproxy.store.local.store import Store


def check_store(store: Store) -> list[str]:
    problems: list[str] = store.index.problems()
    segments, resident = store.segments(), store.resident
    refs: dict[str, int] = {}
    durable_refs: dict[str, int] = {}
    for record in store.records():
        response = record.response
        own = (response,) if type(response) is Segment else ()
        if record.fill is not None:
            own = (*own, record.fill)
        for segment in (*record.segments, *own):
            refs[segment.key] = refs.get(segment.key, 0) + 1
            if record.durable:
                durable_refs[segment.key] = durable_refs.get(segment.key, 0) + 1
            if segments.get(segment.key) is not segment:
                problems.append(f"{record.id} references unindexed {segment.key}")
    packs = store.packs()
    for key, segment in segments.items():
        if segment.refs != refs.get(key, 0):
            problems.append(f"{key} refs {segment.refs} != {refs.get(key, 0)}")
        if segment.digest in resident and segment.data is None:
            problems.append(f"{key} resident without bytes")
        if segment.lost is not None and segment.data is not None:
            problems.append(f"{key} lost ({segment.lost}) but has bytes")
        want = durable_refs.get(key, 0)
        if segment.durable_refs != want or segment.durable != (want > 0):
            problems.append(f"{key} durable {segment.durable} ({segment.durable_refs}) != {want}")
        if segment.on_disk and not segment.durable:
            problems.append(f"{key} is store:false content in the journal")
        if segment.pack > FILES and (
            segment.pack not in packs or packs[segment.pack][0].get(key) is not segment
        ):
            problems.append(f"{key} located in journal file {segment.pack} but not indexed there")
        if segment.data is None and not segment.on_disk and segment.lost is None:
            problems.append(f"{key} has no bytes anywhere and is not marked lost")
    indexed = 0
    for record in store.records():
        for item_id in record.segments[-1].item_ids.ids if record.segments else ():
            indexed += 1
            if not store.items.holds(record.scope, item_id, record):
                problems.append(f"{record.id}'s item {item_id} is not in the item index")
        if record.ids is not None:  # a conversation: a list of item ids per segment
            chain = record.segments
            if len(chain) == 1 and not chain[0].size:
                chain = ()  # an empty conversation's one empty segment
            if [len(ids) for ids in record.ids] != [s.n_items for s in chain]:
                problems.append(f"{record.id}'s item ids disagree with its segments")
    if store.items.entries() != indexed:
        problems.append(f"item index holds {store.items.entries()} entries, records {indexed}")
    if sum(map(resident.held, resident)) != resident.bytes:
        problems.append("resident byte count drifted")
    for segment in resident:
        if segments.get(segment.key) is not segment:
            problems.append(f"{segment.key} resident but unindexed")
    if store.journal is None or not store.durable:
        return problems
    responses: dict[int, list[tuple[str, int]]] = {}  # file -> (record id, place) there
    for record in store.records():
        if type(record.response) is int:
            responses.setdefault(unplace(record.response)[0], []).append(
                (record.id, record.response)
            )
        elif type(record.response) is bytes and not (store.ledger and store.ledger.pending(record)):
            problems.append(f"{record.id} holds its response's bytes but its entry is written")
    j = Journal(store.journal.root)
    on_disk = set(j.existing())
    try:
        for pack, (held, live, size) in packs.items():
            placed = responses.pop(pack, [])
            counted = sum(s.length + SEG_OVERHEAD for s in held.values())
            counted += sum(unplace(at)[2] + SEG_OVERHEAD for _, at in placed)
            if counted != live:
                problems.append(f"journal file {pack}: live byte count drifted")
            if pack not in on_disk:
                problems.append(f"journal file {pack} indexed but missing")
                continue
            actual = j.path(pack).stat().st_size
            if pack == store.journal.active:  # room preallocated past its entries
                actual = size if actual == store.journal.allocated else actual
            if actual != size:
                problems.append(f"journal file {pack} is {actual}B, indexed {size}B")
            for rid, at in placed:
                _, offset, length, _ = unplace(at)
                if offset + length > actual:
                    problems.append(f"{rid}'s response located past the end of journal file {pack}")
                    continue
                try:
                    j.read_response(at)
                except Exception as exc:  # a StoreFailure, reported as drift
                    problems.append(f"{rid}'s response unreadable in journal file {pack}: {exc}")
            for key, segment in held.items():
                if segments.get(key) is not segment:
                    problems.append(f"{key} indexed in journal file {pack} but not live")
                    continue
                if segment.offset + segment.length > actual:
                    problems.append(f"{key} located past the end of journal file {pack}")
                    continue
                try:
                    j.read(key, segment.size, pack, segment.offset, segment.length)
                except Exception as exc:  # a StoreFailure, reported as drift
                    problems.append(f"{key} unreadable in journal file {pack}: {exc}")
        for pack in on_disk - set(packs):
            problems.append(f"journal file {pack} on disk but not indexed")
        for pack in responses:
            problems.append(f"responses located in journal file {pack}, which is not indexed")
        problems += _check_files(store, j)
    finally:
        j.close()
    return problems


def _check_files(store: Store, j: Journal) -> list[str]:
    """Segments in files of their own: each indexed one there and whole, its bytes counted,
    and no file that is neither needed nor waiting for its removal."""
    problems: list[str] = []
    keydir, segments = store.table.keydir, store.segments()
    own = [s for s in segments.values() if s.pack == FILES]
    if sorted(s.key for s in own) != sorted(keydir.files):
        problems.append("segment files indexed disagree with the segments located in them")
    if sum(s.length + SEG_OVERHEAD for s in own) != keydir.live.get(FILES, 0):
        problems.append("segment files: live byte count drifted")
    for segment in own:
        try:
            j.read(segment.key, segment.size, FILES, 0, segment.length)
        except Exception as exc:  # a StoreFailure, reported as drift
            problems.append(f"{segment.key} unreadable in its segment file: {exc}")
    for key in segment_files.on_disk(j.root):
        if key not in keydir.files and key not in keydir.gone:
            problems.append(f"segment file {key} on disk but neither needed nor to be removed")
    return problems
