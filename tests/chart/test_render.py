"""Every job file and CI value file renders, and every object is valid Kubernetes.

Each file is rendered with both kinds of worker workload (workers.kind: an
Indexed Job and a StatefulSet), unless it sets its own. Each rendered
object is checked offline and strictly (unknown fields are errors) against
the Kubernetes OpenAPI schemas that kubernetes-validate ships: for 1.29,
the oldest the chart supports (Chart.yaml's kubeVersion; test_kubeversion.py
says why), for 1.31, where Elastic Indexed Jobs and podFailurePolicy became
stable, and for the newest the package knows. The ServiceMonitor is a CRD,
for which kubernetes-validate has no schema: it gets a structural check against the
fields of the Prometheus Operator's monitoring.coreos.com/v1 that the chart
uses.
"""

import jsonschema
import kubernetes_validate
import pytest

from conftest import CI_VALUES, EXAMPLE_JOBS, RELEASE, NAMESPACE, load_values, strip_source, \
    with_values

LATEST = kubernetes_validate.utils.latest_version()
KUBE_VERSIONS = {"job": ["1.29", "1.31", LATEST], "statefulset": ["1.29", "1.31", LATEST]}
VALUE_FILES = [None] + CI_VALUES + EXAMPLE_JOBS
FILE_IDS = ["defaults"] + [f"ci/{p.name}" for p in CI_VALUES] + \
    [f"jobs/{p.name}" for p in EXAMPLE_JOBS]


def _cases():
    """(file, kind): each file with both kinds, or with the kind it sets."""
    out = []
    for path, fid in zip(VALUE_FILES, FILE_IDS):
        own = (load_values(path).get("workers") or {}).get("kind") if path else None
        for kind in [own] if own else ["job", "statefulset"]:
            out.append(((path, kind), f"{fid}:{kind}"))
    return out


CASES = _cases()
_RENDERED = {}


def render_case(render, case):
    if case not in _RENDERED:
        path, kind = case
        _RENDERED[case] = render(with_values(path, {"workers": {"kind": kind}}))
    return _RENDERED[case]

STANDARD_LABELS = ["helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
                   "app.kubernetes.io/component", "app.kubernetes.io/part-of"]

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}


def crd_schema(api_version, kind, spec):
    """The structure of one object of a CRD the chart writes: apiVersion,
    kind, metadata and the given spec, nothing else."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {
                "type": "object", "additionalProperties": False, "required": ["name", "namespace"],
                "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                               "labels": _LABELS, "annotations": _LABELS},
            },
            "spec": spec,
        },
    }


# The subset of monitoring.coreos.com/v1 ServiceMonitor the chart writes;
# anything else (a typo, a field in the wrong place) fails.
SERVICE_MONITOR = crd_schema("monitoring.coreos.com/v1", "ServiceMonitor", {
    "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
    "properties": {
        "selector": {"type": "object", "additionalProperties": False,
                     "required": ["matchLabels"], "properties": {"matchLabels": _LABELS}},
        "namespaceSelector": {"type": "object", "additionalProperties": False,
                              "properties": {"matchNames": {"type": "array",
                                                            "items": {"type": "string"}}}},
        "endpoints": {
            "type": "array", "minItems": 1,
            "items": {"type": "object", "additionalProperties": False, "required": ["port"],
                      "properties": {
                          "port": {"type": "string"},
                          "path": {"type": "string", "pattern": "^/"},
                          "interval": _DURATION, "scrapeTimeout": _DURATION}}},
    },
})

# The PodGroup of scheduler-plugins' coscheduling plugin
# (scheduling.x-k8s.io/v1alpha1), the fields the chart writes.
POD_GROUP = crd_schema("scheduling.x-k8s.io/v1alpha1", "PodGroup", {
    "type": "object", "additionalProperties": False, "required": ["minMember"],
    "properties": {"minMember": {"type": "integer", "minimum": 1},
                   "scheduleTimeoutSeconds": {"type": "integer", "minimum": 1}},
})

PROMETHEUS_RULE = crd_schema("monitoring.coreos.com/v1", "PrometheusRule", {
    "type": "object", "additionalProperties": False, "required": ["groups"],
    "properties": {"groups": {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "additionalProperties": False, "required": ["name", "rules"],
                  "properties": {
                      "name": {"type": "string", "minLength": 1},
                      "rules": {"type": "array", "minItems": 1, "items": {
                          "type": "object", "additionalProperties": False,
                          "required": ["alert", "expr"],
                          "properties": {
                              "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                              "expr": {"type": "string", "minLength": 1},
                              "for": _DURATION,
                              "labels": _LABELS,
                              "annotations": _LABELS}}}}}}},
})


@pytest.fixture(scope="module", params=[c for c, _ in CASES], ids=[i for _, i in CASES])
def rendered(request, render):
    return render_case(render, request.param)


def test_renders_workers_and_notes(rendered):
    kind = rendered.workers()["kind"]
    assert kind in ("Job", "StatefulSet")
    assert len([o for o in rendered.of_kind("Job") + rendered.of_kind("StatefulSet")
                if o["metadata"]["name"].endswith("-worker")]) == 1
    assert "helm" in rendered.notes and "uninstall" in rendered.notes
    if kind == "Job":
        assert "wait --for=condition=complete" in rendered.notes


@pytest.mark.parametrize("case,kube", [(c, k) for c, _ in CASES for k in KUBE_VERSIONS[c[1]]],
                         ids=[f"{i}@{k}" for c, i in CASES for k in KUBE_VERSIONS[c[1]]])
def test_objects_valid_kubernetes_strict(render, case, kube):
    rendered = render_case(render, case)
    checked = 0
    for obj in rendered.all():
        obj = strip_source(obj)
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_service_monitor_structure
        if obj["apiVersion"].startswith("scheduling.x-k8s.io/"):
            continue  # a CRD: test_pod_group_structure
        try:
            kubernetes_validate.validate(obj, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes "
                        f"{kube} at {where}: {e.message}")
        checked += 1
    assert checked >= 4


def test_strict_validation_catches_an_unknown_field(render):
    sts = strip_source(render({"workers": {"kind": "statefulset"}}).workers())
    sts["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        kubernetes_validate.validate(sts, KUBE_VERSIONS["statefulset"][0], strict=True)
    job = strip_source(render().workers())
    job["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="onExitCode"):
        kubernetes_validate.validate(job, KUBE_VERSIONS["job"][0], strict=True)


def test_service_monitor_structure(rendered):
    monitors = rendered.of_kind("ServiceMonitor")
    for sm in monitors:
        jsonschema.validate(strip_source(sm), SERVICE_MONITOR)
        # It must select the workers' Service and name a port that Service has.
        service = rendered.one("Service", "-worker")
        labels = service["metadata"]["labels"]
        for k, v in sm["spec"]["selector"]["matchLabels"].items():
            assert labels.get(k) == v, f"ServiceMonitor selector {k}={v} misses the Service"
        ports = {p["name"] for p in service["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in ports
            assert ep["path"] == "/metrics"


def test_pod_group_structure(rendered):
    for pg in rendered.of_kind("PodGroup"):
        jsonschema.validate(strip_source(pg), POD_GROUP)
        labels = rendered.workers()["spec"]["template"]["metadata"]["labels"]
        assert labels["scheduling.x-k8s.io/pod-group"] == pg["metadata"]["name"]


def test_prometheus_rule_structure(rendered):
    for rule in rendered.of_kind("PrometheusRule"):
        jsonschema.validate(strip_source(rule), PROMETHEUS_RULE)


def test_prometheus_rule_check_catches_a_typo(render):
    rule = strip_source(render({"monitoring": {"prometheusRule": {"enabled": True}}})
                        .one("PrometheusRule"))
    jsonschema.validate(rule, PROMETHEUS_RULE)
    rule["spec"]["groups"][0]["rules"][0]["experssion"] = "up"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, PROMETHEUS_RULE)


def test_service_monitor_check_catches_a_typo(render):
    sm = render({"serviceMonitor": {"enabled": True}}).one("ServiceMonitor")
    sm = strip_source(sm)
    sm["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(sm, SERVICE_MONITOR)


def test_standard_labels_everywhere(rendered):
    for obj in rendered.all():
        labels = obj["metadata"].get("labels") or {}
        missing = [k for k in STANDARD_LABELS if k not in labels]
        assert not missing, f"{obj['kind']}/{obj['metadata']['name']} lacks labels {missing}"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"].startswith("ductile-")
        assert obj["metadata"]["namespace"] == NAMESPACE


def test_names_unique_and_valid(rendered):
    seen = set()
    for obj in rendered.all():
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in seen, f"two objects {key}"
        seen.add(key)
        assert len(obj["metadata"]["name"]) <= 63


def test_selectors_match_their_pods(rendered):
    for job in [j for j in rendered.of_kind("Job") if j not in rendered.hooks]:
        # The API server adds the selector; the pods' subdomain is the
        # workers' headless Service, which selects them (a hook's Job, the
        # pre-install check, has no Service).
        assert "selector" not in job["spec"]
        pod = job["spec"]["template"]
        svc = rendered.one("Service", pod["spec"]["subdomain"])
        assert svc["metadata"]["name"] == pod["spec"]["subdomain"]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        for k, v in svc["spec"]["selector"].items():
            assert pod["metadata"]["labels"].get(k) == v
    for sts in rendered.of_kind("StatefulSet"):
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        for k, v in sts["spec"]["selector"]["matchLabels"].items():
            assert pod_labels.get(k) == v
        # The governing Service exists, is headless and selects these pods.
        svc = rendered.one("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(all(s["spec"]["template"]["metadata"]["labels"].get(k) == v
                       for k, v in sel.items())
                   for s in rendered.of_kind("StatefulSet") + rendered.of_kind("Job"))
        if pdb["metadata"]["name"].endswith("-worker") and rendered.workers()["kind"] == "Job":
            # The only budget Kubernetes honours for a Job's pods.
            assert set(pdb["spec"]) == {"minAvailable", "selector"}
            assert isinstance(pdb["spec"]["minAvailable"], int)


def test_pod_volumes_and_mounts_agree(rendered):
    pods = [s["spec"]["template"]["spec"]
            for s in rendered.of_kind("StatefulSet") + rendered.of_kind("Job")]
    pods += [p["spec"] for p in rendered.of_kind("Pod")]
    claim_templates = {s["metadata"]["name"]: {t["metadata"]["name"]
                                               for t in s["spec"].get("volumeClaimTemplates", [])}
                       for s in rendered.of_kind("StatefulSet")}
    all_templates = set().union(*claim_templates.values()) if claim_templates else set()
    for spec in pods:
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in all_templates, \
                    f"mount {m['name']} has no volume"
    # A claim the chart creates is the one the workers use.
    for pvc in rendered.of_kind("PersistentVolumeClaim"):
        used = [v for spec in pods for v in spec.get("volumes", [])
                if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]]
        assert used, f"PVC {pvc['metadata']['name']} is mounted by no pod"
