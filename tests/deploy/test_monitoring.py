"""Alerts and the Grafana dashboard: their structure, their metric names, and promtool's verdict."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from service.ops import metrics as server_metrics
from tests.conftest import PROMETHEUS_INSTALL, require_tool

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE.parents[1] / "deploy" / "grafana" / "encoder-dashboard.json"


def _server_series() -> set[str]:
    """Every series name the server's metrics (service.ops.metrics, its external contract) expose:
    counters as _total, histograms as _bucket/_sum/_count, gauges as they are."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for declared in vars(server_metrics).values():
        if isinstance(declared, (MetricWrapperBase, server_metrics.LiveGauges)):
            for family in declared.describe():
                names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names


SERIES_NAMES = _server_series()
METRICS = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in SERIES_NAMES}

# PromQL words that are neither metric names nor followed by "(".
_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}

Manifest = dict[str, Any]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (strings, label lists and ranges removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        is_call = text[match.end() :].lstrip().startswith("(")
        if not is_call and match.group().lower() not in _PROMQL_KEYWORDS:
            names.add(match.group())
    return names


def _alert_rules(manifests: list[Manifest]) -> list[Manifest]:
    return [
        rule
        for item in manifests
        if item["kind"] == "PrometheusRule"
        for group in item["spec"]["groups"]
        for rule in group["rules"]
    ]


def _rule_groups(manifests: list[Manifest]) -> list[Manifest]:
    return [group for item in manifests if item["kind"] == "PrometheusRule" for group in item["spec"]["groups"]]


def _dashboard_queries(dashboard: Manifest) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target."""
    return [
        (f"panel {panel['id']} ({panel['title']}) {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def _promtool() -> str:
    """promtool, which checks the PromQL."""
    return require_tool("promtool", PROMETHEUS_INSTALL)


def _run(command: list[str], cwd: Path) -> None:
    result = subprocess.run(command, check=False, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def dashboard() -> Manifest:
    """The Grafana dashboard as shipped."""
    return json.loads(DASHBOARD.read_text())


def test_metric_names_reader() -> None:
    """The name checks below rely on this reader, so it must find names and skip everything else."""
    expr = (
        "histogram_quantile(0.99, sum by (namespace, le) ("
        'rate(a_bucket{code!="OK", x=~"$pod"}[$__rate_interval])))'
        " > 0.5 and on (pod) b_total offset 5m unless max without (le) (c) == bool 1"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


def test_alert_rules_are_complete(overlay: str, manifests: list[Manifest]) -> None:
    rules = _alert_rules(manifests)
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    expected = {
        "EncoderHighErrorRatio",
        "EncoderHighLatencyP99",
        "EncoderQueueSaturated",
        "EncoderModelNotReady",
        "EncoderStuckInstance",
    }
    if overlay == "gpu":
        expected.add("EncoderGpuPodOnCpu")
    assert set(names) == expected
    for rule in rules:
        assert rule["expr"].strip()
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_alerts_use_only_server_metrics(manifests: list[Manifest]) -> None:
    for rule in _alert_rules(manifests):
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= SERIES_NAMES, f"{rule['alert']}: unknown {names - SERIES_NAMES}"


def test_dashboard_uses_only_server_metrics(dashboard: Manifest) -> None:
    used: set[str] = set()
    for where, expr in _dashboard_queries(dashboard):
        names = metric_names(expr)
        assert names and names <= SERIES_NAMES, f"{where}: {names - SERIES_NAMES or 'no metric'}"
        used |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["query"]["query"])
            assert selector, variable["name"]
            assert metric_names(selector.group(1)) <= SERIES_NAMES, variable["name"]
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert shown >= METRICS, f"not on the dashboard: {METRICS - shown}"


def test_dashboard_layout(dashboard: Manifest) -> None:
    assert dashboard["uid"] and dashboard["title"]
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        columns = range(grid["x"], grid["x"] + grid["w"])
        cells = {(x, y) for x in columns for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells


def test_promtool_checks_alert_rules(manifests: list[Manifest], tmp_path: Path) -> None:
    promtool = _promtool()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": _rule_groups(manifests)}))
    _run([promtool, "check", "rules", "rules.yaml"], tmp_path)


def test_alerts_fire_when_they_should(renders: dict[str, list[Manifest]], tmp_path: Path) -> None:
    """promtool unit tests (alert_tests.yaml) on the gpu overlay's rules: the base's plus the GPU one."""
    promtool = _promtool()
    groups = _rule_groups(renders["gpu"])
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(HERE / "alert_tests.yaml", tmp_path)
    _run([promtool, "test", "rules", "alert_tests.yaml"], tmp_path)


def test_promtool_parses_dashboard_queries(dashboard: Manifest, tmp_path: Path) -> None:
    promtool = _promtool()
    rules = []
    for index, (_, expr) in enumerate(_dashboard_queries(dashboard)):
        # Grafana's variables as a plain Prometheus would see them.
        promql = expr.replace("$__rate_interval", "5m")
        promql = re.sub(r"\$\{?\w+\}?", ".*", promql)
        rules.append({"record": f"dashboard:query_{index}", "expr": promql})
    document = {"groups": [{"name": "dashboard", "rules": rules}]}
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(document))
    _run([promtool, "check", "rules", "dashboard.yaml"], tmp_path)
