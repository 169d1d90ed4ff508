"""How many of Codex CLI's remote compactions complete through the proxy, over HTTP and
over WebSocket.

Codex (`npm i @openai/codex@0.169.0`; the binary in OCXPROXY_CODEX or on PATH), its
provider named "OpenAI" (the name for which it compacts remotely) with a low
`model_auto_compact_token_limit`, in front of `ocxproxy serve` and the fake backend
(tests/fakes/backend.py), whose answer is a tool call, so each run compacts in the middle
of its turn. A run counts as completed when `codex exec` exits 0 having compacted
("context compacted"); the proxy's `ocxproxy_compactions_total` is printed beside.

    python scripts/bench/bench_codex_compaction.py            # 10 runs per transport
    python scripts/bench/bench_codex_compaction.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from benchkit import PYTHON, running, start_child, start_proxy

CONFIG = """model = "fake-model"
model_provider = "gw"
model_auto_compact_token_limit = 2000
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.gw]
name = "OpenAI"
base_url = "{base_url}"
wire_api = "responses"
env_key = "OCXPROXY_BENCH_KEY"
supports_websockets = {websockets}
request_max_retries = 0
stream_max_retries = 0
"""


def run_codex(codex: str, base_url: str, websockets: bool) -> bool:
    with tempfile.TemporaryDirectory(prefix="codex_bench_") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        ws = "true" if websockets else "false"
        (home / "config.toml").write_text(CONFIG.format(base_url=base_url, websockets=ws))
        env = {**os.environ, "CODEX_HOME": str(home), "OCXPROXY_BENCH_KEY": "sk-bench"}
        env.pop("OPENAI_API_KEY", None)
        done = subprocess.run(
            [codex, "exec", "--skip-git-repo-check", "Please CALL:shell now"],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return done.returncode == 0 and "context compacted" in done.stdout + done.stderr


def compactions(proxy_url: str) -> float:
    with urllib.request.urlopen(proxy_url + "/metrics") as answer:
        text = answer.read().decode()
    found = re.findall(
        r'^ocxproxy_compactions_total\{[^}]*outcome="completed"[^}]*\} (\S+)$', text, re.M
    )
    return sum(float(value) for value in found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per transport")
    args = parser.parse_args()
    codex = os.environ.get("OCXPROXY_CODEX") or shutil.which("codex")
    if not codex:
        sys.exit("Codex CLI not found: npm i @openai/codex@0.169.0, then set OCXPROXY_CODEX")
    fake = [PYTHON, "-m", "tests.fakes.backend", "--port", "0"]
    backend = start_child("fake-backend", fake, r"(http://\S+)")
    try:
        proxy = start_proxy(backend.url, "--health-interval", "0")
    except BaseException:
        backend.stop()
        raise
    with running(backend, proxy):
        print(f"Codex {codex}: remote compactions through the proxy ({args.runs} runs each)")
        total = 0
        for transport, websockets in (("HTTP", False), ("WebSocket", True)):
            completed = sum(
                run_codex(codex, proxy.url + "/v1", websockets) for _ in range(args.runs)
            )
            total += completed
            print(f"{transport:<10} {completed}/{args.runs} completed")
        print(f"{'both':<10} {total}/{2 * args.runs} completed")
        print(f"proxy: {compactions(proxy.url):.0f} compactions completed")


if __name__ == "__main__":
    main()
