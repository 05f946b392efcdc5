"""The workers as an elastic Indexed Job (workers.kind: job, the default).

What the rendered Job asks of the Job controller: one pod per index, sized
by workers.replicas through parallelism and completions together, a
podFailurePolicy keyed on the agent's exit codes (read from agent/agent.h,
so a renumbered code fails here), restartPolicy Never, a headless Service
as the pods' subdomain, and a checksum of everything Kubernetes keeps
immutable, which changes exactly when an upgrade would be refused.
"""

import re

import helm_python as helm
import pytest

from conftest import CHART_DIR, SOURCE, with_values
from jobsim import pod_failure_action

CI = CHART_DIR / "ci"
JOBS = SOURCE / "examples" / "jobs"


def agent_exit_codes():
    """{name: code} of the agent's exit codes, from agent/agent.h."""
    text = (SOURCE / "agent" / "agent.h").read_text()
    codes = dict((m.group(1), int(m.group(2)))
                 for m in re.finditer(r"AGENT_EXIT_([A-Z_]+)\s*=\s*(\d+)", text))
    assert codes, "no AGENT_EXIT_* codes in agent/agent.h"
    return codes


def checksum(r):
    return r.workers()["metadata"]["annotations"]["checksum/immutable-spec"]


def test_default_workers_are_an_indexed_job(render):
    r = render()
    job = r.workers()
    assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
    assert [s["metadata"]["name"] for s in r.of_kind("StatefulSet")] == ["demo-ductile-etcd"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 1
    # The API server generates the selector and its labels; a chart-set one
    # would need manualSelector.
    assert "selector" not in spec and "manualSelector" not in spec
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy
    assert spec["podReplacementPolicy"] == "Failed"


@pytest.mark.parametrize("replicas", [2, 3, 8])
def test_size_is_parallelism_and_completions(render, replicas):
    r = render({"job": {"minNodes": 2, "maxNodes": 8}, "workers": {"replicas": replicas}})
    spec = r.workers()["spec"]
    assert spec["parallelism"] == spec["completions"] == replicas


def test_pods_name_the_headless_service_as_subdomain(render):
    r = render(JOBS / "fashion-mnist-gpu.yaml", name="fmnist")
    job = r.workers()
    pod = job["spec"]["template"]
    svc = r.one("Service", pod["spec"]["subdomain"])
    assert svc["metadata"]["name"] == job["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    for k, v in svc["spec"]["selector"].items():
        assert pod["metadata"]["labels"].get(k) == v, f"Service selector {k}={v} misses the pods"


def test_node_id_is_the_pod_name_and_address_the_pod_ip(render):
    for kind in ("job", "statefulset"):
        env = render({"workers": {"kind": kind}}).env()
        assert env["DUCTILE_NODE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["DUCTILE_NODE_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["DUCTILE_TRAIN_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_exit_codes_of_the_policy_are_the_agents(render):
    codes = agent_exit_codes()
    assert codes["OK"] == 0
    job = render().workers()
    rules = job["spec"]["podFailurePolicy"]["rules"]
    container = job["spec"]["template"]["spec"]["containers"][0]["name"]
    for rule in rules:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == container == "agent"
    fail_job = [r for r in rules if r["action"] == "FailJob"]
    assert fail_job[0]["onExitCodes"]["values"] == sorted([codes["USAGE"], codes["JOB_FAILED"]])
    ignored = [r["onExitCodes"]["values"] for r in rules
               if r["action"] == "Ignore" and "onExitCodes" in r]
    assert ignored == [sorted([codes["DROPPED"], codes["LEFT"], codes["NO_ROUND"]])]
    # ... and the pods leave a running job with the code the policy ignores
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DUCTILE_LEAVE_EXIT_CODE"] == str(codes["LEFT"])


def test_policy_maps_every_way_a_pod_ends(render):
    codes = agent_exit_codes()
    job = render().workers()
    disrupted = ("DisruptionTarget",)
    cases = [
        (codes["ERROR"], (), "Count"),        # this agent failed
        (codes["USAGE"], (), "FailJob"),      # bad settings: the same in every pod
        (codes["JOB_FAILED"], (), "FailJob"),  # the job's restart budget is spent
        (codes["DROPPED"], (), "Ignore"),     # etcd dropped the node, not its fault
        (codes["LEFT"], (), "Ignore"),        # deleted while training: replaced
        (codes["NO_ROUND"], (), "Ignore"),  # waited for peers: not a failure
        (137, (), "Count"),                   # SIGKILL: OOM kill, a crash
        (139, (), "Count"),                   # SIGSEGV
        (143, disrupted, "Ignore"),           # preempted, evicted, drained
        (137, disrupted, "Ignore"),           # ... and killed after its grace period
        (codes["ERROR"], disrupted, "Ignore"),
        (codes["JOB_FAILED"], disrupted, "FailJob"),  # the job failed anyway
    ]
    for exit_code, conditions, want in cases:
        got = pod_failure_action(job, exit_code, "agent", conditions)
        assert got == want, f"exit {exit_code} {conditions}: {got}, want {want}"
    # A code in a rule of another container does not match.
    assert pod_failure_action(job, codes["USAGE"], "sidecar") == "Count"


def test_backoff_limits(render):
    spec = render().workers()["spec"]
    assert spec["backoffLimit"] == 6
    assert "backoffLimitPerIndex" not in spec and "maxFailedIndexes" not in spec
    assert "ttlSecondsAfterFinished" not in spec
    spec = render(CI / "job-per-index.yaml").workers()["spec"]
    assert spec["backoffLimit"] == 20
    assert spec["backoffLimitPerIndex"] == 3
    # One index past its limit fails the whole run, never "Failed" at the
    # end of a training run that completed without it.
    assert spec["maxFailedIndexes"] == 0
    assert spec["ttlSecondsAfterFinished"] == 3600
    # 0 is a limit, not "unset".
    spec = render({"workers": {"job": {"backoffLimitPerIndex": 0,
                                       "ttlSecondsAfterFinished": 0}}}).workers()["spec"]
    assert spec["backoffLimitPerIndex"] == 0 and spec["ttlSecondsAfterFinished"] == 0


def test_pod_labels_do_not_follow_the_chart_version(render):
    job = render().workers()
    assert "helm.sh/chart" in job["metadata"]["labels"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels
    assert labels["app.kubernetes.io/component"] == "worker"
    assert labels["app.kubernetes.io/instance"] == "demo"
    # The StatefulSet kind keeps every standard label on its pods.
    sts = render({"workers": {"kind": "statefulset"}}).workers()
    assert "helm.sh/chart" in sts["spec"]["template"]["metadata"]["labels"]


BASE = {"job": {"minNodes": 1, "maxNodes": 8, "command": ["ductile-train", "--model", "mlp"]},
        "workers": {"replicas": 2}}

# What Kubernetes lets an upgrade change in a Job: the checksum stays.
MUTABLE = {
    "replicas": {"workers": {"replicas": 5}},
    "backoff-limit": {"workers": {"job": {"backoffLimit": 11}}},
    "ttl": {"workers": {"job": {"ttlSecondsAfterFinished": 60}}},
    "pdb": {"podDisruptionBudget": {"minAvailable": 2}},
    "service-monitor": {"serviceMonitor": {"enabled": True}},
    "deadline": {"workers": {"job": {"activeDeadlineSeconds": 3600}}},
    "job-labels": {"workers": {"labels": {"kueue.x-k8s.io/queue-name": "team-b"}}},
    "job-annotations": {"workers": {"annotations": {"example.com/owner": "vision"}}},
    "monitoring": {"monitoring": {"dashboard": {"enabled": True},
                                  "prometheusRule": {"enabled": True}}},
}
# What it does not: the checksum changes, so _validate.tpl refuses it.
IMMUTABLE = {
    "image": {"image": {"tag": "0.2.0"}},
    "command": {"job": {"command": ["ductile-train", "--model", "cnn"]}},
    "env": {"job": {"env": {"OMP_NUM_THREADS": "4"}}},
    "max-nodes": {"job": {"maxNodes": 6}},
    "lease-ttl": {"job": {"leaseTTL": 20}},
    "gpus": {"workers": {"gpusPerNode": 1}},
    "resources": {"workers": {"resources": {"requests": {"cpu": "2"}}}},
    "per-index": {"workers": {"job": {"backoffLimitPerIndex": 2}}},
    "script": {"job": {"command": ["python3", "/opt/ductile/job/train.py"],
                       "script": {"content": "print(1)"}}},
    "nccl": {"nccl": {"debug": "INFO"}},
    "events": {"monitoring": {"events": {"enabled": True}}},
    "pod-labels": {"workers": {"podLabels": {"team": "vision"}}},
    "scheduler": {"workers": {"schedulerName": "scheduler-plugins-scheduler"}},
    "extra-env": {"workers": {"extraEnv": [{"name": "A", "value": "1"}]}},
    "security": {"workers": {"containerSecurityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}},
}


@pytest.mark.parametrize("patch", MUTABLE.values(), ids=MUTABLE.keys())
def test_checksum_ignores_what_an_upgrade_may_change(render, patch):
    assert checksum(render(with_values(BASE, patch))) == checksum(render(BASE))


@pytest.mark.parametrize("patch", IMMUTABLE.values(), ids=IMMUTABLE.keys())
def test_checksum_follows_what_kubernetes_keeps_immutable(render, patch):
    assert checksum(render(with_values(BASE, patch))) != checksum(render(BASE))


def test_checksum_covers_the_whole_pod_template(render):
    # Every part of the rendered pod template and of the fixed fields is in
    # it: the same values give the same checksum, and it is a sha256.
    a, b = render(BASE), render(BASE)
    assert checksum(a) == checksum(b)
    assert re.fullmatch(r"[0-9a-f]{64}", checksum(a))


def test_longest_names_keep_pod_host_names_valid(render):
    # The API server refuses a Job whose last pod's host name
    # (<job>-<completions-1>) is not a DNS label.
    r = render({"job": {"name": "long", "maxNodes": 4096}, "workers": {"replicas": 4096}},
               name="a" * 53)
    host = f"{r.workers()['metadata']['name']}-{4096 - 1}"
    assert len(host) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", host)


def test_values_from_before_workers_kind_keep_a_statefulset(render):
    # `helm upgrade --reuse-values` keeps an older release's values, which
    # have neither workers.kind nor workers.job (a null removes a key, as
    # their absence would): that release has a StatefulSet and keeps it.
    r = render({"workers": {"kind": None, "job": None}})
    assert r.workers()["kind"] == "StatefulSet"
    assert not r.of_kind("Job")
    # Asking such a release for a Job says what to do.
    with pytest.raises(helm.HelmRenderError, match="--reset-then-reuse-values"):
        render({"workers": {"kind": "job", "job": None}})


def test_scheduling_fields_of_the_job(render):
    """Kueue's queue label and annotations on the Job object (not its pods),
    the deadline in its spec, the scheduler in its pods."""
    r = render(JOBS / "kueue.yaml", name="fmnist-queued")
    job = r.workers()
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io/queue-name" not in job["spec"]["template"]["metadata"]["labels"]
    assert job["spec"]["activeDeadlineSeconds"] == 86400
    # Kueue creates it suspended and resumes it; the chart never sets
    # suspend, so an upgrade does not fight Kueue over it.
    assert "suspend" not in job["spec"]
    # The chart's own labels stay beside the user's.
    assert job["metadata"]["labels"]["app.kubernetes.io/instance"] == "fmnist-queued"
    assert "activeDeadlineSeconds" not in render().workers()["spec"]
    r = render({"workers": {"schedulerName": "volcano", "annotations": {"a.example/b": "c"}}})
    assert r.pod_spec()["schedulerName"] == "volcano"
    assert r.workers()["metadata"]["annotations"]["a.example/b"] == "c"
    assert "checksum/immutable-spec" in r.workers()["metadata"]["annotations"]
    assert "schedulerName" not in render().pod_spec()


def test_statefulset_gets_the_object_labels_and_scheduler(render):
    r = render({"workers": {"kind": "statefulset", "schedulerName": "volcano",
                            "labels": {"kueue.x-k8s.io/queue-name": "team-a"},
                            "annotations": {"a.example/b": "c"}}})
    sts = r.workers()
    assert sts["kind"] == "StatefulSet"
    assert sts["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert sts["metadata"]["annotations"] == {"a.example/b": "c"}
    assert r.pod_spec()["schedulerName"] == "volcano"


@pytest.mark.parametrize("kind", ["job", "statefulset"])
def test_pod_group_for_gang_scheduling(render, kind):
    r = render(with_values(JOBS / "gang-coscheduling.yaml", {"workers": {"kind": kind}}),
               name="fmnist-gang")
    (pg,) = r.of_kind("PodGroup")
    assert pg["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    name = r.workers()["metadata"]["name"]
    assert pg["metadata"]["name"] == name
    # The gang is the job's minimum: it trains once they run.
    assert pg["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 600}
    pod = r.workers()["spec"]["template"]
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == name
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    # minMember given; no timeout: the plugin's default.
    r = render({"job": {"minNodes": 1, "maxNodes": 4}, "workers": {
        "kind": kind, "replicas": 3, "podGroup": {"enabled": True, "minMember": 3}}})
    assert r.one("PodGroup")["spec"] == {"minMember": 3}
    # Off by default: no PodGroup, no label.
    r = render({"workers": {"kind": kind}})
    assert not r.of_kind("PodGroup")
    assert "scheduling.x-k8s.io/pod-group" not in r.workers()["spec"]["template"]["metadata"]["labels"]
