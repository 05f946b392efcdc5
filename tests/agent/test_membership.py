"""test_membership.py: rounds as nodes come and go.

The workers' environment and a job's finish; a pod lost (SIGKILL) and found
by the sentinels, by its peers' workers or by its lease's end; a node
added, a hot spare taking a lost node's place, a node leaving (SIGTERM,
--leave-exit-code); an agent no round takes within --join-timeout; and
--standalone with its private etcd. None of it is counted as a restart.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import agentkit as kit
from agentkit import ETCD, FAST, SENTINEL_OFF, job_restarts, workers_of
from testlib import check, wait_for



def case_env_and_finish(job):
    job.flags += FAST + ["--nnodes", "3", "--nproc-per-node", "2", "--max-restarts", "7"]
    a = job.start("node-a")
    b = job.start("node-b", env={"OMP_NUM_THREADS": "4"})
    # Flags from DUCTILE_* variables; the command line wins over them.
    c = job.start("node-c", env={"DUCTILE_LOG_FORMAT": "json", "DUCTILE_NPROC_PER_NODE": "5"})
    rnd = job.wait_round(6, 60)
    check(json.loads(c.log().splitlines()[0])["node"] == "node-c", "DUCTILE_LOG_FORMAT=json")
    ws = job.round_workers(rnd)
    check(sorted(int(w["RANK"]) for w in ws) == list(range(6)), "ranks 0..5")
    ports = {w["MASTER_PORT"] for w in ws}
    check(len(ports) == 1 and 0 < int(ports.pop()) < 65536, "one MASTER_PORT")
    by_group = {}
    for w in ws:
        rank, group = int(w["RANK"]), int(w["GROUP_RANK"])
        by_group.setdefault(group, []).append(w)
        expect = {
            "LOCAL_RANK": str(rank - 2 * group), "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "3", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "6",
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "7",
            "TORCHELASTIC_RUN_ID": job.name, "DUCTILE_ETCD_ENDPOINTS": ETCD,
            "DUCTILE_JOB": job.name, "DUCTILE_ROUND": str(rnd),
            "DUCTILE_STORE_PREFIX": "/ductile/%s/rounds/%d/store/" % (job.name, rnd),
            "DUCTILE_CONTROL_FD": "3", "TEST_CONTROL_FD_OPEN": "1",
            "DUCTILE_NODE_ADDR": "127.0.0.1",
        }
        for k, v in expect.items():
            check(w.get(k) == v, "rank %d: %s=%r, want %r" % (rank, k, w.get(k), v))
        want_omp = "4" if int(w["TEST_PPID"]) == b.proc.pid else "1"
        check(w.get("OMP_NUM_THREADS") == want_omp,
              "rank %d: OMP_NUM_THREADS=%r want %s" % (rank, w.get("OMP_NUM_THREADS"), want_omp))
    check(sorted(by_group) == [0, 1, 2], "group ranks 0..2")
    for g, gw in by_group.items():
        check(len({w["TEST_PPID"] for w in gw}) == 1, "group %d on one agent" % g)
    # Output is passed through with the global rank.
    wait_for(lambda: all("[%d] hello from rank %d" % (int(w["RANK"]), int(w["RANK"]))
                         in (a.out() + b.out() + c.out()) for w in ws), 10, "[rank] output")
    wait_for(lambda: "[0] stderr of rank 0" in a.log() + b.log() + c.log(), 10, "[rank] stderr")
    # All workers exit 0: the job is complete and every agent exits 0.
    job.command("all", "exit 0")
    for ag in (a, b, c):
        check(ag.wait_exit(30) == 0, "agent %s exit code" % ag.node)
    check("job complete" in a.log(), "a says job complete")
    os.unlink(os.path.join(job.dir, "cmd.all"))
    # An agent started after completion exits 0 at once, starting nothing.
    d = job.start("node-d")
    check(d.wait_exit(15) == 0, "late agent exit 0")
    check("complete" in d.log(), "late agent says complete: %s" % d.log())
    check(len(job.workers()) == 6, "late agent started no worker")


def kill_case(job, ttl, mesh, sentinel=True):
    # No restart budget: losing a pod is a membership change, not a failure.
    job.flags += ["--lease-ttl", str(ttl), "--last-call", "0.5", "--stop-grace", "2",
                  "--nnodes", "2:3", "--max-restarts", "0"]
    env = dict({"AGENT_TEST_MESH": "1"} if mesh else {}, **({} if sentinel else SENTINEL_OFF))
    if sentinel:
        env["DUCTILE_RDZV_DEBUG"] = "1"  # says when a sentinel watches a member
    a, b, c = (job.start(n, env=env) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    if sentinel:  # a member never seen answering is not judged: watch node-c first
        wait_for(lambda: all("watching member node-c" in x.log() for x in (a, b)), 30,
                 "node-a and node-b to watch node-c")
    time.sleep(0.5)
    t0 = time.monotonic()
    c.proc.kill()
    rnd2 = job.wait_round(2, ttl + 30, newer_than=rnd)
    took = time.monotonic() - t0
    ws = job.round_workers(rnd2)
    check({int(w["TEST_PPID"]) for w in ws} == {a.proc.pid, b.proc.pid},
          "the new round holds the survivors only")
    check(a.alive() and b.alive(), "survivors still running")
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "0" for w in ws), "no restart used")
    # ... and the job still finishes, every survivor exiting 0.
    job.command("all", "exit 0")
    for ag in (a, b):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))
    return took


def case_sigkill_pod(job):
    """A pod lost (its agent and worker SIGKILLed) under workers that never
    notice: the survivors' agents watch the dead one's agent (its probe
    connection closes with its process), find it gone and revoke its lease,
    and the new round forms long before its 30 s lease TTL, with no restart
    counted."""
    ttl = 30
    took = kill_case(job, ttl, mesh=False)
    # Half the TTL: the dead lease's last keep-alive came before the kill.
    check(took < ttl / 2, "new round after %.1f s; the lease TTL is %d s" % (took, ttl))
    logs = job.agents[0].log() + job.agents[1].log()
    check(re.search(r"member node-c is gone \(its agent's connection closed; .*\): its lease "
                    r"is revoked", logs), "a sentinel found node-c gone:\n" + logs)
    check("restart limit" not in logs and job_restarts(job) == 0, "no restart counted")


def case_sigkill_mesh(job):
    # A long TTL: the new round can only come this fast because the survivors'
    # workers saw their peer go and the failure ended the round.
    ttl = 30
    took = kill_case(job, ttl, mesh=True, sentinel=False)
    check(took < ttl, "new round after %.1f s, not before the %d s lease TTL" % (took, ttl))
    a = job.agents[0]
    check(re.search(r"round \d+ ended: peer lost on node-[ab]: worker rank \d+ lost a peer",
                    a.log() + job.agents[1].log()), "a lost peer logged as the cause")
    check("restart limit" not in a.log() + job.agents[1].log(), "no restart counted")


def case_sigkill_script(job):
    """A pod lost under workers that know nothing of the agent (a PyTorch
    script: its collective raises, it exits 1). Their agents ask whose loss
    it was: the dead pod's agent is gone (its probe refuses), so its lease is
    revoked, the exits are a lost peer, not a failure (--max-restarts 0 and
    the job goes on), and the survivors' round forms at once, long before
    the dead agent's 30 s lease would have ended."""
    ttl = 30
    job.flags += ["--lease-ttl", str(ttl), "--stop-grace", "2", "--nnodes", "2:3",
                  "--max-restarts", "0"]
    env = dict(SENTINEL_OFF, AGENT_TEST_MESH="1", AGENT_TEST_MESH_EXIT="1")
    a, b, c = (job.start(n, env=env) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    time.sleep(0.5)
    t0 = time.monotonic()
    # The pod's agent first (its workers die with it, PR_SET_PDEATHSIG): a
    # worker killed alone while its agent still answers is that node's own
    # failure, and the peers' exits then count too (the rule's limit).
    workers = workers_of(job, c)
    c.proc.kill()
    for w in workers:
        try:
            os.kill(w["_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    rnd2 = job.wait_round(2, ttl + 30, newer_than=rnd)
    took = time.monotonic() - t0
    check(took < ttl, "new round after %.1f s, not before the %d s lease TTL" % (took, ttl))
    ws = job.round_workers(rnd2)
    check({int(w["TEST_PPID"]) for w in ws} == {a.proc.pid, b.proc.pid},
          "the new round holds the survivors only")
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "0" for w in ws), "no restart used")
    logs = a.log() + b.log()
    check(re.search(r"member gone, lease revoked: node-c \(", logs), "node-c found gone: " + logs)
    check("the worker's exit was a lost peer" in logs, "an exit taken for a lost peer")
    check(a.alive() and b.alive(), "survivors still running")
    check(job_restarts(job) == 0, "no restart counted, got %s" % job_restarts(job))
    job.command("all", "exit 0")
    for ag in (a, b):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))


def case_sigkill_ttl(job):
    ttl = 3
    took = kill_case(job, ttl, mesh=False, sentinel=False)
    check(took < ttl + 20, "new round after %.1f s, TTL %d s" % (took, ttl))
    check("node-c lost" in job.agents[0].log(), "the cause names node-c: " + job.agents[0].log())


def case_scale_up_and_spare(job):
    job.flags += FAST + ["--nnodes", "2:3", "--max-restarts", "0"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    c = job.start("node-c")
    r2 = job.wait_round(3, 60, newer_than=r1)
    check(c.proc.pid in {int(w["TEST_PPID"]) for w in job.round_workers(r2)}, "c in round")
    check("waiting" in a.log(), "a logs the node waiting")
    d = job.start("node-d")
    wait_for(lambda: "spare" in d.log(), 30, "node-d waits as a hot spare")
    time.sleep(2)
    check(job.running_round(3) == r2, "a spare does not end a full round")
    check(not workers_of(job, d), "the spare runs no worker")
    b.proc.kill()
    r3 = job.wait_round(3, 40, newer_than=r2)
    pids = {int(w["TEST_PPID"]) for w in job.round_workers(r3)}
    check(pids == {a.proc.pid, c.proc.pid, d.proc.pid}, "the spare took node-b's place")
    check("restarts 0 of 0" in a.log().splitlines()[-1] or "restarts 0" in a.log(),
          "membership changes used no restart")


def case_sigterm(job):
    ttl = 30
    job.flags += ["--lease-ttl", str(ttl), "--last-call", "0.5", "--stop-grace", "2",
                  "--shutdown-timeout", "10", "--nnodes", "2:3"]
    a, b, c = (job.start(n) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    cw = workers_of(job, c)
    t0 = time.monotonic()
    c.signal(signal.SIGTERM)
    check(c.wait_exit(10 + 5) == 0, "SIGTERMed agent exits 0")
    check(time.monotonic() - t0 < 12, "within --shutdown-timeout")
    check(any({"term", "stop"} & set(job.worker_log(w["_pid"])) for w in cw),
          "its worker was told to stop")
    rnd2 = job.wait_round(2, ttl - 5, newer_than=rnd)
    check(time.monotonic() - t0 < ttl, "new round before the lease TTL")
    check("node-c left" in a.log(), "cause: node-c left")
    check(rnd2 > rnd, "round number grew")
    # Under a Kubernetes Job a pod that leaves a running job must not count as
    # a completed index: --leave-exit-code gives it another status.
    d = job.start("node-d", ["--leave-exit-code", "5"])
    rnd3 = job.wait_round(3, ttl - 5, newer_than=rnd2)
    d.signal(signal.SIGTERM)
    check(d.wait_exit(15) == 5, "left a running job: exit 5")
    job.wait_round(2, ttl - 5, newer_than=rnd3)
    # At the job's end every agent exits 0, whatever the flag.
    e = job.start("node-e", ["--leave-exit-code", "5"])
    wait_for(lambda: job.running_round(3), 30, "node-e in a round")
    job.command("all", "exit 0")
    for ag in (a, b, e):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end" % ag.node)


def case_join_timeout(job):
    """Waiting is not failing: an agent that no round could take within
    --join-timeout (too few nodes came, as when the scheduler has placed only
    part of a job) exits 6, the code the chart's podFailurePolicy ignores,
    with one line saying why; so does a survivor whose round lost a member
    and that waits alone below --nnodes' minimum."""
    flags = ["--lease-ttl", "3", "--last-call", "0.5", "--stop-grace", "2",
             "--shutdown-timeout", "8", "--join-timeout", "2", "--max-restarts", "0"]
    lone = job.start("node-a", flags=flags + ["--nnodes", "2"])
    check(lone.wait_exit(30) == 6, "a lone agent of --nnodes 2 exits 6:\n" + lone.log())
    last = lone.log().strip().splitlines()[-1]
    check("exiting with code 6: no round froze within the join timeout" in last and
          "too few nodes" in last,
          "one line with the reason: %r" % last)
    check(not job.workers(), "no worker started")
    # A survivor: the round of two formed, one pod is lost, and no one comes.
    b = job.start("node-b", flags=flags + ["--nnodes", "2"])
    c = job.start("node-c", flags=flags + ["--nnodes", "2"])
    job.wait_round(2, 60)
    c.proc.kill()
    check(b.wait_exit(40) == 6, "the survivor exits 6:\n" + b.log())
    last = b.log().strip().splitlines()[-1]
    check("exiting with code 6: no round froze within the join timeout" in last,
          "why: %r" % last)
    check(job_restarts(job) == 0, "no restart counted")


def case_standalone(job):
    tmp = tempfile.mkdtemp(prefix="agent-standalone-")
    try:
        env = dict(os.environ, TMPDIR=tmp, AGENT_TEST_DIR=job.dir)
        p = subprocess.Popen([kit.ARGS.agent, "--standalone", "--nproc-per-node", "2",
                              "--node-id", "solo", "--node-addr", "127.0.0.1", "--last-call",
                              "0.2", "--", kit.ARGS.worker], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        try:
            rnd = job.wait_round(2, 60)
            ws = job.round_workers(rnd)
            ep = ws[0]["DUCTILE_ETCD_ENDPOINTS"]
            check(ep.startswith("http://127.0.0.1:") and ep != ETCD, "private etcd: " + ep)
            check(ws[0]["DUCTILE_JOB"] == "standalone", "default job id")
            check(any(n.startswith("ductile-standalone-") for n in os.listdir(tmp)), "data dir")
            job.command("all", "exit 0")
            _, err = p.communicate(timeout=30)
            check(p.returncode == 0, "exit 0: " + err)
            check(os.listdir(tmp) == [], "data dir removed: %r" % os.listdir(tmp))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
