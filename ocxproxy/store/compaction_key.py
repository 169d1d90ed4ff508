"""The key compaction items are sealed under (CONTRACT.md C10).

Given by the operator (`--compaction-key`), else generated on first start into the state
dir (`compaction.key`, mode 0600) and read from there afterwards. Under `--zdr` a key that
was not given lives in memory only: items sealed under it cannot be opened after a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from ocxproxy.config import Config, ConfigError

log = logging.getLogger("ocxproxy.compaction")

KEY_FILE = "compaction.key"
KEY_BYTES = 32  # AES-256


def key_from_secret(secret: str) -> bytes:
    """An operator's secret (any string; 64 hex digits are taken as the key itself)."""
    text = secret.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    return hashlib.sha256(b"ocxproxy compaction key\0" + text.encode()).digest()


def compaction_key(config: Config, state_dir: Path) -> bytes:
    if config.compaction_key is not None:
        return key_from_secret(config.compaction_key)
    if config.zdr:
        return os.urandom(KEY_BYTES)
    return _key_file(state_dir / KEY_FILE)


def _key_file(path: Path) -> bytes:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return _create(path)
    except OSError as exc:
        raise ConfigError(f"cannot read the compaction key {path}: {exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{path} does not hold a compaction key ({2 * KEY_BYTES} hex digits)")
    return key


def _create(path: Path) -> bytes:
    key = os.urandom(KEY_BYTES)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return _key_file(path)
    except OSError as exc:
        raise ConfigError(f"cannot create the compaction key {path}: {exc}") from None
    try:
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    log.info("generated a compaction key in %s", path)
    return key
