"""Imports point down only (STYLE.md, Layering): checked by walking each module's AST."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ocxproxy"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (lazy imports count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def importing(predicate_module: str) -> list[str]:
    return sorted(
        name
        for name, imports in MODULES.items()
        if any(i == predicate_module or i.startswith(predicate_module + ".") for i in imports)
    )


def uses(imports: set[str], target: str) -> bool:
    return any(i == target or i.startswith(target + ".") for i in imports)


def test_walk_sees_the_package() -> None:
    assert {"ocxproxy.server", "ocxproxy.http.responses", "ocxproxy.continuation.expand"} <= set(
        MODULES
    )
    assert uses(MODULES["ocxproxy.server"], "aiohttp.web")  # the walk does find imports


def test_only_http_and_server_import_aiohttp_web() -> None:
    allowed = {"ocxproxy.server"}
    offenders = [
        name
        for name in importing("aiohttp.web")
        if name not in allowed and not name.startswith("ocxproxy.http")
    ]
    assert offenders == []


@pytest.mark.parametrize(
    "module",
    [
        "ocxproxy.h1",
        "ocxproxy.continuation",
        "ocxproxy.continuation.affinity",
        "ocxproxy.continuation.expand",
        "ocxproxy.continuation.record",
        "ocxproxy.upstream.sse",
        "ocxproxy.upstream.repair",
        "ocxproxy.upstream.chat",
        "ocxproxy.upstream.chat_stream",
        "ocxproxy.store.resident",
        "ocxproxy.errors",
        "ocxproxy.config",
        "ocxproxy.model",
        "ocxproxy.metrics",
    ],
)
def test_pure_modules_do_no_async_io(module: str) -> None:
    imports = MODULES[module]
    for banned in (
        "asyncio",
        "aiohttp",
        "ocxproxy.http",
        "ocxproxy.store",
        "ocxproxy.upstream.pool",
    ):
        if module.startswith("ocxproxy.store") and banned == "ocxproxy.store":
            continue
        assert not uses(imports, banned), f"{module} imports {banned}"


LEVEL_ZERO = (
    "ocxproxy.errors",
    "ocxproxy.config",
    "ocxproxy.model",
    "ocxproxy.metrics",
    "ocxproxy.speedups",
)


@pytest.mark.parametrize("module", LEVEL_ZERO)
def test_level_zero_imports_only_level_zero(module: str) -> None:
    version = {"ocxproxy", "ocxproxy.__version__"}  # the package root holds nothing else
    compiled = {"ocxproxy._speedups"}  # (C: it imports nothing of the package)
    own = {i for i in MODULES[module] if i.startswith("ocxproxy")} - version - compiled
    assert all(any(uses({i}, low) for low in LEVEL_ZERO) for i in own), own


def test_http_1_1_is_read_in_one_place() -> None:
    """Both directions read HTTP/1.1 with h1.py (llhttp); nothing else parses it by hand."""
    assert {"ocxproxy.http.front", "ocxproxy.upstream.http1"} <= set(importing("ocxproxy.h1"))
    assert not uses(MODULES["ocxproxy.h1"], "ocxproxy")


def test_the_create_turn_is_not_tied_to_aiohttp_web() -> None:
    """http/exchange.py runs a turn for the front end, aiohttp's route and WebSocket alike."""
    assert not uses(MODULES["ocxproxy.http.exchange"], "aiohttp.web")


def test_websocket_takes_the_turn_from_exchange_not_the_routes() -> None:
    imports = MODULES["ocxproxy.http.websocket"]
    assert uses(imports, "ocxproxy.http.exchange")
    assert not uses(imports, "ocxproxy.http.responses")


def test_store_never_imports_upstream_or_http() -> None:
    for name, imports in MODULES.items():
        if name.startswith("ocxproxy.store"):
            assert not uses(imports, "ocxproxy.upstream"), name
            assert not uses(imports, "ocxproxy.http"), name


def test_upstream_never_imports_store_or_http() -> None:
    for name, imports in MODULES.items():
        if name.startswith("ocxproxy.upstream"):
            assert not uses(imports, "ocxproxy.store"), name
            assert not uses(imports, "ocxproxy.http"), name


def test_nothing_imports_the_wiring() -> None:
    assert importing("ocxproxy.server") == ["ocxproxy.cli"]  # cli → server.run is the wiring
    assert importing("ocxproxy.cli") == ["ocxproxy.__main__"]


def modules_named(path: Path) -> set[str]:
    """The modules a file imports (not the names it takes from them), submodules named
    in `from package import module` included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if f"{node.module}.{alias.name}" in MODULES
            )
    return found


def test_http_reaches_the_store_through_its_interface_only() -> None:
    """http/ and continuation/ import `ocxproxy.store` (the façade: the interface and the
    types it names), never a module inside it: either store can be behind it."""
    offenders = {
        module_name(path): sorted(m for m in modules_named(path) if m.startswith("ocxproxy.store."))
        for path in sorted(PACKAGE.rglob("*.py"))
        if module_name(path).startswith(("ocxproxy.http", "ocxproxy.continuation"))
    }
    assert {name: inside for name, inside in offenders.items() if inside} == {}
    assert "ocxproxy.store" in modules_named(PACKAGE / "http" / "exchange.py")  # the walk sees it


def test_the_two_stores_are_siblings() -> None:
    """store/shared/ and store/local/ never import each other: what both use sits beside
    them in store/ (the memory-only store a shared store holds is handed to it by the
    façade, typed as store/process.py's ProcessStore)."""
    for name, imports in MODULES.items():
        if name.startswith("ocxproxy.store.shared"):
            assert not uses(imports, "ocxproxy.store.local"), name
        if name.startswith("ocxproxy.store.local"):
            assert not uses(imports, "ocxproxy.store.shared"), name
    assert uses(MODULES["ocxproxy.store.shared.store"], "ocxproxy.store.process")
