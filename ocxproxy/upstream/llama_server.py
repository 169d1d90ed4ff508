"""The embedded backend's child process: llama.cpp's server (``xllamacpp``) until SIGTERM,
SIGINT or the death of its parent. Run by ``LocalBackend`` (upstream/local.py) as
``python -m ocxproxy.upstream.llama_server --model PATH --port N``; the only module that
imports xllamacpp.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ocxproxy.upstream.local import CACHE_RAM_MIB, DEFAULT_CTX

_PARENT_POLL_INTERVAL: Final = 0.5
_PR_SET_PDEATHSIG: Final = 1


def _die_with_parent(parent_pid: int | None) -> int:
    """Ask the kernel to SIGTERM us when our parent exits; return the pid to watch.

    PR_SET_PDEATHSIG fires when the parent *thread* that forked us exits (asyncio forks from
    the event-loop thread, whose end means the proxy is done with us anyway). The getppid()
    poll in main() covers the fork/prctl race and is the only mechanism off Linux.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    expected = parent_pid if parent_pid is not None else os.getppid()
    if os.getppid() != expected:  # the parent died before prctl took effect
        sys.exit(0)
    return expected


def _build_params(args: argparse.Namespace) -> Any:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(args.model)
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx
    if args.threads is not None:
        params.cpuparams.n_threads = args.threads
        params.cpuparams_batch.n_threads = args.threads
    # One slot by default (--parallel). The proxy replays each conversation append-only,
    # so the only thing that matters for speed is that turn N+1 lands on the KV cache left
    # by turn N; with a single slot it always does (measured: ~99% of the prompt cached).
    # A second slot would not help: slots split n_ctx (kv_unified is off, so 2 slots =
    # 4096 tokens each, or twice the KV memory), llama.cpp could route a chain's next turn
    # to the other, cold slot, and on a small CPU box two concurrent decodes are no faster
    # than queueing them. Interleaved conversations still hit: llama.cpp saves the slot's
    # state to its host-RAM prompt cache (--cache-ram-mib) when another prompt takes the
    # slot and restores it on the next turn.
    params.n_parallel = args.parallel
    params.cache_prompt = True  # reuse the slot's KV cache for the common prefix
    params.cache_ram_mib = args.cache_ram_mib
    # Full-size KV cache for sliding-window-attention models; without it llama.cpp cannot
    # reuse a prefix longer than the window. (No effect on SmolLM2, which has no SWA.)
    params.swa_full = True
    params.ctx_shift = False  # reject over-long prompts instead of silently dropping history
    if args.temperature is not None:  # a request's own temperature still wins
        params.sampling.temp = args.temperature  # 0: greedy, the likeliest token
    if args.slot_save_path is not None:  # POST /slots/{id}?action=save|restore (warm resume)
        params.slot_save_path = os.path.join(args.slot_save_path, "")  # llama.cpp appends names
        params.endpoint_slots = True
    return params


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ocxproxy.upstream.llama_server",
        description="Run the embedded llama.cpp server until SIGTERM/SIGINT.",
    )
    parser.add_argument("--model", type=Path, required=True, help="GGUF model file")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback)")
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="context size in tokens")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: auto)")
    parser.add_argument("--parallel", type=int, default=1, help="slots (they split --ctx)")
    parser.add_argument(
        "--cache-ram-mib",
        type=int,
        default=CACHE_RAM_MIB,
        help="host-RAM prompt cache for other prompts' KV state (0: off)",
    )
    parser.add_argument(
        "--slot-save-path",
        type=Path,
        default=None,
        help="directory for slot saves (POST /slots/{id}?action=save|restore); default: off",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature for a request that sets none (default: llama.cpp's)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    parent = _die_with_parent(args.parent_pid)
    os.umask(0o077)  # what llama.cpp writes (slot saves) is the proxy user's alone
    # Until the server is up, SIGTERM/SIGINT keep their default action (die at once): a
    # Python handler could not run while the model loads inside native code anyway.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    params = _build_params(args)
    import xllamacpp

    try:
        server = xllamacpp.Server(params)  # loads the model, serves on native threads
    except RuntimeError as exc:
        print(f"ocxproxy.upstream.llama_server: llama.cpp server failed: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"ocxproxy.upstream.llama_server: serving on {server.listening_address}", flush=True)
    while not stop.wait(_PARENT_POLL_INTERVAL):
        if os.getppid() != parent:
            print(
                "ocxproxy.upstream.llama_server: parent process is gone, exiting", file=sys.stderr
            )
            break
    del server  # joins llama.cpp's main loop
    return 0


if __name__ == "__main__":
    sys.exit(main())
