"""The state dir's format marker: the file `format` names, as one decimal number, the
on-disk format the dir is written in.

A release reads every format up to its own and refuses a newer one (`NewerFormat`)
before it changes anything in the dir: a newer format's entries would be skipped as
unknown, and every record since lost. A dir without the file was written before the
marker (format 1, which this release reads); the first start that takes the dir writes
the marker (temp file, fsync, rename, directory fsync) before its first write, so
a later release that changes the format marks the dir before it writes any of it.

Blocking calls: run them in a thread.
"""

from __future__ import annotations

from pathlib import Path

from ocxproxy.config import ConfigError
from ocxproxy.store.local import files

NAME = "format"
UNMARKED = 1  # a dir written before the marker existed
# What this release writes: responses in their records' entries (REC, RSP) (2), the
# members filled in from the request a segment that record rows name (3), a small
# response's bytes as they are, with their CRC-32 (4).
FORMAT = 4
_LIMIT = 64  # bytes: the file holds one number


class NewerFormat(ConfigError):
    """The state dir is in a format newer than this release reads: it refuses the dir
    rather than load part of it and lose the rest."""

    def __init__(self, root: Path, found: int) -> None:
        self.found = found
        super().__init__(
            f"state dir {root} is in format {found}, newer than this ocxproxy reads "
            f"(format {FORMAT}); a later release wrote it and loading it here would lose "
            f"records: run that release (or a later one), or choose another --state-dir"
        )


class UnreadableFormat(ConfigError):
    """The marker is there but does not name a format."""


def read(root: Path) -> int:
    """The dir's format (UNMARKED without a marker); NewerFormat when this release cannot
    read it, UnreadableFormat when the marker is not a number. Changes nothing."""
    path = root / NAME
    try:
        raw = files.read_regular(path, _LIMIT)
    except FileNotFoundError:
        return UNMARKED
    except OSError as exc:
        raise UnreadableFormat(f"state dir {root}: its format marker {path}: {exc}") from None
    text = raw.decode("ascii", "replace").strip()
    if not text.isdigit():
        raise UnreadableFormat(
            f"state dir {root}: its format marker {path} does not name a format "
            f"({text[:20]!r}); this ocxproxy reads formats up to {FORMAT}"
        )
    found = int(text)
    if found > FORMAT:
        raise NewerFormat(root, found)
    return found


def mark(root: Path, found: int) -> None:
    """Record this release's format in the dir (durably), unless it says so already."""
    if found != FORMAT:
        files.write_atomic(root / NAME, [b"%d\n" % FORMAT])
