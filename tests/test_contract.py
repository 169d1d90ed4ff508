"""Clause citations (`C1.7`, `C6`) in code and tests point at docs/CONTRACT.md, and at a
clause that it has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "CONTRACT.md"
CITATION = re.compile(r"(?<![\w.])C[1-9](?:\.\d+)?(?!\w)")


def clauses() -> set[str]:
    """`C1` for a section `## C1. …`, `C1.7` for item 7 of its numbered list."""
    found: set[str] = set()
    section = None
    for line in CONTRACT.read_text().splitlines():
        if heading := re.match(r"## (C[1-9])\. ", line):
            section = heading.group(1)
            found.add(section)
        elif section and (item := re.match(r"(\d+)\. ", line)):
            found.add(f"{section}.{item.group(1)}")
    return found


def citing_lines() -> list[tuple[str, str]]:
    lines = []
    for folder in ("ocxproxy", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # this file names clauses as examples
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if CITATION.search(line):
                    lines.append((f"{path.relative_to(ROOT)}:{number}", line))
    return lines


def test_the_contract_has_its_sections_and_c1_items() -> None:
    have = clauses()
    assert {f"C{n}" for n in range(1, 10)} <= have
    assert {f"C1.{n}" for n in range(1, 9)} <= have


def test_every_citation_names_a_clause_of_docs_contract() -> None:
    lines = citing_lines()
    assert any("C1.7" in line for _, line in lines)  # the walk does see citations
    have = clauses()
    unknown = [
        (where, cited)
        for where, line in lines
        for cited in CITATION.findall(line)
        if cited not in have
    ]
    assert unknown == []


def test_every_citing_line_says_which_file() -> None:
    bare = [where for where, line in citing_lines() if "CONTRACT.md" not in line]
    assert bare == [], "write 'CONTRACT.md C1.7': the clauses are docs/CONTRACT.md's"
