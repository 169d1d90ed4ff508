"""The repository describes the product, not how it was built: no text names a work
session, a wave of work or an issue by number ("session 9", "this session", "issue 18",
"#15"). What changed when is git log's. Words that are the product's own (aiohttp's
ClientSession, `session_id`, the Agents SDK's `session=`, a "long coding session") pass."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ""}
FOLDERS = ("ocxproxy", "tests", "scripts", "docs", "deploy", ".ci")
FILES = ("README.md", "pyproject.toml")

HISTORY = re.compile(
    r"""
      \bissues?\ +\#?\d+                                  # issue 18, issues 13 and 15
    | \bsessions?\ +\d+                                   # session 9
    | \b(?:this|last|previous|earlier|next|that)\ session\b   # this session
    | \bwaves?\ +\d+                                      # wave 2
    | (?<![^\s(])\#\d{1,5}\b                              # #15, (#15); not echo#1 or x#3381
    """,
    re.IGNORECASE | re.VERBOSE,
)


def texts() -> list[Path]:
    paths = [ROOT / name for name in FILES]
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
                paths.append(path)
    return [path for path in paths if path != Path(__file__).resolve()]


def mentions(text: str) -> list[str]:
    return [match.group(0) for match in HISTORY.finditer(text)]


def test_no_text_narrates_sessions_or_issue_numbers() -> None:
    found = []
    for path in texts():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue  # binary test data
        for number, line in enumerate(lines, 1):
            if hits := mentions(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {', '.join(hits)}")
    assert found == [], "history belongs in git log:\n" + "\n".join(found)


def test_the_walk_sees_the_docs_and_the_code() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in texts()}
    assert {"README.md", "docs/ARCHITECTURE.md", "ocxproxy/cli.py", "scripts/serve"} <= names


def test_what_it_flags_and_what_it_lets_pass() -> None:
    flagged = [
        "start-up time is one of issue 18's figures",
        "the shared tier (issue 15)",
        "figures from session 9's end runs",
        "Sessions 7 and 8 measured it",
        "what this session changed",
        "wave 2 brought conversations",
        "fixed in #15",
        "(#15)",
    ]
    passing = [
        "async with aiohttp.ClientSession() as session:",
        "response = await session.post(url)",
        'headers["session_id"] = sid',
        "agents.Runner.run(agent, question, session=session)",
        "the long coding session: at the context limit",
        'assert text == "echo#3: again"',
        "valkey-io/valkey#3381 is the upstream work",
        "an issue tracker",
        'prompt_cache_key="codex-session-1"',
        "# 1 MiB",
    ]
    assert [text for text in flagged if not mentions(text)] == []
    assert [text for text in passing if mentions(text)] == []
