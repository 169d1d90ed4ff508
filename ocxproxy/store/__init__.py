"""The continuation store: records of remembered responses and the segments they share.

Owns memory and disk state; never imports aiohttp, ocxproxy.http or ocxproxy.upstream.
Every way a lookup can fail is a StoreFailure with a FailureReason. Store (core.py) does
every change and owns the records (records.py); segments.py's SegmentTable alone changes
segments (resident.py the memory tier, keydir.py where their bytes are); ledger.py queues
a durable record's journal entries and applies each commit's outcome; durable.py owns the
files, the committer (disk.py) and the checkpoint. journal.py holds the files (journal,
packs, checkpoint) and codec.py their entries, restore.py start-up's rebuilding of the
index, upkeep.py the maintenance policy and the checkpoint's encoding, stats.py the stats
and gauges.
Public surface: Store, StoreStats, default_state_dir.
"""

from ocxproxy.store.core import Store, StoreStats, default_state_dir

__all__ = ["Store", "StoreStats", "default_state_dir"]
