"""End-to-end against the real llama.cpp server (xllamacpp + SmolLM2-135M): the proof that
expansion is byte-stable enough for the backend's prefix cache (CONTRACT.md C1)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pydantic
import pytest

from ocxproxy.upstream import local
from scripts import demo
from tests.conftest import MakeProxy, ProxyHandle, unavailable
from tests.e2e.conftest import HAVE_LLAMA, MIN_CACHED_RATIO, MISSING, MODEL, cached_ratio
from tests.e2e.text import QUESTIONS, long_message

pytestmark = [pytest.mark.llama, pytest.mark.timeout(300)]

if not HAVE_LLAMA:
    unavailable(MISSING)


@pytest.fixture
async def llama_proxy(make_proxy: MakeProxy, llama_url: str) -> ProxyHandle:
    return await make_proxy(llama_url)


async def test_chain_hits_prefix_cache_every_continuation(llama_proxy: ProxyHandle) -> None:
    client = llama_proxy.client()
    first = await client.responses.create(
        model="local", input=long_message(1500, seed=1), max_output_tokens=16
    )
    assert first.usage is not None and first.usage.input_tokens > 1350
    previous, ratios = first.id, []
    # The same history as a client that resends it would: its answers by item_reference.
    history: list[Any] = [{"role": "user", "content": long_message(1500, seed=1)}]
    history += [{"type": "item_reference", "id": item.id} for item in first.output]
    for question in QUESTIONS[:4]:
        turn = await client.responses.create(
            model="local", input=question, previous_response_id=previous, max_output_tokens=16
        )
        assert turn.usage is not None and turn.usage.input_tokens > first.usage.input_tokens
        assert turn.previous_response_id == previous
        ratios.append(cached_ratio(turn.usage))
        previous = turn.id
        history.append({"role": "user", "content": question})
        history += [{"type": "item_reference", "id": item.id} for item in turn.output]
    history.append({"role": "user", "content": QUESTIONS[4]})
    by_reference = await client.responses.create(model="local", input=history, max_output_tokens=16)
    assert by_reference.usage is not None
    assert by_reference.usage.input_tokens > turn.usage.input_tokens
    ratios.append(cached_ratio(by_reference.usage))
    assert min(ratios) >= MIN_CACHED_RATIO, ratios


async def test_codex_style_full_history_passes_through_and_hits(
    llama_proxy: ProxyHandle,
) -> None:
    """Codex over HTTP: store:false, the whole history each turn, encrypted reasoning
    requested, a prompt_cache_key; never previous_response_id."""
    client = llama_proxy.client()
    history: list[dict[str, object]] = [
        {"type": "message", "role": "user", "content": long_message(1500, seed=2)}
    ]
    ratios = []
    for turn in range(5):
        response = await client.responses.create(
            model="local",
            input=history,  # type: ignore[arg-type]
            store=False,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="codex-session-1",
            max_output_tokens=16,
        )
        if turn:
            ratios.append(cached_ratio(response.usage))
        history += [item.model_dump(exclude_none=True) for item in response.output]
        history.append({"type": "message", "role": "user", "content": QUESTIONS[turn]})
    assert min(ratios) >= MIN_CACHED_RATIO, ratios
    # store:false over HTTP is not remembered: continuing from it is not found.
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="local", input="x", previous_response_id=response.id)
    assert info.value.code == "previous_response_not_found"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_answer_cut_at_max_output_tokens_is_incomplete(
    llama_proxy: ProxyHandle, llama_url: str, stream: bool
) -> None:
    # Greedy, SmolLM2 answers this in ~25 tokens. llama.cpp's own Responses API says
    # `completed` for the answer it cut at 16.
    hi = {"model": "local", "input": "Say hi.", "temperature": 0}
    async with (
        aiohttp.ClientSession() as http,
        http.post(llama_url + "/v1/responses", json=hi | {"max_output_tokens": 16}) as raw,
    ):
        direct = orjson.loads(await raw.read())
    assert (direct["status"], direct["usage"]["output_tokens"]) == ("completed", 16)
    client: Any = llama_proxy.client()
    for limit, status in ((16, "incomplete"), (200, "completed")):
        if stream:
            events = [
                e
                async for e in await client.responses.create(
                    stream=True, max_output_tokens=limit, **hi
                )
            ]
            assert events[-1].type == f"response.{status}"
            response = events[-1].response
        else:
            response = await client.responses.create(max_output_tokens=limit, **hi)
        assert response.status == status and response.output_text
        assert (response.usage.output_tokens == 16) == (limit == 16)
        reason = response.incomplete_details and response.incomplete_details.reason
        assert reason == ("max_output_tokens" if limit == 16 else None)


async def test_structured_output_by_llamas_own_response_format(llama_proxy: ProxyHandle) -> None:
    # llama.cpp's Responses API ignores text.format; its response_format, forwarded as
    # sent, constrains the answer to the schema (README, Limits).
    class City(pydantic.BaseModel):
        name: str
        country: str

    schema = City.model_json_schema() | {"additionalProperties": False}
    constrained = {"name": "City", "schema": schema, "strict": True}
    answer = await llama_proxy.client().responses.parse(
        model="local",
        input="Name a city in France.",
        text_format=City,
        temperature=0,
        max_output_tokens=100,
        extra_body={"response_format": {"type": "json_schema", "json_schema": constrained}},
    )
    assert answer.status == "completed"
    assert isinstance(answer.output_parsed, City) and answer.output_parsed.name


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_readmes_demo_converses_on_the_cache(
    llama_proxy: ProxyHandle, stream: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its answers are cut at 24 tokens, mostly: the stream's then end incomplete.
    await demo.converse(llama_proxy.base_url, turns=3, first_tokens=1500, stream=stream)
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert all(float(row[4]) >= MIN_CACHED_RATIO for row in rows[1:]), rows


async def test_sdk_stream_helper_works_on_llamas_incomplete_stream(
    llama_proxy: ProxyHandle, llama_url: str
) -> None:
    # llama.cpp's own stream lacks sequence_number: the proxy repairs it (CONTRACT.md C1.7).
    async with aiohttp.ClientSession() as http:
        body = {"model": "local", "input": "Say hi", "stream": True, "max_output_tokens": 8}
        async with http.post(llama_url + "/v1/responses", json=body) as raw:
            assert b'"sequence_number"' not in await raw.read()
    client = llama_proxy.client()
    # (Greedy, an answer of ~25 tokens: it ends within its limit, so the helper, which
    # wants response.completed, gets its final Response.)
    async with client.responses.stream(
        model="local", input="Say hi.", temperature=0, max_output_tokens=64
    ) as stream:
        kinds, numbers, text = [], [], ""
        async for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = await stream.get_final_response()
    assert final.usage is not None and final.usage.output_tokens < 64
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert numbers == list(range(len(numbers)))
    assert final.output_text == text and text
    second = await client.responses.create(
        model="local", input="And again?", previous_response_id=final.id, max_output_tokens=8
    )
    assert second.status == ("incomplete" if second.usage.output_tokens >= 8 else "completed")


# -- the embedded backend as `ocxproxy serve` runs it -------------------------------------


async def _start_serve(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ocxproxy", "serve", "--port", "0", "--zdr", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


async def test_serve_without_upstream_runs_and_stops_the_embedded_backend() -> None:
    proc = await _start_serve()
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        match = re.search(r"(http://\S+)/v1", line)
        assert match, line
        children = _children(proc.pid)
        assert len(children) == 1, children
        async with aiohttp.ClientSession() as http:
            async with http.get(match.group(1) + "/readyz") as ready:
                assert ready.status == 200
            body = {"model": "local", "input": "Say hi", "max_output_tokens": 8}
            async with http.post(match.group(1) + "/v1/responses", json=body) as answer:
                assert answer.status == 200
                raw = await answer.read()
                response = orjson.loads(raw)
                cut = response["usage"]["output_tokens"] >= 8
                assert response["status"] == ("incomplete" if cut else "completed")
                # What llama.cpp sampled with (its defaults), not OpenAI's 1.0.
                assert (response["temperature"], response["top_p"]) == (0.8, 0.95)
            async with http.get(match.group(1) + "/v1/models") as models:
                assert models.status == 200
                listing = await models.read()
        # The embedded model's short name, never its file's path.
        name = local.served_name(MODEL) if MODEL else ""
        assert orjson.loads(raw)["model"] == name and "/" not in name
        assert [m["id"] for m in orjson.loads(listing)["data"]] == [name]
        assert b".gguf" not in raw and b".gguf" not in listing
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert all(_is_gone(child) for child in children)


async def test_local_temperature_zero_answers_a_request_the_same_each_time() -> None:
    # llama.cpp's default temperature (0.8) samples: 24 tokens of a story differ run to run.
    proc = await _start_serve("--local-temperature", "0")
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        match = re.search(r"(http://\S+)/v1", line)
        assert match, line
        body = {"model": "local", "input": "Tell me a story.", "max_output_tokens": 24}
        texts = []
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(match.group(1) + "/v1/responses", json=body) as answer:
                    assert answer.status == 200
                    response = orjson.loads(await answer.read())
                    assert (response["temperature"], response["top_p"]) == (0.0, 0.95)
                    output = response["output"]
                    texts.append(output[-1]["content"][0]["text"])
        assert len(set(texts)) == 1 and len(texts[0]) > 40, texts
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def _is_gone(pid: int) -> bool:
    try:
        return " Z " in Path(f"/proc/{pid}/stat").read_text()  # a zombie is gone too
    except FileNotFoundError:
        return True


async def test_serve_with_an_unloadable_model_fails_clearly(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"definitely not gguf")
    proc = await _start_serve("--local-model", str(bogus))
    _, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2
    errors = [ln for ln in stderr.decode().splitlines() if ln.startswith("ocxproxy: error:")]
    assert len(errors) == 1 and "failed to start" in errors[0], stderr


async def test_serve_without_the_extra_says_what_to_install(tmp_path: Path) -> None:
    # A stand-in package directory that hides xllamacpp from this interpreter.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['xllamacpp'] = None\n")
    proc = await _start_serve(env={"PYTHONPATH": str(shadow)})
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    message = stderr.decode().strip().splitlines()[-1]
    assert "--upstream" in message and "xllamacpp" in message.replace("ocxproxy[local]", "")
