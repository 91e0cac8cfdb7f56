# SPDX-License-Identifier: MIT
"""monitoring/: the alert rules are valid and fire on the series that mean them (promtool check and
test, from Debian's prometheus package, unpacked by make setup), and every query of the Grafana
dashboard parses and names only metrics something exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from applianctl.status import exposition, gpu_metrics

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
# where tools/setup-host unpacks it (APPLIANCE_HOST_CACHE moves the cache there too)
PROMTOOL = Path(os.environ.get("APPLIANCE_HOST_CACHE", "/var/cache/appliance-host")) / "prometheus/usr/bin/promtool"
# what else a fleet's Prometheus scrapes from an appliance's metrics site: the GPUs' series
# (applianctl/status/gpu_metrics.py, AMD device-metrics-exporter's names), the engine's
# /engine/metrics (vLLM's names, as in tests/fixtures/vllm/'s recorded scrape), node_exporter's textfile freshness, and
# Prometheus itself (up)
OTHER_METRICS = {"up", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "node_textfile_mtime_seconds", *gpu_metrics.HELP}
PROMQL_WORDS = {"count", "sum", "by", "or", "and", "unless", "vector", "min", "max", "increase", "rate", "without", "on"}
_METRIC = re.compile(r"(?<![\w:\"{=$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=[{\[)\s]|$|==|!=|<|>|/)")


def _promtool() -> str:
    found = str(PROMTOOL) if PROMTOOL.exists() else shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: run `make setup` (it unpacks Debian's prometheus package)")
    return found


def _metrics(expr: str) -> set[str]:
    """The metric names of a PromQL expression (label matchers and grouping label lists left out)."""
    bare = re.sub(r"\{[^}]*\}", "{}", expr)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    return {m for m in _METRIC.findall(bare) if m not in PROMQL_WORDS}


def test_the_alert_rules_check_and_their_unit_tests_pass() -> None:
    check = subprocess.run([_promtool(), "check", "rules", str(MONITORING / "appliance.rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([_promtool(), "test", "rules", "appliance.rules.test.yml"], cwd=MONITORING, capture_output=True, text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_the_rules_cover_what_the_fleet_needs_and_name_only_exported_metrics() -> None:
    rules = yaml.safe_load((MONITORING / "appliance.rules.yml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"ApplianceDown", "ApplianceVersionRolledBack", "ApplianceEngineNotReady", "ApplianceReplicaDown",
                                          "ApplianceVarNearlyFull", "ApplianceGpuEccRising", "ApplianceStatusStale",
                                          "ApplianceReplicaStalled", "ApplianceNeedsPhysicalAction"}
    for rule in rules:
        assert _metrics(rule["expr"]) <= set(exposition.HELP) | OTHER_METRICS, rule["expr"]


def test_every_dashboard_query_parses_and_names_only_exported_metrics(tmp_path: Path) -> None:
    dashboard = json.loads((MONITORING / "appliance-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for expr in exprs:
        assert _metrics(expr) and _metrics(expr) <= set(exposition.HELP) | OTHER_METRICS, expr
    # promtool parses PromQL when it checks rules: each query as a recording rule
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(rules))
    check = subprocess.run([_promtool(), "check", "rules", str(tmp_path / "dashboard.rules.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_documented_promtool_command_runs_as_printed() -> None:
    # make setup unpacks promtool into the host cache, not onto PATH: the documents give a make
    # target (listed by make help) or the full path, never a bare `promtool ...` to type.
    if not PROMTOOL.exists():
        pytest.fail("promtool is missing: run `make setup` (it unpacks Debian's prometheus package)")
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    quoted = [code for path in docs for code in re.findall(r"`([^`\n]+)`", path.read_text())]
    assert not [code for code in quoted if code.startswith("promtool ")]
    assert "make promtool-test" in quoted
    env = {**os.environ, "APPLIANCE_HOST_CACHE": str(PROMTOOL.parents[3])}
    run = subprocess.run(["make", "-s", "promtool-test"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
    helped = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "make promtool-test" in helped.stdout
