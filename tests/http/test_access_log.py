"""--access-log: one line per request (and per WebSocket turn) with the documented fields,
from both ways a request comes in (the front end's create path and aiohttp's routes), and
never a prompt, an output or a key."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ocxproxy.http.access_log import FIELDS, SCOPE_CHARS
from ocxproxy.http.context import scope_of
from tests.conftest import MakeProxy, ProxyHandle
from tests.fakes.backend import FakeBackend

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-a"
SCOPE = scope_of({"Authorization": f"Bearer {KEY}"})[:SCOPE_CHARS]
LOGFMT = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')

Line = dict[str, Any]


def json_lines(capsys: pytest.CaptureFixture[str]) -> list[Line]:
    """The access lines the proxy wrote to stdout so far."""
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def logfmt_lines(capsys: pytest.CaptureFixture[str]) -> list[Line]:
    lines = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("time="):
            pairs = LOGFMT.findall(line)
            lines.append({k: json.loads(v) if v.startswith('"') else v for k, v in pairs})
    return lines


def check_common(line: Line, route: str, method: str = "POST") -> None:
    assert list(line) == list(FIELDS)
    assert line["route"] == route and line["method"] == method
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert (
        abs((datetime.fromisoformat(line["time"]) - datetime.now().astimezone()).total_seconds())
        < 60
    )
    assert line["scope"] == SCOPE
    assert 0 <= line["overhead_ms"] <= line["duration_ms"]
    assert line["backend_ms"] == pytest.approx(line["duration_ms"] - line["overhead_ms"], abs=0.01)


async def json_proxy(make_proxy: MakeProxy, backend: FakeBackend) -> ProxyHandle:
    return await make_proxy(backend.url, access_log="json")


async def test_json_lines_for_a_chain_in_json_then_sse(
    make_proxy: MakeProxy, backend: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await json_proxy(make_proxy, backend)
    client = proxy.client(KEY)
    first = await client.responses.create(model="m", input="a first message " * 20)
    async with client.responses.stream(
        model="m", input="and a second", previous_response_id=first.id
    ) as stream:
        await stream.get_final_response()

    one, two = json_lines(capsys)
    for line in (one, two):
        check_common(line, "/v1/responses")
        assert line["status"] == 200 and line["outcome"] == "200"
        assert line["backend"] == backend.url and line["backend_ms"] > 0
        assert re.fullmatch(r"[0-9a-f]{16}", line["request_id"])
    assert one["request_id"] != two["request_id"]
    assert one["expansion"] is None and one["history_bytes"] == 0
    usage = [r.json["input"] for r in backend.responses_seen]
    assert one["input_tokens"] > 0 and one["cached_tokens"] == 0
    # The second turn carried the first one's history, which the fake's cache had seen.
    assert two["expansion"] == "hit"
    assert 0 < two["history_bytes"] < len(json.dumps(usage[1]))
    assert two["input_tokens"] > one["input_tokens"] and two["cached_tokens"] > 0


async def test_a_create_served_by_aiohttp_logs_the_same_fields(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    capsys: pytest.CaptureFixture[str],
    http: aiohttp.ClientSession,
) -> None:
    """A chunked create is not the front end's case: aiohttp's route serves it, through
    the same guarded() and the same line."""
    proxy = await json_proxy(make_proxy, backend)
    first = await proxy.client(KEY).responses.create(model="m", input="a first message")

    async def chunked() -> AsyncIterator[bytes]:
        yield json.dumps({"model": "m", "input": "more", "previous_response_id": first.id}).encode()

    async with http.post(
        proxy.base_url + "/responses",
        data=chunked(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 200
        assert resp.headers.get("Connection") == "close"  # aiohttp served it, not the front end
    front, routed = json_lines(capsys)
    assert list(front) == list(routed)
    check_common(routed, "/v1/responses")
    assert routed["status"] == 200 and routed["backend"] == backend.url
    assert routed["expansion"] == "hit" and routed["history_bytes"] > 0
    assert routed["input_tokens"] > 0 and routed["cached_tokens"] > 0


async def test_a_failed_lookup_logs_its_reason_and_no_backend(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    capsys: pytest.CaptureFixture[str],
    http: aiohttp.ClientSession,
) -> None:
    proxy = await json_proxy(make_proxy, backend)
    async with http.post(
        proxy.base_url + "/responses",
        json={"input": "x", "previous_response_id": "resp_nowhere"},
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-42.a:b"},
    ) as resp:
        assert resp.status == 400
    (line,) = json_lines(capsys)
    check_common(line, "/v1/responses")
    assert line["status"] == 400 and line["expansion"] == "unknown"
    assert line["backend"] is None and line["backend_ms"] == 0
    assert line["input_tokens"] is None and line["cached_tokens"] is None
    assert line["request_id"] == "trace-42.a:b"  # the client's own id, a plain token


async def test_passthrough_and_aiohttp_routes_log_too_probes_do_not(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    capsys: pytest.CaptureFixture[str],
    http: aiohttp.ClientSession,
) -> None:
    proxy = await json_proxy(make_proxy, backend)
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/healthz", "/readyz", "/metrics"):
        async with http.get(proxy.url + path) as resp:
            assert resp.status == 200
    async with http.get(
        proxy.base_url + "/models", headers={**auth, "X-Request-Id": 'bad id with="stuff"'}
    ) as resp:
        assert resp.status == 200
    async with http.delete(proxy.base_url + "/responses/resp_nowhere", headers=auth) as resp:
        assert resp.status == 404  # answered from the store alone
    models, lookup = json_lines(capsys)
    check_common(models, "/v1/models", "GET")
    assert models["status"] == 200 and models["backend"] == backend.url
    assert models["expansion"] is None and models["input_tokens"] is None
    assert re.fullmatch(r"[0-9a-f]{16}", models["request_id"])  # the odd one was replaced
    check_common(lookup, "/v1/responses/{response_id}", "DELETE")
    assert lookup["status"] == 404 and lookup["backend"] is None


async def test_websocket_turns_log_one_line_each(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    capsys: pytest.CaptureFixture[str],
    http: aiohttp.ClientSession,
) -> None:
    proxy = await json_proxy(make_proxy, backend)
    async with http.ws_connect(
        proxy.base_url + "/responses",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "agent-7"},
    ) as ws:
        previous = None
        for word in ("hello", "again", "again"):
            frame: dict[str, Any] = {"type": "response.create", "model": "m", "input": word}
            if previous is not None:
                frame["previous_response_id"] = previous
            await ws.send_json(frame)
            while True:
                event = await ws.receive_json(timeout=5)
                if event["type"] in ("response.completed", "error"):
                    break
            previous = "resp_unknown" if previous is not None else event["response"]["id"]
    lines = json_lines(capsys)
    assert [line["request_id"] for line in lines] == ["agent-7.1", "agent-7.2", "agent-7.3"]
    for line in lines:
        check_common(line, "websocket /v1/responses", "WS")
    first, second, third = lines
    assert first["outcome"] == "completed" and first["status"] is None
    assert first["backend"] == backend.url and first["input_tokens"] > 0
    assert second["expansion"] == "hit" and second["history_bytes"] > 0
    assert third["outcome"] == "rejected" and third["status"] == 400
    assert third["expansion"] == "unknown" and third["backend"] is None


HEX16 = re.compile(r"[0-9a-f]{16}")


async def test_every_answer_carries_the_request_id_that_the_log_and_backend_have(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    capsys: pytest.CaptureFixture[str],
    http: aiohttp.ClientSession,
) -> None:
    """X-Request-Id: the client's own when it is a plain token, else a new one; the same id
    in the answer, in the access line and in the backend's request, on both ways in (the
    front end's create path and aiohttp's routes), for successes and errors alike."""
    proxy = await json_proxy(make_proxy, backend)
    auth = {"Authorization": f"Bearer {KEY}"}
    create = {"model": "m", "input": "hi"}
    asked = [
        ("POST", "/responses", create, "trace-7.a:b"),  # front end, the client's id
        ("POST", "/responses", create, None),  # front end, a new id
        ("POST", "/responses", create, 'bad id="x"'),  # front end, an unusable id: replaced
        ("POST", "/responses", {"input": "x", "previous_response_id": "resp_no"}, None),  # 400
        ("GET", "/models", None, "models-1"),  # aiohttp, forwarded
        ("GET", "/models", None, None),
        ("DELETE", "/responses/resp_nowhere", None, "del-1"),  # aiohttp, the proxy's own 404
    ]
    answered = []
    for method, path, body, given in asked:
        headers = {**auth, **({"X-Request-Id": given} if given else {})}
        async with http.request(method, proxy.base_url + path, json=body, headers=headers) as resp:
            answered.append(resp.headers.getall("X-Request-Id"))
    for (_, _, _, given), ids in zip(asked, answered, strict=True):
        assert len(ids) == 1
        if given is not None and " " not in given:
            assert ids == [given]
        else:
            assert HEX16.fullmatch(ids[0])
    ids = [only for (only,) in answered]
    assert len(set(ids)) == len(ids)
    assert [line["request_id"] for line in json_lines(capsys)] == ids
    # The backend saw the same ids: three creates and two model lists reached it.
    assert [seen.headers.getall("X-Request-Id") for seen in backend.seen] == [
        [ids[0]],
        [ids[1]],
        [ids[2]],
        [ids[4]],
        [ids[5]],
    ]
    async with http.get(proxy.url + "/healthz") as resp:  # probes too (not logged)
        assert HEX16.fullmatch(resp.headers["X-Request-Id"])


async def test_refusals_carry_a_request_id(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    """A refused key (on both ways in) and a malformed request, which the front end answers
    before any route, carry an id too."""
    proxy = await make_proxy(backend.url, api_keys=("sk-right",))
    wrong = {"Authorization": "Bearer sk-wrong", "X-Request-Id": "who-1"}
    async with http.post(proxy.base_url + "/responses", json={"input": "x"}, headers=wrong) as r:
        assert (r.status, r.headers["X-Request-Id"]) == (401, "who-1")
    async with http.get(proxy.base_url + "/models", headers=wrong) as resp:
        assert (resp.status, resp.headers["X-Request-Id"]) == (401, "who-1")
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n")
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert re.search(rb"\r\nX-Request-Id: [0-9a-f]{16}\r\n", answer)
    assert backend.seen == []


async def test_websocket_upgrade_answer_and_turns_carry_the_id(
    make_proxy: MakeProxy, backend: FakeBackend, http: aiohttp.ClientSession
) -> None:
    proxy = await json_proxy(make_proxy, backend)
    async with http.ws_connect(
        proxy.base_url + "/responses",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "agent-9"},
    ) as ws:
        assert ws._response.headers["X-Request-Id"] == "agent-9"
        for word in ("one", "two"):
            await ws.send_json({"type": "response.create", "model": "m", "input": word})
            while (await ws.receive_json(timeout=5))["type"] != "response.completed":
                pass
    assert [seen.headers["X-Request-Id"] for seen in backend.seen] == ["agent-9.1", "agent-9.2"]


async def test_text_lines_are_logfmt_with_the_same_fields(
    make_proxy: MakeProxy, backend: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = await make_proxy(backend.url, access_log="text")
    client = proxy.client(KEY)
    await client.responses.create(model="m", input="hi")
    await client.models.list()
    create, models = logfmt_lines(capsys)
    assert list(create) == list(FIELDS)
    assert create["route"] == "/v1/responses" and create["status"] == "200"
    assert create["backend"] == backend.url and create["expansion"] == "-"
    assert create["scope"] == SCOPE and int(create["input_tokens"]) > 0
    assert models["route"] == "/v1/models" and models["input_tokens"] == "-"


async def test_off_by_default(proxy: ProxyHandle, capsys: pytest.CaptureFixture[str]) -> None:
    await proxy.client(KEY).responses.create(model="m", input="hi")
    assert proxy.proxy.access_log is None
    assert json_lines(capsys) == []


async def test_no_prompt_output_or_key_in_any_log_line(
    make_proxy: MakeProxy,
    backend: FakeBackend,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    http: aiohttp.ClientSession,
) -> None:
    """Every log line at every level, and the access log on stdout, while prompts, outputs
    and a key that carry a marker go through each route."""
    caplog.set_level("DEBUG")
    marker = "PRIVATE-7f3a"
    key = f"sk-{marker}"
    proxy = await make_proxy(backend.url, access_log="json")
    client = proxy.client(key)
    auth = {"Authorization": f"Bearer {key}", "X-Request-Id": marker.lower()[:4]}
    first = await client.responses.create(
        model="m", instructions=f"{marker} instructions", input=f"{marker} says hi"
    )
    assert marker in first.output_text  # the fake echoes it: outputs carry it too
    async with client.responses.stream(
        model="m", input=f"{marker} streams", previous_response_id=first.id
    ) as stream:
        await stream.get_final_response()
    async with http.post(
        proxy.base_url + "/responses",
        json={"input": f"{marker} lost", "previous_response_id": f"resp_{marker}"},
        headers=auth,
    ) as resp:
        assert resp.status == 400
    async with http.post(
        proxy.base_url + "/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": f"{marker} chat"}]},
        headers=auth,
    ) as resp:
        await resp.read()
    async with http.post(proxy.base_url + "/responses", data=f"{{{marker}", headers=auth) as resp:
        assert resp.status == 400
    async with http.ws_connect(proxy.base_url + "/responses", headers=auth) as ws:
        await ws.send_json({"type": "response.create", "model": "m", "input": f"{marker} ws"})
        while (await ws.receive_json(timeout=5))["type"] != "response.completed":
            pass
    out = capsys.readouterr().out
    access_lines = [json.loads(line) for line in out.splitlines()]
    assert len(access_lines) == 6
    assert all(line["scope"] == scope_of(auth)[:SCOPE_CHARS] for line in access_lines)
    assert marker not in out and marker.lower() not in out
    assert len(caplog.records) > 3  # the other logs did speak (a debug line per turn, ...)
    for record in caplog.records:
        text = record.getMessage()
        assert marker not in text and marker.lower() not in text, (record.name, text)


async def test_serve_writes_access_lines_to_stdout_alone(
    backend: FakeBackend, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """`ocxproxy serve --access-log json`: stdout has the lines (after the listening
    line), stderr the other logs, at --log-level warning too."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ocxproxy", "serve", "--upstream", backend.url,
        "--port", "0", "--state-dir", str(tmp_path / "state"), "--log-level", "warning",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OCXPROXY_ACCESS_LOG": "json"},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            listening = (await proc.stdout.readline()).decode()
        found = re.search(r"listening on (http://\S+)", listening)
        assert found, listening
        base = found.group(1)
        async with http.post(base + "/responses", json={"model": "m", "input": "hi"}) as resp:
            assert resp.status == 200
        async with http.get(base + "/models") as resp:
            assert resp.status == 200
        async with asyncio.timeout(10):
            lines = [json.loads(await proc.stdout.readline()) for _ in range(2)]
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            _, stderr = await proc.communicate()
    assert [line["route"] for line in lines] == ["/v1/responses", "/v1/models"]
    assert all(list(line) == list(FIELDS) for line in lines)
    assert lines[0]["scope"] == "anonymous"[:SCOPE_CHARS]
    assert b"request_id" not in stderr
