"""The single-node store: records in memory, their segments in memory and in the journal.

store.py's Store owns the records and does every change; the journal (journal.py, codec.py),
its committer (committer.py, syncer.py, fsync_child.py), the durable state (durable.py,
ledger.py), the checkpoint and start-up's rebuilding (upkeep.py, restore.py) sit beside it.
"""
