"""An instant, stateless Responses backend for benchmarks: no model, no simulated work.

`POST /v1/responses` reads the body and answers at once with a fixed one-item response
(`"ok"`) under a fresh id, as JSON or, when the body has `"stream":true`, as a short
spec-complete SSE stream (every event carries `sequence_number`). Its output item's id is
`msg_x` every time (benchmarks that build the forwarded history themselves rely on it), or
with `--unique-item-ids` a fresh one per response, as real servers send (`msg_` and 32
random hex digits, vLLM's form). `GET /_last` reports
the size and SHA-256 of the last body received, so a benchmark can check that what the
proxy forwarded is byte-identical to the body it sends directly.

Unlike tests/fakes/backend.py (which simulates a prefix cache, ≈9 ms per 512 KB) this
costs the same small amount whatever the history, so it cancels out of
"via proxy - direct".

    python scripts/bench/instant_backend.py --port 0   # prints "instant backend listening on URL"
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

import loopback
import orjson
from aiohttp import web

OUTPUT_ITEM: dict[str, Any] = {  # the one output item every turn adds
    "type": "message",
    "id": "msg_x",  # or, --unique-item-ids, a fresh id written over _ITEM_ID
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
}
_RID = b"__RID__"
_TOKENS = b"9999999"  # placeholder, same width as the number written over it
_ITEM_ID = b"msg_x"


def _response(status: str, output: list[object]) -> dict[str, object]:
    return {
        "id": _RID.decode(),
        "object": "response",
        "created_at": 1700000000,
        "status": status,
        "model": "bench",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": int(_TOKENS),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": int(_TOKENS),
        },
    }


def _json_template() -> bytes:
    return orjson.dumps(_response("completed", [OUTPUT_ITEM]))


def _sse_template() -> bytes:
    pending = _response("in_progress", [])
    pending.pop("usage")
    part = {"type": "output_text", "text": "", "annotations": []}
    loc = {"item_id": "msg_x", "output_index": 0, "content_index": 0}
    added = {**OUTPUT_ITEM, "status": "in_progress", "content": []}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
        {"type": "response.output_item.added", "output_index": 0, "item": added},
        {"type": "response.content_part.added", **loc, "part": part},
        {"type": "response.output_text.delta", **loc, "delta": "ok", "logprobs": []},
        {"type": "response.output_text.done", **loc, "text": "ok", "logprobs": []},
        {"type": "response.content_part.done", **loc, "part": OUTPUT_ITEM["content"][0]},
        {"type": "response.output_item.done", "output_index": 0, "item": OUTPUT_ITEM},
        {"type": "response.completed", "response": _response("completed", [OUTPUT_ITEM])},
    ]
    out = []
    for seq, event in enumerate(events):
        event["sequence_number"] = seq
        out.append(b"event: %s\ndata: %s\n\n" % (event["type"].encode(), orjson.dumps(event)))
    return b"".join(out)


class InstantBackend:
    def __init__(self, *, unique_item_ids: bool = False) -> None:
        self.unique_item_ids = unique_item_ids
        self.count = 0
        self.last = b""
        self.prefix = f"resp_{os.getpid()}_".encode()
        self.json = _json_template()
        self.sse = _sse_template()

    def _fill(self, template: bytes, body: bytes) -> bytes:
        self.count += 1
        tokens = b"%-7d" % min(len(body) // 4, 9_999_999)  # JSON allows the trailing spaces
        rid = self.prefix + b"%d" % self.count
        filled = template.replace(_RID, rid).replace(_TOKENS, tokens)
        if self.unique_item_ids:
            filled = filled.replace(b'"%s"' % _ITEM_ID, b'"msg_%s"' % os.urandom(16).hex().encode())
        return filled

    def answer(self, body: bytes) -> tuple[bytes, bool]:
        """The answer to one create request, and whether it is an SSE stream."""
        self.last = body
        if b'"stream":true' in body:
            return self._fill(self.sse, body), True
        return self._fill(self.json, body), False

    def raw(self, head: bytes, body: bytes) -> tuple[bytes, bytes]:
        """The answer on loopback.RawServer (`--raw`): the cheapest a backend can be."""
        payload, is_stream = self.answer(body)
        return (b"text/event-stream" if is_stream else b"application/json"), payload

    async def create(self, request: web.Request) -> web.StreamResponse:
        payload, is_stream = self.answer(await request.read())
        if is_stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(payload)
            await response.write_eof()
            return response
        return web.Response(body=payload, content_type="application/json")

    async def last_body(self, request: web.Request) -> web.Response:
        info = {
            "count": self.count,
            "len": len(self.last),
            "sha256": hashlib.sha256(self.last).hexdigest(),
        }
        return web.json_response(info)


def build_app(*, unique_item_ids: bool = False) -> web.Application:
    backend = InstantBackend(unique_item_ids=unique_item_ids)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/responses", backend.create)
    app.router.add_get("/_last", backend.last_body)
    app.router.add_get("/health", _health)  # as real servers have: the proxy probes it
    return app


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def serve(port: int, raw: bool, unique_item_ids: bool) -> None:
    if raw:
        backend = InstantBackend(unique_item_ids=unique_item_ids)
        await loopback.serve(port, "instant backend (raw) listening on {url}", handler=backend.raw)
    else:
        app = build_app(unique_item_ids=unique_item_ids)
        await loopback.serve(port, "instant backend listening on {url}", app=app)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--raw", action="store_true", help="hand-written HTTP/1.1, no aiohttp")
    parser.add_argument(
        "--unique-item-ids", action="store_true", help="a fresh output item id per response"
    )
    args = parser.parse_args()
    loopback.run(serve(args.port, args.raw, args.unique_item_ids))


if __name__ == "__main__":
    main()
