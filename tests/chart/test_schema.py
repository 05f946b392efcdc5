"""Bad job files are rejected with a message that names the problem.

One case per rule. Rules on one value live in values.schema.json (Helm
reports "at '/path': ..."); rules across values live in
templates/_validate.tpl (Helm reports the template's `fail` message). Each
case starts from a valid job, breaks exactly one thing, and checks both
that the render fails and that the message points at what was broken.
"""


import helm_python as helm
import jsonschema
import pytest

from conftest import EXAMPLE_JOBS, load_values, with_values

GOOD = {
    "job": {"name": "good", "minNodes": 1, "maxNodes": 4,
            "command": ["ductile-train", "--model", "mlp"]},
    "workers": {"replicas": 2},
}


# (id, patch onto GOOD, fragments the error must contain)
SCHEMA_RULES = [
    ("job-name-uppercase", {"job": {"name": "Train_1"}}, ["/job/name", "Train_1"]),
    ("job-name-too-long", {"job": {"name": "a" * 64}}, ["/job/name"]),
    ("job-name-leading-dash", {"job": {"name": "-x"}}, ["/job/name"]),
    ("typo-top-level", {"wrokers": {"replicas": 2}}, ["additional properties 'wrokers'"]),
    ("typo-in-job", {"job": {"minNode": 1}}, ["/job", "'minNode'"]),
    ("typo-in-workers", {"workers": {"gpuPerNode": 1}}, ["/workers", "'gpuPerNode'"]),
    ("typo-in-etcd", {"etcd": {"replica": 3}}, ["/etcd", "'replica'"]),
    ("image-repository-with-space", {"image": {"repository": "my image"}}, ["/image/repository"]),
    ("image-repository-with-tag", {"image": {"repository": "ductile:1.0"}}, ["/image/repository"]),
    ("image-repository-empty", {"image": {"repository": ""}}, ["/image/repository"]),
    ("image-tag-invalid", {"image": {"tag": "v1 beta"}}, ["/image/tag"]),
    ("image-digest-invalid", {"image": {"digest": "sha256:xyz"}}, ["/image/digest"]),
    ("image-pull-policy", {"image": {"pullPolicy": "Sometimes"}}, ["/image/pullPolicy"]),
    ("min-nodes-zero", {"job": {"minNodes": 0}}, ["/job/minNodes"]),
    ("replicas-negative", {"workers": {"replicas": -1}}, ["/workers/replicas"]),
    ("replicas-not-integer", {"workers": {"replicas": "two"}}, ["/workers/replicas"]),
    ("gpus-negative", {"workers": {"gpusPerNode": -1}}, ["/workers/gpusPerNode"]),
    ("gpus-too-many", {"workers": {"gpusPerNode": 17}}, ["/workers/gpusPerNode"]),
    ("gpus-fractional", {"workers": {"gpusPerNode": 0.5}}, ["/workers/gpusPerNode"]),
    ("command-empty", {"job": {"command": []}}, ["/job/command"]),
    ("command-not-list", {"job": {"command": "ductile-train --model mlp"}}, ["/job/command"]),
    ("command-blank-program", {"job": {"command": [""]}}, ["/job/command/0"]),
    ("command-not-strings", {"job": {"command": ["ductile-train", 5]}}, ["/job/command/1"]),
    ("rebuild-unknown", {"job": {"rebuild": "reboot"}}, ["/job/rebuild"]),
    ("log-format-unknown", {"job": {"logFormat": "xml"}}, ["/job/logFormat"]),
    ("lease-ttl-too-small", {"job": {"leaseTTL": 1}}, ["/job/leaseTTL"]),
    ("env-bad-name", {"job": {"env": {"1BAD": "x"}}}, ["/job/env"]),
    ("shm-size-invalid", {"workers": {"shmSize": "lots"}}, ["/workers/shmSize"]),
    ("resources-typo", {"workers": {"resources": {"request": {"cpu": "1"}}}},
     ["/workers/resources", "'request'"]),
    ("resources-bad-quantity", {"workers": {"resources": {"limits": {"memory": "2 GB"}}}},
     ["/workers/resources/limits/memory"]),
    ("http-port-privileged", {"workers": {"httpPort": 80}}, ["/workers/httpPort"]),
    ("nccl-debug-unknown", {"nccl": {"debug": "LOUD"}}, ["/nccl/debug"]),
    ("nccl-extra-env-not-nccl", {"nccl": {"extraEnv": {"CUDA_VISIBLE_DEVICES": "0"}}},
     ["/nccl/extraEnv"]),
    ("toleration-bad-effect", {"workers": {"tolerations": [{"key": "k", "effect": "Never"}]}},
     ["/workers/tolerations/0/effect"]),
    ("etcd-two-members", {"etcd": {"replicas": 2}}, ["/etcd/replicas", "1, 3"]),
    ("etcd-endpoint-not-url", {"etcd": {"enabled": False, "external": {"endpoints": ["etcd:2379"]}}},
     ["/etcd/external/endpoints/0"]),
    ("etcd-image-tag-empty", {"etcd": {"image": {"tag": ""}}}, ["/etcd/image/tag"]),
    ("checkpoint-access-mode", {"checkpoint": {"accessModes": ["ReadWriteSome"]}},
     ["/checkpoint/accessModes/0"]),
    ("pdb-bad-percent", {"podDisruptionBudget": {"minAvailable": "half"}},
     ["/podDisruptionBudget/minAvailable"]),
    ("workers-kind-unknown", {"workers": {"kind": "deployment"}}, ["/workers/kind"]),
    ("typo-in-workers-job", {"workers": {"job": {"backoffLimits": 3}}},
     ["/workers/job", "'backoffLimits'"]),
    ("backoff-limit-negative", {"workers": {"job": {"backoffLimit": -1}}},
     ["/workers/job/backoffLimit"]),
    ("backoff-limit-per-index-negative", {"workers": {"job": {"backoffLimitPerIndex": -1}}},
     ["/workers/job/backoffLimitPerIndex"]),
    ("backoff-limit-above-int32", {"workers": {"job": {"backoffLimit": 2 ** 31}}},
     ["/workers/job/backoffLimit"]),
    ("ttl-negative", {"workers": {"job": {"ttlSecondsAfterFinished": -5}}},
     ["/workers/job/ttlSecondsAfterFinished"]),
    ("typo-in-monitoring", {"monitoring": {"dashbaord": {"enabled": True}}},
     ["/monitoring", "'dashbaord'"]),
    ("dashboard-enabled-not-bool", {"monitoring": {"dashboard": {"enabled": "yes"}}},
     ["/monitoring/dashboard/enabled"]),
    ("dashboard-bad-label", {"monitoring": {"dashboard": {"labels": {"grafana dashboard": "1"}}}},
     ["/monitoring/dashboard/labels"]),
    ("no-progress-minutes-zero", {"monitoring": {"prometheusRule": {"noProgressMinutes": 0}}},
     ["/monitoring/prometheusRule/noProgressMinutes"]),
    ("restarts-per-hour-not-integer",
     {"monitoring": {"prometheusRule": {"restartsPerHour": "3"}}},
     ["/monitoring/prometheusRule/restartsPerHour"]),
    ("events-enabled-not-bool", {"monitoring": {"events": {"enabled": 1}}},
     ["/monitoring/events/enabled"]),
    ("rule-severity-invalid", {"monitoring": {"prometheusRule": {"severity": "Very Bad"}}},
     ["/monitoring/prometheusRule/severity"]),
    ("ttl-not-integer", {"workers": {"job": {"ttlSecondsAfterFinished": "1h"}}},
     ["/workers/job/ttlSecondsAfterFinished"]),
    # Scheduling.
    ("deadline-zero", {"workers": {"job": {"activeDeadlineSeconds": 0}}},
     ["/workers/job/activeDeadlineSeconds"]),
    ("deadline-not-integer", {"workers": {"job": {"activeDeadlineSeconds": "1d"}}},
     ["/workers/job/activeDeadlineSeconds"]),
    ("scheduler-name-invalid", {"workers": {"schedulerName": "My Scheduler"}},
     ["/workers/schedulerName"]),
    ("object-labels-not-strings", {"workers": {"labels": {"kueue.x-k8s.io/queue-name": 1}}},
     ["/workers/labels"]),
    ("object-annotations-not-map", {"workers": {"annotations": ["a=b"]}},
     ["/workers/annotations"]),
    ("pod-group-typo", {"workers": {"podGroup": {"enabeld": True}}},
     ["/workers/podGroup", "'enabeld'"]),
    ("pod-group-min-zero", {"workers": {"podGroup": {"enabled": True, "minMember": 0}}},
     ["/workers/podGroup/minMember"]),
    # The pod's extension points.
    ("extra-volumes-not-list", {"workers": {"extraVolumes": {"name": "data"}}},
     ["/workers/extraVolumes"]),
    ("extra-volume-without-name", {"workers": {"extraVolumes": [{"emptyDir": {}}]}},
     ["/workers/extraVolumes/0", "name"]),
    ("extra-volume-without-source", {"workers": {"extraVolumes": [{"name": "data"}]}},
     ["/workers/extraVolumes/0"]),
    ("extra-volume-unknown-source", {"workers": {"extraVolumes": [{"name": "d", "emptydir": {}}]}},
     ["/workers/extraVolumes/0", "'emptydir'"]),
    ("extra-volume-bad-name", {"workers": {"extraVolumes": [{"name": "Data", "emptyDir": {}}]}},
     ["/workers/extraVolumes/0/name"]),
    ("extra-mount-relative-path",
     {"workers": {"extraVolumeMounts": [{"name": "tmp", "mountPath": "data"}]}},
     ["/workers/extraVolumeMounts/0/mountPath"]),
    ("extra-mount-without-path", {"workers": {"extraVolumeMounts": [{"name": "tmp"}]}},
     ["/workers/extraVolumeMounts/0", "mountPath"]),
    ("extra-env-map", {"workers": {"extraEnv": {"A": "1"}}}, ["/workers/extraEnv"]),
    ("extra-env-number", {"workers": {"extraEnv": [{"name": "A", "value": 1}]}},
     ["/workers/extraEnv/0/value"]),
    ("extra-env-value-and-from",
     {"workers": {"extraEnv": [{"name": "A", "value": "1",
                                "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}},
     ["/workers/extraEnv/0"]),
    ("extra-env-unknown-source",
     {"workers": {"extraEnv": [{"name": "A", "valueFrom": {"secretRef": {"name": "s"}}}]}},
     ["/workers/extraEnv/0/valueFrom", "'secretRef'"]),
    ("env-from-typo", {"workers": {"envFrom": [{"secretsRef": {"name": "s3"}}]}},
     ["/workers/envFrom/0", "'secretsRef'"]),
    ("env-from-without-name", {"workers": {"envFrom": [{"secretRef": {}}]}},
     ["/workers/envFrom/0/secretRef", "name"]),
    ("runtime-class-not-string", {"workers": {"runtimeClassName": True}},
     ["/workers/runtimeClassName"]),
    ("init-containers-not-list", {"workers": {"initContainers": {"name": "x", "image": "y"}}},
     ["/workers/initContainers"]),
    ("init-container-without-image", {"workers": {"initContainers": [{"name": "fetch"}]}},
     ["/workers/initContainers/0", "image"]),
    ("init-container-typo",
     {"workers": {"initContainers": [{"name": "f", "image": "busybox", "comand": ["true"]}]}},
     ["/workers/initContainers/0", "'comand'"]),
    ("security-context-typo",
     {"workers": {"containerSecurityContext": {"capabilities": {"adds": ["IPC_LOCK"]}}}},
     ["/workers/containerSecurityContext/capabilities", "'adds'"]),
    ("security-context-caps-not-list",
     {"workers": {"containerSecurityContext": {"capabilities": {"add": "IPC_LOCK"}}}},
     ["/workers/containerSecurityContext/capabilities/add"]),
    ("pod-annotations-not-strings", {"workers": {"podAnnotations": {"a": True}}},
     ["/workers/podAnnotations"]),
]

# Cross-field rules of templates/_validate.tpl.
TEMPLATE_RULES = [
    ("min-above-max", {"job": {"minNodes": 5, "maxNodes": 4}, "workers": {"replicas": 5}},
     ["job.minNodes (5) must not exceed job.maxNodes (4)"]),
    ("replicas-below-min", {"job": {"minNodes": 3}, "workers": {"replicas": 2}},
     ["workers.replicas (2) must be at least job.minNodes (3)"]),
    ("replicas-above-max", {"workers": {"replicas": 5}},
     ["workers.replicas (5) must not exceed job.maxNodes (4)"]),
    ("nproc-above-gpus", {"job": {"nprocPerNode": 4}, "workers": {"gpusPerNode": 2}},
     ["job.nprocPerNode (4) must not exceed workers.gpusPerNode (2)"]),
    ("grace-not-above-shutdown", {"job": {"shutdownTimeout": 30},
                                  "workers": {"terminationGracePeriodSeconds": 30}},
     ["workers.terminationGracePeriodSeconds (30) must be above job.shutdownTimeout (30)"]),
    ("gpus-in-resources", {"workers": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
     ["workers.resources.limits.nvidia.com/gpu", "workers.gpusPerNode"]),
    ("external-etcd-without-endpoints", {"etcd": {"enabled": False}},
     ["etcd.enabled is false but etcd.external.endpoints is empty"]),
    ("external-etcd-while-enabled",
     {"etcd": {"external": {"endpoints": ["http://etcd.infra:2379"]}}},
     ["etcd.external.* is set but etcd.enabled is true"]),
    ("tls-with-http-endpoint",
     {"etcd": {"enabled": False, "external": {"endpoints": ["http://etcd.infra:2379"],
                                              "tls": {"secretName": "etcd-tls"}}}},
     ["http://etcd.infra:2379", "must be https://"]),
    ("https-without-tls-secret",
     {"etcd": {"enabled": False, "external": {"endpoints": ["https://etcd.infra:2379"]}}},
     ["https://etcd.infra:2379", "etcd.external.tls.secretName is empty"]),
    ("claim-and-per-pod", {"checkpoint": {"existingClaim": "ckpt", "perPod": True}},
     ["checkpoint.existingClaim and checkpoint.perPod are exclusive"]),
    ("pdb-both-set", {"podDisruptionBudget": {"minAvailable": 1, "maxUnavailable": 1}},
     ["minAvailable or maxUnavailable, not both"]),
    ("script-not-in-command", {"job": {"script": {"content": "print(1)"}}},
     ["job.script is set but job.command never names /opt/ductile/job/train.py"]),
    # workers.kind: job (the default) and what a Job cannot do.
    ("job-with-per-pod-checkpoints", {"checkpoint": {"perPod": True}},
     ["checkpoint.perPod needs workers.kind=statefulset"]),
    ("job-pdb-max-unavailable", {"podDisruptionBudget": {"maxUnavailable": 1}},
     ["podDisruptionBudget.maxUnavailable needs workers.kind=statefulset"]),
    ("job-pdb-percent", {"podDisruptionBudget": {"minAvailable": "50%"}},
     ['podDisruptionBudget.minAvailable "50%"', "integer minAvailable"]),
    ("statefulset-with-per-index-limit",
     {"workers": {"kind": "statefulset", "job": {"backoffLimitPerIndex": 1}}},
     ["workers.job.backoffLimitPerIndex is set but workers.kind is statefulset"]),
    ("statefulset-with-events",
     {"workers": {"kind": "statefulset"}, "monitoring": {"events": {"enabled": True}}},
     ["monitoring.events.enabled needs workers.kind=job"]),
    ("statefulset-with-ttl",
     {"workers": {"kind": "statefulset", "job": {"ttlSecondsAfterFinished": 60}}},
     ["workers.job.ttlSecondsAfterFinished is set but workers.kind is statefulset"]),
    ("statefulset-with-deadline",
     {"workers": {"kind": "statefulset", "job": {"activeDeadlineSeconds": 3600}}},
     ["workers.job.activeDeadlineSeconds is set but workers.kind is statefulset"]),
    ("pod-group-above-replicas",
     {"workers": {"podGroup": {"enabled": True, "minMember": 3}}},
     ["workers.podGroup.minMember (3) must not exceed workers.replicas (2)"]),
    ("extra-volume-named-like-the-charts",
     {"workers": {"extraVolumes": [{"name": "shm", "emptyDir": {}}]}},
     ['workers.extraVolumes[0]: the name "shm" is one of the chart\'s own volumes']),
    ("extra-volume-twice",
     {"workers": {"extraVolumes": [{"name": "d", "emptyDir": {}}, {"name": "d", "emptyDir": {}}]}},
     ['workers.extraVolumes[1]: the name "d" is given twice']),
    ("extra-mount-of-no-volume",
     {"workers": {"extraVolumeMounts": [{"name": "data", "mountPath": "/data"}]}},
     ['workers.extraVolumeMounts[0]: no volume named "data"']),
    ("init-container-named-agent",
     {"workers": {"initContainers": [{"name": "agent", "image": "busybox"}]}},
     ['workers.initContainers[0]: the name "agent"']),
]


def test_good_job_renders(chart):
    chart.validate_schema(GOOD)
    assert chart.render(GOOD, name="demo")


def test_schema_is_valid_draft7(chart):
    jsonschema.Draft7Validator.check_schema(chart.schema)
    assert chart.schema["$schema"] == "http://json-schema.org/draft-07/schema#"


@pytest.mark.parametrize("path", [None] + EXAMPLE_JOBS,
                         ids=["defaults"] + [p.name for p in EXAMPLE_JOBS])
def test_shipped_values_valid_for_draft7(chart, path):
    values = load_values(path) if path else None
    jsonschema.Draft7Validator(chart.schema).validate(chart.merge_values(values))


@pytest.mark.parametrize("patch,fragments", [r[1:] for r in SCHEMA_RULES],
                         ids=[r[0] for r in SCHEMA_RULES])
def test_schema_rejects(chart, patch, fragments):
    values = with_values(GOOD, patch)
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name="demo")
    message = str(err.value)
    for f in fragments:
        assert f in message, f"{f!r} not in: {message}"
    # The schema alone (no template run) rejects it too: it is a schema rule.
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
    # So does a second, independent draft-07 validator (older Helm releases
    # use another JSON Schema library than Helm 4).
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(chart.schema).validate(chart.merge_values(values))


@pytest.mark.parametrize("patch,fragments", [r[1:] for r in TEMPLATE_RULES],
                         ids=[r[0] for r in TEMPLATE_RULES])
def test_cross_field_rule_rejects(chart, patch, fragments):
    values = with_values(GOOD, patch)
    chart.validate_schema(values)  # each value is fine on its own...
    with pytest.raises(helm.HelmRenderError) as err:  # ...together they are not
        chart.render(values, name="demo")
    message = str(err.value)
    for f in fragments:
        assert f in message, f"{f!r} not in: {message}"


def test_release_name_must_be_a_job_id_without_job_name(chart):
    values = with_values(GOOD, {})
    del values["job"]["name"]
    with pytest.raises(helm.HelmRenderError, match="set job.name"):
        chart.render(values, name="my.release")
    # The same release name is fine once job.name is given.
    assert chart.render(GOOD, name="my.release")


@pytest.mark.parametrize("boundary", [(1, 1, 1), (1, 4, 1), (1, 4, 4), (2, 2, 2)],
                         ids=["1-1-1", "min-equal", "max-equal", "fixed-2"])
def test_scale_range_boundaries_accepted(chart, boundary):
    lo, hi, n = boundary
    chart.render(with_values(GOOD, {"job": {"minNodes": lo, "maxNodes": hi},
                               "workers": {"replicas": n}}), name="demo")


@pytest.mark.parametrize("values", [
    {"workers": {"kind": "statefulset"}, "checkpoint": {"perPod": True}},
    {"workers": {"kind": "statefulset"}, "podDisruptionBudget": {"maxUnavailable": 1}},
    {"workers": {"kind": "statefulset"}, "podDisruptionBudget": {"minAvailable": "50%"}},
    {"checkpoint": {"enabled": False, "perPod": True}},
    {"podDisruptionBudget": {"enabled": False, "maxUnavailable": 1}},
], ids=["sts-per-pod", "sts-max-unavailable", "sts-percent", "job-per-pod-unused",
        "job-pdb-off"])
def test_what_only_a_statefulset_can_do_is_fine_there(chart, values):
    # The rules refused for a Job stay allowed where they work.
    chart.render(with_values(GOOD, values), name="demo")


def test_zero_replicas_accepted_when_min_allows_it_not_otherwise(chart):
    # Scaling to zero pauses a job only through kubectl; the chart insists
    # on a startable size.
    with pytest.raises(helm.HelmRenderError, match="at least job.minNodes"):
        chart.render(with_values(GOOD, {"workers": {"replicas": 0}}), name="demo")


@pytest.mark.parametrize("path", EXAMPLE_JOBS, ids=[p.name for p in EXAMPLE_JOBS])
def test_example_job_breaks_on_a_typo(chart, path):
    values = load_values(path)
    values["job"]["maxNode"] = values["job"].pop("maxNodes", 1)
    with pytest.raises(helm.HelmValuesError, match="maxNode"):
        chart.render(values, name="demo")


# Objects whose inside is a Kubernetes structure passed through unchanged
# (checked by the API server, and by test_render with kubernetes-validate).
PASS_THROUGH = {"/properties/global", "/definitions/affinity/properties/nodeAffinity",
                "/definitions/affinity/properties/podAffinity",
                "/definitions/affinity/properties/podAntiAffinity",
                "/properties/workers/properties/topologySpreadConstraints/items",
                "/properties/networkPolicy/properties/metricsFrom/items",
                "/definitions/stringMap", "/definitions/k8sObject"}


def test_schema_closed_everywhere(chart):
    schema = chart.schema
    open_objects = []

    def walk(node, path):
        if isinstance(node, dict):
            is_object = node.get("type") == "object" or "properties" in node
            if is_object and path not in PASS_THROUGH and node.get("additionalProperties") is not False:
                open_objects.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(schema, "")
    assert not open_objects, f"objects that accept unknown keys: {open_objects}"
    # Self-contained: every $ref points into this file.
    refs = []
    walk_refs = lambda n: (refs.append(n["$ref"]) if isinstance(n, dict) and "$ref" in n else None,
                           [walk_refs(v) for v in (n.values() if isinstance(n, dict) else
                                                   n if isinstance(n, list) else [])])
    walk_refs(schema)
    assert refs and all(r.startswith("#/") for r in refs), refs


def test_every_default_value_is_described(chart):
    # values.yaml is the documentation: each leaf key has a comment above it,
    # or sits in a block (requests, probe timings) whose key has one.
    import re
    from conftest import CHART_DIR
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()

    def commented(i):
        return i > 0 and lines[i - 1].strip().startswith("#")

    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):(\s.*)?$", line)
        if not m or not (m.group(3) or "").strip():
            continue  # a section header, described by its children
        if commented(i):
            continue
        # Walk up the enclosing keys below the top-level sections (whose
        # comment describes the section, not each key); one must carry it.
        indent, j, ok = len(m.group(1)), i, False
        while indent > 2 and not ok:
            j = next((k for k in range(j - 1, -1, -1)
                      if lines[k].strip() and not lines[k].strip().startswith("#")
                      and len(lines[k]) - len(lines[k].lstrip()) < indent), None)
            if j is None:
                break
            indent = len(lines[j]) - len(lines[j].lstrip())
            ok = commented(j)
        if not ok:
            undocumented.append(m.group(2))
    assert not undocumented, f"values without a comment: {undocumented}"
