"""A job's life across releases: its id in etcd, the pre-install check, the
release's own pods in its scheduling rules.

- The rendezvous id is <namespace>-<job name>: two releases of one job name
  in two namespaces never share keys on one etcd.
- With an existing etcd, a pre-install hook Job asks etcd whether the id
  belongs to a job that ended, and fails the install naming the id and
  job.startOver; with job.startOver it runs `ductile-agent reset` instead.
  The hook's script runs against the real agent and etcd in
  test_agent_contract.py.
- A worker affinity's strings are templates, so a job file selects its own
  release's pods whatever the release is called.
- Each install has an id, made once and kept across upgrades (lookup), in
  a ConfigMap every agent reads (DUCTILE_INSTALL_ID): with the chart's
  etcd kept across installs, agents refuse a job an earlier install ended,
  and job.startOver (DUCTILE_START_OVER) has them train it again. The
  agents' side runs against the real agent and etcd in
  test_agent_contract.py.
"""

import re
import shutil

import pytest

from conftest import CI_VALUES, EXAMPLE_JOBS, NAMESPACE, SOURCE, load_values, with_values

EXTERNAL = {"etcd": {"enabled": False,
                     "external": {"endpoints": ["http://etcd.infra.svc:2379"]}}}


def rdzv_id(rendered):
    return rendered.env()["DUCTILE_RDZV_ID"]


def test_rdzv_id_carries_the_namespace(render):
    assert rdzv_id(render({})) == f"{NAMESPACE}-demo"
    assert rdzv_id(render({"job": {"name": "train"}})) == f"{NAMESPACE}-train"
    # The helm test pod and the NOTES name the same id.
    r = render({"job": {"name": "train"}})
    test_pod = r.one("Pod", "-test-rendezvous")["spec"]["containers"][0]
    assert r.env(test_pod)["DUCTILE_RDZV_ID"] == f"{NAMESPACE}-train"
    assert f"--rdzv-id {NAMESPACE}-train" in r.notes


def test_two_namespaces_two_ids(render):
    a = render(EXTERNAL, namespace="team-a")
    b = render(EXTERNAL, namespace="team-b")
    assert rdzv_id(a) == "team-a-demo" and rdzv_id(b) == "team-b-demo"
    assert rdzv_id(a) != rdzv_id(b)


def test_rdzv_id_too_long_is_one_line_naming_job_name(chart):
    import helm_python as helm
    values = {"job": {"name": "j" * 60}}
    chart.validate_schema(values)  # a valid job name on its own...
    with pytest.raises(helm.HelmRenderError) as err:  # ...too long with the namespace
        chart.render(values, name="demo", namespace="training")
    message = str(err.value)
    assert "job.name" in message and "more than 63" in message
    assert f'"training-{"j" * 60}"' in message


def check_job(rendered):
    return rendered.one("Job", "-check")


def check_script(rendered):
    return check_job(rendered)["spec"]["template"]["spec"]["containers"][0]["command"][2]


def test_no_check_with_the_charts_own_etcd(render):
    # Its etcd does not exist yet when pre-install hooks run.
    assert not [j for j in render({}).of_kind("Job") if j["metadata"]["name"].endswith("-check")]


def test_check_hook_with_an_existing_etcd(render):
    r = render(EXTERNAL)
    job = check_job(r)
    meta = job["metadata"]
    assert meta["annotations"]["helm.sh/hook"] == "pre-install"
    assert "hook-succeeded" in meta["annotations"]["helm.sh/hook-delete-policy"]
    assert job in r.hooks  # never a release object
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    # The release's ServiceAccount does not exist yet before install.
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    c = pod["containers"][0]
    assert c["image"] == r.agent()["image"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = r.env(c)
    assert env["DUCTILE_RDZV_ID"] == f"{NAMESPACE}-demo"
    assert env["DUCTILE_RDZV_ENDPOINT"] == "http://etcd.infra.svc:2379"
    script = check_script(r)
    assert "ductile-agent status" in script and "job.startOver=true" in script
    assert "ductile-agent reset" not in script


def test_start_over_resets_instead(render):
    script = check_script(render(with_values(EXTERNAL, {"job": {"startOver": True}})))
    assert "ductile-agent reset" in script and "ductile-agent status" not in script


def test_check_hook_gets_tls_and_credentials(render):
    r = render(SOURCE / "charts" / "ductile" / "ci" / "external-etcd-tls.yaml")
    job = check_job(r)
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = r.env(c)
    agent_env = r.env()
    for k in ("DUCTILE_ETCD_CACERT", "DUCTILE_ETCD_CERT", "DUCTILE_ETCD_KEY",
              "DUCTILE_ETCD_USER", "DUCTILE_ETCD_PASSWORD", "DUCTILE_RDZV_ENDPOINT"):
        assert env[k] == agent_env[k], k
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == set(volumes)
    assert env["DUCTILE_ETCD_CACERT"].startswith(mounts["etcd-tls"] + "/")


# ---- the release's own pods in the workers' affinity ----

FILES = CI_VALUES + EXAMPLE_JOBS


def selectors(affinity):
    for kind in ("podAntiAffinity", "podAffinity"):
        a = (affinity or {}).get(kind) or {}
        for term in a.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
            yield term
        for w in a.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
            yield w["podAffinityTerm"]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
@pytest.mark.parametrize("release", ["fmnist", "fmnist-gpu", "demo"])
def test_affinity_selects_the_releases_own_workers(render, path, release):
    """An affinity term that names a release selects this release's workers,
    whatever the release is called (the README installs fmnist-gpu.yaml as
    release fmnist)."""
    values = load_values(path)
    r = render(values, name=release)
    pod = r.workers()["spec"]["template"]
    labels = pod["metadata"]["labels"]
    for term in selectors(pod["spec"].get("affinity")):
        match = (term.get("labelSelector") or {}).get("matchLabels") or {}
        if "app.kubernetes.io/instance" in match:
            assert match["app.kubernetes.io/instance"] == release, term
        if match.get("app.kubernetes.io/component") == "worker":
            assert all(labels.get(k) == v for k, v in match.items()), \
                f"{match} selects none of the release's workers ({labels})"


def test_the_gpu_example_spreads_its_own_workers(render):
    r = render(SOURCE / "examples" / "jobs" / "fashion-mnist-gpu.yaml", name="fmnist")
    terms = list(selectors(r.pod_spec()["affinity"]))
    assert terms and terms[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] \
        == "fmnist"


# ---- the chart's own etcd: 1 or 3 members, TLS from a made or given Secret ----

TLS_CASES = [(n, given) for n in (1, 3) for given in ("", "my-etcd-certs")]


@pytest.mark.parametrize("replicas,given", TLS_CASES,
                         ids=[f"{n}-members-{'given' if g else 'made'}" for n, g in TLS_CASES])
def test_etcd_tls(render, replicas, given):
    import base64
    import subprocess
    r = render({"etcd": {"replicas": replicas, "tls": {"enabled": True, "secretName": given}}})
    sts = r.one("StatefulSet", "-etcd")
    pod = sts["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    flags = dict(a.split("=", 1) for a in args)
    for k in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
              "--initial-advertise-peer-urls"):
        assert flags[k].startswith("https://"), (k, flags[k])
    assert flags["--client-cert-auth"] == "true" and flags["--peer-client-cert-auth"] == "true"
    peers = flags["--initial-cluster"].split(",")
    assert len(peers) == replicas and all("=https://" in p for p in peers)
    secret_name = given or "demo-ductile-etcd-tls"
    assert {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"] == secret_name
    # Every client (agents, the helm test pod) gets https endpoints and the files.
    env = r.env()
    assert env["DUCTILE_RDZV_ENDPOINT"].count("https://") == replicas
    worker_volumes = {v["name"]: v for v in r.pod_spec()["volumes"]}
    assert worker_volumes["etcd-tls"]["secret"]["secretName"] == secret_name
    assert env["DUCTILE_ETCD_CACERT"] == "/etc/ductile/etcd-tls/ca.crt"
    assert env["DUCTILE_ETCD_CERT"] == "/etc/ductile/etcd-tls/tls.crt"
    assert env["DUCTILE_ETCD_KEY"] == "/etc/ductile/etcd-tls/tls.key"
    test_pod = r.one("Pod", "-test-rendezvous")
    assert r.env(test_pod["spec"]["containers"][0])["DUCTILE_ETCD_CERT"] == env["DUCTILE_ETCD_CERT"]
    secrets = [s for s in r.of_kind("Secret") if s["metadata"]["name"].endswith("-etcd-tls")]
    if given:
        assert not secrets  # the user's own
        return
    # The made certificate names every member and is signed by the made CA.
    data = {k: base64.b64decode(v).decode() for k, v in secrets[0]["data"].items()}
    assert set(data) == {"ca.crt", "tls.crt", "tls.key"}
    text = subprocess.run(["openssl", "x509", "-noout", "-text"], input=data["tls.crt"],
                          capture_output=True, text=True, check=True).stdout
    for i in range(replicas):
        assert f"DNS:demo-ductile-etcd-{i}.demo-ductile-etcd-peer.{NAMESPACE}.svc.cluster.local" \
            in text
    assert "TLS Web Server Authentication" in text and "TLS Web Client Authentication" in text
    for host in env["DUCTILE_RDZV_ENDPOINT"].split(","):
        assert host.split("//")[1].split(":")[0] in text


def test_etcd_plain_by_default(render):
    r = render({"etcd": {"replicas": 3}})
    assert r.env()["DUCTILE_RDZV_ENDPOINT"].count("http://") == 3
    assert "DUCTILE_ETCD_CERT" not in r.env()
    assert not r.of_kind("Secret")


AUTH_CASES = [(n, tls, given) for n in (1, 3) for tls in (False, True) for given in ("", "pw")]


@pytest.mark.parametrize("replicas,tls,given", AUTH_CASES,
                         ids=[f"{n}-members{'-tls' if t else ''}-{'given' if g else 'made'}"
                              for n, t, g in AUTH_CASES])
def test_etcd_auth(render, replicas, tls, given):
    r = render({"etcd": {"replicas": replicas, "tls": {"enabled": tls},
                         "auth": {"enabled": True, "secretName": given}}})
    secret_name = given or "demo-ductile-etcd-auth"
    made = [s for s in r.of_kind("Secret") if s["metadata"]["name"].endswith("-etcd-auth")]
    assert bool(made) != bool(given)
    ref = {"secretKeyRef": {"name": secret_name, "key": "password"}}
    # The agents, the helm test pod and the hook's etcdctl all get the password.
    assert r.env()["DUCTILE_ETCD_USER"] == "root"
    assert r.env()["DUCTILE_ETCD_PASSWORD"] == ref
    test_pod = r.one("Pod", "-test-rendezvous")["spec"]["containers"][0]
    assert r.env(test_pod)["DUCTILE_ETCD_PASSWORD"] == ref
    hook = r.one("Job", "-etcd-auth")
    assert hook in r.hooks and hook["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
    spec = hook["spec"]["template"]["spec"]
    # No selector of the members (StatefulSet, Services) matches the hook's pod.
    labels = hook["spec"]["template"]["metadata"]["labels"]
    members = r.one("StatefulSet", "-etcd")["spec"]["selector"]["matchLabels"]
    assert any(labels.get(k) != v for k, v in members.items())
    steps = [c["args"] for c in spec["initContainers"] + spec["containers"]]
    assert steps[0][:3] == ["user", "add", "root"] and steps[-1] == ["auth", "enable"]
    for c in spec["initContainers"] + spec["containers"]:
        env = r.env(c)
        assert c["image"].startswith("quay.io/coreos/etcd:")
        assert env["ETCD_ROOT_PASSWORD"] == ref
        assert env["ETCDCTL_ENDPOINTS"] == r.env()["DUCTILE_RDZV_ENDPOINT"]
        assert env["ETCDCTL_ENDPOINTS"].count("https://" if tls else "http://") == replicas
        assert ("ETCDCTL_CERT" in env) == tls
        if tls:
            mounts = {m["name"] for m in c["volumeMounts"]}
            assert mounts == {v["name"] for v in spec["volumes"]}


def test_made_auth_password_is_random(render):
    import base64
    pw = [base64.b64decode(render({"etcd": {"auth": {"enabled": True}}})
                           .one("Secret", "-etcd-auth")["data"]["password"]) for _ in range(2)]
    assert len(pw[0]) == 32 and pw[0] != pw[1]


def test_no_auth_by_default(render):
    r = render({})
    assert "DUCTILE_ETCD_USER" not in r.env() and "DUCTILE_ETCD_PASSWORD" not in r.env()
    assert not [j for j in r.of_kind("Job") if j["metadata"]["name"].endswith("-etcd-auth")]


BAD_ETCD = [
    ("auth-secret-without-auth", {"etcd": {"auth": {"secretName": "pw"}}},
     "etcd.auth.secretName"),
    ("auth-on-external", {"etcd": {"enabled": False, "auth": {"enabled": True},
                                   "external": {"endpoints": ["http://etcd:2379"]}}},
     "etcd.auth.enabled"),
    ("auth-typo", {"etcd": {"auth": {"user": "root"}}}, "/etcd/auth"),
    ("two-members", {"etcd": {"replicas": 2}}, "/etcd/replicas"),
    ("tls-secret-without-tls", {"etcd": {"tls": {"secretName": "certs"}}},
     "etcd.tls.secretName"),
    ("tls-on-external", {"etcd": {"enabled": False, "tls": {"enabled": True},
                                  "external": {"endpoints": ["http://etcd:2379"]}}},
     "etcd.tls.enabled"),
    ("tls-secret-bad-name", {"etcd": {"tls": {"enabled": True, "secretName": "Certs_1"}}},
     "/etcd/tls/secretName"),
    ("tls-typo", {"etcd": {"tls": {"enable": True}}}, "/etcd/tls"),
]


@pytest.mark.parametrize("values,key", [b[1:] for b in BAD_ETCD], ids=[b[0] for b in BAD_ETCD])
def test_bad_etcd_values_are_one_line_naming_the_key(chart, values, key):
    import helm_python as helm
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        chart.render(values, name="demo")
    message = str(err.value).strip()
    assert key in message, message
    assert len(message.splitlines()) == 1 or key in message.splitlines()[-1], message


# ---- the chart's etcd volumes go with the release unless kept ----

@pytest.mark.parametrize("keep,policy", [(None, "Delete"), (False, "Delete"), (True, "Retain")])
def test_etcd_volumes_go_with_the_release(render, keep, policy):
    persistence = {} if keep is None else {"keepOnUninstall": keep}
    r = render({"etcd": {"persistence": persistence}})
    spec = r.one("StatefulSet", "-etcd")["spec"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": policy,
                                                            "whenScaled": "Retain"}
    # NOTES say to delete the volumes by hand only when they are kept.
    assert ("component=etcd" in r.notes) == (policy == "Retain")


def test_no_retention_policy_without_volumes(render):
    spec = render({"etcd": {"persistence": {"enabled": False}}}).one("StatefulSet", "-etcd")["spec"]
    assert "persistentVolumeClaimRetentionPolicy" not in spec and "volumeClaimTemplates" not in spec


# ---- the install id: one per install, kept across upgrades ----

def install_configmap(rendered):
    return rendered.one("ConfigMap", "-install")


@pytest.mark.parametrize("kind", ["job", "statefulset"])
def test_every_agent_reads_the_install_id_from_one_configmap(render, kind):
    r = render({"workers": {"kind": kind}})
    cm = install_configmap(r)
    assert cm["metadata"]["name"] == "demo-ductile-install"
    assert cm in r.objects  # a release object: it goes with the release
    assert re.fullmatch(r"[a-z0-9]{12}", cm["data"]["id"]), cm["data"]
    # From the ConfigMap, not a literal: the pod template (immutable in a
    # Job) stays the same whatever the id, and every pod reads the same one.
    ref = {"configMapKeyRef": {"name": "demo-ductile-install", "key": "id"}}
    assert r.env()["DUCTILE_INSTALL_ID"] == ref
    assert cm["data"]["id"] not in str(r.workers())


def test_install_id_is_made_anew_per_install(render):
    ids = {install_configmap(render({}))["data"]["id"] for _ in range(3)}
    assert len(ids) == 3


def helper_chart(tmp_path, template):
    """A chart of the ductile chart's own helpers and one template: the
    install id's logic with the ConfigMap that lookup would find."""
    import helm_python as helm
    root = tmp_path / "helpers"
    (root / "templates").mkdir(parents=True)
    (root / "Chart.yaml").write_text("apiVersion: v2\nname: helpers\nversion: 0.1.0\n")
    shutil.copy(SOURCE / "charts" / "ductile" / "templates" / "_helpers.tpl",
                root / "templates" / "_helpers.tpl")
    (root / "templates" / "id.yaml").write_text(template)
    with helm.Chart.load(str(root)) as c:
        return dict(c.render(None, name="demo", namespace=NAMESPACE, is_install=False))[
            "helpers/templates/id.yaml"]


def test_install_id_kept_when_lookup_finds_the_configmap(tmp_path):
    # What lookup returns: the live ConfigMap, or an empty map.
    kept = helper_chart(tmp_path, '''kept: {{ include "ductile.installIdOf" (dict "data" (dict "id" "k3v9x0q2m1ab")) }}
none: {{ include "ductile.installIdOf" dict }}
nodata: {{ include "ductile.installIdOf" (dict "kind" "ConfigMap") }}
''')
    got = dict(line.split(": ") for line in kept.strip().splitlines())
    assert got["kept"] == "k3v9x0q2m1ab"
    assert re.fullmatch(r"[a-z0-9]{12}", got["none"]) and re.fullmatch(r"[a-z0-9]{12}",
                                                                       got["nodata"])
    # The template looks up its own ConfigMap by the name the agents read.
    text = (SOURCE / "charts" / "ductile" / "templates" / "install-configmap.yaml").read_text()
    assert 'lookup "v1" "ConfigMap" .Release.Namespace $name' in text
    assert 'include "ductile.installIdOf" $live' in text


@pytest.mark.parametrize("values", [{}, EXTERNAL])
def test_start_over_reaches_the_agents(render, values):
    assert "DUCTILE_START_OVER" not in render(values).env()
    assert "DUCTILE_START_OVER" not in render(with_values(values, {"job": {"startOver": False}})).env()
    r = render(with_values(values, {"job": {"startOver": True}}))
    assert r.env()["DUCTILE_START_OVER"] == "true"
