"""Pure continuation logic: request parsing, expansion by byte splicing, and what to record.

No I/O, no asyncio, no aiohttp: bytes and dicts in, bytes and dataclasses out.
"""
