"""Trains the zstd dictionary the shared tier compresses its values with and writes it to
ocxproxy/store/shared/dictionary.py, with its SHA-256.

Most of a small turn is structure that every turn repeats: the item shapes of the Responses
API, and the response object's fields (model, tools, parameters, usage). A dictionary of
them, shipped in the package, lets a turn's segment and record compress to a fraction of
their size even when they are a few hundred bytes (zstd alone cannot: too little to learn
from). The corpus is synthetic but shaped like real traffic: OpenAI-shaped items and
response objects (message, function_call and its output, reasoning; the full field set or
the short one local servers send), ids of the lengths real servers use, common English and
programming words. It is values as the layout stores them (shared/frame.py's payload).

A new dictionary is a new layout: values written with the old one cannot be read with it,
so shared/keys.py's LAYOUT must change with it (tests/shared/test_layout.py checks the digest).

    .venv/bin/python scripts/shared_dictionary.py            # writes the module
    .venv/bin/python scripts/shared_dictionary.py --check    # exit 1 if it would differ
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import random
import sys
from pathlib import Path
from typing import Any

import orjson
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ocxproxy.store.shared.frame import payload  # noqa: E402

MODULE = ROOT / "ocxproxy" / "store" / "shared" / "dictionary.py"
SIZE = 4096
SAMPLES = 4000

WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by not but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number no most people my
over know than call first who may down side been now find any new work part take get place
made where after back little only round year came show every good me give our under name
very through just form great think say help line turn cause much mean before move right old
too same tell does set three want well also play small end put home read hand large add even
here must big high such follow why ask change went light kind off need try again point
should found answer still learn keep never last let thought start might close real few file
function error test code return value list string data request response server client config
path module class import python build run fix bug update check type null true false object
array please can't don't it's let's I'm sure thanks here's summary step next done failed
passed output input user assistant tool call result line lines changes diff patch branch
commit review
""".split()  # noqa: SIM905
MODELS = [
    "gpt-5",
    "gpt-5-mini",
    "gpt-4.1",
    "gpt-4o-mini",
    "o4-mini",
    "gpt-oss-20b",
    "qwen3-8b",
    "llama-3.1-8b-instruct",
    "mistral-small",
]
TOOLS = ["shell", "read_file", "apply_patch", "search", "get_weather", "list_dir", "web_fetch"]
HEX = "0123456789abcdef"


class Corpus:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self, low: int, high: int) -> str:
        words = self.rng.choices(WORDS, k=self.rng.randint(low, high))
        return " ".join(words).capitalize() + self.rng.choice([".", "?", "", ".\n"])

    def hexid(self, prefix: str) -> str:
        n = self.rng.choice([8, 24, 32, 48])
        return prefix + "".join(self.rng.choices(HEX, k=n))

    def input_item(self) -> dict[str, Any]:
        kind = self.rng.random()
        if kind < 0.35:
            return {"role": "user", "content": self.text(3, 60)}
        if kind < 0.65:
            part = {"type": "input_text", "text": self.text(3, 80)}
            return {"type": "message", "role": "user", "content": [part]}
        output = self.text(3, 120)
        return {"type": "function_call_output", "call_id": self.hexid("call_"), "output": output}

    def output_item(self) -> dict[str, Any]:
        kind = self.rng.random()
        if kind < 0.5:
            text = {"type": "output_text", "text": self.text(1, 90), "annotations": []}
            if self.rng.random() < 0.3:
                text["logprobs"] = []
            return {
                "type": "message",
                "id": self.hexid("msg_"),
                "role": "assistant",
                "status": "completed",
                "content": [text],
            }
        if kind < 0.8:
            arguments = orjson.dumps({"path": f"src/{self.rng.choice(WORDS)}.py"}).decode()
            return {
                "type": "function_call",
                "id": self.hexid("fc_"),
                "call_id": self.hexid("call_"),
                "name": self.rng.choice(TOOLS),
                "arguments": arguments,
                "status": "completed",
            }
        summary = [{"type": "summary_text", "text": self.text(5, 40)}]
        return {"type": "reasoning", "id": self.hexid("rs_"), "summary": summary}

    def segment(self) -> bytes:
        items = [self.input_item() for _ in range(self.rng.randint(1, 2))]
        items += [self.output_item() for _ in range(self.rng.randint(1, 3))]
        raw = [orjson.dumps(item) for item in items]
        data = b",".join(raw)
        spans, at = [], 0
        for item, blob in zip(items, raw, strict=True):
            if "id" in item:
                spans.append([item["id"], at, at + len(blob)])
            at += len(blob) + 1
        calls = sorted(i["call_id"] for i in items if i.get("type") == "function_call")
        return payload(orjson.dumps([len(items), calls, spans]), data)

    def record(self) -> bytes:
        rng = self.rng
        tokens = rng.randint(10, 120_000)
        out = rng.randint(1, 4000)
        response: dict[str, Any] = {}
        if rng.random() < 0.6:
            response["previous_response_id"] = self.hexid("resp_")
        response |= {
            "id": "",
            "object": "response",
            "created_at": rng.randint(1_700_000_000, 1_900_000_000),
            "status": "completed",
            "model": rng.choice(MODELS),
            "output": [],
        }
        full = rng.random() < 0.6  # OpenAI's full field set, else what local servers send
        if full:
            response |= {
                "background": False,
                "error": None,
                "incomplete_details": None,
                "instructions": self.text(5, 30) if rng.random() < 0.3 else None,
                "max_output_tokens": None,
                "max_tool_calls": None,
            }
        response |= {"parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        if full:
            response |= {
                "metadata": {},
                "reasoning": {
                    "effort": rng.choice(["low", "medium", "high", None]),
                    "summary": None,
                },
                "service_tier": "default",
                "store": True,
                "temperature": 1.0,
                "text": {"format": {"type": "text"}, "verbosity": "medium"},
                "top_logprobs": 0,
                "top_p": 1.0,
                "truncation": "disabled",
                "user": None,
            }
        cached = rng.randint(0, tokens)
        response["usage"] = {
            "input_tokens": tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": rng.randint(0, out)},
            "total_tokens": tokens + out,
        }
        skeleton = orjson.dumps(response)
        created = rng.randint(1_700_000_000_000, 1_900_000_000_000)
        backend = f"http://{rng.choice(['127.0.0.1', '10.0.0.7', 'gpu-1'])}:{rng.randint(1, 65535)}"
        affinity = rng.choice(["root:", "pck:", "head:"]) + self.hexid("resp_")
        at = skeleton.find(b'"id":""') + 6  # where the record's id goes back
        meta = [
            created,
            (created + rng.random()) / 1000 + 2_592_000,
            rng.randint(1, 400),
            [rng.randint(0, 400), rng.randint(100, 4000)],
            backend,
            affinity,
            True,
            at,
        ]
        return payload(orjson.dumps(meta), skeleton)


def train() -> bytes:
    corpus = Corpus(seed=15)
    samples: list[bytes | bytearray | memoryview] = [corpus.segment() for _ in range(SAMPLES)]
    samples += [corpus.record() for _ in range(SAMPLES)]
    return zstandard.train_dictionary(SIZE, samples, level=3, threads=1).as_bytes()


def module_text(dictionary: bytes) -> str:
    encoded = base64.b85encode(dictionary).decode()
    lines = [encoded[i : i + 90] for i in range(0, len(encoded), 90)]
    body = "\n".join(f'    b"{line}"' for line in lines)
    return (
        '"""The zstd dictionary of the shared tier\'s values (layout.py), written by\n'
        'scripts/shared_dictionary.py: do not edit. A new dictionary is a new layout."""\n\n'
        "import base64\n\n"
        f'SHA256 = "{hashlib.sha256(dictionary).hexdigest()}"\n'
        f"DICTIONARY = base64.b85decode(\n{body}\n)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    text = module_text(train())
    if args.check:
        same = MODULE.read_text() == text
        print("store/shared/dictionary.py is " + ("up to date" if same else "out of date"))
        sys.exit(0 if same else 1)
    MODULE.write_text(text)
    print(f"wrote {MODULE.relative_to(ROOT)} ({SIZE} bytes, sha256 {text.split(chr(34))[7]})")


if __name__ == "__main__":
    main()
