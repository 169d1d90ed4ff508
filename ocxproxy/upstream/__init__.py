"""Talking to backends: the pool (choice, health, sessions), SSE framing, the local backend.

aiohttp client errors and timeouts are mapped to UpstreamError here and nowhere else.
Never imports the store or aiohttp.web.
"""
