"""continuation/affinity.py: which key a request is routed by, and which key its chain keeps."""

from __future__ import annotations

from typing import Any

import pytest

from ocxproxy.continuation.affinity import HEAD_KEY, PCK_KEY, ROOT_KEY, affinity_of, chain_key
from ocxproxy.continuation.expand import check_request
from ocxproxy.model import Record, Segment

HI = {"role": "user", "content": "hi"}
LATER = {"role": "user", "content": "later"}


def parent(affinity_key: str | None) -> Record:
    response = Segment(b"{}", 0, frozenset(), durable=True)
    return Record("resp_p", "scope", 0.0, 1e9, True, None, response, affinity_key=affinity_key)


@pytest.mark.parametrize(
    ("body", "parent_key", "expected"),
    [
        ({"model": "m", "input": [HI], "prompt_cache_key": "k"}, None, PCK_KEY + "k"),
        ({"model": "m", "input": [HI], "prompt_cache_key": "k"}, "root:r", PCK_KEY + "k"),
        ({"model": "m", "input": [HI]}, "root:r", "root:r"),
        ({"model": "m", "input": [HI], "prompt_cache_key": ""}, "root:r", "root:r"),
        ({"model": "m", "input": [HI], "prompt_cache_key": 7}, "root:r", "root:r"),
    ],
    ids=["client-key", "client-key-over-chain", "chain", "empty-client-key", "non-string-key"],
)
def test_a_client_key_wins_then_the_chain_key(
    body: dict[str, Any], parent_key: str | None, expected: str
) -> None:
    prev = None if parent_key is None else parent(parent_key)
    assert affinity_of(check_request(body), prev) == expected


def head(body: dict[str, Any], prev: Record | None = None) -> str:
    key = affinity_of(check_request(body), prev)
    assert key.startswith(HEAD_KEY)
    return key


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ({"model": "m", "input": [HI]}, {"model": "m", "input": [HI, LATER]}, True),
        ({"model": "m", "input": [HI]}, {"model": "m", "input": [HI], "temperature": 1}, True),
        ({"model": "m", "input": [HI]}, {"model": "n", "input": [HI]}, False),
        ({"model": "m", "input": [HI]}, {"model": "m", "input": [LATER]}, False),
        (
            {"model": "m", "input": [HI]},
            {"model": "m", "instructions": "Be.", "input": [HI]},
            False,
        ),
    ],
    ids=["more-history", "other-settings", "other-model", "other-opening", "other-instructions"],
)
def test_without_a_key_the_opening_is_the_key(
    a: dict[str, Any], b: dict[str, Any], same: bool
) -> None:
    assert (head(a) == head(b)) is same


def test_a_parent_without_a_key_falls_back_to_the_opening() -> None:
    body = {"model": "m", "input": [HI]}
    assert head(body, parent(None)) == head(body)


OPENED = HEAD_KEY + "abc"


@pytest.mark.parametrize(
    ("key", "has_parent", "response", "expected"),
    [
        (OPENED, False, {"id": "resp_1"}, ROOT_KEY + "resp_1"),
        (None, False, {"id": "resp_1"}, ROOT_KEY + "resp_1"),
        (OPENED, True, {"id": "resp_1"}, OPENED),
        (PCK_KEY + "k", False, {"id": "resp_1"}, PCK_KEY + "k"),
        ("root:r", True, {"id": "resp_2"}, "root:r"),
        (OPENED, False, {"id": 5}, OPENED),
        (OPENED, False, None, OPENED),
    ],
    ids=[
        "first-turn-by-opening",
        "first-turn-unkeyed",
        "later-turn",
        "client-key",
        "chain-keeps-root",
        "id-not-a-string",
        "no-response",
    ],
)
def test_a_chain_opened_alike_gets_its_own_root_key(
    key: str | None, has_parent: bool, response: Any, expected: str
) -> None:
    prev = parent(key) if has_parent else None
    assert chain_key(key, prev, response) == expected
