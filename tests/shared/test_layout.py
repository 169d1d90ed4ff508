"""The shared tier's layout (store/shared/keys.py, store/shared/layout.py) on its own: key
names, the dictionary the values are compressed with, the encoding of values. The same
layout on a real server: tests/shared/test_store.py."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from ocxproxy.model import ItemIds, Segment
from ocxproxy.store.shared import dictionary, layout
from ocxproxy.store.shared.keys import LAYOUT, Keys, budget_keys, kept_keys

SCOPE = hashlib.sha256(b"token").hexdigest()[:32]  # as http/context.py makes one


def test_the_dictionary_is_the_one_the_layout_was_made_with() -> None:
    # A new dictionary is a new layout: change LAYOUT (and this digest) with it.
    digest = hashlib.sha256(dictionary.DICTIONARY).hexdigest()
    assert digest == dictionary.SHA256 == layout.DICTIONARY_SHA256


def test_key_names_carry_the_layout_tag_and_the_scope_in_raw_bytes() -> None:
    keys = Keys("ocx:", SCOPE)
    assert keys.base == b"ocx:" + LAYOUT + b"\x10" + bytes.fromhex(SCOPE)
    digest = hashlib.sha256(b"x").hexdigest()
    assert keys.segment(digest) == keys.base + b"s" + hashlib.sha256(b"x").digest()
    assert keys.record("resp_1") == keys.base + b"rresp_1"
    assert Keys("ocx:", "anonymous").base == b"ocx:" + LAYOUT + b"\x89anonymous"
    # Text that is no canonical hex hash stays text, marked so: no hash's bytes spell it.
    spelled = b"abcdefghijklmnop".hex()  # a hash whose bytes spell a 16-letter text
    scopes = (SCOPE, SCOPE.upper(), "anonymous", "ab", "AB", spelled, "abcdefghijklmnop")
    bases = {Keys("ocx:", s).base for s in scopes}
    assert len(bases) == len(scopes)
    assert all(not k.startswith(b"ocx:" + LAYOUT + b"\0") for k in bases)  # the budget's


def test_conversation_and_idempotency_names_are_the_ones_servers_hold() -> None:
    # A conversation never expires: renaming its keys would lose every one at an upgrade.
    keys = Keys("ocx:", SCOPE)
    assert keys.conversation("conv_1") == [
        f"ocx:{SCOPE}:conv:conv_1",
        f"ocx:{SCOPE}:conv:conv_1:items",
        f"ocx:{SCOPE}:lock:conv_1",
    ]
    assert keys.idempotency("idem_1") == [f"ocx:{SCOPE}:idem:idem_1", f"ocx:{SCOPE}:idemrun:idem_1"]
    reserved = b"ocx:" + LAYOUT + b"\0"
    assert budget_keys("ocx:") == (reserved + b"chains", reserved + b"bytes", reserved + b"total")
    assert kept_keys("ocx:") == [
        reserved + b"kept",
        reserved + b"keptbytes",
        reserved + b"kepttotal",
        reserved + b"total",
    ]


def test_a_small_turn_compresses_to_under_half_with_the_dictionary() -> None:
    user = orjson.dumps({"role": "user", "content": "please fix the failing test in the module"})
    output = orjson.dumps(
        {
            "type": "message",
            "id": "msg_68af1c2e9b0c8190a1d3",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Done: it passes.", "annotations": []}],
        }
    )
    data = user + b"," + output
    segment = Segment(data, 2, frozenset(), durable=True, item_ids=ItemIds([("msg_x", 0, 1)]))
    value = layout.encode_segment(segment, data)
    assert len(value) < len(data) / 2
    decoded = layout.decode_segment(segment.key, value)
    assert decoded.data == data and decoded.n_items == 2
    assert decoded.item_ids.span("msg_x") == (0, 1)


def test_a_value_that_is_not_this_layouts_is_refused() -> None:
    data = b'{"role":"user","content":"hi"}'
    segment = Segment(data, 1, frozenset(), durable=True)
    value = layout.encode_segment(segment, data)
    with pytest.raises(ValueError, match="unknown encoding"):
        layout.decode_segment(segment.key, b"z" + value[1:])
    with pytest.raises(ValueError, match="failed its digest"):
        layout.decode_segment(hashlib.sha256(b"other").hexdigest(), value)
    with pytest.raises(ValueError, match="unreadable"):
        layout.read_head("resp_1", b"1:12345678" + b"r" + b"\xff\xff")
