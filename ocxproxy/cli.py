"""Command line: flags, OCXPROXY_* environment and a --config file → Config → server.run.
Exit codes: 0 clean shutdown, 2 bad configuration (one line on stderr).

To add a setting, add one `setting(...)` field to `Config` in ocxproxy/config.py: its
flag, environment variable, config-file key, --help line (in its group, with its default)
and its checks all come from that field. Nothing here names a setting.

A value's source, strongest first: the flag, the OCXPROXY_* variable, the config file
(`--config FILE` or OCXPROXY_CONFIG), the default. An error names that source.

`ocxproxy state stats|verify|gc [--state-dir DIR]` inspects the state dir of a stopped (or,
for stats and verify, a running) proxy: 0 fine, 1 problems found or the dir is busy."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ocxproxy import __version__
from ocxproxy.config import (
    CONFIG_ENV,
    GROUPS,
    SETTINGS,
    ConfigError,
    build_config,
    default_text,
    env_name,
    flag_name,
    group_of,
    help_for,
    idle_settings,
    is_hidden,
    kind_of,
    metavar_for,
    read_config_file,
    unknown_env_names,
)

# OCXPROXY_* variables that the project's own scripts and tests read: not settings, and
# not typos to warn about when they reach the proxy's environment.
TOOLING_ENV = (
    "OCXPROXY_VENV",
    "OCXPROXY_REQUIRE_LLAMA",
    "OCXPROXY_STALL_MS",
    "OCXPROXY_STALL_STEPS",
    "OCXPROXY_PROFILE_OUT",
    "OCXPROXY_PROFILE_CLOCK",
    "OCXPROXY_BENCH_ABLATE",
    "OCXPROXY_CODEX",  # the Codex CLI binary of the Codex tests and benchmark
    "OCXPROXY_OPENAI_NODE",  # openai-node's node_modules, for the tests through it
    "OCXPROXY_NO_SPEEDUPS",  # the compiled fast paths not loaded (ocxproxy/speedups.py)
    "OCXPROXY_REQUIRE_SPEEDUPS",  # or required (CI)
)
UNITS = (
    "SIZE is bytes, or a number with a unit: 500kb, 64MiB, 1GiB (k, m, g: powers of 1000; "
    "KiB, MiB, GiB, TiB: of 1024). DURATION is seconds, or a number with a unit: 500ms, "
    "90s, 15m, 2h, 30d. Each setting is taken from, strongest first: its flag, its "
    "environment variable (in brackets), the --config file (keys as the flags, without the "
    'dashes: max-disk-bytes = "1GiB"), its default.'
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, in the style of a bad value's: `--port: expected one argument`; an
        unknown flag names the closest real one."""
        message = message.removeprefix("argument ")
        if message.startswith("unrecognized arguments: "):
            flags = ["--config", *(flag_name(name) for name in SETTINGS)]
            unknown = message.split()[2].partition("=")[0]
            near = difflib.get_close_matches(unknown, flags, n=1)
            message += f" (did you mean {near[0]}?)" if near else ""
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
        description="Run the proxy. Point a client's base URL at http://HOST:PORT/v1.",
        epilog=UNITS,
    )
    groups = {name: serve.add_argument_group(name) for name in GROUPS}
    groups[GROUPS[0]].add_argument(
        "--config",
        metavar="FILE",
        help=f"a TOML file of settings, overridden by flags and variables [{CONFIG_ENV}]",
    )
    for name in SETTINGS:
        default = default_text(name)
        text = help_for(name) + (f" (default: {default})" if default else "")
        text = argparse.SUPPRESS if is_hidden(name) else f"{text} [{env_name(name)}]"
        group = groups[group_of(name)]
        kind = kind_of(name)
        if kind == "flag":  # --no-zdr: off, whatever the config file says
            group.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, help=text)
        elif kind == "list":
            metavar = metavar_for(name)
            group.add_argument(flag_name(name), action="append", metavar=metavar, help=text)
        else:
            group.add_argument(flag_name(name), metavar=metavar_for(name), help=text)
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
    state.add_argument(
        "--config", metavar="FILE", help=f"the serve config file, for its state-dir [{CONFIG_ENV}]"
    )
    return parser


def _state(args: argparse.Namespace, environ: dict[str, str]) -> int:
    from ocxproxy.store import default_state_dir
    from ocxproxy.store.local import admin

    raw = args.state_dir or environ.get(env_name("state_dir"))
    config_file = args.config or environ.get(CONFIG_ENV)
    if raw is None and config_file:
        try:
            raw = read_config_file(Path(config_file))[0].get("state_dir")
        except ConfigError as exc:
            print(f"ocxproxy: error: {exc}", file=sys.stderr)
            return 2
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
            print(f"{len(problems)} problems, {report.checked} segments and responses checked")
            return 1 if problems else 0
        removed = admin.gc(root)
    except admin.StateBusy as exc:
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # e.g. a state dir in a newer format
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 1
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} entries removed")
    return 0


def _raw_settings(
    args: argparse.Namespace, environ: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each setting's raw value from the strongest source that has one, and, for those not
    from a flag, where it came from (errors name it). List settings take a comma list from
    the environment."""
    config_file = args.config or environ.get(CONFIG_ENV)
    raw, sources = read_config_file(Path(config_file)) if config_file else ({}, {})
    for name in SETTINGS:
        value = getattr(args, name, None)
        if value is not None:
            raw[name] = value
            sources.pop(name, None)
            continue
        env = environ.get(env_name(name))
        if env is not None:
            raw[name] = [env] if kind_of(name) == "list" else env
            sources[name] = env_name(name)
    return raw, sources


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    args = _parser().parse_args(argv)
    environ = dict(os.environ) if environ is None else environ
    if args.command == "state":
        return _state(args, environ)
    for line in unknown_env_names(environ, TOOLING_ENV):
        print(f"ocxproxy: warning: {line}", file=sys.stderr)
    try:
        raw, sources = _raw_settings(args, environ)
        config = build_config(raw, sources=sources)
    except ConfigError as exc:
        print(f"ocxproxy: error: {exc}", file=sys.stderr)
        return 2
    for line in idle_settings(config, sources):
        print(f"ocxproxy: warning: {line}", file=sys.stderr)
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
