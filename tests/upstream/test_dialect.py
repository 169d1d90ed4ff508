"""Which backends speak chat (`--upstream-dialect`), and the Translator the pool uses to
shape one request for each dialect (upstream/dialect.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ocxproxy.config import Config, ConfigError, build_config
from ocxproxy.errors import InvalidRequest
from ocxproxy.metrics import Metrics
from ocxproxy.upstream.dialect import Translator
from ocxproxy.upstream.pool import UpstreamPool

A, B = "http://a:8000", "http://b:8000"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"upstream": [A]}, {A: "responses"}),
        ({"upstream": [A, B], "upstream_dialect": ["chat"]}, {A: "chat", B: "chat"}),
        ({"upstream": [A, B], "upstream_dialect": ["responses,chat"]}, {A: "responses", B: "chat"}),
        (
            {"upstream": [A + "/v1", B], "upstream_dialect": ["Chat", "responses"]},
            {A: "chat", B: "responses"},
        ),
    ],
)
def test_dialect_per_backend(raw: dict[str, Any], expected: dict[str, str]) -> None:
    config = build_config(raw)
    assert {url: config.dialect_of(url) for url in config.upstream} == expected
    pool = UpstreamPool(config.upstream, config, Metrics())
    assert {b.url: b.dialect for b in pool.backends} == expected


def test_one_dialect_also_covers_the_embedded_backend() -> None:
    config = Config(upstream_dialect=("chat",))
    pool = UpstreamPool((), config, Metrics())
    pool.add("http://127.0.0.1:9999")
    assert [b.dialect for b in pool.backends] == ["chat"]
    assert Config().dialect_of("http://x") == "responses"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (
            {"upstream": [A], "upstream_dialect": ["completions"]},
            "--upstream-dialect: unknown value",
        ),
        (
            {"upstream": [A, B], "upstream_dialect": ["chat,chat,chat"]},
            "3 dialects for 2 --upstream URLs",
        ),
        (
            {"upstream": [A, A], "upstream_dialect": ["chat,responses"]},
            "2 dialects for 1 --upstream URL",
        ),
    ],
)
def test_bad_dialects_fail_with_one_line(raw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    assert fragment in str(info.value) and "\n" not in str(info.value)


BODY = orjson.dumps({"model": "m", "input": "hi", "stream": True})


def test_translator_touches_only_responses_creates_for_chat_backends() -> None:
    translator = Translator("POST", "/v1/responses", BODY)
    assert translator.request("responses") == ("/v1/responses", BODY)
    path, body = translator.request("chat")
    assert path == "/v1/chat/completions"
    assert orjson.loads(body) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert translator.request("chat")[1] is body  # translated once, however many tries
    for method, path_qs, data in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", BODY),
        ("POST", "/v1/responses/compact", BODY),
        ("POST", "/v1/responses", None),  # a streamed passthrough body is never read here
    ):
        assert Translator(method, path_qs, data).request("chat") == (path_qs, data)


def test_translator_query_string_and_errors() -> None:
    assert Translator("POST", "/v1/responses?x=1", BODY).request("chat")[0] == (
        "/v1/chat/completions"
    )
    with pytest.raises(InvalidRequest) as info:
        Translator(
            "POST", "/v1/responses", b'{"input":"x","tools":[{"type":"web_search"}]}'
        ).request("chat")
    assert info.value.param == "tools[0].type"
    with pytest.raises(InvalidRequest):
        Translator("POST", "/v1/responses", b"[1]").request("chat")
