"""What the rendered job asks of Kubernetes: GPUs, env, shm, probes, grace, etcd.

Each test renders a job and reads the objects the cluster would get; the
values come from the job files users copy (examples/jobs) and from the
chart's CI value files, so a change that breaks a shipped job fails here.
"""

import json
import pathlib
import re

import pytest

from conftest import CHART_DIR, SOURCE, NAMESPACE, RELEASE, load_values

CI = CHART_DIR / "ci"
JOBS = SOURCE / "examples" / "jobs"


def by_name(items):
    return {i["name"]: i for i in items}


def test_gpu_requests_and_limits(render):
    r = render(JOBS / "fashion-mnist-gpu.yaml")
    res = r.agent()["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 8
    assert res["requests"]["nvidia.com/gpu"] == 8
    # The user's other requests and limits are kept next to the GPUs.
    assert res["requests"]["cpu"] == "32"
    assert res["limits"]["memory"] == "192Gi"
    # One trainer per GPU unless nprocPerNode says otherwise.
    assert r.env()["DUCTILE_NPROC_PER_NODE"] == "8"


def test_cpu_job_asks_for_no_gpu(render):
    r = render(JOBS / "fashion-mnist-cpu.yaml")
    res = r.agent()["resources"]
    for part in ("requests", "limits"):
        assert "nvidia.com/gpu" not in res.get(part, {})
    assert r.env()["DUCTILE_NPROC_PER_NODE"] == "2"


def test_gpu_resource_name_follows_values(render):
    r = render({"workers": {"gpusPerNode": 2, "gpuResourceName": "amd.com/gpu"}})
    assert r.agent()["resources"]["limits"] == {"amd.com/gpu": 2}


def test_agent_env_from_values(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    env = r.env()
    assert env["DUCTILE_RDZV_ID"] == "ml-ci-gpu"  # <namespace>-<job.name>
    assert env["DUCTILE_NNODES"] == "2:8"
    assert env["DUCTILE_NPROC_PER_NODE"] == "8"
    assert env["DUCTILE_REBUILD"] == "inplace"
    assert env["DUCTILE_SHUTDOWN_TIMEOUT"] == "45"
    assert env["DUCTILE_MAX_RESTARTS"] == "3"
    assert env["DUCTILE_LEASE_TTL"] == "10"
    assert env["DUCTILE_LAST_CALL"] == "5"
    assert env["DUCTILE_JOIN_TIMEOUT"] == "600"
    assert env["DUCTILE_HTTP_PORT"] == "29400"
    assert env["DUCTILE_STOP_GRACE"] == "5"
    assert env["DUCTILE_LOG_FORMAT"] == "text"
    # Every value is a string, as Kubernetes requires of env values.
    assert all(isinstance(v, (str, dict)) for v in env.values())


def test_node_identity_from_downward_api(render):
    env = render().env()
    assert env["DUCTILE_NODE_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["DUCTILE_TRAIN_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["DUCTILE_NODE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_agent_runs_the_job_command(render):
    r = render(JOBS / "fashion-mnist-cpu.yaml")
    c = r.agent()
    assert c["command"] == ["ductile-agent"]
    assert c["args"][0] == "--"
    assert c["args"][1:4] == ["ductile-train", "--model", "mlp"]
    assert "--epochs" in c["args"] and "10" in c["args"]


@pytest.mark.parametrize("lo,hi,n", [(1, 4, 2), (3, 3, 3), (2, 16, 16)])
def test_scale_range(render, lo, hi, n):
    values = {"job": {"minNodes": lo, "maxNodes": hi}, "workers": {"replicas": n}}
    r = render(values)
    assert r.env()["DUCTILE_NNODES"] == f"{lo}:{hi}"
    assert r.workers()["spec"]["parallelism"] == r.workers()["spec"]["completions"] == n
    values["workers"]["kind"] = "statefulset"
    r = render(values)
    assert r.env()["DUCTILE_NNODES"] == f"{lo}:{hi}"
    assert r.workers()["spec"]["replicas"] == n
    assert r.workers()["spec"]["podManagementPolicy"] == "Parallel"


def test_shm_is_memory_emptydir_with_size(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    pod = r.workers()["spec"]["template"]["spec"]
    shm = by_name(pod["volumes"])["shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert by_name(r.agent()["volumeMounts"])["shm"]["mountPath"] == "/dev/shm"


def test_probes_on_agent_endpoint(render):
    r = render(CI / "hostnetwork.yaml")
    c = r.agent()
    assert c["ports"] == [{"name": "http", "containerPort": 29500, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert r.env()["DUCTILE_HTTP_PORT"] == "29500"
    assert c["livenessProbe"]["failureThreshold"] >= 3


@pytest.mark.parametrize("shutdown", [5, 20, 45, 300])
def test_grace_period_above_shutdown_timeout(render, shutdown):
    r = render({"job": {"shutdownTimeout": shutdown}})
    grace = r.workers()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > shutdown
    assert r.env()["DUCTILE_SHUTDOWN_TIMEOUT"] == str(shutdown)


def test_grace_period_default_fits_default_shutdown(render):
    r = render()
    spec = r.workers()["spec"]["template"]["spec"]
    assert r.env()["DUCTILE_SHUTDOWN_TIMEOUT"] == "20"
    assert spec["terminationGracePeriodSeconds"] == 30


def test_explicit_grace_period_kept(render):
    r = render(CI / "hostnetwork.yaml")
    assert r.workers()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90


def test_etcd_endpoint_single_member(render):
    r = render()
    sts = r.one("StatefulSet", "-etcd")
    assert sts["spec"]["replicas"] == 1
    host = f"{RELEASE}-ductile-etcd-0.{RELEASE}-ductile-etcd-peer.{NAMESPACE}.svc.cluster.local"
    assert r.env()["DUCTILE_RDZV_ENDPOINT"] == f"http://{host}:2379"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--initial-cluster={RELEASE}-ductile-etcd-0=http://{host}:2380" in args


def test_etcd_three_members(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    sts = r.one("StatefulSet", "-etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    endpoints = r.env()["DUCTILE_RDZV_ENDPOINT"].split(",")
    assert len(endpoints) == 3
    for i, ep in enumerate(endpoints):
        assert ep.startswith(f"http://{RELEASE}-ductile-etcd-{i}.{RELEASE}-ductile-etcd-peer.")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    cluster = next(a for a in c["args"] if a.startswith("--initial-cluster="))
    assert cluster.count("=http://") == 3
    assert c["image"] == "quay.io/coreos/etcd:v3.5.19"
    # Persistent data: one claim per member, on the requested class.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert by_name(c["volumeMounts"])["data"]["mountPath"] == "/var/lib/etcd"
    # Quorum survives a drain.
    assert r.one("PodDisruptionBudget", "-etcd")["spec"]["maxUnavailable"] == 1


def test_etcd_image_pinned(render):
    image = render().one("StatefulSet", "-etcd")["spec"]["template"]["spec"]["containers"][0]["image"]
    repo, tag = image.rsplit(":", 1)
    assert tag not in ("latest", "") and tag[0] == "v" and tag.count(".") == 2


def test_external_etcd_with_tls_and_auth(render):
    r = render(CI / "external-etcd-tls.yaml")
    assert not [s for s in r.of_kind("StatefulSet") if s["metadata"]["name"].endswith("-etcd")]
    assert not [s for s in r.of_kind("Service") if "-etcd" in s["metadata"]["name"]]
    env = r.env()
    assert env["DUCTILE_RDZV_ENDPOINT"] == ",".join(
        f"https://etcd-{i}.etcd.infra.svc:2379" for i in range(3))
    assert env["DUCTILE_ETCD_CACERT"] == "/etc/ductile/etcd-tls/ca.crt"
    assert env["DUCTILE_ETCD_CERT"] == "/etc/ductile/etcd-tls/tls.crt"
    assert env["DUCTILE_ETCD_KEY"] == "/etc/ductile/etcd-tls/tls.key"
    assert env["DUCTILE_ETCD_USER"] == {"secretKeyRef": {"name": "etcd-credentials", "key": "username"}}
    assert env["DUCTILE_ETCD_PASSWORD"] == {"secretKeyRef": {"name": "etcd-credentials",
                                                             "key": "password"}}
    pod = r.workers()["spec"]["template"]["spec"]
    assert by_name(pod["volumes"])["etcd-tls"]["secret"]["secretName"] == "etcd-client-tls"
    assert by_name(r.agent()["volumeMounts"])["etcd-tls"] == {
        "name": "etcd-tls", "mountPath": "/etc/ductile/etcd-tls", "readOnly": True}
    # The helm test reaches the same etcd the same way.
    test_pod = r.one("Pod", "-test-rendezvous")
    test_env = r.env(test_pod["spec"]["containers"][0])
    assert test_env["DUCTILE_ETCD_CACERT"] == env["DUCTILE_ETCD_CACERT"]
    assert by_name(test_pod["spec"]["volumes"])["etcd-tls"]["secret"]["secretName"] == "etcd-client-tls"


def test_helm_test_runs_agent_status(render):
    r = render(JOBS / "fashion-mnist-gpu.yaml", name="fmnist")
    pod = r.one("Pod", "-test-rendezvous")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:2] == ["/bin/sh", "-ec"]
    assert ('ductile-agent status --rdzv-endpoint "$DUCTILE_RDZV_ENDPOINT" '
            '--rdzv-id "$DUCTILE_RDZV_ID"') in cmd[2]
    env = r.env(container)
    assert env["DUCTILE_RDZV_ID"] == "ml-fmnist-gpu"
    assert env["DUCTILE_RDZV_ENDPOINT"] == r.env()["DUCTILE_RDZV_ENDPOINT"]
    assert not render(CI / "hostnetwork.yaml").of_kind("Pod")


def test_labels_on_pods_and_selectors(render):
    r = render()
    tmpl = r.workers()["spec"]["template"]["metadata"]["labels"]
    assert tmpl["app.kubernetes.io/name"] == "ductile"
    assert tmpl["app.kubernetes.io/instance"] == RELEASE
    assert tmpl["app.kubernetes.io/component"] == "worker"
    # Selectors are immutable: they must not carry labels that change on upgrade.
    for sts in r.of_kind("StatefulSet"):
        sel = sts["spec"]["selector"]["matchLabels"]
        assert "helm.sh/chart" not in sel and "app.kubernetes.io/version" not in sel


def test_extra_pod_labels_and_annotations(render):
    r = render({"workers": {"podLabels": {"team": "vision"},
                            "podAnnotations": {"example.com/owner": "ml"}}})
    meta = r.workers()["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "vision"
    assert meta["annotations"]["example.com/owner"] == "ml"


# Every extension point of the worker pod at once, rendered for both kinds.
EXTENDED = {
    "job": {"env": {"OMP_NUM_THREADS": "4"}},
    "workers": {
        "runtimeClassName": "nvidia",
        "podAnnotations": {"example.com/owner": "ml"},
        "extraVolumes": [{"name": "datasets",
                          "persistentVolumeClaim": {"claimName": "imagenet", "readOnly": True}},
                         {"name": "creds", "secret": {"secretName": "s3"}}],
        "extraVolumeMounts": [{"name": "datasets", "mountPath": "/data", "readOnly": True},
                              {"name": "creds", "mountPath": "/etc/s3"},
                              {"name": "checkpoints", "mountPath": "/out", "subPath": "run-1"}],
        "extraEnv": [{"name": "WANDB_API_KEY",
                      "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}},
                     {"name": "DATA_DIR", "value": "/data"},
                     {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "envFrom": [{"secretRef": {"name": "s3-creds"}},
                    {"configMapRef": {"name": "training", "optional": True}, "prefix": "TRAIN_"}],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36",
                            "command": ["sh", "-c", "cp -r /src/. /data"],
                            "volumeMounts": [{"name": "datasets", "mountPath": "/data"}]}],
        "containerSecurityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
    },
}


@pytest.mark.parametrize("kind", ["job", "statefulset"])
def test_pod_extension_points(render, kind):
    r = render({**EXTENDED, "workers": {**EXTENDED["workers"], "kind": kind}})
    w = EXTENDED["workers"]
    pod = r.pod_spec()
    agent = r.agent()
    assert pod["runtimeClassName"] == "nvidia"
    assert r.workers()["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "ml"
    # Volumes after the chart's own, mounts on the agent container.
    volumes = by_name(pod["volumes"])
    assert {"shm", "tmp", "checkpoints"} <= set(volumes)
    for v in w["extraVolumes"]:
        assert volumes[v["name"]] == v
    mounts = agent["volumeMounts"]
    assert mounts[-3:] == w["extraVolumeMounts"]
    assert by_name(mounts)["shm"]["mountPath"] == "/dev/shm"
    # EnvVars, valueFrom included, after the chart's and job.env's; job.env
    # still works.
    env = agent["env"]
    assert env[-3:] == w["extraEnv"]
    names = [e["name"] for e in env]
    assert names.index("OMP_NUM_THREADS") < names.index("WANDB_API_KEY")
    assert r.env()["OMP_NUM_THREADS"] == "4"
    assert r.env()["DUCTILE_RDZV_ID"] == "ml-demo"  # <namespace>-<release>
    assert agent["envFrom"] == w["envFrom"]
    # Init containers run before the agent, as given.
    assert pod["initContainers"] == w["initContainers"]
    assert [c["name"] for c in pod["containers"]] == ["agent"]
    # The security context: IPC_LOCK added, the rest of the chart's kept.
    csc = agent["securityContext"]
    assert csc["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
    assert csc["allowPrivilegeEscalation"] is False and csc["runAsNonRoot"] is True
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_pod_extension_points_default_to_nothing(render):
    for kind in ("job", "statefulset"):
        r = render({"workers": {"kind": kind}})
        pod, agent = r.pod_spec(), r.agent()
        for key in ("runtimeClassName", "initContainers", "schedulerName"):
            assert key not in pod, key
        assert "envFrom" not in agent
        assert {v["name"] for v in pod["volumes"]} == {"shm", "tmp", "checkpoints"}


def test_container_security_context_replaces_key_by_key(render):
    # A key replaces the chart's, false included (a merge that skips false
    # would keep runAsNonRoot true and the pod could not run as root);
    # capabilities.drop replaces the chart's drop list.
    r = render({"workers": {"readOnlyRootFilesystem": False, "containerSecurityContext": {
        "runAsNonRoot": False, "runAsUser": 0,
        "capabilities": {"add": ["IPC_LOCK", "SYS_RESOURCE"], "drop": ["NET_RAW"]}}}})
    csc = r.agent()["securityContext"]
    assert csc["runAsNonRoot"] is False and csc["runAsUser"] == 0
    assert csc["capabilities"] == {"add": ["IPC_LOCK", "SYS_RESOURCE"], "drop": ["NET_RAW"]}
    assert csc["readOnlyRootFilesystem"] is False
    assert csc["privileged"] is False
    # The etcd containers keep the chart's own.
    etcd = r.one("StatefulSet", "-etcd")["spec"]["template"]["spec"]["containers"][0]
    assert etcd["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert etcd["securityContext"]["runAsNonRoot"] is True


def _assert_hardened(pod_spec, container):
    psc = pod_spec["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["runAsUser"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    csc = container["securityContext"]
    assert csc["runAsNonRoot"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["privileged"] is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod_spec["automountServiceAccountToken"] is False


def test_security_context(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    worker = r.workers()["spec"]["template"]["spec"]
    _assert_hardened(worker, r.agent())
    assert r.agent()["securityContext"]["readOnlyRootFilesystem"] is True
    # A read-only root needs a writable /tmp.
    assert by_name(r.agent()["volumeMounts"])["tmp"]["mountPath"] == "/tmp"
    etcd = r.one("StatefulSet", "-etcd")["spec"]["template"]["spec"]
    _assert_hardened(etcd, etcd["containers"][0])
    assert etcd["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    test_pod = render().one("Pod", "-test-rendezvous")["spec"]
    _assert_hardened(test_pod, test_pod["containers"][0])


def test_service_account(render):
    r = render()
    sa = r.one("ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    assert r.workers()["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    r = render({"serviceAccount": {"create": False, "name": "shared"}})
    assert not r.of_kind("ServiceAccount")
    assert r.workers()["spec"]["template"]["spec"]["serviceAccountName"] == "shared"


def test_pdb_defaults_to_min_nodes(render):
    r = render(JOBS / "fashion-mnist-gpu.yaml")
    pdb = r.one("PodDisruptionBudget", "-worker")
    assert pdb["spec"] == {"minAvailable": 2, "selector": pdb["spec"]["selector"]}
    assert not render({"podDisruptionBudget": {"enabled": False}}).of_kind("PodDisruptionBudget")


def test_checkpoint_shared_claim(render):
    r = render(JOBS / "fashion-mnist-gpu.yaml")
    pvc = r.one("PersistentVolumeClaim", "-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "shared-rwx"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    vol = by_name(r.workers()["spec"]["template"]["spec"]["volumes"])["checkpoints"]
    assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert by_name(r.agent()["volumeMounts"])["checkpoints"]["mountPath"] == "/checkpoints"


def test_checkpoint_existing_claim(render):
    r = render(CI / "external-etcd-tls.yaml")
    assert not r.of_kind("PersistentVolumeClaim")
    vol = by_name(r.workers()["spec"]["template"]["spec"]["volumes"])["checkpoints"]
    assert vol == {"name": "checkpoints",
                   "persistentVolumeClaim": {"claimName": "shared-checkpoints"}}


def test_checkpoint_per_pod(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    assert not r.of_kind("PersistentVolumeClaim")
    (claim,) = r.workers()["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "checkpoints"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert "checkpoints" not in by_name(r.workers()["spec"]["template"]["spec"]["volumes"])


def test_checkpoint_disabled_is_emptydir(render):
    r = render(CI / "cpu-1-node.yaml")
    vol = by_name(r.workers()["spec"]["template"]["spec"]["volumes"])["checkpoints"]
    assert vol == {"name": "checkpoints", "emptyDir": {}}
    # etcd without persistence keeps its data in an emptyDir.
    etcd = r.one("StatefulSet", "-etcd")
    assert "volumeClaimTemplates" not in etcd["spec"]
    assert by_name(etcd["spec"]["template"]["spec"]["volumes"])["data"] == {
        "name": "data", "emptyDir": {}}


def test_nccl_env_only_when_set(render):
    env = render().env()
    assert not [k for k in env if k.startswith("NCCL_")]
    env = render(CI / "gpu-3-etcd-members.yaml").env()
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_HCA"] == "mlx5"
    assert env["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert env["NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "NCCL_DEBUG" not in env and "NCCL_IB_DISABLE" not in env
    env = render(CI / "hostnetwork.yaml").env()
    assert env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert render({"nccl": {"debug": "INFO", "ibDisable": False}}).env()["NCCL_IB_DISABLE"] == "0"


def test_scheduling_from_values(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    spec = r.workers()["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "podAntiAffinity" in spec["affinity"]
    assert spec["priorityClassName"] == "training"
    # The default etcd of 3 spreads its members over hosts.
    etcd = r.one("StatefulSet", "-etcd")["spec"]["template"]["spec"]
    assert "podAntiAffinity" in etcd["affinity"]


def test_host_network(render):
    r = render(CI / "hostnetwork.yaml")
    spec = r.workers()["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert r.agent()["image"] == ("registry.example.com:5000/ml/ductile@sha256:"
                                  "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
    spec = render().workers()["spec"]["template"]["spec"]
    assert "hostNetwork" not in spec and "dnsPolicy" not in spec


def test_image_tag_defaults_to_app_version(render, chart):
    assert render().agent()["image"] == f"ductile/ductile:{chart.metadata['appVersion']}"
    assert render(CI / "cpu-1-node.yaml").agent()["image"] == "ductile/ductile:0.1.0-cpu"


def test_network_policy(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    workers = r.one("NetworkPolicy", "-worker")
    sel = r.workers()["spec"]["selector"]["matchLabels"]
    assert workers["spec"]["podSelector"]["matchLabels"] == sel
    assert workers["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == sel
    assert workers["spec"]["ingress"][1]["ports"] == [{"port": "http", "protocol": "TCP"}]
    etcd = r.one("NetworkPolicy", "-etcd")
    client = etcd["spec"]["ingress"][0]
    assert client["ports"] == [{"port": "client", "protocol": "TCP"}]
    # Workers (and the test pod) carry the labels the etcd policy admits.
    pod_labels = r.workers()["spec"]["template"]["metadata"]["labels"]
    for k, v in client["from"][0]["podSelector"]["matchLabels"].items():
        assert pod_labels[k] == v
    assert not render().of_kind("NetworkPolicy")


def test_service_monitor(render):
    r = render(CI / "gpu-3-etcd-members.yaml")
    sm = r.one("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert not render().of_kind("ServiceMonitor")


@pytest.mark.parametrize("job,backend", [("pytorch-script.yaml", "gloo"),
                                         ("pytorch-cuda.yaml", "nccl")])
def test_pytorch_script_from_configmap(render, job, backend):
    r = render(JOBS / job)
    cm = r.one("ConfigMap", "-script")
    script = cm["data"]["train.py"]
    assert f'init_process_group("{backend}", init_method="env://"' in script
    compile(script, "train.py", "exec")  # the shipped script is valid Python
    assert by_name(r.agent()["volumeMounts"])["script"] == {
        "name": "script", "mountPath": "/opt/ductile/job", "readOnly": True}
    vol = by_name(r.workers()["spec"]["template"]["spec"]["volumes"])["script"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert r.agent()["args"][1:3] == ["python3", "/opt/ductile/job/train.py"]
    env = r.env()
    assert env["DUCTILE_REBUILD"] == "restart"
    assert env["HOME"] == "/tmp"
    # A new script rolls the pods.
    ann = r.workers()["spec"]["template"]["metadata"]["annotations"]
    other = render({"job": {"command": ["python3", "/opt/ductile/job/train.py"],
                            "script": {"content": "print(2)"}}})
    assert other.workers()["spec"]["template"]["metadata"]["annotations"]["checksum/script"] != \
        ann["checksum/script"]


def test_pytorch_cuda_job_runs_a_script_per_gpu(render):
    r = render(JOBS / "pytorch-cuda.yaml")
    assert r.agent()["image"].endswith(":0.1.0-pytorch-cuda")
    assert r.agent()["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert r.env()["DUCTILE_NPROC_PER_NODE"] == "8"
    # Each process takes the GPU of its LOCAL_RANK, which the agent sets.
    script = r.one("ConfigMap", "-script")["data"]["train.py"]
    assert 'os.environ["LOCAL_RANK"]' in script and "torch.cuda.set_device" in script


def test_notes_tell_watch_scale_remove(render):
    r = render(JOBS / "fashion-mnist-gpu.yaml", name="fmnist")
    notes = r.notes
    assert f"kubectl -n {NAMESPACE} get pods -l app.kubernetes.io/instance=fmnist" in notes
    assert f"kubectl -n {NAMESPACE} get job/fmnist-ductile-worker -w" in notes
    assert "--set workers.replicas=N" in notes
    assert (f"kubectl -n {NAMESPACE} patch job/fmnist-ductile-worker --type=merge "
            """-p '{"spec":{"parallelism":N,"completions":N}}'""") in notes
    assert (f"kubectl -n {NAMESPACE} wait --for=condition=complete job/fmnist-ductile-worker"
            in notes)
    assert f"kubectl -n {NAMESPACE} exec job/fmnist-ductile-worker -- ductile-agent status" in notes
    assert "statefulset" not in notes
    assert f"helm -n {NAMESPACE} uninstall fmnist" in notes
    assert f"helm -n {NAMESPACE} test fmnist" in notes
    assert "between 2 and 8" in notes


def test_notes_of_the_statefulset_kind(render):
    values = load_values(JOBS / "fashion-mnist-gpu.yaml")
    values["workers"]["kind"] = "statefulset"
    notes = render(values, name="fmnist").notes
    assert f"kubectl -n {NAMESPACE} scale statefulset/fmnist-ductile-worker --replicas=N" in notes
    assert f"kubectl -n {NAMESPACE} exec fmnist-ductile-worker-0 -- ductile-agent status" in notes
    assert "patch job" not in notes and "condition=complete" not in notes
    assert f"helm -n {NAMESPACE} uninstall fmnist" in notes


def test_long_release_name_keeps_pod_names_valid(render):
    name = "a" * 53  # Helm's longest release name
    r = render({"job": {"name": "long"}}, name=name)
    workers = r.workers()["metadata"]["name"]
    # A pod's host name, <job>-<index> (or <statefulset>-<ordinal>), must
    # stay a DNS label, with room for 4 digits.
    assert len(workers) + 5 <= 63


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "ductile"
    assert pathlib.Path(CHART_DIR / "values.schema.json").is_file()
    assert chart.schema["additionalProperties"] is False


# ---- monitoring: the Grafana dashboard and the PrometheusRule ----

AGENT_HTTP = SOURCE / "agent" / "http.c"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "offset", "bool", "inf", "nan"}


def exported_metrics():
    """Every metric name the agent's /metrics declares (its # TYPE lines in agent/http.c)."""
    found = dict(re.findall(r"# TYPE (ductile_[a-z0-9_]+) (counter|gauge)", AGENT_HTTP.read_text()))
    assert len(found) >= 10, "no metrics found in agent/http.c"
    return found


def promql_metrics(expr):
    """The metric names an expression reads: its identifiers less label matchers,
    strings, ranges, grouping clauses, functions and keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", e):
        if m.group(2) or m.group(1).lower() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(1))
    return names


def check_exprs(exprs, exported):
    assert exprs
    for expr in exprs:
        names = promql_metrics(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - set(exported)
        assert not unknown, f"{expr!r} names metrics the agent does not export: {unknown}"


def test_metric_names_follow_prometheus_conventions():
    for name, kind in exported_metrics().items():
        assert name.endswith("_total") == (kind == "counter"), name
    for name in ["ductile_worker_samples_total", "ductile_worker_samples_per_second",
                 "ductile_worker_loss", "ductile_worker_last_step_timestamp_seconds",
                 "ductile_worker_step"]:
        assert name in exported_metrics(), name


def test_metric_check_catches_an_unknown_name():
    exported = exported_metrics()
    assert promql_metrics('sum by (rank) (rate(ductile_worker_samples_total{job="x"}[5m]))') == \
        {"ductile_worker_samples_total"}
    with pytest.raises(AssertionError, match="ductile_worker_sample_total"):
        check_exprs(["sum(rate(ductile_worker_sample_total[5m]))"], exported)
    with pytest.raises(AssertionError, match="up"):
        check_exprs(["max(up) and on (job) ductile_round"], exported)


def test_monitoring_off_by_default(render):
    r = render()
    assert not r.of_kind("PrometheusRule")
    assert not [c for c in r.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]


def test_dashboard_configmap(render):
    r = render(CI / "monitoring.yaml")
    cm = r.one("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "training"}
    dash = json.loads(cm["data"]["ductile.json"])
    assert dash["uid"] and dash["title"] and dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    check_exprs(exprs, exported_metrics())
    # Every panel reads one job: the namespace and scrape job variables.
    for expr in exprs:
        assert 'namespace="$namespace"' in expr and 'job="$job"' in expr, expr
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "job"} <= names
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # The progress the agent exports is on it.
    shown = set().union(*(promql_metrics(e) for e in exprs))
    assert {"ductile_worker_samples_per_second", "ductile_worker_loss",
            "ductile_worker_last_step_timestamp_seconds", "ductile_worker_step",
            "ductile_restarts_total"} <= shown


def test_prometheus_rule_alerts(render):
    r = render(CI / "monitoring.yaml")
    rule = r.one("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    rules = {x["alert"]: x for g in rule["spec"]["groups"] for x in g["rules"]}
    assert set(rules) == {"DuctileNoProgress", "DuctileRestartsClimbing", "DuctileJobFailing"}
    check_exprs([x["expr"] for x in rules.values()], exported_metrics())
    # Thresholds from the values; every rule reads this release's pods alone.
    assert rules["DuctileNoProgress"]["expr"].endswith("> 1200")
    assert "ductile_worker_last_step_timestamp_seconds" in rules["DuctileNoProgress"]["expr"]
    assert "offset 1h" in rules["DuctileRestartsClimbing"]["expr"]
    assert rules["DuctileRestartsClimbing"]["expr"].endswith(">= 2")
    assert rules["DuctileJobFailing"]["expr"].endswith(">= 3")  # job.maxRestarts' default
    service = r.one("Service", "-worker")["metadata"]["name"]
    for x in rules.values():
        assert f'namespace="{NAMESPACE}", job="{service}"' in x["expr"], x["expr"]
        assert x["labels"]["severity"]
        # Alertmanager templates reach the rule unrendered by Helm.
        assert "{{ $labels.job }}" in x["annotations"]["description"]
    # With no restart budget there is no budget to warn about.
    r = render({"monitoring": {"prometheusRule": {"enabled": True}}, "job": {"maxRestarts": 0}})
    alerts = [x["alert"] for g in r.one("PrometheusRule")["spec"]["groups"] for x in g["rules"]]
    assert alerts == ["DuctileNoProgress", "DuctileRestartsClimbing"]


def test_events_rbac_and_env(render):
    r = render(CI / "monitoring.yaml")
    role = r.one("Role", "-events")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    binding = r.one("RoleBinding", "-events")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    spec = r.pod_spec()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert spec["automountServiceAccountToken"] is True
    env = r.env()
    assert env["DUCTILE_K8S_EVENTS"] == "true"
    assert env["DUCTILE_K8S_JOB_NAME"] == r.workers()["metadata"]["name"]
    assert env["DUCTILE_K8S_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["DUCTILE_K8S_JOB_UID"] == {
        "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}


def test_events_off_by_default(render):
    r = render()
    assert not r.of_kind("Role") and not r.of_kind("RoleBinding")
    assert r.pod_spec()["automountServiceAccountToken"] is False
    assert not [k for k in r.env() if k.startswith("DUCTILE_K8S_")]
