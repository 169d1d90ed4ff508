"""Command line: flags and OCXPROXY_* environment → Config → server.run. Exit codes:
0 clean shutdown, 2 bad configuration (one line on stderr).

`ocxproxy state stats|verify|gc [--state-dir DIR]` inspects the state dir of a stopped (or,
for stats and verify, a running) proxy: 0 fine, 1 problems found or the dir is busy."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ocxproxy import __version__
from ocxproxy.config import (
    BOOL_SETTINGS,
    LIST_SETTINGS,
    SETTINGS,
    ConfigError,
    build_config,
    env_name,
    help_for,
    metavar_for,
)

_HIDDEN = ("snapshot_delay",)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ocxproxy: error: {message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ocxproxy",
        description="Stateful OpenAI Responses API in front of stateless inference servers.",
    )
    parser.add_argument("--version", action="version", version=f"ocxproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy. Point a client's base URL at http://HOST:PORT/v1. "
        "Every flag can also be set by the environment variable named in its help.",
    )
    for name in SETTINGS:
        flag = "--" + name.replace("_", "-")
        text = f"{help_for(name)} [{env_name(name)}]"
        if name in _HIDDEN:
            text = argparse.SUPPRESS
        if name in BOOL_SETTINGS:
            serve.add_argument(flag, action="store_const", const="true", default=None, help=text)
        elif name in LIST_SETTINGS:
            serve.add_argument(flag, action="append", metavar="VALUE", help=text)
        else:
            metavar = metavar_for(name) or name.split("_")[-1].upper()
            serve.add_argument(flag, metavar=metavar, help=text)
    state = commands.add_parser(
        "state",
        help="inspect, verify or clean the state dir",
        description="stats: records, segments and journal files; verify: read the checkpoint "
        "and journal and check every live segment's digest (exit 1 on problems); gc: remove "
        "journal files nothing needs and temp files (proxy stopped).",
    )
    state.add_argument("action", choices=("stats", "verify", "gc"))
    state.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"{help_for('state_dir')} [{env_name('state_dir')}]",
    )
    return parser


def _state(args: argparse.Namespace, environ: dict[str, str]) -> int:
    from ocxproxy.store import admin, default_state_dir

    raw = args.state_dir or environ.get(env_name("state_dir"))
    root = Path(raw) if raw else default_state_dir()
    if not root.is_dir():
        print(f"ocxproxy: error: no state dir at {root}", file=sys.stderr)
        return 1
    try:
        if args.action == "stats":
            print("\n".join(admin.inspect(root).lines()))
            return 0
        if args.action == "verify":
            report, problems = admin.verify(root)
            print("\n".join(report.lines()))
            for problem in problems:
                print(f"problem: {problem}")
            print(f"{len(problems)} problems, {report.checked} segments checked")
            return 1 if problems else 0
        removed = admin.gc(root)
    except admin.StateBusy as exc:
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 1
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} entries removed")
    return 0


def _raw_settings(
    args: argparse.Namespace, environ: dict[str, str]
) -> tuple[dict[str, Any], set[str]]:
    """Flags win over the environment; list settings take a comma list from the env.
    Also returns which settings came from the environment (errors name the variable)."""
    raw: dict[str, Any] = {}
    from_env: set[str] = set()
    for name in SETTINGS:
        value = getattr(args, name, None)
        if value is None:
            env = environ.get(env_name(name))
            if env is not None:
                value = [env] if name in LIST_SETTINGS else env
                from_env.add(name)
        raw[name] = value
    return raw, from_env


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    args = _parser().parse_args(argv)
    environ = dict(os.environ) if environ is None else environ
    if args.command == "state":
        return _state(args, environ)
    try:
        raw, from_env = _raw_settings(args, environ)
        config = build_config(raw, from_env=from_env)
    except ConfigError as exc:
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from ocxproxy import server
    from ocxproxy.upstream.local import LocalBackendError

    try:
        server.run(config)
    except (LocalBackendError, ConfigError) as exc:  # ConfigError: e.g. the shared store's
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"ocxproxy: error: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
