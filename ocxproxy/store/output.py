"""A stored response object without the output items its turn's segment already holds."""

from __future__ import annotations

from ocxproxy.model import shared

_OUTPUT = b'"output":['


def split_output(response: bytes, items: bytes) -> tuple[bytes, tuple[int, int] | None]:
    """Cut from `response` the leading bytes of its output array that equal the tail of
    `items` (the same serialized output items), so they are stored once. Any cut is
    verified byte for byte, so putting them back always restores `response` exactly."""
    start = response.find(_OUTPUT)
    if start < 0:
        return response, None
    start += len(_OUTPUT)
    probe = response[start : start + 64]
    if not probe or probe.startswith(b"]"):
        return response, None
    at = items.find(probe)
    for _ in range(4):
        if at < 0:
            break
        length = len(items) - at
        if response.startswith(items[at:], start):
            return response[:start] + response[start + length :], shared((start, length))
        at = items.find(probe, at + 1)
    return response, None
