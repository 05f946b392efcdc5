"""`helm lint` passes on the chart, with its defaults and with every CI value file.

Lint runs Helm's own chart checks (Chart.yaml, templates, values against
the schema) in strict mode, where warnings are errors too; it targets the
oldest Kubernetes the chart supports.
"""

import pytest
import helm_python as helm

from conftest import CHART_DIR, CI_VALUES, EXAMPLE_JOBS, load_values

FILES = [None] + CI_VALUES + EXAMPLE_JOBS
IDS = ["defaults"] + [f"ci/{p.name}" for p in CI_VALUES] + [f"jobs/{p.name}" for p in EXAMPLE_JOBS]


def findings(report, at_least):
    return [m for m in report["messages"] if m["severity"] >= at_least]


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_helm_lint_strict(path):
    values = load_values(path) if path else None
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace="ml",
                       kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1
    assert not report["errors"], report["errors"]
    assert not findings(report, 2), findings(report, 2)  # warnings and errors


def test_helm_lint_reports_a_bad_value():
    report = helm.lint(str(CHART_DIR), {"job": {"minNodes": "two"}}, strict=True)
    assert report["errors"] or findings(report, 3), report
    text = str(report)
    assert "minNodes" in text


def test_lint_only_infos_on_defaults():
    report = helm.lint(str(CHART_DIR), None, strict=True)
    # "icon is recommended" is the one info Helm gives; anything new shows here.
    infos = [m["error"] for m in report["messages"]]
    assert all("icon is recommended" in i for i in infos), infos
