"""Store.check(): drift between the index, the tiers and the files on disk (diskcache's
`check`). Diagnostic only: it lists the spill directory, so call it while the store is idle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ocxproxy.store import Store


def check_store(store: Store) -> list[str]:
    problems: list[str] = []
    segments, resident, disk = store._segments, store.resident, store.disk
    refs: dict[str, int] = {}
    durable_refs: dict[str, int] = {}
    for record in store._records.values():
        for segment in (*record.segments, record.response):
            refs[segment.key] = refs.get(segment.key, 0) + 1
            if record.durable:
                durable_refs[segment.key] = durable_refs.get(segment.key, 0) + 1
            if segments.get(segment.key) is not segment:
                problems.append(f"{record.id} references unindexed {segment.key}")
    for key, segment in segments.items():
        if segment.refs != refs.get(key, 0):
            problems.append(f"{key} refs {segment.refs} != {refs.get(key, 0)}")
        if key in resident and segment.data is None:
            problems.append(f"{key} resident without bytes")
        if segment.lost is not None and segment.data is not None:
            problems.append(f"{key} lost ({segment.lost}) but has bytes")
        want = durable_refs.get(key, 0)
        if segment.durable_refs != want or segment.durable != (want > 0):
            problems.append(f"{key} durable {segment.durable} ({segment.durable_refs}) != {want}")
        if segment.on_disk and not segment.durable:
            problems.append(f"{key} is store:false content on disk")
        if segment.on_disk and (disk is None or disk.files.get(key) is not segment):
            problems.append(f"{key} on disk but not in the disk tier")
    indexed = 0
    for record in store._records.values():
        for item_id in record.segments[-1].item_ids.ids if record.segments else ():
            indexed += 1
            if not any(r is record for r in store.items.holders(record.scope, item_id)):
                problems.append(f"{record.id}'s item {item_id} is not in the item index")
    if store.items.entries() != indexed:
        problems.append(f"item index holds {store.items.entries()} entries, records {indexed}")
    if sum(s.size for s in resident) != resident.bytes:
        problems.append("resident byte count drifted")
    for segment in resident:
        if segments.get(segment.key) is not segment:
            problems.append(f"{segment.key} resident but unindexed")
    if disk is None or not disk.enabled:
        return problems
    if sum(s.disk_size for s in disk.files.values()) != disk.bytes:
        problems.append("disk byte count drifted")
    scan = disk.spill.scan()
    for key, segment in disk.files.items():
        if segments.get(key) is not segment or not segment.on_disk:
            problems.append(f"{key} in the disk tier but not an indexed on-disk segment")
        if key not in scan.files:
            problems.append(f"{key} indexed on disk but its file is missing")
        elif scan.files[key] != segment.disk_size:
            problems.append(f"{key} file is {scan.files[key]}B, indexed {segment.disk_size}B")
    for key in scan.files:
        if key not in disk.files and key not in disk.doomed:
            problems.append(f"{key} orphan spill file")
    problems.extend(f"stray entry {p}" for p in (*scan.temps, *scan.unsafe))
    return problems
