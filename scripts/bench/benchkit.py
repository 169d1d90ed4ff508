"""Shared pieces of the benchmarks in scripts/bench/ (not a test helper, never collected).

Child processes (the proxy, the instant backend) started and stopped by their own pid,
/proc readings (CPU time, peak RSS), realistic Responses items of a chosen size,
percentiles, a plain-text table, and a py-spy summary.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")

BYTES_PER_TOKEN = 4  # the usual rough figure for English text and JSON


# -- child processes ----------------------------------------------------------------------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    url: str
    log: Path
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_child(
    name: str,
    argv: Sequence[str],
    ready: str,
    *,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> Child:
    """Start `argv` and wait for a stdout line matching `ready` (its group 1 is the URL)."""
    log = Path(f"/tmp/bench_{name}_{os.getpid()}.log")
    err = log.open("w")
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=ROOT,
        bufsize=1,
        env={**os.environ, **(env or {})},
    )
    err.close()
    found: list[str] = []
    event = threading.Event()
    child = Child(name, proc, "", log)

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            child.lines.append(line)
            m = re.search(ready, line)
            if m and not found:
                found.append(m.group(1))
                event.set()
        event.set()

    threading.Thread(target=drain, daemon=True, name=f"{name}-stdout").start()
    if not event.wait(timeout) or not found:
        child.stop()
        raise RuntimeError(f"{name} did not start: {log.read_text()[-2000:]}")
    child.url = found[0]
    return child


def start_backend(*, raw: bool = False, unique_item_ids: bool = False) -> Child:
    """scripts/bench/instant_backend.py (aiohttp; `raw`: hand-written HTTP, cheaper;
    `unique_item_ids`: a fresh output item id per response, not `msg_x`)."""
    argv = [PYTHON, str(BENCH / "instant_backend.py"), "--port", "0"]
    argv += ["--raw"] if raw else []
    argv += ["--unique-item-ids"] if unique_item_ids else []
    return start_child("backend", argv, r"listening on (http://\S+)")


PROXY_ARGS = ("--port", "0", "--log-level", "warning")


def state_args() -> list[str]:
    """The default durable configuration: a fresh state dir, removed when the bench exits."""
    state = tempfile.mkdtemp(prefix="ocxproxy_bench_")
    atexit.register(shutil.rmtree, state, ignore_errors=True)
    return ["--state-dir", state]


def start_proxy(upstream: str, *extra: str) -> Child:
    """`python -m ocxproxy serve` on the default durable configuration (a fresh state dir;
    pass "--zdr" in `extra` for memory-only), uvloop picked automatically."""
    store = [] if "--zdr" in extra else state_args()
    argv = [PYTHON, "-m", "ocxproxy", "serve", "--upstream", upstream, *PROXY_ARGS, *store]
    return start_child("proxy", [*argv, *extra], r"ocxproxy listening on (http://\S+?)/v1")


def start_profiled(upstream: str, name: str, *, ablate: str = "", out: Path | None = None) -> Child:
    """ocxproxy under scripts/bench/profiled_proxy.py: cProfile on SIGUSR1/SIGUSR2, ablations."""
    argv = [PYTHON, str(BENCH / "profiled_proxy.py"), "serve", "--upstream", upstream]
    env = {"OCXPROXY_BENCH_ABLATE": ablate, "OCXPROXY_PROFILE_OUT": str(out or "/dev/null")}
    argv += [*PROXY_ARGS, *state_args()]
    return start_child(name, argv, r"listening on (http://\S+?)/v1", env=env)


@contextlib.contextmanager
def running(*children: Child) -> Iterator[None]:
    try:
        yield
    finally:
        for child in reversed(children):
            child.stop()


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """`--quick` and `--nice`, the options every benchmark takes."""
    parser.add_argument("--quick", action="store_true", help="smoke run, < 30 s")
    parser.add_argument(
        "--nice",
        type=int,
        metavar="N",
        help="run the benchmark's processes at niceness N (e.g. -10, as root) on a shared box",
    )


def raise_priority(niceness: int) -> str:
    """Run this process and the children it starts at `niceness` (negative needs root), so
    that other work on a shared box takes less from the measurement. With the kernel's
    autogroup scheduling, niceness only counts inside a session's group, so the group's
    own niceness (/proc/self/autogroup) is set too, and put back at exit. Returns a note."""
    try:
        now = os.nice(niceness - os.nice(0))
    except PermissionError:
        return f"could not set niceness {niceness} (not root); running at {os.nice(0)}"
    note = f"benchmark processes run at niceness {now}"
    group = Path("/proc/self/autogroup")
    try:
        before = int(group.read_text().split()[-1])
        group.write_text(str(niceness))
    except (OSError, ValueError, IndexError):
        return note
    atexit.register(group.write_text, str(before))
    return note + f", their autogroup too (was {before}, restored at exit)"


# -- /proc ------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (not idle or iowait) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLK_TCK


def status_kib(pid: int, key: str) -> int:
    """A `kB` field of /proc/PID/status, e.g. VmHWM (peak RSS) or VmRSS."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


# -- items -------------------------------------------------------------------------------------

_WORDS = (
    "the", "request", "handler", "reads", "config", "value", "from", "file", "and", "returns",
    "error", "when", "path", "is", "missing", "we", "should", "add", "retry", "logic", "to",
    "the", "upstream", "client", "with", "exponential", "backoff", "test", "suite", "passes",
    "after", "fixing", "import", "cycle", "in", "module", "store", "index", "segment", "cache",
    "eviction", "policy", "function", "call", "output", "json", "schema", "stream", "event",
    "delta", "token", "usage", "latency", "budget"
)  # fmt: skip
_TOOLS = ("read_file", "run_shell", "search_code", "apply_patch", "list_dir")


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def make_items(target_bytes: int, seed: int = 1) -> list[dict[str, Any]]:
    """A realistic agent history of about `target_bytes` serialized: a user request, then
    rounds of assistant text, function_call and function_call_output, now and then a user
    message. The last item is a tool output, so the next turn is the model's."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = [{"role": "user", "content": _text(rng, 60)}]
    size = len(orjson.dumps(items[0]))
    n = 0
    while size < target_bytes:
        n += 1
        call_id = f"call_{seed}_{n:05d}"
        tool = rng.choice(_TOOLS)
        round_: list[dict[str, Any]] = [
            {
                "type": "message",
                "id": f"msg_{seed}_{n:05d}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": _text(rng, rng.randint(10, 60)),
                        "annotations": [],
                    }
                ],
            },
            {
                "type": "function_call",
                "id": f"fc_{seed}_{n:05d}",
                "call_id": call_id,
                "name": tool,
                "arguments": orjson.dumps(
                    {"path": f"src/{rng.choice(_WORDS)}.py", "n": n}
                ).decode(),
                "status": "completed",
            },
            {
                "type": "function_call_output",
                "call_id": call_id,
                "output": _text(rng, rng.randint(40, 400)),
            },
        ]
        if rng.random() < 0.15:
            round_.append({"role": "user", "content": _text(rng, rng.randint(5, 40))})
        for item in round_:
            items.append(item)
            size += len(orjson.dumps(item)) + 1
    return items


def codex_members(seed: int = 1) -> dict[str, Any]:
    """The members a coding agent (Codex CLI) sends again on every turn, at its sizes:
    ~15 KB of `instructions` and ~13 KB of function `tools` with JSON-schema parameters,
    and its small settings."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    while sum(map(len, paragraphs)) < 15_000:
        paragraphs.append(_text(rng, 60) + ".")
    tools = []
    for n in range(12):
        properties = {
            f"arg_{k}": {"type": rng.choice(("string", "integer")), "description": _text(rng, 12)}
            for k in range(6)
        }
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        parameters |= {"required": ["arg_0"], "additionalProperties": False}
        tools.append(
            {
                "type": "function",
                "name": f"{rng.choice(_TOOLS)}_{n}",
                "description": _text(rng, 30),
                "strict": False,
                "parameters": parameters,
            }
        )
    return {
        "instructions": "\n\n".join(paragraphs),
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": True,
        "prompt_cache_key": f"codex-{seed}",
    }


def user_message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# -- figures -----------------------------------------------------------------------------------


def pct(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation; NaN for no values."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    n: int
    p50: float
    p90: float
    p99: float
    max: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        s = sorted(values)
        mean = sum(s) / len(s) if s else float("nan")
        return cls(len(s), pct(s, 0.5), pct(s, 0.9), pct(s, 0.99), s[-1] if s else 0.0, mean)

    def minus(self, other: Summary) -> Summary:
        return Summary(
            self.n,
            self.p50 - other.p50,
            self.p90 - other.p90,
            self.p99 - other.p99,
            self.max - other.max,
            self.mean - other.mean,
        )


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


# -- proxy's own overhead histogram --------------------------------------------------------------

_METRIC = re.compile(
    r'^ocxproxy_proxy_overhead_seconds_(sum|count)\{route="/v1/responses"\} (\S+)$', re.M
)


def overhead_metric(text: str) -> tuple[float, float]:
    """(sum, count) of ocxproxy_proxy_overhead_seconds for /v1/responses."""
    values = {kind: float(value) for kind, value in _METRIC.findall(text)}
    return values.get("sum", 0.0), values.get("count", 0.0)


# -- profiles --------------------------------------------------------------------------------


def _group(file: str, func: str) -> str:
    if file == "~":
        if "orjson" in func:
            return "C: orjson"
        if "hashlib" in func or "sha256" in func:
            return "C: hashlib"
        return "C: other builtins (join, isinstance, len, ...)"
    m = re.search(r"/ocxproxy/(\w+)", file)
    if m and "/site-packages/" not in file:
        return f"ocxproxy/{m.group(1)}"
    m = re.search(r"/site-packages/(\w+)/(\w+)", file)
    if m:
        pkg, mod = m.groups()
        if pkg == "aiohttp":
            if mod.startswith(("client", "connector", "tracing", "cookiejar")):
                return "aiohttp: client side"
            if mod.startswith("web"):
                return "aiohttp: server side (web_*)"
            return "aiohttp: shared (streams, http_writer, helpers)"
        return pkg
    if re.search(r"/(asyncio|contextlib|_weakrefset|weakref|enum|typing|functools)", file):
        return "stdlib: asyncio, contextlib, weakref, ..."
    return "stdlib: other"


@dataclass
class PstatsSummary:
    total: float  # seconds of profiler clock
    groups: list[tuple[str, float]]
    top_self: list[tuple[str, float, int]]  # name, tottime, calls
    inclusive: dict[str, float]  # function name → cumtime


def summarize_pstats(path: Path, top: int = 15) -> PstatsSummary:
    import pstats

    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    groups: Counter[str] = Counter()
    rows: list[tuple[str, float, int]] = []
    inclusive: dict[str, float] = {}
    total = 0.0
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.items():
        if (
            file.endswith("profiled_proxy.py")
            or func == "<method 'disable' of '_lsprof.Profiler' objects>"
        ):
            continue
        total += tt
        groups[_group(file, func)] += tt
        short = re.sub(r".*/(site-packages|lib/python3\.\d+)/", "", file)
        short = re.sub(r".*/(ocxproxy/)", r"\1", short)
        name = func if file == "~" else f"{func} ({short}:{line})"
        rows.append((name, tt, nc))
        if "/ocxproxy/" in file and "/site-packages/" not in file:
            inclusive[f"{func} ({short})"] = max(ct, inclusive.get(f"{func} ({short})", 0.0))
    rows.sort(key=lambda r: -r[1])
    ranked = [(name, float(seconds)) for name, seconds in groups.most_common()]
    return PstatsSummary(total, ranked, rows[:top], inclusive)


def start_floor(upstream: str, *, server: str = "aiohttp", client: str = "aiohttp") -> Child:
    """floor_proxy.py: the least a continuation proxy can do (aiohttp or raw sides)."""
    argv = [PYTHON, str(BENCH / "floor_proxy.py"), "--upstream", upstream, "--port", "0"]
    argv += ["--server", server, "--upstream-client", client]
    return start_child(f"floor-{server}-{client}", argv, r"listening on (http://\S+?)/v1")
