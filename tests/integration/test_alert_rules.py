"""The alert rules shipped beside the Grafana dashboard (configs/alerts.yaml) are valid
Prometheus rules and behave as their tests say (issue 52, acceptance 5): `promtool check
rules` and `promtool test rules` (Debian's `prometheus` package, installed by
scripts/setup-host.sh) must pass, every alert must have a case where it fires and one
where it stays quiet, and every metric a rule reads must be one the agent declares (a
renamed metric would otherwise leave an alert silent forever).

Here and not in tests/unit: the arm64 tier runs tests/unit where promtool is absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.kernel import require_kernel

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "configs" / "alerts.yaml"
TESTS = ROOT / "tests" / "alerts" / "alerts-tests.yaml"
# a metric's declaration in agent/: counter("millwright_x", ...), gauge(...), histogram(...)
DECLARED = re.compile(r"""\b(?:counter|gauge|histogram)\(\s*["'](millwright_[a-z0-9_]+)["']""")
# the suffixes a histogram's series add to its name
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promtool() -> str:
    path = shutil.which("promtool")
    # a missing promtool is a missing test tool: skipped on a dev box, a failure in CI
    require_kernel(path is not None, "promtool not installed (Debian package prometheus; make setup)")
    assert path is not None
    return path


def alerts() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout + r.stderr


def test_promtool_test_rules():
    r = subprocess.run([promtool(), "test", "rules", str(TESTS)], capture_output=True, text=True, timeout=120,
                       cwd=TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    """An alert added to configs/alerts.yaml without both cases fails here."""
    doc = yaml.safe_load(TESTS.read_text())
    assert [str(Path(f)) for f in doc["rule_files"]] == ["../../configs/alerts.yaml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for t in case.get("alert_rule_test") or []:
            (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = alerts()
    assert len(names) == len(set(names)), f"an alert name appears twice: {names}"
    assert len(names) >= 9, names
    assert not set(names) - firing, f"alerts without a firing case: {sorted(set(names) - firing)}"
    assert not set(names) - quiet, f"alerts without a quiet case: {sorted(set(names) - quiet)}"
    assert not (firing | quiet) - set(names), f"cases of unknown alerts: {sorted((firing | quiet) - set(names))}"


def test_every_rule_reads_a_metric_the_agent_declares():
    declared = {m for p in (ROOT / "agent").rglob("*.py") for m in DECLARED.findall(p.read_text())}
    assert "millwright_self_fences_total" in declared   # the pattern still finds declarations
    doc = yaml.safe_load(RULES.read_text())
    used = {m for g in doc["groups"] for r in g["rules"] for m in re.findall(r"\bmillwright_[a-z0-9_]+", r["expr"])}
    assert used
    missing = sorted(m for m in used
                     if m not in declared and not any(m.endswith(s) and m[: -len(s)] in declared
                                                      for s in HISTOGRAM_SUFFIXES))
    assert not missing, f"rules read metrics the agent does not declare: {missing}"


@pytest.mark.parametrize("name", ["runbook", "summary", "description"])
def test_every_alert_has_severity_and_annotations(name):
    doc = yaml.safe_load(RULES.read_text())
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / "operations.md").read_text(), re.M)}
    for g in doc["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
            assert "for" in r, r["alert"]
            text = r["annotations"][name]
            assert text.strip(), (r["alert"], name)
            if name == "runbook":
                path, _, anchor = text.partition("#")
                assert path == "docs/operations.md" and anchor in headings, (r["alert"], text)
