"""Where segment bytes are: the count of segments the journal holds, and per journal file
the bytes its live segments take, its size, when a segment last left it (or changed its
row there: the checkpoint copies a file's rows only if neither happened), and the keys of
the segments placed there (compaction's list of what to look at: a segment that left
stays listed until its file goes, at most as many as those still there once the file is
sparse enough to compact). Segments in files of their own (segment_files.py, "file"
FILES) are counted in `live` like a journal file's, listed in `files`, and, once none
needs a file, in `gone` until it is removed. A durable record's response kept in its
record's journal entry (`model.place`) is counted in its file's `live` the same way, and
its record's id listed there (`responses`, compaction's list, as `keys`). Store owns the
one Keydir and calls it whenever a segment's or a response's location changes."""

from __future__ import annotations

from collections.abc import Iterable

from ocxproxy.model import LENGTH_MAX, Segment, unplace
from ocxproxy.store.local.segment_files import FILES

SEG_OVERHEAD = 96  # about what a SEG entry adds to its blob (frame, metadata)


class Keydir:
    __slots__ = (
        "captures", "changed_at", "files", "gone", "keys", "left_at", "live", "live_bytes",
        "located", "lost_at", "responses", "sizes",
    )  # fmt: skip

    def __init__(self) -> None:
        self.located = 0  # segments whose bytes the journal holds
        self.live: dict[int, int] = {}  # file -> compressed bytes of those segments
        self.sizes: dict[int, int] = {}  # file -> its size
        self.left_at: dict[int, int] = {}  # file -> capture number when a segment last left
        # file -> capture number when a segment located there last changed its metadata
        self.changed_at: dict[int, int] = {}
        self.keys: dict[int, list[bytes]] = {}  # file -> digests of the segments placed there
        # file -> ids of the records whose responses were placed there
        self.responses: dict[int, list[str]] = {}
        self.live_bytes = 0
        self.captures = 0  # checkpoints captured
        # capture number when a segment live records hold last lost its journal copy
        self.lost_at = -1
        self.files: dict[str, None] = {}  # keys (hex) of the segments in files of their own
        self.gone: dict[str, int] = {}  # files no segment needs -> capture number they left at

    def _listed(self, pack: int) -> list[bytes]:
        keys = self.keys.get(pack)
        if keys is None:
            keys = self.keys[pack] = []
        return keys

    def locate(self, segment: Segment, pack: int, offset: int, length: int) -> None:
        segment.pack, segment.lost = pack, None
        segment.place(offset, length)
        self.located += 1
        self.live[pack] = self.live.get(pack, 0) + length + SEG_OVERHEAD
        self.live_bytes += length + SEG_OVERHEAD
        if pack == FILES:
            self.files[segment.key] = None
            self.gone.pop(segment.key, None)
        else:
            self._listed(pack).append(segment.digest)

    def restored(self, segments: Iterable[Segment]) -> None:
        """Start-up: count `segments`, whose locations were read from the journal, as
        located (one pass; `locate` per segment is most of a 100,000-record start)."""
        live, keys, total, n = self.live, self.keys, 0, 0
        for segment in segments:
            length = (segment.at & LENGTH_MAX) + SEG_OVERHEAD  # (its length, read directly)
            live[segment.pack] = live.get(segment.pack, 0) + length
            if segment.pack == FILES:
                self.files[segment.key] = None
            else:
                listed = keys.get(segment.pack)
                if listed is None:
                    listed = keys[segment.pack] = []
                listed.append(segment.digest)
            total += length
            n += 1
        self.live_bytes += total
        self.located += n

    def locate_response(self, record_id: str, at: int) -> None:
        """Record `record_id`'s response is now at `at` (`model.place`)."""
        pack, _, length, _ = unplace(at)
        self.live[pack] = self.live.get(pack, 0) + length + SEG_OVERHEAD
        self.live_bytes += length + SEG_OVERHEAD
        listed = self.responses.get(pack)
        if listed is None:
            listed = self.responses[pack] = []
        listed.append(record_id)

    def restored_responses(self, placed: list[tuple[str, int]]) -> None:
        """Start-up: `locate_response` of each (record id, place), in one pass."""
        live, responses, total = self.live, self.responses, 0
        for record_id, at in placed:
            pack, _, length, _ = unplace(at)
            live[pack] = live.get(pack, 0) + length + SEG_OVERHEAD
            total += length + SEG_OVERHEAD
            listed = responses.get(pack)
            if listed is None:
                listed = responses[pack] = []
            listed.append(record_id)
        self.live_bytes += total

    def unlocate_response(self, at: int) -> None:
        """A response no longer at `at`: its record went, or it moved."""
        pack, _, length, _ = unplace(at)
        self.live[pack] -= length + SEG_OVERHEAD
        self.live_bytes -= length + SEG_OVERHEAD
        self.left_at[pack] = self.captures

    def unlocate(self, segment: Segment) -> None:
        pack = segment.pack
        if pack < 0:
            return
        self.located -= 1
        self.live[pack] -= segment.length + SEG_OVERHEAD
        self.live_bytes -= segment.length + SEG_OVERHEAD
        if pack == FILES:
            del self.files[segment.key]
            self.gone[segment.key] = self.captures
        else:
            self.left_at[pack] = self.captures
        segment.pack = -1

    def lost(self, segment: Segment) -> None:
        """A located segment that records still hold is unreadable where it is: no longer
        located (those records' rows leave the checkpoint, so none of its rows is copied
        from the previous checkpoint file: `lost_at`)."""
        if segment.pack >= 0:
            self.lost_at = self.captures
        self.unlocate(segment)

    def changed(self, segment: Segment) -> None:
        """A located segment's metadata (its row) changed: its item ids were learnt."""
        if segment.pack > FILES:
            self.changed_at[segment.pack] = self.captures

    def unchanged_since(self, pack: int, capture: int) -> bool:
        """No segment left journal file `pack`, or changed its row there, since
        `capture`. (One may have come back: a forgotten segment taken back where it was
        lists its key there again, so the number of keys listed tells that.)"""
        return self.left_at.get(pack, -1) < capture and self.changed_at.get(pack, -1) < capture

    def written_unneeded(self, key: str) -> None:
        """A segment file written for a segment dropped while its commit was in flight:
        removed like one that left, unless a live segment was placed in it since."""
        if key not in self.files:
            self.gone[key] = self.captures

    def unneeded(self, capture: int) -> list[str]:
        """Keys of the files no segment has needed since before `capture`."""
        return [key for key, left in self.gone.items() if left < capture]

    def removed(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.gone.pop(key, None)

    def drop(self, pack: int) -> None:
        self.live.pop(pack, None)
        self.sizes.pop(pack, None)
        self.left_at.pop(pack, None)
        self.changed_at.pop(pack, None)
        self.keys.pop(pack, None)
        self.responses.pop(pack, None)

    def sparse(self, before: int, below: float, budget: int) -> set[int]:
        """Files before `before` whose live share is under `below`, oldest first, until
        their live bytes pass `budget`."""
        out: set[int] = set()
        for pack, size in sorted(self.sizes.items()):
            live = self.live.get(pack, 0)
            if pack < before and 0 < live < size * below and budget > 0:
                out.add(pack)
                budget -= live
        return out

    def placed(self, before: int) -> list[tuple[int, list[bytes]]]:
        """(file, the digests listed for it) for each file before `before`, in order, after
        those in files of their own."""
        journal = [(p, keys) for p, keys in sorted(self.keys.items()) if p < before]
        return [(FILES, [bytes.fromhex(key) for key in self.files]), *journal]

    def removable(self, before: int, capture: int) -> list[int]:
        """Files before `before` that no live segment has needed since `capture`."""
        return [
            p
            for p in self.sizes
            if p < before and not self.live.get(p) and self.left_at.get(p, -1) < capture
        ]

    def packs(self, segments: Iterable[Segment]) -> dict[int, tuple[dict[str, Segment], int, int]]:
        """Journal file -> (segments located there by key, their bytes as counted, its
        size); segments in files of their own are not listed."""
        held: dict[int, dict[str, Segment]] = {p: {} for p in self.sizes}
        for segment in segments:
            if segment.pack > FILES:
                held.setdefault(segment.pack, {})[segment.key] = segment
        return {p: (held[p], self.live.get(p, 0), self.sizes.get(p, -1)) for p in held}
