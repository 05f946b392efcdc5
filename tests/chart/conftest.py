"""Shared fixtures of the chart tests: the chart, rendered by Helm's own engine.

The chart is loaded and rendered with helm-python-sdk, which binds the Helm
Go SDK: the same template engine, values coalescing and values.schema.json
check that `helm install` runs, offline. A render returns the manifests as
parsed objects, so tests assert on structure, never on text.
"""

import copy
import json
import os
import pathlib
import sys

import helm_python as helm
import pytest
import yaml

SOURCE = pathlib.Path(os.environ.get("DUCTILE_SOURCE_DIR",
                                     pathlib.Path(__file__).resolve().parents[2]))
CHART_DIR = SOURCE / "charts" / "ductile"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
EXAMPLE_JOBS = sorted((SOURCE / "examples" / "jobs").glob("*.yaml"))
RELEASE = "demo"
# The tests' shared helpers (tests/harness/testlib.py), for any chart test.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "harness"))
NAMESPACE = "ml"

# Each list must be non-empty: a glob that finds nothing would make the
# parametrized tests silently vanish.
assert CI_VALUES, f"no value files in {CHART_DIR / 'ci'}"
assert EXAMPLE_JOBS, f"no job files in {SOURCE / 'examples' / 'jobs'}"


def load_values(path):
    with open(path) as f:
        return yaml.safe_load(f) or {}


class Rendered:
    """The objects of one render, with lookups by kind and name."""

    def __init__(self, manifests):
        self.notes = manifests.pop(f"{CHART_DIR.name}/templates/NOTES.txt", "")
        self.objects = []
        self.hooks = []
        for path, text in sorted(manifests.items()):
            for doc in yaml.safe_load_all(text):
                if not doc:
                    continue
                doc.setdefault("__source__", path)
                annotations = (doc.get("metadata") or {}).get("annotations") or {}
                (self.hooks if "helm.sh/hook" in annotations else self.objects).append(doc)

    def all(self):
        return self.objects + self.hooks

    def of_kind(self, kind):
        return [o for o in self.all() if o["kind"] == kind]

    def one(self, kind, name_suffix=""):
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got " + str(
            [o["metadata"]["name"] for o in found])
        return found[0]

    def workers(self):
        """The workers' workload: the Indexed Job or the StatefulSet."""
        found = [o for o in self.of_kind("Job") + self.of_kind("StatefulSet")
                 if o["metadata"]["name"].endswith("-worker")]
        assert len(found) == 1, f"expected one worker Job or StatefulSet, got {found}"
        return found[0]

    def pod_spec(self):
        return self.workers()["spec"]["template"]["spec"]

    def agent(self):
        containers = self.workers()["spec"]["template"]["spec"]["containers"]
        return next(c for c in containers if c["name"] == "agent")

    def env(self, container=None):
        """The container's env as {name: value or valueFrom}."""
        container = container or self.agent()
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(str(CHART_DIR)) as c:
        yield c


@pytest.fixture(scope="session")
def render(chart):
    """render(values, name=RELEASE, kube_version=None) -> Rendered; values
    are a dict or a file. kube_version ("v1.30.0") is the cluster version
    the templates see (.Capabilities.KubeVersion); None: the SDK's own."""

    def _render(values=None, name=RELEASE, namespace=NAMESPACE, kube_version=None):
        if isinstance(values, (str, os.PathLike)):
            values = load_values(values)
        if kube_version is None:
            manifests = chart.render(values, name=name, namespace=namespace, is_install=True)
        else:
            manifests = render_for_kube(chart, values, name, namespace, kube_version)
        return Rendered(dict(manifests))

    return _render


def render_for_kube(chart, values, name, namespace, kube_version):
    """Chart.render with a cluster version. helm-python-sdk 0.2.2 (pinned)
    takes kube_version in the options of its native render call but does
    not expose it in Chart.render; this passes it the same way."""
    from helm_python import _native
    opts = {"name": name, "namespace": namespace, "is_install": True,
            "kube_version": kube_version}
    payload = None if values is None else json.dumps(values)
    return json.loads(_native.call_string("helm_render", chart._raw(), payload, json.dumps(opts)))


def with_values(base, patch):
    """base (a dict or a file) with patch merged in, as `-f base --set ...` would."""
    out = copy.deepcopy(load_values(base) if isinstance(base, (str, os.PathLike)) else base or {})
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = with_values(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def strip_source(obj):
    return {k: v for k, v in obj.items() if k != "__source__"}
