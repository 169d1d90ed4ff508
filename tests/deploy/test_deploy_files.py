"""deploy/: the dashboard and the alert rules use only metrics the proxy exports, filter by
the dashboard's variables, say what good looks like; promtool accepts the rules and their
unit tests cover every alert firing and not firing."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from ocxproxy.metrics import Histogram, Metrics, _Family
from tests.deploy.queries import (
    ALERTS,
    ALERTS_TEST,
    alert_rules,
    dashboard,
    metric_names,
    panels,
    require,
    selectors,
    targets,
    variables,
)

BACKEND_LABELLED = ("ocxproxy_upstream_", "ocxproxy_backend_", "ocxproxy_continuation_")


def exported_names() -> set[str]:
    names = set()
    for family in vars(Metrics()).values():
        if isinstance(family, _Family):
            names.add(family.name)
            if isinstance(family, Histogram):
                names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_every_metric_the_dashboard_and_the_alerts_use_is_exported() -> None:
    exported = exported_names()
    used = {name for t in targets() for name in metric_names(t.expr)}
    used |= {name for rule in alert_rules().values() for name in metric_names(rule["expr"])}
    assert used - exported == set()
    # What the dashboard must show, by the metric that shows it.
    for wanted in (
        "ocxproxy_requests_total",
        "ocxproxy_proxy_overhead_seconds_bucket",
        "ocxproxy_upstream_latency_seconds_bucket",
        "ocxproxy_upstream_ttfb_seconds_bucket",
        "ocxproxy_backend_cached_tokens_total",
        "ocxproxy_continuation_cached_tokens_total",
        "ocxproxy_expansions_total",
        "ocxproxy_store_entries",
        "ocxproxy_store_bytes",
        "ocxproxy_store_capacity_bytes",
        "ocxproxy_store_capacity_entries",
        "ocxproxy_store_evictions_total",
        "ocxproxy_spill_failures_total",
        "ocxproxy_snapshot_failures_total",
        "ocxproxy_snapshot_age_seconds",
        "ocxproxy_journal_lag_seconds",
        "ocxproxy_store_available",
        "ocxproxy_store_write_failures_total",
        "ocxproxy_affinity_total",
        "ocxproxy_backend_up",
        "ocxproxy_admission_rejected_total",
        "ocxproxy_websocket_connections",
        "ocxproxy_websocket_turns_total",
        "ocxproxy_compactions_total",
        "ocxproxy_compaction_summary_tokens_total",
        "ocxproxy_truncation_steps_total",
        "ocxproxy_context_length_exceeded_total",
        "ocxproxy_token_counts_total",
        "ocxproxy_cache_miss_total",
        "ocxproxy_cache_checks_total",
        "ocxproxy_kv_saves_total",
        "ocxproxy_kv_restores_total",
        "ocxproxy_kv_saved_bytes",
    ):
        assert any(wanted in metric_names(t.expr) for t in targets()), wanted


def test_the_dashboard_is_importable_with_its_variables() -> None:
    board = dashboard()
    assert board["uid"] == "ocxproxy" and board["title"]
    found = variables()
    assert found["datasource"]["type"] == "datasource"
    assert found["datasource"]["query"] == "prometheus"
    for name in ("instance", "backend"):
        assert found[name]["type"] == "query"
        assert found[name]["datasource"]["uid"] == "${datasource}"
        assert found[name]["query"].startswith("label_values(")
        assert found[name]["includeAll"] and found[name]["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("panel", panels(), ids=lambda p: p["title"])
def test_each_panel_says_what_good_looks_like_and_follows_the_variables(panel: dict) -> None:
    description = panel["description"]
    assert "Good" in description and "\n" not in description
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"]
    for target in panel["targets"]:
        assert target["datasource"]["uid"] == "${datasource}"
        expr = target["expr"]
        for selector in selectors(expr):
            assert 'instance=~"$instance"' in selector, selector
            if selector.startswith(BACKEND_LABELLED):
                assert 'backend=~"$backend"' in selector, selector
        if "rate(" in expr:
            assert "[$__rate_interval]" in expr


def test_each_alert_says_what_to_check_first() -> None:
    rules = alert_rules()
    assert len(rules) >= 10
    for name, rule in rules.items():
        assert name.startswith("Ocxproxy")
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert "Check first" in rule["annotations"]["description"], name


def test_the_unit_tests_cover_every_alert_firing_and_quiet() -> None:
    fires, quiet = set(), set()
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fires == set(alert_rules()) == quiet


def test_promtool_accepts_the_rules() -> None:
    promtool = require("promtool")
    run = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in run.stdout + run.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    promtool = require("promtool")
    run = subprocess.run(
        [promtool, "test", "rules", ALERTS_TEST.name],
        cwd=ALERTS_TEST.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout + run.stderr
