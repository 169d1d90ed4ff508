"""Several `ocxproxy serve` replicas (the real CLI, as child processes, tests/serve.py) on one
shared store, each on a free port with its own state dir, in front of one upstream; a
round-robin picker over those that run. A replica can be killed (-9) and started again
in its slot."""

from __future__ import annotations

import asyncio
import itertools
import signal
from pathlib import Path

from tests.serve import Serve


class Replicas:
    def __init__(
        self,
        upstream: str,
        store_url: str,
        state_root: Path,
        n: int = 3,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.upstream, self.store_url, self.state_root = upstream, store_url, state_root
        self.extra, self.env = extra, env
        self.slots: list[Serve] = [self._new(i) for i in range(n)]
        self.started: list[Serve] = []  # every process ever started, for teardown
        self._turn = itertools.count()

    def _new(self, i: int) -> Serve:
        return Serve(
            self.upstream,
            self.state_root / f"replica-{i}",
            "--shared-store",
            self.store_url,
            *self.extra,
            env=self.env,
        )

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Serve:
        return self.slots[i]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.slots]

    async def start(self) -> Replicas:
        """Start every slot, together (Python's start-up dominates)."""
        await asyncio.gather(*(self.start_slot(i) for i in range(len(self.slots))))
        return self

    async def start_slot(self, i: int) -> Serve:
        """(Re)start slot i on its own state dir; a fresh process."""
        if self.slots[i].proc is not None:
            self.slots[i] = self._new(i)
        serve = self.slots[i]
        self.started.append(serve)
        await serve.start()
        return serve

    async def kill9(self, i: int) -> None:
        await self.slots[i].kill9()

    def running(self) -> list[Serve]:
        """The replicas that run and listen (not one being restarted)."""
        return [s for s in self.slots if s.running and s.url]

    def next(self) -> Serve:
        """The next running replica, round robin."""
        alive = self.running()
        assert alive, "no replica runs"
        return alive[next(self._turn) % len(alive)]

    async def close(self) -> None:
        for serve in self.started:
            if serve.running:
                await serve.stop(signal.SIGKILL)
