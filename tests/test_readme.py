"""The README's snippets work as written: each Python client snippet and the curl pair run
against a real proxy (in front of the fake backend) and continue a chain, and its config
file is one `serve --config` accepts. Only the base URL is swapped for the test proxy's."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from ocxproxy.config import build_config, read_config_file
from tests.conftest import ProxyHandle

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BASE_URL = "http://127.0.0.1:8080/v1"
SECOND_TURN = "echo#3: And the next one?"  # the fake backend saw both turns


def blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def python_snippets() -> list[str]:
    """The section "Point a client at it": each snippet makes two chained turns."""
    section = README.split("\n## Point a client at it\n", 1)[1].split("\n## ", 1)[0]
    return [code for code in blocks("python", section) if BASE_URL in code]


async def run(*argv: str, cwd: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(60):
        out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out[-3000:]
    return out


def test_the_readme_has_the_client_snippets() -> None:
    snippets = python_snippets()
    assert len(snippets) >= 2  # the OpenAI SDK, the Agents SDK
    assert any("from agents import" in code for code in snippets)
    assert any("curl" in code and BASE_URL in code for code in blocks("sh"))


@pytest.mark.parametrize("index", range(len(python_snippets())))
async def test_python_snippet_continues_a_chain(
    proxy: ProxyHandle, tmp_path: Path, index: int
) -> None:
    code = python_snippets()[index].replace(BASE_URL, proxy.base_url)
    (tmp_path / "snippet.py").write_text(code)
    out = await run(sys.executable, "snippet.py", cwd=tmp_path)
    assert out.strip().splitlines()[-1] == SECOND_TURN
    assert proxy.metric("ocxproxy_expansions_total", outcome="hit") == 1


async def test_curl_pair_continues_a_chain(proxy: ProxyHandle, tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    (block,) = [code for code in blocks("sh") if "curl" in code and BASE_URL in code]
    first, second = re.split(r"^# then.*\n", block.replace(BASE_URL, proxy.base_url), flags=re.M)
    answer = json.loads(await run("bash", "-c", first, cwd=tmp_path))
    assert second.count("resp_…") == 1
    second = second.replace("resp_…", answer["id"])
    chained = json.loads(await run("bash", "-c", second, cwd=tmp_path))
    assert chained["output"][0]["content"][0]["text"] == SECOND_TURN
    assert chained["previous_response_id"] == answer["id"]


def test_config_file_snippet_is_accepted(tmp_path: Path) -> None:
    (snippet,) = [code for code in blocks("toml") if "--config" in code]
    path = tmp_path / "ocxproxy.toml"
    path.write_text(snippet)
    raw, sources = read_config_file(path)
    config = build_config(raw, sources=sources)
    assert config.upstream == ("http://gpu:8000",)
    assert config.max_disk_bytes == 10 * 1024**3


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_point_at_files_and_headings_that_exist() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", README)
    assert ("docs/BEHAVIOR.md", "metrics") in links  # the walk does see anchored links
    broken = []
    for path, anchor in links:
        target = ROOT / path
        if not target.exists():
            broken.append(path)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)
            if anchor not in {slug(heading) for heading in headings}:
                broken.append(f"{path}#{anchor}")
    assert broken == []
