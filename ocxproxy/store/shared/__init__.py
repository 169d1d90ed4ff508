"""The shared tier: the store on Valkey/Redis, several replicas on one server.

store.py's SharedStore; its key layout and scripts (layout.py, conversation_scripts.py),
its connection and round trips (server.py, wire.py), its start-up checks (checks.py).
Imported only when asked for: its client is an extra (ocxproxy[shared]).
"""
