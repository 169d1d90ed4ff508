"""The queries shipped in deploy/: every dashboard target and alert expression, and the
vector selectors inside them, for the tests that check them against the proxy's metrics."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import missing_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "ocxproxy.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"

# A metric name followed by optional label matchers; names inside `by (...)` and
# functions are not followed by `{` or `[` in our queries, so they never match alone.
_SELECTOR = re.compile(r"\b(up|ocxproxy_[a-z_]+)(\{[^}]*\})?")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True)
class Target:
    panel: str
    expr: str
    legend: str

    def resolved(self, instance: str, rate_interval: str = "1m") -> str:
        """The query as Grafana sends it with one instance, every backend selected."""
        return (
            self.expr.replace("$__rate_interval", rate_interval)
            .replace("$instance", re.escape(instance).replace("\\", "\\\\"))
            .replace("$backend", ".*")
        )

    @property
    def legend_labels(self) -> list[str]:
        return _LEGEND_LABEL.findall(self.legend)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def targets() -> list[Target]:
    return [
        Target(p["title"], t["expr"], t.get("legendFormat", ""))
        for p in panels()
        for t in p["targets"]
    ]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def alert_rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def selectors(expr: str) -> list[str]:
    """Each vector selector of a query, as a query of its own."""
    return [name + (matchers or "") for name, matchers in _SELECTOR.findall(expr)]


def metric_names(expr: str) -> set[str]:
    return {name for name, _ in _SELECTOR.findall(expr) if name != "up"}


def require(binary: str) -> str:
    """Debian's `prometheus` package provides prometheus and promtool. Missing: skip, but
    fail under CI (CI=true; .ci/run installs the package), where a skip would hide it."""
    path = shutil.which(binary)
    if path is None:
        reason = f"{binary} is not installed (apt-get install prometheus)"
        missing_tool(reason)
    return path
