"""Building turns and stores for the store tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import zstandard
from hypothesis import HealthCheck, settings

from ocxproxy.metrics import Metrics
from ocxproxy.model import Turn
from ocxproxy.store import Store

_PROFILES = {
    "fast": settings(max_examples=50, stateful_step_count=50),
    "deep": settings(max_examples=1000, stateful_step_count=80),
}
# HYPOTHESIS_PROFILE=fast (default) or deep picks how hard the store tests search; applied
# per test (not globally) so other packages' Hypothesis settings stay their own.
HYPOTHESIS = settings(
    _PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "fast")],
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


async def inline(fn: Callable[..., Any], /, *args: Any) -> Any:
    """An offload that runs the blocking call right here: deterministic for Hypothesis."""
    return fn(*args)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def items_of(texts: list[str]) -> tuple[bytes, int]:
    encoded = [orjson.dumps({"role": "user", "content": t}) for t in texts]
    return b",".join(encoded), len(encoded)


def make_turn(
    response_id: str,
    user: str,
    *,
    scope: str = "scope-a",
    durable: bool = True,
    answer: str | None = None,
    call_id: str | None = None,
    filled: bool = False,
) -> Turn:
    """A turn whose new items are one user message and one assistant message (or call);
    `filled`: its response ends with members filled in from the request (`FILL`)."""
    output: dict[str, Any]
    if call_id is not None:
        output = {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}
    else:
        text = answer if answer is not None else f"echo: {user}"
        output = {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
    user_item = orjson.dumps({"role": "user", "content": user})
    out = orjson.dumps(output)
    response = {
        "id": response_id,
        "object": "response",
        "status": "completed",
        "model": "m",
        "output": [output],
        "usage": {"input_tokens": 5, "output_tokens": 3},
    }
    encoded = orjson.dumps(response)
    output_at = (encoded.find(b'"output":[') + 10, len(out))  # (as build_turn finds it)
    fill, fill_at = b"", -1
    if filled:
        # The members the envelope fills in from the request, before the closing brace
        # as it puts them: the store keeps them once (Turn.fill).
        fill, fill_at = FILL, len(encoded)
        encoded = b"".join((encoded[:-1], b",", FILL, b"}"))
    return Turn(
        response_id=response_id,
        scope=scope,
        durable=durable,
        items=user_item + b"," + out,
        n_items=2,
        call_ids=frozenset({call_id} if call_id else ()),
        response=encoded,
        fill=fill,
        fill_at=fill_at,
        output_at=output_at,
    )


FILL = b'"instructions":"Be brief.","tools":[],"tool_choice":"auto","temperature":1.0'


def make_store(state_dir: Path | None, **overrides: Any) -> Store:
    options: dict[str, Any] = {
        "max_resident_bytes": 64 * 1024,
        "max_entries": 10_000,
        "ttl": 3600.0,
        "metrics": Metrics(),
        "state_dir": state_dir,
        "snapshot_delay": 0.01,
    }
    options.update(overrides)
    return Store(**options)


def sample(metric: Any, **labels: str) -> float:
    """The current value of a prometheus metric (child)."""
    child = metric.labels(**labels) if labels else metric
    return float(child.get())


def journal_files(state_dir: Path) -> dict[int, Path]:
    root = state_dir / "journal"
    if not root.exists():
        return {}
    return {int(p.name.removesuffix(".log")): p for p in root.glob("*.log")}


def checkpoint_ids(state_dir: Path) -> list[str]:
    """Record ids the checkpoint alone names (no journal replay)."""
    from ocxproxy.store.local import codec, journal

    loaded = codec.Loaded()
    codec.load_checkpoint((state_dir / journal.CHECKPOINT).read_bytes(), loaded)
    return list(loaded.records)


def durable_ids(state_dir: Path) -> list[str]:
    """Record ids a start-up would load: checkpoint plus journal (read only)."""
    from ocxproxy.store.local.journal import Journal

    return list(Journal(state_dir).load(repair=False).records)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def unzstd_all(data: bytes) -> list[bytes]:
    """Every zstd frame found anywhere in `data` (journal entries embed them), decompressed."""
    out: list[bytes] = []
    at = data.find(_ZSTD_MAGIC)
    while at >= 0:
        with contextlib.suppress(zstandard.ZstdError):
            out.append(zstandard.ZstdDecompressor().decompressobj().decompress(data[at:]))
        at = data.find(_ZSTD_MAGIC, at + 1)
    return out


def all_bytes_under(path: Path) -> bytes:
    """Every byte of every file under `path`, with every zstd frame in them decompressed."""
    chunks: list[bytes] = []
    if not path.exists():
        return b""
    for root, _dirs, names in os.walk(path):
        for name in names:
            p = Path(root, name)
            if p.is_symlink() or not p.is_file():
                continue
            data = p.read_bytes()
            chunks.append(data)
            chunks.extend(unzstd_all(data))
    return b"\n".join(chunks)
