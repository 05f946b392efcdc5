"""`helm lint` passes on the chart, with its defaults and with every CI value file.

Lint runs Helm's own chart checks (Chart.yaml, templates, values against
the schema) in strict mode, where warnings are errors too; it targets the
oldest Kubernetes the chart supports (Chart.yaml's kubeVersion, 1.29), with
each kind of worker workload.
"""

import pytest
import helm_python as helm

from conftest import CHART_DIR, CI_VALUES, EXAMPLE_JOBS, load_values

FILES = [None] + CI_VALUES + EXAMPLE_JOBS
OLDEST = {"job": "v1.29.0", "statefulset": "v1.29.0"}
# Each file with both kinds, or with the kind it sets.
CASES = [(path, kind) for path in FILES for kind in OLDEST
         if ((load_values(path) if path else {}).get("workers") or {}).get("kind", kind) == kind]
CASE_IDS = [f"{'defaults' if p is None else p.parent.name + '/' + p.name}:{k}" for p, k in CASES]


def findings(report, at_least):
    return [m for m in report["messages"] if m["severity"] >= at_least]


@pytest.mark.parametrize("path,kind", CASES, ids=CASE_IDS)
def test_helm_lint_strict(path, kind):
    values = load_values(path) if path else {}
    values.setdefault("workers", {})["kind"] = kind
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace="ml",
                       kube_version=OLDEST[kind])
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
