"""Chart.yaml's kubeVersion is the oldest Kubernetes the rendered chart works on.

FEATURES says, for each Kubernetes feature the templates rely on, the first
release where it works on a cluster with default settings (beta and on by
default, or GA: nothing behind an alpha gate) and the release where it went
GA. FIELDS maps every field the chart sets in a workload (Job, StatefulSet,
their pod template, the helm test pod, PodDisruptionBudget) to the feature
it needs, or to None when it has no floor above the table's oldest entry;
KINDS does the same for each apiVersion and kind. Both are closed: a
template that sets a field or object the tables do not know fails here until
someone looks up its version and adds it.

From the rendered manifests (the defaults, the StatefulSet kind, every CI
value file and example job with both kinds, and one render with every
optional part turned on) the tests find the features in use and check that
kubeVersion's floor is exactly what the default render needs, and no lower
than any other render needs. Helm itself refuses a chart whose kubeVersion
the cluster does not meet (`helm install` and `helm template
--kube-version`): the last tests run that check through Helm's install
action.
"""

import json
import re

import helm_python as helm
import pytest
import yaml
from helm_python.config import Config

from conftest import CHART_DIR, CI_VALUES, EXAMPLE_JOBS, NAMESPACE, RELEASE, load_values, \
    with_values

# feature -> (works with default settings from, GA in). Sources: the
# feature-gate pages of kubernetes.io (kubernetes/website,
# content/en/docs/reference/command-line-tools-reference/feature-gates/<gate>.md),
# which give each gate's alpha/beta/GA releases and defaults, and the KEPs.
FEATURES = {
    # completionMode: Indexed. Gate IndexedJob: alpha 1.21 (off), beta 1.22
    # (on), GA 1.24 (KEP-2214).
    "IndexedJob": ((1, 22), (1, 24)),
    # StatefulSet.spec.persistentVolumeClaimRetentionPolicy. Gate
    # StatefulSetAutoDeletePVC: alpha 1.23, beta 1.27 (on), GA 1.32
    # (KEP-1847).
    "StatefulSetAutoDeletePVC": ((1, 27), (1, 32)),
    # Resizing an Indexed Job by changing completions with parallelism.
    # Gate ElasticIndexedJob: beta 1.27 (on), GA 1.31 (KEP-3715).
    "ElasticIndexedJob": ((1, 27), (1, 31)),
    # spec.podFailurePolicy. Gate JobPodFailurePolicy: alpha 1.25 (off),
    # beta 1.26 (on), GA 1.31 (KEP-3329).
    "JobPodFailurePolicy": ((1, 26), (1, 31)),
    # The DisruptionTarget pod condition a podFailurePolicy rule matches.
    # Gate PodDisruptionConditions: alpha 1.25 (off), beta 1.26 (on), GA 1.31.
    "PodDisruptionConditions": ((1, 26), (1, 31)),
    # spec.podReplacementPolicy. Gate JobPodReplacementPolicy: alpha 1.28
    # (off: the API server drops the field), beta 1.29 (on), GA 1.34
    # (KEP-3939).
    "JobPodReplacementPolicy": ((1, 29), (1, 34)),
    # spec.backoffLimitPerIndex and maxFailedIndexes (only when
    # workers.job.backoffLimitPerIndex is set). Gate JobBackoffLimitPerIndex:
    # alpha 1.28 (off), beta 1.29 (on), GA 1.33 (KEP-3850).
    "JobBackoffLimitPerIndex": ((1, 29), (1, 33)),
    # spec.ttlSecondsAfterFinished. Gate TTLAfterFinished: alpha 1.12,
    # beta 1.21 (on), GA 1.23.
    "TTLAfterFinished": ((1, 21), (1, 23)),
    # policy/v1 PodDisruptionBudget: served from 1.21 (policy/v1beta1 removed
    # in 1.25; kubernetes.io deprecated API migration guide).
    "PodDisruptionBudgetV1": ((1, 21), (1, 21)),
    # securityContext.fsGroupChangePolicy. Gate ConfigurableFSGroupPolicy:
    # alpha 1.18, beta 1.20 (on), GA 1.23.
    "ConfigurableFSGroupPolicy": ((1, 20), (1, 23)),
    # securityContext.seccompProfile (the field; annotations before):
    # GA 1.19 (KEP-135).
    "SeccompProfileField": ((1, 19), (1, 19)),
    # spec.topologySpreadConstraints. Gate EvenPodsSpread: beta 1.18 (on),
    # GA 1.19.
    "EvenPodsSpread": ((1, 18), (1, 19)),
    # emptyDir.sizeLimit. Gate LocalStorageCapacityIsolation: beta 1.10
    # (on), GA 1.25.
    "LocalStorageCapacityIsolation": ((1, 10), (1, 25)),
    # spec.runtimeClassName. Gate RuntimeClass: alpha 1.12, beta 1.14 (on),
    # GA 1.20 (KEP-585).
    "RuntimeClass": ((1, 14), (1, 20)),
}

# Every field the chart sets in a workload -> the feature it needs, or None:
# in the API, on by default, since before 1.18 (the oldest floor above).
FIELDS = {
    "Job.spec.parallelism": None,
    # The chart changes completions on `helm upgrade` (workers.replicas),
    # which only an elastic Indexed Job allows.
    "Job.spec.completions": "ElasticIndexedJob",
    "Job.spec.backoffLimit": None,
    "Job.spec.activeDeadlineSeconds": None,
    "Job.spec.ttlSecondsAfterFinished": "TTLAfterFinished",
    "Job.spec.completionMode": "IndexedJob",
    "Job.spec.backoffLimitPerIndex": "JobBackoffLimitPerIndex",
    "Job.spec.maxFailedIndexes": "JobBackoffLimitPerIndex",
    "Job.spec.podReplacementPolicy": "JobPodReplacementPolicy",
    "Job.spec.podFailurePolicy": "JobPodFailurePolicy",
    "Job.spec.template": None,
    "Job.spec.activeDeadlineSeconds": None,
    "PodFailurePolicyRule.action": "JobPodFailurePolicy",
    "PodFailurePolicyRule.onExitCodes": "JobPodFailurePolicy",
    "PodFailurePolicyRule.onPodConditions": "JobPodFailurePolicy",
    "PodFailurePolicyRule.onPodConditions.type=DisruptionTarget": "PodDisruptionConditions",
    "StatefulSet.spec.serviceName": None,
    "StatefulSet.spec.replicas": None,
    "StatefulSet.spec.podManagementPolicy": None,
    "StatefulSet.spec.updateStrategy": None,
    "StatefulSet.spec.selector": None,
    "StatefulSet.spec.template": None,
    "StatefulSet.spec.volumeClaimTemplates": None,
    "StatefulSet.spec.persistentVolumeClaimRetentionPolicy": "StatefulSetAutoDeletePVC",
    "PodDisruptionBudget.spec.minAvailable": None,
    "PodDisruptionBudget.spec.maxUnavailable": None,
    "PodDisruptionBudget.spec.selector": None,
    "PodSpec.restartPolicy": None,
    "PodSpec.subdomain": None,
    "PodSpec.serviceAccountName": None,
    "PodSpec.automountServiceAccountToken": None,
    "PodSpec.enableServiceLinks": None,
    "PodSpec.terminationGracePeriodSeconds": None,
    "PodSpec.hostNetwork": None,
    "PodSpec.dnsPolicy": None,
    "PodSpec.securityContext": None,
    "PodSpec.imagePullSecrets": None,
    "PodSpec.priorityClassName": None,
    "PodSpec.nodeSelector": None,
    "PodSpec.tolerations": None,
    "PodSpec.affinity": None,
    "PodSpec.topologySpreadConstraints": "EvenPodsSpread",
    "PodSpec.containers": None,
    "PodSpec.initContainers": None,
    "PodSpec.volumes": None,
    "PodSpec.schedulerName": None,
    "PodSpec.runtimeClassName": "RuntimeClass",
    "PodSpec.initContainers": None,
    "PodSecurityContext.runAsNonRoot": None,
    "PodSecurityContext.runAsUser": None,
    "PodSecurityContext.runAsGroup": None,
    "PodSecurityContext.fsGroup": None,
    "PodSecurityContext.fsGroupChangePolicy": "ConfigurableFSGroupPolicy",
    "PodSecurityContext.seccompProfile": "SeccompProfileField",
    "Container.name": None,
    "Container.image": None,
    "Container.imagePullPolicy": None,
    "Container.command": None,
    "Container.args": None,
    "Container.env": None,
    "Container.ports": None,
    "Container.livenessProbe": None,
    "Container.readinessProbe": None,
    "Container.resources": None,
    "Container.securityContext": None,
    "Container.volumeMounts": None,
    "Container.envFrom": None,
    "Container.terminationMessagePolicy": None,
    "SecurityContext.allowPrivilegeEscalation": None,
    "SecurityContext.privileged": None,
    "SecurityContext.readOnlyRootFilesystem": None,
    "SecurityContext.runAsNonRoot": None,
    "SecurityContext.capabilities": None,
    "SecurityContext.seccompProfile": "SeccompProfileField",
    "Volume.emptyDir": None,
    "Volume.emptyDir.medium": None,
    "Volume.emptyDir.sizeLimit": "LocalStorageCapacityIsolation",
    "Volume.persistentVolumeClaim": None,
    "Volume.persistentVolumeClaim.claimName": None,
    "Volume.configMap": None,
    "Volume.configMap.name": None,
    "Volume.configMap.defaultMode": None,
    "Volume.secret": None,
    "Volume.secret.secretName": None,
    "Volume.secret.defaultMode": None,
}

# Every object the chart renders, by apiVersion and kind -> feature or None.
KINDS = {
    "batch/v1 Job": None,                # batch/v1 Job: GA long before 1.18
    "apps/v1 StatefulSet": None,         # apps/v1: 1.9
    "policy/v1 PodDisruptionBudget": "PodDisruptionBudgetV1",
    "networking.k8s.io/v1 NetworkPolicy": None,  # 1.7
    "v1 Service": None,
    "v1 ServiceAccount": None,
    "v1 ConfigMap": None,
    "v1 Secret": None,
    "v1 PersistentVolumeClaim": None,
    "v1 Pod": None,
    # A CRD of the Prometheus Operator, only with serviceMonitor.enabled:
    # its version is the operator's, not the cluster's.
    "monitoring.coreos.com/v1 ServiceMonitor": None,
    # A CRD of scheduler-plugins, only with workers.podGroup.enabled: its
    # version is the plugin's, not the cluster's.
    "scheduling.x-k8s.io/v1alpha1 PodGroup": None,
    "monitoring.coreos.com/v1 PrometheusRule": None,  # monitoring.prometheusRule.enabled
    "rbac.authorization.k8s.io/v1 Role": None,  # 1.8; monitoring.events.enabled
    "rbac.authorization.k8s.io/v1 RoleBinding": None,
}

# Every optional part of the chart turned on, so its fields are classified.
EVERYTHING = {
    "workers": {
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"a": "b"}}}],
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {}},
        "priorityClassName": "training",
        "hostNetwork": True,
        "job": {"backoffLimitPerIndex": 2, "ttlSecondsAfterFinished": 3600,
                "activeDeadlineSeconds": 86400},
        "schedulerName": "scheduler-plugins-scheduler",
        "podGroup": {"enabled": True},
        "runtimeClassName": "nvidia",
        "extraVolumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        "extraVolumeMounts": [{"name": "data", "mountPath": "/data"}],
        "extraEnv": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        "envFrom": [{"secretRef": {"name": "s"}}],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36", "command": ["true"],
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "containerSecurityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
    },
    "image": {"pullSecrets": ["regcred"]},
    "podDisruptionBudget": {"enabled": True},
    "networkPolicy": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "monitoring": {"dashboard": {"enabled": True}, "prometheusRule": {"enabled": True},
                   "events": {"enabled": True}},
    "etcd": {"replicas": 3},
    "job": {"script": {"content": "print('hi')\n"},
            "command": ["python", "/opt/ductile/job/train.py"]},
}


def chart_metadata():
    with open(CHART_DIR / "Chart.yaml") as f:
        text = f.read()
    return text, yaml.safe_load(text)


def kube_floor():
    """kubeVersion as (major, minor): a single lower bound `>=X.Y.0-0` (the
    -0 lets vendors' pre-release-tagged builds, v1.29.3-eks-..., match)."""
    _, meta = chart_metadata()
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)\.0-0", meta.get("kubeVersion", ""))
    assert m, f"kubeVersion {meta.get('kubeVersion')!r} is not of the form >=X.Y.0-0"
    return int(m.group(1)), int(m.group(2))


def spec_fields(obj):
    """The classified paths of the fields one object sets."""
    kind, spec = obj["kind"], obj.get("spec") or {}
    out = set()
    if kind in ("Job", "StatefulSet", "PodDisruptionBudget"):
        out |= {f"{kind}.spec.{k}" for k in spec}
    if kind == "Job":
        for rule in (spec.get("podFailurePolicy") or {}).get("rules", []):
            out |= {f"PodFailurePolicyRule.{k}" for k in rule}
            for cond in rule.get("onPodConditions", []):
                out.add(f"PodFailurePolicyRule.onPodConditions.type={cond['type']}")
    pod = {"Job": lambda: spec["template"]["spec"], "StatefulSet": lambda: spec["template"]["spec"],
           "Pod": lambda: spec}.get(kind, lambda: None)()
    if pod is not None:
        out |= {f"PodSpec.{k}" for k in pod}
        out |= {f"PodSecurityContext.{k}" for k in pod.get("securityContext") or {}}
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            out |= {f"Container.{k}" for k in c}
            out |= {f"SecurityContext.{k}" for k in c.get("securityContext") or {}}
        for v in pod.get("volumes", []):
            for source, body in v.items():
                if source == "name":
                    continue
                out.add(f"Volume.{source}")
                out |= {f"Volume.{source}.{k}" for k in body or {}}
    return out


def kind_of(obj):
    return f"{obj['apiVersion']} {obj['kind']}"


def features_used(rendered):
    used = set()
    for obj in rendered.all():
        for path in spec_fields(obj):
            if FIELDS.get(path):
                used.add(FIELDS[path])
        if KINDS.get(kind_of(obj)):
            used.add(KINDS[kind_of(obj)])
    return used


def needed(features):
    return max(FEATURES[f][0] for f in features)




def _everything_statefulset():
    values = with_values(EVERYTHING, {"workers": {"kind": "statefulset"},
                                      "checkpoint": {"perPod": True},
                                      "podDisruptionBudget": {"maxUnavailable": 1},
                                      "monitoring": {"events": {"enabled": False}}})
    del values["workers"]["job"]  # the Job's own settings are refused here
    return values


RENDERS = {"defaults": None, "statefulset": {"workers": {"kind": "statefulset"}},
           "everything:job": EVERYTHING, "everything:statefulset": _everything_statefulset()}
for _path in CI_VALUES + EXAMPLE_JOBS:
    _own = (load_values(_path).get("workers") or {}).get("kind")
    for _kind in [_own] if _own else ["job", "statefulset"]:
        RENDERS[f"{_path.parent.name}/{_path.name}:{_kind}"] = with_values(
            _path, {"workers": {"kind": _kind}})
_RENDERED = {}


def rendered(render, name):
    if name not in _RENDERED:
        _RENDERED[name] = render(RENDERS[name])
    return _RENDERED[name]


def fmt(version):
    return "%d.%d" % version


def test_tables_are_consistent():
    for name, (works, ga) in FEATURES.items():
        assert works <= ga, name
    assert set(v for v in FIELDS.values() if v) <= set(FEATURES)
    assert set(v for v in KINDS.values() if v) <= set(FEATURES)


@pytest.mark.parametrize("name", RENDERS)
def test_tables_cover_every_field_and_kind(render, name):
    r = rendered(render, name)
    unknown_fields = sorted(set().union(*(spec_fields(o) for o in r.all())) - set(FIELDS))
    assert not unknown_fields, (
        f"fields without a Kubernetes version in {__file__}'s FIELDS: {unknown_fields}; "
        "look up the release each needs (on by default) and add it, with FEATURES")
    unknown_kinds = sorted({kind_of(o) for o in r.all()} - set(KINDS))
    assert not unknown_kinds, f"objects without a Kubernetes version in KINDS: {unknown_kinds}"


def test_default_render_sets_the_floor(render):
    # The default render (workers.kind: job) needs exactly kubeVersion's floor:
    # not more (the chart would install where it cannot work), not less
    # (the chart would refuse clusters it works on).
    used = features_used(rendered(render, "defaults"))
    assert {"IndexedJob", "ElasticIndexedJob", "JobPodFailurePolicy",
            "PodDisruptionConditions", "JobPodReplacementPolicy"} <= used
    assert kube_floor() == needed(used), (
        f"kubeVersion floor {fmt(kube_floor())}, the default render needs {fmt(needed(used))} "
        f"({sorted(f for f in used if FEATURES[f][0] == needed(used))})")


@pytest.mark.parametrize("name", RENDERS)
def test_floor_covers_every_render(render, name):
    used = features_used(rendered(render, name))
    assert needed(used) <= kube_floor(), (
        f"{name} needs Kubernetes {fmt(needed(used))}: "
        f"{sorted(f for f in used if FEATURES[f][0] > kube_floor())}")


def test_statefulset_kind_needs_less(render):
    # The StatefulSet kind uses nothing of the Job's; its own floor is below
    # the chart's (the README says which applies where).
    used = features_used(rendered(render, "statefulset"))
    assert not used & {"IndexedJob", "ElasticIndexedJob", "JobPodFailurePolicy",
                       "JobPodReplacementPolicy"}
    assert needed(used) < kube_floor()


def test_chart_yaml_names_the_features_that_set_the_floor(render):
    text, _ = chart_metadata()
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    used = features_used(rendered(render, "defaults"))
    setting = [f for f in used if FEATURES[f][0] == kube_floor()]
    assert setting
    for feature in setting:
        assert feature in comments, f"Chart.yaml's comment does not name {feature}"


def helm_install_dry_run(chart, values, kube_version):
    """`helm install --dry-run=client --kube-version V` (what `helm template
    --kube-version V` runs), through the SDK's install action: nothing is
    contacted, and Helm checks the chart's kubeVersion as it would on a
    cluster of that version."""
    from helm_python import _native
    with Config(storage_driver="memory", namespace=NAMESPACE) as cfg:
        opts = {"namespace": NAMESPACE, "dry_run": "client", "kube_version": kube_version}
        return json.loads(_native.call_string(
            "helm_install", cfg._raw(), _native.HANDLE(0), chart._raw(), None, RELEASE,
            json.dumps(values), json.dumps(opts)))


@pytest.mark.parametrize("kind", ["job", "statefulset"])
def test_helm_refuses_a_cluster_below_the_floor(chart, kind):
    major, minor = kube_floor()
    values = {"workers": {"kind": kind}}
    below = f"v{major}.{minor - 1}.9"
    with pytest.raises(helm.HelmReleaseError, match=r"chart requires kubeVersion: >=%d\.%d\.0-0 "
                       r"which is incompatible with Kubernetes %s" % (major, minor, below)):
        helm_install_dry_run(chart, values, below)
    # The floor itself, a vendor's build of it, and a later release install.
    for ok in (f"v{major}.{minor}.0", f"v{major}.{minor}.3-eks-1234567", "v1.35.0"):
        release = helm_install_dry_run(chart, values, ok)
        assert release["chart_name"] == "ductile"
        workload = "Job" if kind == "job" else "StatefulSet"
        assert f"kind: {workload}\n" in release["manifest"]
