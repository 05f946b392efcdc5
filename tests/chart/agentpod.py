"""agentpod: the rendered agent container run here, for the chart's agent tests.

What test_agent_contract.py and test_indexed_job.py share: the real agent,
test worker and etcd that ctest names (AGENT, WORKER, ETCD, and NEEDS_AGENT,
the mark that skips the tests without them when run by hand), a container's
environment as the kubelet would set it (pod_env, configmaps_of), running a
command (run), waiting with a deadline (wait_until), the node ids etcd
holds (live_nodes), and a one-node job run to its end (run_one_node_job).
"""

import os
import subprocess
import time

import pytest

from testlib import free_port

AGENT = os.environ.get("DUCTILE_AGENT_BIN")
WORKER = os.environ.get("DUCTILE_TEST_WORKER")
ETCD = os.environ.get("DUCTILE_TEST_ETCD")

# Run by hand without them, the tests skip; under ctest (DUCTILE_CTEST set)
# a missing one is a failure, never a silent skip.
NEEDS_AGENT = pytest.mark.skipif(
    not (AGENT and ETCD and WORKER) and not os.environ.get("DUCTILE_CTEST"),
    reason="needs DUCTILE_AGENT_BIN, DUCTILE_TEST_WORKER and a with-etcd etcd (ctest sets them)")

INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

# Correctness bounds, not speed: each is far above what the step takes.
DEADLINE = 90


def pod_env(container, overrides, pod_name="demo-ductile-worker-0", index=None, secrets=None,
            configmaps=None):
    """The container's env as the kubelet would set it, plus overrides;
    secrets and configmaps (configmaps_of) map (name, key) to the value a
    secretKeyRef or configMapKeyRef reads."""
    env = {"PATH": os.path.dirname(AGENT) + os.pathsep + os.environ["PATH"]}
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
        if k in os.environ:
            env[k] = os.environ[k]
    fields = {"metadata.name": pod_name, "metadata.namespace": "ml",
              "status.podIP": "127.0.0.1"}
    if index is not None:
        fields[INDEX_ANNOTATION] = str(index)
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e.get("valueFrom", {}) and secrets:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        elif "configMapKeyRef" in e.get("valueFrom", {}) and configmaps:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = configmaps[(ref["name"], ref["key"])]
        else:
            pytest.fail(f"env {e['name']} comes from {e['valueFrom']}: not set up here")
    if index is not None:
        # What the Job controller adds to every container of an Indexed Job.
        env["JOB_COMPLETION_INDEX"] = str(index)
    env.update(overrides)
    return env


def configmaps_of(rendered):
    """What the rendered ConfigMaps hold, by (name, key): the install id."""
    return {(cm["metadata"]["name"], k): v for cm in rendered.of_kind("ConfigMap")
            for k, v in (cm.get("data") or {}).items()}


def run(args, env, timeout=60):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def wait_until(pred, what, tick=None, deadline=DEADLINE):
    """pred()'s first answer that is neither None nor False."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if tick:
            tick()
        got = pred()
        if got is not None and got is not False:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def live_nodes(job_id):
    """The node ids registered (alive) in job_id, from `ductile-agent status`."""
    proc = run([AGENT, "status", "--rdzv-endpoint", ETCD, "--rdzv-id", job_id],
               dict(os.environ))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("live nodes")), None)
    return set(line.split(":", 1)[1].split()) if line else set()


def run_one_node_job(render, name, rendered=None, **job):
    """Renders a one-node CPU job (or takes `rendered`, one such render) and
    runs its agent (worker: `true`) to the end."""
    assert AGENT and ETCD, "DUCTILE_AGENT_BIN or DUCTILE_TEST_ETCD not set"
    r = rendered or render({"job": {"name": name, "command": ["true"], "lastCall": 1, **job}})
    container = r.agent()
    env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD,
                              "DUCTILE_HTTP_PORT": str(free_port())},
                  configmaps=configmaps_of(r))
    assert env["DUCTILE_NODE_ADDR"] == "127.0.0.1"  # from status.podIP
    proc = run(container["command"] + container["args"], env)
    return r, proc
