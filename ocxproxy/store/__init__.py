"""The continuation store: records of remembered responses and the segments they share.

Owns memory and disk state; never imports aiohttp, ocxproxy.http or ocxproxy.upstream.
Every way a lookup can fail is a StoreFailure with a FailureReason. Store (core.py) is the
one owner of the state; journal.py holds the files (journal, packs, checkpoint) and
codec.py their entries, disk.py the committer that writes them, resident.py the memory
tier, keydir.py the per-file accounting of where segment bytes are, restore.py start-up's
rebuilding of the index, upkeep.py the maintenance policy and the checkpoint's encoding.
Public surface: Store, StoreStats, default_state_dir.
"""

from ocxproxy.store.core import Store, StoreStats, default_state_dir

__all__ = ["Store", "StoreStats", "default_state_dir"]
